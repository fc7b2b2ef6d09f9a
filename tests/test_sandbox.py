"""sandbox.py and envs.python: hostile programs against the sandbox, each asserting the protective outcome wherever the
start-up line claims it (the configuration detected here, and each with one protection off, so every form of the
line is checked against what it says), the tool's replies in a ToolEnv, and the gsm8k_python task on SmolLM2."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
import torch
from conftest import REPO, make_tokenizer
from transformers.utils import get_json_schema

import sandbox
from envs import ToolEnv, python
from sandbox import PY_SHOW, run_python, sandbox_protections

DETECT = sandbox._sandbox  # the cached detection, which the mode fixture patches over
BOUND = 10.0  # seconds: a 1 s timeout returns well within it; a program left running, or a stalled kill, would not
MODES = {  # the detected configuration, and with one protection off (skipped where it is off already)
    "detected": {},
    "no Landlock": {"abi": 0},
    "no cgroup": {"cgroup": None},
    "no namespaces": {"ns": False, "userns": False},
    "no seccomp": {"seccomp": False},
}
CALLER = (  # a caller of its own: one call of the code on its stdin in the configuration given -> its reply
    "import json, sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\nsandbox.PY_UIDS = sys.argv[3]\n"
    "print(sandbox._run(json.loads(sys.argv[2]), sys.stdin.read(), 60)[0].decode())"
)


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


def wrappers(caller):
    """Pids of the sandbox's own processes (the wrapper, its namespace's init) of the calls a caller pid made."""
    return marked(f"{sandbox.CONFINE}\0{caller}\0")


def gone(pids_of, bound=BOUND):
    """Waits up to bound seconds for pids_of() to be empty -> what is left (killed, so that a failure leaves none)."""
    end = time.monotonic() + bound
    while pids_of() and time.monotonic() < end:
        time.sleep(0.05)
    left = pids_of()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def processes(line):
    """The processes a call may have at once, as the start-up line says."""
    return int(line.split("processes ")[1].split(")")[0])


def new_marker():
    return f"{1000 + uuid.uuid4().int % 10**6}.{os.getpid()}"


def sleeper(marker):
    """Code: start a process tagged with marker that sleeps."""
    return f"import os\nif os.fork() == 0:\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"


@pytest.fixture(params=list(MODES))
def mode(request, monkeypatch):
    """The sandbox as detected here, and with one protection off: run_python then runs that configuration and
    sandbox_protections() says what it enforces -> that line."""
    conf = DETECT()[0]
    args = {k: conf[k] for k in ("uid", "ns", "userns", "abi", "cgroup", "seccomp")}
    if all(args[k] == v for k, v in MODES[request.param].items()) and request.param != "detected":
        pytest.skip(f"{request.param}: the detected configuration already")
    args.update(MODES[request.param])
    changed = sandbox._config(**args)
    if not changed["ns"] and conf["uid"] is not None:  # another uid must run it without the mount namespace's help
        exe = os.path.realpath("/usr/bin/python3")
        if not os.path.exists(exe):
            pytest.skip("no /usr/bin/python3 for a fresh uid to run without namespaces")
        changed["exe"] = exe
    line = sandbox._describe(changed)
    monkeypatch.setattr(sandbox, "_sandbox", lambda: (changed, line))
    return line


# -----------------------------------------------------------------------------
# the tool and the line


def test_tool_schema_result_and_error_reply(mode, monkeypatch):
    """Fails if the docstring no longer gives transformers a schema, if a program's output is not the result, if a
    failing program's reply does not start with its error's last line (a reply is cut to its head: 64 tokens), or if
    the same failing program gives two replies (a random temp-dir path in the traceback)."""
    assert get_json_schema(python)["function"]["parameters"]["required"] == ["code"]
    assert python("print(6 * 7)") == "42\n"
    replies = []
    for _ in range(2):
        with pytest.raises(RuntimeError) as e:
            python("print('partial')\nprint(48 / 0)")
        replies.append(str(e.value))
    first = replies[0].splitlines()[0]
    assert first.startswith("ZeroDivisionError: division by zero") and "exit 1" in first, replies[0]
    assert "partial" in replies[0] and replies[0] == replies[1], replies
    monkeypatch.setattr(sandbox, "PY_TIMEOUT", 0.5)
    with pytest.raises(RuntimeError, match="^timed out after 0.5 s"):  # no exit status: the status first
        python("print('partial')\nwhile True:\n    pass")


@pytest.mark.parametrize(
    "code, name",
    [
        ("raise ValueError('v' * 2000)", "ValueError: vvv"),
        ("print('x' * 3000)\nraise KeyError('k' * 2000)", "KeyError: 'kkk"),
        ("raise ValueError('bad\\n' + 'v' * 2000)", "ValueError: bad"),
        ("e = ValueError('x')\ne.add_note('n' * 2000)\nraise e", "ValueError: x"),
        ("def f(n):\n    if n:\n        f(n - 1)\n    raise OSError('bad\\n' + 'w' * 300)\nf(40)", "OSError: bad"),
        ("raise ValueError('v' * 100_000)", "ValueError: vvv"),
    ],
    ids=["long-last-line", "after-long-output", "lines-of-message", "a-note", "deep-traceback", "past-the-read-cap"],
)
def test_a_failing_call_s_reply_starts_with_the_exception_s_name(code, name):
    """Issue 53, 5: a reply keeps its head (64 tokens), so it starts with the error: the exception's name and the start
    of its message, whatever the message's length or lines, then the exit status. Fails if run_python cuts a failure's
    output to its tail (a last line longer than PY_SHOW loses its name: 'error: [cut: ...] vvvv'), or if envs.python
    puts a traceback's last line first (a message of several lines, or a note, starts the reply without the name)."""
    with pytest.raises(RuntimeError) as e:
        python(code)
    reply = str(e.value)
    if name == "ValueError: vvv" and "100_000" in code:  # stopped at PY_READ or exited: the status may come first
        assert name in reply[:120], reply[:300]
    else:
        first = reply.splitlines()[0]
        assert first.startswith(name) and first.endswith("(exit 1)"), reply[:300]
    assert len(reply) < 2 * PY_SHOW, len(reply)


