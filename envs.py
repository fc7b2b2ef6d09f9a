"""Tool use in rollouts (agentic GRPO), imported only when a task has tools: `calculator`, a safe arithmetic tool,
and `ToolEnv`, which rollout.sample's decode loop steps once per token: it spots a complete call in a row's own
text, runs it (a daemon thread, a timeout) and feeds that row the chat template's rendering of the result as its
next tokens. A tool is a plain function: its name, type hints and Google-style docstring are its schema. Formats:
- "json" when the chat template writes `<tool_call>` (Qwen2.5, Hermes): calls are `<tool_call>\\n{"name": NAME,
  "arguments": {...}}\\n</tool_call>`, results come back in the template's "tool" role;
- "tags" otherwise (SmolLM2): `<NAME>INPUT</NAME>` for one-argument tools, results come back as a user message
  `Result: ...`; any `</word>` closing an earlier `<word>` is a call (an unknown name is an error).
One call per assistant turn: the environment replies at the first closing tag."""

import ast
import inspect
import json
import math
import operator
import re
import threading
import time
from collections import deque

import torch
from transformers.utils import get_json_schema

MAX_CHARS, MAX_DIGITS, MAX_EXPONENT = 200, 100, 64  # far beyond word-problem arithmetic; each op stays instant
OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_RESULT_CHARS = 500  # a tool's reply costs tokens of the row's budget
TAG_RE = re.compile(r"<(\w+)>(.*?)</\1>", re.S)
MARK, DUMMY = "CALL", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "CALL"}]
MALFORMED = 'error: malformed call; write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'

# -----------------------------------------------------------------------------
# the calculator


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses, e.g. "(3 + 4.5) * 2".

    Args:
        expression: the arithmetic expression to evaluate, e.g. "1234 * 56"
    """
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")  # parsed, never eval'd
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return _format(_eval(tree.body))


def _eval(node):
    """Python's arithmetic on int/float literals; every value is checked, every power bounded before it runs."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise ValueError(f"exponent beyond {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and a != 0 and b * math.log10(abs(a)) > MAX_DIGITS:
            raise ValueError("result too large")  # |a ** b| > 10 ** MAX_DIGITS, refused before computing it
        try:
            return _checked(OPS[type(node.op)](a, b))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    what = type(node.value if isinstance(node, ast.Constant) else getattr(node, "op", node)).__name__
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def _checked(value):
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ValueError("complex result")
    if not abs(value) <= 10**MAX_DIGITS:  # also inf and nan
        raise ValueError("result too large")
    return value


def _format(value):
    """An int as is ("69104"); a float rounded to 6 decimals, as an int string when whole ("2.5", "5", "0.333333")."""
    if isinstance(value, int):
        return str(value)
    value = round(value, 6)
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


# -----------------------------------------------------------------------------
# the environment


def _call(fn, args, kwargs, box):
    try:
        box.append((str(fn(*args, **kwargs))[:MAX_RESULT_CHARS], False))
    except Exception as e:  # the row reads the error and goes on
        box.append((f"error: {str(e) or type(e).__name__}"[:MAX_RESULT_CHARS], True))


