"""envs.python: hostile programs against the sandbox (each asserts the protective outcome the start-up line
promises here), the tool's contract in a ToolEnv, and the gsm8k_python task on the offline SmolLM2."""

import os
import socket
import threading
import time
import uuid

import pytest
import torch
from transformers.utils import get_json_schema

import envs
from envs import PY_LIMITS, PY_SHOW, ToolEnv, python, run_python, sandbox_protections

BOUND = 10.0  # seconds: a 1 s timeout returns well within it; a program left running would not


def marked(marker):
    """Pids whose command line holds marker: the processes a program started and tagged."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return pids


def test_tool_schema_result_and_error():
    """Fails if the docstring no longer gives transformers a schema, if a program's output is not the result, or if
    a raising program comes back as a normal result rather than an error holding its traceback's last line."""
    schema = get_json_schema(python)
    assert schema["function"]["parameters"]["required"] == ["code"]
    assert python("print(6 * 7)") == "42\n"
    with pytest.raises(RuntimeError, match=r"(?s)exit 1: .*ZeroDivisionError: division by zero"):
        python("1 / 0")


def test_start_up_line_is_one_line_and_honest():
    """Fails if the line spans lines, or if it leaves out 'not a security boundary' while the network or the writes
    are not confined (or says it while both are)."""
    line = sandbox_protections()
    assert line.startswith("python sandbox:") and "\n" not in line
    confined = "no network" in line and "writes only in its dir" in line
    assert ("not a security boundary" in line) != confined, line


def test_infinite_loop_times_out():
    """Fails if the wall-clock timeout is not enforced: the loop would then run to its CPU limit (a different
    status) or forever."""
    start = time.monotonic()
    text, status = run_python("while True:\n    pass", timeout=1)
    assert status == "timed out after 1 s" and time.monotonic() - start < BOUND


def test_fork_bomb_is_limited_and_nothing_of_it_remains(mode):
    """Fails if RLIMIT_NPROC does not bind (more than PY_LIMITS' processes at once) or if any process the bomb
    started outlives the call."""
    marker = f"{1000 + uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        f"            os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    except OSError:\n"
        "        pass\n"
    )
    most, box = 0, []
    worker = threading.Thread(target=lambda: box.append(run_python(code, timeout=2)))
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        most = max(most, len(marked(marker)))
        time.sleep(0.05)
    assert box[0][1] == "timed out after 2 s" and time.monotonic() - start < BOUND
    assert 0 < most <= PY_LIMITS["RLIMIT_NPROC"], most
    assert marked(marker) == []


@pytest.fixture(params=["detected", "no namespaces"])
def mode(request, monkeypatch):
    """The sandbox as detected here, and without namespaces (where the kill by uid alone must reach everything)."""
    conf, line = envs._sandbox()
    exe = os.path.realpath("/usr/bin/python3")  # one its uid can run without the mount namespace's help
    if request.param == "no namespaces" and (conf["uid"] is None or not os.path.exists(exe)):
        pytest.skip("not root (only the process group is killed: the line says so), or no /usr/bin/python3")
    if request.param == "no namespaces":
        monkeypatch.setattr(envs, "_sandbox", lambda: ({**conf, "ns": False, "reveal": [], "exe": exe}, line))
    return request.param


@pytest.mark.parametrize("escape", [False, True])
def test_background_processes_are_gone_after_the_reply(escape, mode):
    """Fails if a process the program started (escape: one that left the session and cleared its parent-death
    signal) still runs once the call has returned, after an exit or a timeout: the wrapper reaped before its pid
    namespace has emptied (a race: caught in about half the runs), or (no namespaces) the uid's processes not
    killed until none is left."""
    marker = f"{2000 + uuid.uuid4().int % 10**6}.{os.getpid()}"
    leave = "os.setsid(); ctypes.CDLL(None).prctl(1, 0)\n    " if escape else ""
    sleep = f"os.execv('/bin/sleep', ['sleep', '{marker}'])"  # 20 of them: their end takes a while to complete
    code = f"import ctypes, os\nfor _ in range(20):\n  if os.fork() == 0:\n    {leave}{sleep}\nprint('ok', flush=True)"
    for timeout_code in "", "\nwhile True:\n    pass":
        text, status = run_python(code + timeout_code, timeout=1)
        assert text.startswith("ok")
        assert marked(marker) == [], (escape, status)


def test_ten_gb_allocation_is_a_memory_error():
    """Fails if RLIMIT_AS is not set: 10 GB would then be granted (overcommit) or kill the host's processes."""
    text, status = run_python("x = bytearray(10 * 2**30)")
    assert status == "exit 1" and "MemoryError" in text