def test_start_up_line_is_one_line_and_honest(mode):
    """Fails if the line spans lines, or if it leaves out 'not a security boundary' where namespaces or Landlock
    are missing (or says it where both hold)."""
    assert mode == sandbox_protections() and mode.startswith("python sandbox:") and "\n" not in mode
    both = "namespaces:" in mode and "Landlock:" in mode
    assert ("not a security boundary" in mode) != both, mode


def test_each_call_runs_as_its_own_uid():
    """Fails if, as root, a call runs as root, as the caller's uid, or as the uid of another call."""
    if "a fresh uid per call" not in sandbox_protections():
        pytest.skip("not root: calls run as your uid, as the line says")
    uids = [int(run_python("import os; print(os.getuid())")[0]) for _ in range(2)]
    assert 0 not in uids and os.getuid() not in uids and uids[0] != uids[1], uids


# -----------------------------------------------------------------------------
# everything it starts ends with the call


def test_infinite_loop_times_out():
    """Fails if the wall-clock timeout is not enforced: the loop would then run to its CPU limit (a different
    status) or forever."""
    start = time.monotonic()
    text, status = run_python("while True:\n    pass", timeout=1)
    assert status == "timed out after 1 s" and time.monotonic() - start < BOUND


def test_fork_bomb_is_limited_and_nothing_of_it_remains(mode):
    """Fails if RLIMIT_NPROC does not bind (more processes at once than the line's) or if any process the bomb
    started outlives the call."""
    marker = new_marker()
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
    assert 0 < most <= processes(mode), (most, mode)
    assert gone(lambda: marked(marker), 0) == []


@pytest.mark.parametrize("escape", [False, True])
def test_background_processes_are_gone_after_the_reply(escape, mode):
    """Fails if a process the program started (escape: one that left the session and cleared its parent-death
    signal) still runs once the call has returned, after an exit or a timeout: the wrapper reaped before its pid
    namespace has emptied, or (no namespaces) the uid's processes not killed until none is left."""
    marker, n = new_marker(), min(20, processes(mode) - 1)
    leave = "os.setsid(); ctypes.CDLL(None).prctl(1, 0)\n    " if escape else ""
    sleep = f"os.execv('/bin/sleep', ['sleep', '{marker}'])"  # 20 of them: their end takes a while to complete
    code = f"import ctypes, os\nfor _ in range({n}):\n  if os.fork() == 0:\n    {leave}{sleep}\nprint('ok', flush=True)"
    for timeout_code in "", "\nwhile True:\n    pass":
        text, status = run_python(code + timeout_code, timeout=1)
        assert text.startswith("ok")
        assert gone(lambda: marked(marker), 0) == [], (escape, status)


@pytest.mark.parametrize("first", ["kill", "fork"])
def test_the_program_cannot_signal_its_wrapper_and_stay(mode, first):
    """Issue 43.1. Fails if the program can SIGKILL the wrapper (kill(0): it shares the wrapper's process group and
    uid) and then, out of the session and with no parent-death signal, outlive the call with what it started: the
    program as its pid namespace's init (immune to its own kill), or a child of it that did the same."""
    marker = new_marker()
    escape = f"ctypes.CDLL(None).prctl(1, 0)\nos.kill(0, signal.SIGKILL)\nos.setsid()\n{sleeper(marker)}"
    if first == "fork":  # a child does it: the program itself may not survive its own kill(0)
        escape = "if os.fork() == 0:\n" + "".join(f"    {line}\n" for line in escape.splitlines())
    code = f"import ctypes, os, signal, time\n{escape}time.sleep(30)\n"
    run_python(code, timeout=2)
    assert gone(lambda: marked(marker) + wrappers(os.getpid()), 0) == []