class ToolEnv:
    """Per-rollout tool environment: reset(N) before the decode loop, step(tok, done) once per step; after it
    calls (N,) counts the calls each row made (errors included) and errors (N,) those that gave an error."""

    def __init__(self, tools, tokenizer, max_calls=4, timeout=2.0, format=None):
        if not tokenizer.chat_template:
            raise ValueError("ToolEnv needs a tokenizer with a chat template")
        self.tools, self.tokenizer = {f.__name__: f for f in tools}, tokenizer
        self.max_calls, self.timeout = max_calls, timeout
        self.format = format or ("json" if "<tool_call>" in str(tokenizer.chat_template) else "tags")
        if self.format not in ("json", "tags"):
            raise ValueError(f"format is 'json' or 'tags', not {self.format!r}")
        many = [n for n, f in self.tools.items() if len(inspect.signature(f).parameters) != 1]
        if self.format == "tags" and many:
            raise ValueError(f"the tags format (<NAME>INPUT</NAME>) takes one-argument tools, not {', '.join(many)}")
        json_format = self.format == "json"
        self.template_kwargs = {"tools": [get_json_schema(f) for f in self.tools.values()]} if json_format else {}
        # a call ends in '>': decode a row only on a token whose vocabulary string has one (byte-level BPE keeps '>',
        # byte fallback writes <0x3E>)
        self._gt = [">" in str(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
        self._tail = self._after_mark(DUMMY, False)  # the template's end of an assistant turn
        self.reply("", "0")  # the template's check, now rather than at the first call
        self.reset(0)

    def render(self, messages):
        """HF tool-use chat messages (an assistant's "tool_calls", "tool" results) -> (messages, template kwargs)
        as this environment shows them: unchanged with the tools' schemas ("json"); or with calls written as tags,
        results as user messages and one line on the syntax in the system message ("tags")."""
        if any(len(m.get("tool_calls") or []) > 1 for m in messages):
            raise ValueError("one tool call per assistant message: the environment replies after the first")
        if self.format == "json":
            return messages, dict(self.template_kwargs)
        out = []
        for m in messages:
            if m["role"] == "tool":
                m = {"role": "user", "content": f"Result: {m['content']}"}
            elif m.get("tool_calls"):
                f = m["tool_calls"][0]["function"]
                args = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
                if len(args) != 1:
                    raise ValueError(f"the tags format takes one-argument calls, not {args}")
                call = f"<{f['name']}>{next(iter(args.values()))}</{f['name']}>"
                m = {"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), call]))}
            out.append(m)
        listing = "; ".join(f"{n}: {(inspect.getdoc(f) or n).splitlines()[0]}" for n, f in self.tools.items())
        line = f"To use a tool, write <NAME>INPUT</NAME>; its result comes back as 'Result: ...'. Tools: {listing}"
        if out and out[0]["role"] == "system":
            return [{**out[0], "content": out[0]["content"] + "\n" + line}] + out[1:], {}
        return [{"role": "system", "content": line}] + out, {}

    def reply(self, name, result):
        """The text the chat template puts after a call: the end of the assistant turn, the result as a "tool"
        (json) or user (tags) message, the next assistant header; taken from the template itself, as what follows
        an assistant message "CALL" once the reply comes after it."""
        msg = {"role": "user", "content": f"Result: {result}"}
        if self.format == "json":
            msg = {"role": "tool", "name": name or "", "content": result}
        suffix = self._after_mark(DUMMY + [msg], True)
        if not suffix.startswith(self._tail):
            raise ValueError(
                f"this chat template ends an assistant turn with {self._tail!r} but writes "
                f"{suffix[: len(self._tail)]!r} there before a tool reply: a rollout cannot continue it"
            )
        return suffix

    def reset(self, n_rows):
        """Start a rollout of n_rows rows: no text, no queued reply, no calls."""
        self._text = [[] for _ in range(n_rows)]  # each row's own token ids since its last reply
        self._queue = [deque() for _ in range(n_rows)]  # reply ids still to feed
        self.calls = torch.zeros(n_rows, dtype=torch.long)  # (N,)
        self.errors = torch.zeros(n_rows, dtype=torch.long)  # (N,)

    def step(self, tok, done):
        """One decode step: tok (N,) sampled, done (N,) rows already stopped (left alone) -> (tok (N,) what each row
        takes, is_env (N,) where that is a reply token, end (N,) rows whose call went past max_calls: no reply, the
        row stops). A call completed by this step's token runs now; its reply is fed from the next step on."""
        assert tok.shape == done.shape == (len(self._text),), f"reset({tok.numel()}) first: one entry per row"
        ids, N = tok.tolist(), tok.numel()
        is_env, end, found = [False] * N, [False] * N, []
        for i, stopped in enumerate(done.tolist()):
            if stopped:
                continue
            if self._queue[i]:
                ids[i], is_env[i] = self._queue[i].popleft(), True
                continue
            self._text[i].append(ids[i])
            if ids[i] < len(self._gt) and self._gt[ids[i]]:
                call = self._parse(self.tokenizer.decode(self._text[i], skip_special_tokens=False))
                if call is not None:
                    self._text[i] = []
                    end[i] = bool(self.calls[i] >= self.max_calls)
                    if not end[i]:
                        found.append((i, call))
        for (i, (name, _, _, _)), (text, error) in zip(found, self._run([call for _, call in found])):
            self._queue[i].extend(self.tokenizer(self.reply(name, text), add_special_tokens=False)["input_ids"])
            self.calls[i] += 1
            self.errors[i] += error
        return tok.new_tensor(ids), torch.tensor(is_env, device=tok.device), torch.tensor(end, device=tok.device)

    def format_reward(self, completions, **_):
        """1.0 where a completion holds a well-formed call to a known tool (its result may still be an error): a
        small shaping reward for the format, fn(completions, **fields) as in rewards.py."""
        return [float(any(c[0] in self.tools for c in self._calls(text))) for text in completions]

    def _parse(self, text):
        """The first complete call in text -> (name, args, kwargs, end of the call in text); name None when it is
        malformed; None when there is no complete call."""
        if self.format == "tags":
            m = TAG_RE.search(text)
            return None if m is None else (m.group(1), (m.group(2).strip(),), {}, m.end())
        body, closed, _ = text.partition("</tool_call>")
        if not closed:
            return None
        try:
            call = json.loads(body.rpartition("<tool_call>")[2])
            if isinstance(call["name"], str) and isinstance(call["arguments"], dict):
                return call["name"], (), call["arguments"], len(body) + len(closed)
        except (ValueError, TypeError, KeyError):  # not JSON, not an object, no name or arguments
            pass
        return None, (), {}, len(body) + len(closed)

    def _calls(self, text):
        while (call := self._parse(text)) is not None:
            yield call
            text = text[call[3] :]

    def _run(self, calls):
        """Run calls at once (tools must be thread-safe), each in a daemon thread, joined up to one deadline ->
        [(text, is_error)]. A call past the timeout is abandoned (Python cannot stop a thread): it runs on, its result
        is dropped, and it does not hold up the interpreter's exit. A call holding the GIL in C code (a huge int power)
        blocks the loop whatever the timeout: the calculator bounds its own work."""
        boxes, threads = [[] for _ in calls], []
        for (name, args, kwargs, _), box in zip(calls, boxes):
            if name is None:
                box.append((MALFORMED, True))
            elif name not in self.tools:
                box.append((f"error: unknown tool {name!r}; tools: {', '.join(self.tools)}", True))
            else:
                threads.append(threading.Thread(target=_call, args=(self.tools[name], args, kwargs, box), daemon=True))
                threads[-1].start()
        deadline = time.monotonic() + self.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [
            box[0] if box else (f"error: {call[0]} timed out after {self.timeout:g} s", True)
            for call, box in zip(calls, boxes)
        ]

    def _after_mark(self, messages, add_generation_prompt):
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )
        if MARK not in text:
            raise ValueError(f"this chat template drops an assistant message's content ({MARK!r}): no tool replies")
        return text.split(MARK, 1)[1]


# -----------------------------------------------------------------------------
# --- python: code in a sandboxed subprocess
# A fresh interpreter per call, started by a small wrapper (SANDBOX_MAIN) that confines itself, then execs it. The
# wrapper, not a preexec_fn, does the setup: a preexec_fn is unsafe in a process with threads (the rollout's).

import functools  # noqa: E402  (this section's own imports: it is self-contained)
import itertools  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

PY_TIMEOUT = 5.0  # wall seconds per call; the caller's own timeout must be longer to see this one's message
PY_LIMITS = {  # per process: a 10 GB list is a MemoryError, a fork bomb stops at 64 processes
    "RLIMIT_AS": 1 << 30,
    "RLIMIT_FSIZE": 16 << 20,
    "RLIMIT_NPROC": 64,
    "RLIMIT_NOFILE": 64,
    "RLIMIT_CORE": 0,
}
PY_READ = 64 << 10  # bytes read at most: past it the program is stopped
PY_SHOW = 400  # characters shown: a reply costs the row's tokens
PY_DISK = "32m"  # its directory is a tmpfs of this size where a mount namespace is made
# a fresh unused uid per call (never reused while a process runs: a killed process's zombie still counts for
# RLIMIT_NPROC until reaped), so limits and kills reach that call alone; the pid keeps processes apart
PY_UID = 2_000_000_000
PY_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
_calls = itertools.count()  # next() is atomic: threads get distinct numbers

SANDBOX_MAIN = r"""
import ctypes, json, os, resource, signal, struct, sys
conf = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
NEWNS, NEWCGROUP, NEWUTS, NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000  # clone(2) flags
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
NOSUID_NODEV, BIND_REC, REC_PRIVATE = 0x2 | 0x4, 0x1000 | 0x4000, 0x4000 | 0x40000


def ok(ret, what):
    if ret < 0:
        raise OSError(ctypes.get_errno(), what)
    return ret


def mount(src, dst, fstype, flags, data=None):
    args = src and src.encode(), dst.encode(), fstype and fstype.encode(), L(flags), data and data.encode()
    ok(libc.mount(*args), dst)


ok(libc.prctl(1, L(signal.SIGKILL)), "pdeathsig")  # its caller gone: gone too
if os.getppid() != conf["ppid"]:
    os._exit(126)
cwd, uid, exe = os.getcwd(), conf["uid"], conf["exe"]
owner = os.getuid() if uid is None else uid
with open("main.py", "rb") as f:
    code = f.read()
if conf["ns"]:  # a net namespace holds only a loopback, down; the pid one dies with its init
    gid = os.getgid()
    ok(libc.unshare(L(NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWPID | NEWNET | NEWUSER * conf["userns"])), "unshare")
    if conf["userns"]:
        maps = ("setgroups", "deny"), ("uid_map", "%d %d 1" % (owner, owner)), ("gid_map", "%d %d 1" % (gid, gid))
        for name, text in maps:  # the same ids inside: files it makes are its own
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    mount(None, "/", None, REC_PRIVATE)  # nothing mounted here shows outside
    for hidden, path in conf["reveal"]:  # the interpreter under a directory its uid cannot enter (/root): only it
        stash = os.path.join(cwd, "stash")
        os.mkdir(stash)
        mount(path, stash, None, BIND_REC)
        mount("tmpfs", hidden, "tmpfs", NOSUID_NODEV, "mode=0755")
        os.makedirs(path)
        mount(stash, path, None, BIND_REC)
        ok(libc.umount2(stash.encode(), 2), "umount")
    mount("tmpfs", cwd, "tmpfs", NOSUID_NODEV, "size=%s,mode=0700,uid=%d,gid=%d" % (conf["disk"], owner, owner))
    os.chdir(cwd)  # the tmpfs, not the directory under it
    with open("main.py", "wb") as f:
        f.write(code)
    os.chown("main.py", owner, owner)
for name, value in conf["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
ok(libc.prctl(38, L(1), L(0), L(0), L(0)), "no_new_privs")
if conf["landlock"]:  # writes only in cwd, reads of system and interpreter files only, no TCP, no signals out
    abi = ok(libc.syscall(L(444), None, L(0), L(1)), "landlock")
    fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1
    attr = struct.pack("QQQ", fs, 3, 3)[: {1: 8, 2: 8, 3: 8, 4: 16, 5: 16}.get(abi, 24)]
    ruleset = ok(libc.syscall(L(444), attr, L(len(attr)), L(0)), "landlock ruleset")
    rules = [(p, 13 if os.path.isdir(p) else 5) for p in conf["read"]]  # execute, read files (and dirs)
    rules += [("/dev/null", 6), ("/dev/urandom", 4), (cwd, fs)]
    for path, rights in rules:
        if os.path.exists(path):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            ok(libc.syscall(L(445), L(ruleset), L(1), struct.pack("=Qi", rights & fs, fd), L(0)), path)
            os.close(fd)
    ok(libc.syscall(L(446), L(ruleset), L(0)), "landlock restrict")
if conf["ns"]:  # its first child is the namespace's init: when it ends, the kernel kills all it started
    pid = os.fork()
    if pid:
        status = os.waitpid(pid, 0)[1]
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) != signal.SIGKILL:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        if os.WIFSIGNALED(status):
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status) % 256)
    libc.prctl(1, L(signal.SIGKILL))
os.execv(exe, [exe, "-I", "-S", "-B", "-X", "utf8", "main.py"])
"""


def python(code: str) -> str:
    """Run a Python program (standard library only) in a sandbox and return what it prints.

    Args:
        code: the program; print the result, e.g. "print(48 / 2 + 48)"
    """
    text, status = run_python(code)
    if status is not None:
        raise RuntimeError(f"{status}: {text}")
    return text or "(no output: print the result)"


def sandbox_protections():
    """One line: what confines a python call here (printed at start-up by a task that uses it)."""
    return _sandbox()[1]


def run_python(code, timeout=PY_TIMEOUT):
    """Run `code` confined as sandbox_protections() says -> (text, status): status None when it exited 0, else one
    short line (exit code, signal, timeout, output cut); text its stdout and stderr as they came, decoded with
    U+FFFD for bytes that are not UTF-8, the head shown (the tail after a failure: a traceback's last line)."""
    conf = _sandbox()[0]
    out, status = _run(conf, code, timeout)
    text = out.decode("utf-8", errors="replace")
    if len(text) > PY_SHOW and status is None:
        text = text[:PY_SHOW] + f" [cut: {len(out)} bytes]"
    if len(text) > PY_SHOW and status is not None:
        text = f"[cut: {len(out)} bytes] " + text[-PY_SHOW:]
    return text, status


@functools.cache
def _sandbox():
    """The strongest configuration whose interpreter starts here -> (config, line). As root the code runs as an
    unused uid or not at all."""
    root = os.geteuid() == 0
    for ns, landlock in (True, True), (True, False), (False, True), (False, False):
        conf = _config(PY_UID if root else None, ns, ns and not root, landlock)
        if _run(conf, "print(6 * 7)", 10.0) == (b"42\n", None):
            return conf, _describe(conf)
    raise RuntimeError("python sandbox: no confined interpreter starts here (as root: none as another uid)")


def _config(uid, ns, userns, landlock):
    prefix = os.path.realpath(sys.base_prefix)
    hidden = None
    for i in range(1, len(prefix.split("/"))):  # the first directory on the way others may not enter (/root)
        step = "/".join(prefix.split("/")[: i + 1])
        if hidden is None and uid is not None and not os.stat(step).st_mode & stat.S_IXOTH:
            hidden = step
    limits = dict(PY_LIMITS)
    if uid is None and not userns:  # RLIMIT_NPROC counts all the user's processes, not this call's
        del limits["RLIMIT_NPROC"]
    return {
        "uid": uid,
        "exe": os.path.realpath(sys.executable),
        "ns": ns,
        "userns": userns,
        "landlock": landlock,
        "reveal": [[hidden, prefix]] if hidden else [],
        "limits": limits,
        "disk": PY_DISK,
        "read": ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", prefix],
    }


def _describe(conf):
    limits = conf["limits"]
    nproc = limits.get("RLIMIT_NPROC", "unbounded")
    parts = [
        f"python sandbox: a fresh interpreter, rlimits (cpu, {limits['RLIMIT_AS'] >> 20} MiB memory, "
        f"{limits['RLIMIT_FSIZE'] >> 20} MiB files, processes {nproc}), own session, scrubbed env"
    ]
    if conf["uid"] is not None:
        parts.append("a fresh uid per call")
    if conf["ns"]:
        parts.append(f"namespaces: no network, own pids (all it starts dies with it), a {conf['disk']} tmpfs dir")
    if conf["landlock"]:
        parts.append("Landlock: writes only in its dir, reads of system files only, no TCP")
    if not conf["ns"]:
        parts.append("network NOT cut")
    if not conf["ns"] and conf["uid"] is None:  # only its process group is killed
        parts.append("a process that leaves its session may outlive the call")
    if not conf["landlock"]:
        parts.append("writes NOT confined beyond file permissions")
    if not (conf["ns"] and conf["landlock"]):
        parts.append("not a security boundary")
    return "; ".join(parts)


def _run(conf, code, timeout):
    """One call: its uid, a temp dir, the wrapper; everything it started killed and the dir removed after,
    whatever happened -> (output bytes, status)."""
    uid = conf["uid"]
    if uid is not None:
        uid += os.getpid() % 20_000 * 100_000 + next(_calls) % 100_000  # < 2**32 - 1
    cpu = math.ceil(timeout) + 1  # CPU seconds: a busy loop ends here even if the wall clock check were missed
    conf = {**conf, "uid": uid, "ppid": os.getpid(), "limits": {**conf["limits"], "RLIMIT_CPU": cpu}}
    workdir = tempfile.mkdtemp(prefix="grpo-python-")
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "main.py"), uid, uid)
        argv = [conf["exe"], "-I", "-S", "-B", "-c", SANDBOX_MAIN, json.dumps(conf)]
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=PY_ENV,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return _read(proc, timeout)
        finally:
            _kill(proc, conf)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _read(proc, timeout):
    """Its output until it exits, up to PY_READ bytes and the timeout -> (bytes, status); it is not reaped here, so
    its pid (its group's id) stays its own until everything is killed."""
    deadline = time.monotonic() + timeout
    out = bytearray()
    eof = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(out), f"timed out after {timeout:g} s"
        if len(out) > PY_READ:
            return bytes(out), f"stopped after {PY_READ} bytes of output"
        if not eof and select.select([proc.stdout], [], [], min(left, 0.05))[0]:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            out += chunk
            eof = not chunk
            continue
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return bytes(out), _status(info)
        if eof:
            time.sleep(min(left, 0.01))