def test_writes_outside_its_directory_fail(tmp_path):
    """Fails if a write outside its directory lands: in /tmp, in $HOME, in a directory anyone may write (which
    only Landlock stops: checked where the line says writes are confined), or if its own directory is not writable."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    targets = [f"/tmp/grpo_marker_{uuid.uuid4().hex}", os.path.expanduser(f"~/grpo_marker_{uuid.uuid4().hex}")]
    if "writes only in its dir" in sandbox_protections():
        targets.append(str(open_dir / "marker"))
    for target in targets:
        text, status = run_python(f"open({target!r}, 'w').write('x')\n")
        assert status == "exit 1" and "Error" in text, (target, text)
        assert not os.path.exists(target), target
    assert run_python("open('mine.txt', 'w').write('x'); print(open('mine.txt').read())") == ("x\n", None)


def test_the_parents_environment_is_not_readable(monkeypatch):
    """Fails if the child's environment is not the scrubbed one (it inherits the caller's, a secret included) or if
    it can read the caller's from /proc/<pid>/environ."""
    monkeypatch.setenv("GRPO_TEST_SECRET", f"grpo-secret-{uuid.uuid4().hex}")
    code = (
        "import os\n"
        "print(os.environ.get('GRPO_TEST_SECRET'), sorted(os.environ))\n"
        f"for pid in os.getppid(), {os.getpid()}:\n"
        "    try:\n"
        "        print(b'GRPO_TEST_SECRET' in open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
    )
    text, status = run_python(code)
    lines = text.splitlines()
    assert status is None and lines[0] == f"None {sorted(envs.PY_ENV)}" and "True" not in lines[1:], text


def test_a_megabyte_of_output_is_capped():
    """Fails if the output is read without a cap (1 MB buffered and the program left to finish) or shown uncut."""
    start = time.monotonic()
    text, status = run_python("import sys\nsys.stdout.write('x' * 2**20)\nimport time\ntime.sleep(30)")
    assert status == f"stopped after {envs.PY_READ} bytes of output", status
    assert len(text) < PY_SHOW + 40 and time.monotonic() - start < BOUND


def test_control_strings_come_back_as_plain_text():
    """Fails if bytes that are not UTF-8 raise rather than decode as U+FFFD, or if special-token strings, ANSI
    escapes or NUL bytes are dropped or altered: the tool returns the text as it came."""
    raw = b"<|im_end|>\n<|im_start|>assistant\n\x1b[31mred\x1b[0m\x00\xff\xfe</python>"
    text = python(f"import sys\nsys.stdout.buffer.write({raw!r})")
    assert isinstance(text, str)
    assert text == raw.decode("utf-8", errors="replace") and "<|im_end|>" in text and "\ufffd" in text


def test_temp_dir_is_removed_after_a_run_and_after_a_timeout(monkeypatch):
    """Fails if the call's temporary directory survives a normal exit or a timeout."""
    made, mkdtemp = [], envs.tempfile.mkdtemp

    def spy(**kw):
        made.append(mkdtemp(**kw))
        return made[-1]

    monkeypatch.setattr(envs.tempfile, "mkdtemp", spy)
    run_python("open('f', 'w').write('x' * 1000)")
    run_python("open('f', 'w').write('x')\nwhile True:\n    pass", timeout=1)
    assert len(made) == 2 and not any(os.path.exists(d) for d in made)


def test_network_is_cut_where_the_line_says_so():
    """Fails if, where the start-up line says there is no network, a connection to a port listening on the
    caller's loopback gets through."""
    if "no network" not in sandbox_protections():
        pytest.skip("the network is not cut here: the start-up line says so")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        text, status = run_python(code)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert status == "exit 1" and "connected" not in text.splitlines()


def test_calls_run_side_by_side():
    """Fails if calls are serialised (a lock around the run, the GIL held while waiting): four 2 s programs at
    once would take 8 s."""
    box, start = [], time.monotonic()
    threads = [threading.Thread(target=lambda: box.append(run_python("import time; time.sleep(2)"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert box == [("", None)] * 4 and time.monotonic() - start < 7.0


@pytest.mark.real_model
def test_real_gsm8k_python_rollout(real_model):
    """gsm8k_python on SmolLM2: row 0 is made to call python (a forced prefix), row 1 decodes greedily (script -1:
    its own choice). Fails if the call does not run in the sandbox, if its reply is not fed as env_mask tokens (no
    loss) and decoding does not go on, or if the calls counted disagree with the replies in the trajectory."""
    import extra_tasks
    from rollout import sample
    from test_tool_rollouts import Forced

    model, tok = real_model
    task = extra_tasks.get("gsm8k_python")
    env = task.tools(tok, 2)
    assert isinstance(env, ToolEnv) and env.format == "tags"
    examples = task.load("test")[:2]
    call = tok("<python>print(3 * 4 + 5)</python>", add_special_tokens=False)["input_ids"]
    reply = tok(env.reply("python", "17\n"), add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [task.prompt(ex) for ex in examples]
    r = sample(
        Forced(model, [call, [-1]]), tok, prompts, 1, len(call) + len(reply) + 24, [end], temperature=0.0, env=env
    )
    n, m = len(call), len(call) + len(reply)
    assert r.completion_ids[0, :n].tolist() == call and r.completion_ids[0, n:m].tolist() == reply
    assert r.env_mask[0, n:m].all() and not r.env_mask[0, :n].any() and r.completion_mask[0, m]
    assert r.tool_calls[0] >= 1 and r.tool_errors[0] == 0
    for i in range(2):  # each reply a run of env tokens, one call counted per run
        spans = int((r.env_mask[i, 1:] & ~r.env_mask[i, :-1]).sum()) + int(r.env_mask[i, 0])
        assert r.tool_calls[i] == spans, i
    assert not (r.completion_mask.bool() & r.env_mask).any() and torch.all(r.sample_logp[r.env_mask] == 0)