def start_sleeping(caller, marker):
    """Hand the caller (reading its program on stdin) a program that writes `marker` and sleeps; wait until it has."""
    with caller.stdin:
        caller.stdin.write(sleeper(marker) + "import time\ntime.sleep(60)")
    end = time.monotonic() + BOUND
    while not marked(marker) and time.monotonic() < end:
        time.sleep(0.05)


def test_a_stopped_group_does_not_stall_the_call(mode):
    """Issue 43.3. Fails if a program that SIGSTOPs its process group (the wrapper too, where it shares it) makes the
    call wait on a stopped process (the kill path waiting 10 s for a stopped wrapper) or leaves anything running."""
    marker = new_marker()
    start = time.monotonic()
    text, status = run_python(sleeper(marker) + "import signal\nos.killpg(0, signal.SIGSTOP)\n", timeout=1)
    assert status == "timed out after 1 s" and time.monotonic() - start < BOUND, status
    assert gone(lambda: marked(marker) + wrappers(os.getpid()), 0) == []


def test_a_killed_caller_leaves_nothing(mode):
    """Issue 43.2. Fails if, the caller SIGKILLed mid-call (as the OOM killer does), the wrapper, the program or what
    it started survive: a parent-death signal set before the uid change (which clears it), or none on the init."""
    if "may outlive a killed caller" in mode:
        pytest.skip("the line says a killed caller may leave its processes here")
    marker = new_marker()
    script = "import json, sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\n"
    script += "sandbox._run(json.loads(sys.argv[2]), sys.stdin.read(), 60)"  # the code not in its command line
    conf = json.dumps(sandbox._sandbox()[0])
    caller = subprocess.Popen([sys.executable, "-c", script, str(REPO), conf], stdin=subprocess.PIPE, text=True)
    try:
        start_sleeping(caller, marker)
        assert marked(marker), "the call did not start"
    finally:
        caller.kill()
        caller.wait()
    assert gone(lambda: marked(marker) + wrappers(caller.pid)) == []


def test_the_reply_comes_after_everything_of_the_call_has_ended(monkeypatch):
    """Issue 43.8. Fails if gsm8k_python's tool row answers a call (a timeout reply) while the call still runs: an
    abandoned call keeps its sandbox, so more run at once than the env pool's workers."""
    import extra_tasks

    monkeypatch.setattr(sandbox, "PY_TIMEOUT", 1.0)
    env = extra_tasks.python_tool(make_tokenizer())
    row = env.make()
    row.reset({})
    marker = new_marker()
    code = sleeper(marker) + "import signal, time\ntime.sleep(0.5)\nos.killpg(0, signal.SIGSTOP)\n"
    text, error = row.run("python", (code,), {})
    assert error and "timed out after 1 s" in text, text
    assert marked(marker) + wrappers(os.getpid()) == []


# -----------------------------------------------------------------------------
# memory, files, network, sockets, /proc


def test_ten_gb_allocation_is_a_memory_error():
    """Fails if RLIMIT_AS is not set: 10 GB would then be granted (overcommit) or kill the host's processes."""
    text, status = run_python("x = bytearray(10 * 2**30)")
    assert status == "exit 1" and "MemoryError" in text


def rss_anon(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += sum(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))
        except OSError:  # ended meanwhile
            pass
    return total


def test_memory_is_bounded_for_the_whole_call(mode):
    """Issue 43.4. Fails if the call's processes together hold more than sandbox.PY_MEMORY at once: four processes of
    400 MiB each (1.6 GB) under a per-process limit alone. Summed over processes as the kernel counts their own
    memory (RssAnon), sampled while they hold it."""
    if "for the whole call" not in mode and "processes NOT bounded" in mode:
        pytest.skip("the line bounds no call's memory here")
    marker = new_marker()
    hog = "b = b'x' * (400 << 20)\nimport time\ntime.sleep(60)"
    code = (
        "import os, sys, time\nfor _ in range(4):\n    try:\n        if os.fork() == 0:\n"
        f"            os.execv(sys.executable, [sys.executable, '-c', {hog!r}, '{marker}'])\n"
        "    except OSError:\n        pass\ntime.sleep(60)\n"
    )
    most, box = 0, []
    worker = threading.Thread(target=lambda: box.append(run_python(code, timeout=3)))
    worker.start()
    while worker.is_alive():
        most = max(most, rss_anon(marked(marker)))
        time.sleep(0.02)
    assert most <= sandbox.PY_MEMORY, (most >> 20, mode)
    assert gone(lambda: marked(marker), 0) == []