def _status(info):
    if info.si_code == os.CLD_EXITED and info.si_status == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return f"exit {info.si_status}"
    name = signal.Signals(info.si_status).name
    if info.si_status == signal.SIGXCPU:
        name += " (CPU limit)"
    return f"killed by {name}"


def _kill(proc, conf):
    """Everything the call started, ended before the reply. With namespaces: its init killed, then the wrapper (which
    waits for it) reaped: the kernel ends an init only once every other process of its namespace has ended. Then its
    session's group; without namespaces, every process of its uid, until none is left."""
    kids = []
    if conf["ns"]:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                kids = [int(pid) for pid in f.read().split()]
        except OSError:  # the wrapper is gone
            pass
    for pid in kids:
        _signal(os.kill, pid)
    if kids:
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            pass
    if proc.returncode is None:  # not reaped: its pid is still its group's
        _signal(os.killpg, proc.pid)
    uid = conf["uid"]
    for _ in range(100):  # as root, without namespaces: every process of its uid, none of anyone else's
        pids = []
        if uid is not None and not conf["ns"]:
            pids = _uid_pids(uid)
        if not pids:
            break
        for pid in pids:
            _signal(os.kill, pid)
        time.sleep(0.01)
    proc.wait()
    proc.stdout.close()


def _signal(kill, pid):
    try:
        kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _uid_pids(uid):
    """Pids of the live processes (zombies aside) whose real, effective or saved uid is uid."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # ended meanwhile
            continue
        if str(uid) in fields.get("Uid", "").split()[:3] and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(pid))
    return pids