def test_writes_outside_its_directory_fail(tmp_path, mode):
    """Fails if a write outside its directory lands: in /tmp, in $HOME, in the interpreter's directory (writable by
    its owner, the program's uid in a user namespace: a read-only bind there), in a directory anyone may write (which
    only Landlock or the mount namespace stop: checked where the line says writes are confined), or if its own
    directory is not writable."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    targets = [f"/tmp/grpo_marker_{uuid.uuid4().hex}", os.path.expanduser(f"~/grpo_marker_{uuid.uuid4().hex}")]
    targets.append(os.path.join(os.path.realpath(sys.base_prefix), f"grpo_marker_{uuid.uuid4().hex}"))
    if "writes only in its dir" in mode or "namespaces:" in mode:
        targets.append(str(open_dir / "marker"))
    for target in targets:
        run_python(f"open({target!r}, 'w').write('x')\n")  # with namespaces its /tmp is its own dir: no error
        assert not os.path.exists(target), target
    assert run_python("open('mine.txt', 'w').write('x'); print(open('mine.txt').read())") == ("x\n", None)


def test_file_size_and_disk_are_bounded(mode):
    """Fails if a file may grow past the line's size (RLIMIT_FSIZE: 17 MiB written in one file), or, where the line
    says its dir is a tmpfs of that size, if its files together may grow past it (three files of 15 MiB)."""
    code = (
        "import os\ntry:\n    open('big', 'wb').write(b'x' * (17 << 20))\nexcept OSError as e:\n    print(e.errno)\n"
        "os.remove('big')\nfor i in range(3):\n    try:\n        open(f'f{i}', 'wb').write(b'x' * (15 << 20))\n"
        "    except OSError as e:\n        print(e.errno)\nprint(sum(os.path.getsize(f) for f in os.listdir('.')))\n"
    )
    text, status = run_python(code)
    lines = text.split()
    files = int(mode.split(" MiB files")[0].rsplit(" ", 1)[1])
    assert status is None and files == 16 and lines[0] == "27", text  # EFBIG
    if "32m tmpfs dir" in mode:
        assert lines[1] == "28" and int(lines[-1]) <= 32 << 20, text  # ENOSPC
    assert 2 * (15 << 20) <= int(lines[-1]), text  # up to the bound, it is written


def test_a_private_tmpdir_works(tmp_path, monkeypatch, mode):
    """Issue 43.6. Fails if a $TMPDIR others cannot enter (a batch scheduler's 0700 one) breaks calls or their
    detection: the fresh uid cannot reach a work dir made there by path."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert run_python("print(6 * 7)") == ("42\n", None)
    assert tempfile.gettempdir() == str(private)  # where a work dir would be made
    if mode == DETECT()[1]:  # detection too
        assert DETECT.__wrapped__()[1] == mode


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
    assert status is None and lines[0] == f"None {sorted(sandbox.PY_ENV)}" and "True" not in lines[1:], text


def test_host_files_and_other_processes_are_not_readable(tmp_path, mode):
    """Issue 43.7. Fails if, where the line says its pids are its own, there is no /proc or reads are of system files
    only, the program finds a secret in another process's command line (the host's /proc left in the new pid
    namespace) or, where it says no host files or system files only, in a world-readable file in /tmp."""
    if "own pids" not in mode and "reads of system files only" not in mode:
        pytest.skip("the line says host files and /proc are readable here")
    secret, name = f"grpo-secret-{uuid.uuid4().hex}", f"/tmp/grpo-file-{uuid.uuid4().hex}"  # not in the code
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", secret])
    with open(name, "w") as f:  # world-readable
        f.write(secret)
    code = (
        "import os\nfound, paths = [], ['NAME', '/proc/PID/cmdline']\n"
        "try:\n    paths += [f'/proc/{p}/cmdline' for p in os.listdir('/proc')]\nexcept OSError:\n    pass\n"
        "for path in paths:\n    try:\n        found.append(open(path, 'rb').read())\n    except OSError:\n"
        "        pass\nprint(found)\n"
    )
    try:
        text, status = run_python(code.replace("NAME", name).replace("PID", str(holder.pid)))
    finally:
        holder.kill()
        holder.wait()
        os.remove(name)
    assert secret not in text, text


def test_the_callers_keys_are_not_readable(mode):
    """Fails if the program can read a key in its caller's session keyring (kernel keyrings are not namespaced, and
    a keyring's possessor may read its keys whatever its uid): the program not given a session keyring of its own
    (the "no seccomp" mode checks it alone: elsewhere keyctl is refused too)."""
    add_key, keyctl = key_syscalls()
    secret = f"grpo-secret-{uuid.uuid4().hex}"
    program = (  # every key in its session keyring, read
        "import ctypes, struct\nlibc = ctypes.CDLL(None)\nbuf = ctypes.create_string_buffer(4096)\n"
        f"n = max(0, libc.syscall({keyctl}, 11, -3, buf, 4096))\n"
        "for key in struct.unpack(f'{n // 4}i', buf.raw[:n]):\n"
        f"    m = max(0, libc.syscall({keyctl}, 11, key, buf, 4096))\n"
        "    print(buf.raw[:m])\n"
    )
    script = (  # a caller with a session keyring of its own (as a login's) holding a secret key
        "import ctypes, json, sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\nlibc = ctypes.CDLL(None)\n"
        f"libc.syscall({keyctl}, 1, b'grpo-test')\n"
        f"assert libc.syscall({add_key}, b'user', b'grpo', b'{secret}', {len(secret)}, -3) > 0\n"
        "print(sandbox._run(json.loads(sys.argv[2]), sys.stdin.read(), 60))\n"
    )
    conf = json.dumps(sandbox._sandbox()[0])
    done = subprocess.run(
        [sys.executable, "-c", script, str(REPO), conf], input=program, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and secret not in done.stdout, (done.stdout, done.stderr)


def key_syscalls():
    """(add_key, keyctl) numbers here, or a skip."""
    if os.uname().machine not in sandbox.KEY_SYSCALLS:
        pytest.skip(f"the key syscalls' numbers are not known here ({os.uname().machine})")
    numbers = sandbox.KEY_SYSCALLS[os.uname().machine][1]
    return numbers[0], numbers[2]


def keys_held(uid):
    """How many keys the kernel holds for uid (/proc/key-users: 'uid: usage nkeys/nikeys ...'), 0 where none."""
    with open("/proc/key-users") as f:
        for who, counts in (line.split(":", 1) for line in f):
            if int(who) == uid:
                return int(counts.split()[1].split("/")[0])
    return 0


def spawn_at(pid, argv, **kw):
    """A process started as pid (the next pid set through ns_last_pid, as CRIU does), or a skip saying why not."""
    for _ in range(50):  # another process may take the pid first
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError as e:
            pytest.skip(f"a caller's pid cannot be chosen here: {e}")
        proc = subprocess.Popen(argv, **kw)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.skip(f"pid {pid} was taken by others 50 times")


def forget_keys(uid):
    """As uid, its user, user-session and persistent keyrings cleared and invalidated (the kernel then frees them):
    what a test made where keys outlive a call is not left in the kernel."""
    keyctl = key_syscalls()[1]
    code = (
        f"import ctypes\nlibc = ctypes.CDLL(None)\nrings = [libc.syscall({keyctl}, 0, r, 0) for r in (-4, -5)]\n"
        f"for ring in rings + [libc.syscall({keyctl}, 22, -1, -2)]:\n"
        f"    libc.syscall({keyctl}, 7, ring)\n    libc.syscall({keyctl}, 21, ring)\n"
    )
    held = uid != os.getuid() and keys_held(uid)  # naming the keyrings of a uid that has none makes them
    if held and os.path.exists("/usr/bin/python3"):  # an interpreter another uid may run
        subprocess.run(["/usr/bin/python3", "-c", code], user=uid, group=uid, extra_groups=[], check=False)


def test_a_key_added_in_a_call_is_gone_after_it(mode):
    """Issue 54.1. Fails if a call's keys outlive it (the seccomp filter not installed, or not refusing add_key or
    keyctl): 200 keys added to its user keyring, its user, user-session and persistent keyrings named, then, once the
    call has ended, the kernel still holds keys for its uid (as root a fresh one: none at all)."""
    if "kernel keys NOT refused" in mode:
        pytest.skip(f"the line says keys a call adds outlive it here: {mode}")
    add_key, keyctl = key_syscalls()
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None)\nadded = 0\nfor i in range(200):\n"
        f"    added += libc.syscall({add_key}, b'user', b'grpo-%d' % i, b'x' * 64, 64, -4) > 0\n"
        f"made = [libc.syscall({keyctl}, 0, ring, 1) for ring in (-4, -5)] + [libc.syscall({keyctl}, 22, -1, -2)]\n"
        "print(os.getuid(), added, made)\n"
    )
    before = keys_held(os.getuid())
    text, status = run_python(code)
    uid = int(text.split()[0])
    left = before if uid == os.getuid() else 0
    end = time.monotonic() + BOUND  # the kernel frees a key whose last holder ended a moment later
    while keys_held(uid) != left and time.monotonic() < end:
        time.sleep(0.05)
    held = keys_held(uid)
    forget_keys(uid)
    assert status is None and held == left, (text, held)


def test_another_archs_system_call_does_not_pass_the_filter(mode):
    """Fails if, on x86_64, a system call of i386's table (int 0x80, where 286-288 are the key syscalls and 248-250
    others) returns where the line says seccomp refuses keys: the filter's arch check dropped."""
    if "seccomp:" not in mode or os.uname().machine != "x86_64":
        pytest.skip(f"no seccomp filter here, or not x86_64 ({os.uname().machine}): {mode}")
    code = (  # i386's getpid (20) by int 0x80, from executable memory
        "import ctypes, mmap\nbuf = mmap.mmap(-1, 4096, prot=7)\n"
        "buf.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))\n"  # mov eax, 20; int 0x80; ret
        "call = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))\n"
        "print('returned', call())\n"
    )
    text, status = run_python(code)
    assert status is not None and "returned" not in text, (text, status)


def test_two_callers_whose_pids_collide_never_share_a_uid():
    """Issue 54.3. Fails if two callers at once, their pids 20000 apart (forced through ns_last_pid), make their
    calls as one uid (a uid derived from pid % 20000 and the call number): they would share the processes' limit,
    and without namespaces the kill of one call's uid would end the other's processes."""
    conf = sandbox._sandbox()[0]
    if conf["uid"] is None:
        pytest.skip("not root: calls run as your uid, as the line says")
    argv = [sys.executable, "-c", CALLER, str(REPO), json.dumps(conf), sandbox.PY_UIDS]
    code = "import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(2)"  # the two calls overlap
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with open("/proc/sys/kernel/pid_max") as f:
        pids = [
            p
            for p in range(301, int(f.read()) - 20000)
            if not any(os.path.exists(f"/proc/{p + d}") for d in (0, 20000))
        ]
    if not pids:
        pytest.skip("no two free pids 20000 apart")
    first = spawn_at(pids[0], argv, **pipes)
    try:
        second = spawn_at(pids[0] + 20000, argv, **pipes)
        replies = [second.communicate(code, timeout=60)[0], first.communicate(code, timeout=60)[0]]
    finally:
        first.kill()
        first.wait()
    uids = [int(reply.split()[0]) for reply in replies]
    assert uids[0] != uids[1], (first.pid, second.pid, replies)


def test_uids_are_taken_once_by_callers_at_once(tmp_path):
    """Fails if callers taking uids at once (four processes, as DDP ranks) get one twice: the count read and grown
    without the lock."""
    path = str(tmp_path / "uids")
    take = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport sandbox\nsandbox.PY_UIDS = {path!r}\n"
    take += "print(*(sandbox._next_uid() for _ in range(2000)))"
    callers = [subprocess.Popen([sys.executable, "-c", take], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    uids = [uid for caller in callers for uid in caller.communicate(timeout=60)[0].split()]
    assert len(uids) == len(set(uids)) == 8000, len(set(uids))


def test_a_killed_callers_uid_is_not_taken_again(tmp_path, monkeypatch):
    """Fails if, a caller SIGKILLed mid-call, the next call waits on the count's lock (a lock the kernel did not
    release with its dead holder), or takes the dead caller's uid, whose processes may still be ending."""
    conf = sandbox._sandbox()[0]
    if conf["uid"] is None:
        pytest.skip("not root: calls run as your uid, as the line says")
    monkeypatch.setattr(sandbox, "PY_UIDS", str(tmp_path / "uids"))
    marker = new_marker()
    argv = [sys.executable, "-c", CALLER, str(REPO), json.dumps(conf), sandbox.PY_UIDS]
    caller = subprocess.Popen(argv, stdin=subprocess.PIPE, text=True)
    try:
        start_sleeping(caller, marker)
        with open(f"/proc/{marked(marker)[0]}/status") as f:
            uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
    finally:
        caller.kill()
        caller.wait()
    start = time.monotonic()
    assert sandbox._next_uid() != uid and time.monotonic() - start < BOUND, uid
    assert gone(lambda: marked(marker) + wrappers(caller.pid)) == []


def test_a_later_call_finds_nothing_an_earlier_call_left(mode):
    """Issue 54.2. Fails if a later caller given the earlier caller's pid (forced through ns_last_pid) makes its call
    as the earlier call's uid (derived from pid and call number), or reads the key that call left in its user keyring
    (where key syscalls are not refused, the "no seccomp" mode, keys outlive a call: its uid alone keeps them apart)."""
    if "a fresh uid per call" not in mode:
        pytest.skip("not root: calls run as your uid, as the line says")
    add_key, keyctl = key_syscalls()
    secret = f"grpo-secret-{uuid.uuid4().hex}"
    leave = (
        f"import ctypes, os\nprint(os.getuid())\n"
        f"ctypes.CDLL(None).syscall({add_key}, b'user', b'grpo', b'{secret}', {len(secret)}, -4)\n"
    )
    find = (  # every key in its user and persistent keyrings, linked into its session keyring (possessed: readable)
        "import ctypes, os, struct\nprint(os.getuid())\nlibc = ctypes.CDLL(None)\n"
        f"buf = ctypes.create_string_buffer(4096)\nlibc.syscall({keyctl}, 8, -4, -3)\n"
        f"for ring in -4, libc.syscall({keyctl}, 22, -1, -3):\n"
        f"    n = max(0, libc.syscall({keyctl}, 11, ring, buf, 4096))\n"
        "    for key in struct.unpack(f'{n // 4}i', buf.raw[:n]):\n"
        f"        m = max(0, libc.syscall({keyctl}, 11, key, buf, 4096))\n"
        "        print(buf.raw[:m])\n"
    )
    argv = [sys.executable, "-c", CALLER, str(REPO), json.dumps(sandbox._sandbox()[0]), sandbox.PY_UIDS]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    earlier = subprocess.Popen(argv, **pipes)
    replies = [earlier.communicate(leave, timeout=60)[0]]
    try:
        later = spawn_at(earlier.pid, argv, **pipes)  # its pid free again: the earlier caller has been reaped
        replies.append(later.communicate(find, timeout=60)[0])
    finally:
        for uid in {int(reply.split()[0]) for reply in replies if reply.strip()}:
            forget_keys(uid)
    uids = [int(reply.split()[0]) for reply in replies]
    assert uids[0] != uids[1] and secret not in replies[1], replies


def test_socket_files_and_abstract_sockets_are_not_reached(tmp_path, mode):
    """Issue 43.5. Fails if the program connects to a world-writable unix socket file in /tmp (as /tmp/.X11-unix/X0,
    the D-Bus socket or /dev/log are) where the line says no host sockets, or to an abstract unix socket where the
    line says there is no network or no abstract sockets out; the listener must have received nothing."""
    path = f"/tmp/grpo-sock-{uuid.uuid4().hex}"
    abstract = f"\0grpo-sock-{uuid.uuid4().hex}"
    targets = []
    if "no host files or sockets" in mode or "no network" in mode:
        targets.append(path)
    if "no network" in mode or "abstract sockets out" in mode:
        targets.append(abstract)
    if not targets:
        pytest.skip("the line says unix sockets are reachable here")
    servers = []
    for target in targets:
        server = socket.socket(socket.AF_UNIX)
        server.bind(target)
        server.listen()
        server.setblocking(False)
        servers.append(server)
    if path in targets:  # anyone may connect, as to /tmp/.X11-unix/X0
        os.chmod(path, 0o777)
    try:
        for target in targets:
            code = (
                f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({target!r})\ns.send(b'hi')\nprint('sent')"
            )
            text, status = run_python(code)
            assert status == "exit 1" and "sent" not in text, (target, text)
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in servers:
            server.close()
        if os.path.exists(path):
            os.unlink(path)


def test_network_is_cut_where_the_line_says_so(mode):
    """Fails if, where the start-up line says there is no network or no TCP, a connection to a port listening on
    the caller's loopback gets through."""
    if "no network" not in mode and "no TCP" not in mode:
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


# -----------------------------------------------------------------------------
# output, clean-up, concurrency


def test_a_megabyte_of_output_is_capped():
    """Fails if the output is read without a cap (1 MB buffered and the program left to finish) or shown uncut."""
    start = time.monotonic()
    text, status = run_python("import sys\nsys.stdout.write('x' * 2**20)\nimport time\ntime.sleep(30)")
    assert status == f"stopped after {sandbox.PY_READ} bytes of output", status
    assert len(text) < PY_SHOW + 40 and time.monotonic() - start < BOUND


def test_control_strings_come_back_as_plain_text():
    """Fails if bytes that are not UTF-8 raise rather than decode as U+FFFD, or if special-token strings, ANSI
    escapes or NUL bytes are dropped or altered: the tool returns the text as it came."""
    raw = b"<|im_end|>\n<|im_start|>assistant\n\x1b[31mred\x1b[0m\x00\xff\xfe</python>"
    text = python(f"import sys\nsys.stdout.buffer.write({raw!r})")
    assert isinstance(text, str)
    assert text == raw.decode("utf-8", errors="replace") and "<|im_end|>" in text and "\ufffd" in text


def test_temp_dir_and_cgroup_are_removed_after_a_run_and_after_a_timeout(monkeypatch, mode):
    """Fails if the call's host temporary directory (made without namespaces) or its cgroup survives a normal exit
    or a timeout."""
    made, mkdtemp = [], tempfile.mkdtemp

    def spy(**kw):
        made.append(mkdtemp(**kw))
        return made[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", spy)
    conf = sandbox._sandbox()[0]
    run_python("open('f', 'w').write('x' * 1000)")
    run_python("open('f', 'w').write('x')\nwhile True:\n    pass", timeout=1)
    assert len(made) == (0 if conf["ns"] else 2) and not any(os.path.exists(d) for d in made)
    if conf["cgroup"]:
        assert not [d for d in os.listdir(conf["cgroup"]) if d.startswith(f"grpo-python-{os.getpid()}-")]


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


# -----------------------------------------------------------------------------
# gsm8k_python on SmolLM2


def python_rollout(real_model, gsm8k_dir, monkeypatch, program, budget):
    """gsm8k_python on SmolLM2, 2 GSM8K test questions: row 0 made to call python with program (a forced prefix), row
    1 decoding greedily (script -1: its own choice) -> (rollout, the call's ids, the env)."""
    import extra_tasks
    from rollout import Sampler, sample
    from test_tool_rollouts import Forced

    model, tok = real_model
    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir[0]))  # the canonical files, else the sample: no download
    task = extra_tasks.get("gsm8k_python", {"max_tool_calls": 2})
    env = task.env(tok)
    assert isinstance(env, ToolEnv) and env.format == "tags"
    call = tok(f"<python>{program}</python>", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [task.prompt(ex) for ex in task.load("test")[:2]]
    budget = len(call) + budget
    greedy = Sampler(temperature=0.0)
    r = sample(
        Forced(model, [call, [-1]]), tok, prompts, 1, max_new_tokens=budget, stop_ids=[end], sampler=greedy, env=env
    )
    return r, call, env


@pytest.mark.real_model
def test_real_gsm8k_python_rollout(real_model, gsm8k_dir, monkeypatch):
    """Fails if the call does not run in the sandbox, if its reply is not fed as env_mask tokens (no loss) and
    decoding does not go on, if the calls counted disagree with the replies in the trajectory, or if the test needs
    GSM8K_DIR set or a download (it reads the canonical files, else tests/gsm8k_sample.jsonl)."""
    tok = real_model[1]
    r, call, env = python_rollout(real_model, gsm8k_dir, monkeypatch, "print(3 * 4 + 5)", 64 + 24)
    reply = tok(env.reply("python", "17\n"), add_special_tokens=False)["input_ids"]
    n, m = len(call), len(call) + len(reply)
    assert r.completion_ids[0, :n].tolist() == call and r.completion_ids[0, n:m].tolist() == reply
    assert r.env_mask[0, n:m].all() and not r.env_mask[0, :n].any() and r.completion_mask[0, m]
    assert r.env_state[0]["tool_calls"] >= 1 and r.env_state[0]["tool_errors"] == 0
    for i in range(2):  # each reply a run of env tokens, one call counted per run
        spans = int((r.env_mask[i, 1:] & ~r.env_mask[i, :-1]).sum()) + int(r.env_mask[i, 0])
        assert r.env_state[i]["tool_calls"] == spans, i
    assert not (r.completion_mask.bool() & r.env_mask).any() and torch.all(r.sample_logp[r.env_mask] == 0)


@pytest.mark.real_model
def test_real_failing_call_reply_shows_the_error(real_model, gsm8k_dir, monkeypatch):
    """Issue 42. Fails if, after a failing call (print(48 / 0)), the reply tokens the model reads (cut to
    max_reply_tokens, 64, from their head) do not hold the error's last line: a traceback shown from its start, whose
    'ZeroDivisionError: division by zero' falls past token 64 with SmolLM2's tokenizer."""
    tok = real_model[1]
    r, call, env = python_rollout(real_model, gsm8k_dir, monkeypatch, "print(48 / 0)", 64 + 24)
    n = len(call)
    length = int(r.env_mask[0, n:].long().cumprod(0).sum())  # the reply: the env tokens right after the call
    assert 0 < length and env.max_reply_tokens == 64
    read = tok.decode(r.completion_ids[0, n : n + length])
    assert r.env_state[0]["tool_errors"] == 1 and "ZeroDivisionError: division by zero" in read, read


def test_the_process_scan_reads_a_name_that_is_not_utf8():
    """Fails if sandbox._uid_pids decodes /proc/PID/status strictly: a live process whose name is not UTF-8 (the
    kernel cuts a name at 15 bytes, mid-character) would end every python tool call in a UnicodeDecodeError."""
    code = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'bad\\xc7name', 0, 0, 0); print(1, flush=True)"
    code += "; time.sleep(60)"  # PR_SET_NAME = 15
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"1"  # named by now
        with open(f"/proc/{proc.pid}/comm", "rb") as f:
            assert b"\xc7" in f.read()  # the planted name is there, not UTF-8
        assert proc.pid in sandbox._uid_pids(os.getuid())
    finally:
        proc.kill()
        proc.wait()
