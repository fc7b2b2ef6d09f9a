"""Environments in rollouts (agentic GRPO), imported only when a task has one: `EnvDriver` holds one environment per
row and is stepped by rollout.sample's decode loop; `ToolEnv` (an EnvDriver of `Tools`, one `ToolRow` a row) answers
tool calls (`calculator`, a safe arithmetic tool), `FeedbackEnv` says when an answer is wrong and lets the row try
again. A tool is a plain function: its name, type hints and Google-style docstring are its schema. Call formats:
- "json" when the chat template writes `<tool_call>` (Qwen2.5, Hermes): calls are `<tool_call>\\n{"name": NAME,
  "arguments": {...}}\\n</tool_call>`, results come back in the template's "tool" role;
- "tags" otherwise (SmolLM2): `<NAME>INPUT</NAME>` for one-argument tools, NAME a registered tool (any other tag is
  text: `<think>`), results come back as a user message `Result: ...`.
One call per assistant turn: the environment replies at the first complete call."""

import ast
import functools
import inspect
import itertools
import json
import math
import operator
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

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
REPLY = "\x00REPLY\x00"  # a placeholder: where the template puts a reply's content
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
    """An int as is ("69104"); a float to 15 significant digits, as an int string when whole ("2.5", "5",
    "0.333333333333333", "5.42101086242752e-20"): no small result shown as 0."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".15g")


# -----------------------------------------------------------------------------
# environments: one object per row, driven by rollout.sample's decode loop through EnvDriver


class EnvDriver:
    """One rollout's environments, stepped once per decode step by rollout.sample. `make()` gives a row's environment,
    an object with
        reset(example) -> an opening message (a user message appended to the prompt) or None;
        turn(text, stopped) -> (reply, done): the row's own text since its last reply (its stop token left out;
            stopped: the row just sampled one), run in a worker thread while the other rows decode on; reply: a user
            message's text, a chat message dict (a "tool" message), or None; done: the row ends here;
        state() -> dict of numbers: reward fields, eval.py's and the step's env/ metrics (tool_calls, attempts, ...);
    and optionally ends_turn(text, stopped) -> bool, cheap: whether that text ends a turn (default: at the row's stop
    token), and end(text): a row the budget cut ends with that text unanswered (a last judgement; no reply).
    `make` may also carry render(messages) -> (messages, template kwargs), how prompts show the environment, and
    turn_chars: only a token whose vocabulary string holds one of them may end a turn before the stop token (None:
    any token; absent: none). Replies are text: tokenized with special-token parsing off, max_reply_tokens at most;
    only the chat template's frame around them is control tokens. A turn before the stop token runs only where the
    budget left can hold the shortest reply and one more own token: else the model could never act on its reply."""

    def __init__(self, make, tokenizer, max_reply_tokens=64, workers=8):
        if not tokenizer.chat_template:
            raise ValueError("an environment needs a tokenizer with a chat template")
        self.make, self.tokenizer, self.max_reply_tokens = make, tokenizer, max_reply_tokens
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="env")
        chars = getattr(make, "turn_chars", "")
        vocab = [str(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
        self._may_end = [chars is None or any(c in t for c in chars) for t in vocab]
        self._tail = _after_mark(tokenizer, DUMMY, False, {})  # the template's end of an assistant turn
        self._least = len(
            self.frame({"role": "user", "content": "0"}, False)
        )  # the shortest reply; checks the template
        self.reset([], [], 1)

    def render(self, messages):
        """Chat messages -> (messages, template kwargs) as the prompt shows this environment."""
        if hasattr(self.make, "render"):
            return self.make.render(messages)
        return messages, {}

    def reset(self, examples, prompts, group_size):
        """Start a rollout: group_size rows per example, each its own environment reset on it -> the prompts, each with
        its first row's opening message (if any) as a last user message."""
        self.envs = [self.make() for _ in range(len(examples) * group_size)]
        openings = [env.reset(examples[i // group_size]) for i, env in enumerate(self.envs)]
        self._text = [[] for _ in self.envs]  # each row's own token ids since its last reply
        self._queue = [deque() for _ in self.envs]  # reply ids still to feed
        self._pending = [None] * len(self.envs)  # (future of a turn, whether it was at a stop token)
        out = []
        for i, p in enumerate(prompts):
            opening = openings[i * group_size]
            if opening is not None:
                p = ([{"role": "user", "content": p}] if isinstance(p, str) else p) + [opening_msg(opening)]
            out.append(p)
        return out

    def frame(self, message, stopped):
        """A reply message -> the ids fed to the row: the template's frame (after an assistant turn, less the stop
        token the row wrote itself when stopped, up to the next assistant header) around the message's content,
        which is tokenized as text and cut to max_reply_tokens."""
        message = opening_msg(message)
        suffix = _after_mark(self.tokenizer, DUMMY + [{**message, "content": REPLY}], True, {})
        if not suffix.startswith(self._tail):
            raise ValueError(
                f"this chat template ends an assistant turn with {self._tail!r} but writes "
                f"{suffix[: len(self._tail)]!r} there before a reply: a rollout cannot continue it"
            )
        head, _, tail = suffix.partition(REPLY)
        if stopped:  # the row's own stop token ended its turn: the frame goes on after it
            head = head[len(self._tail.rstrip()) :] if head.startswith(self._tail.rstrip()) else head
        ids = self.tokenizer(str(message["content"]), add_special_tokens=False, split_special_tokens=True)
        body = ids["input_ids"][: self.max_reply_tokens]
        return self._ids(head) + body + self._ids(tail)

    def step(self, tok, done, stopped, left):
        """One decode step: tok (N,) sampled, done (N,) rows already ended (left alone), stopped (N,) rows that
        sampled a stop token, left (N,) each row's budget after this token -> tok (N,) what each row takes, own (N,) it
        is the model's token, reply (N,) an environment's, end (N,) the row ends here. A row neither own nor reply waits
        on its environment's turn: a hole (masked like padding); when every row left waits, the step blocks for one.
        A turn is not run where the row could not act on its reply (left too small), unless the row stopped (its
        answer is still checked); on a row's last budget token its environment's end(text) judges what is left."""
        N, ids, left = tok.numel(), tok.tolist(), left.tolist()
        own, reply, end = [False] * N, [False] * N, stopped.tolist()
        active = [i for i in range(N) if not done[i]]
        waiting = [self._pending[i][0] for i in active if self._pending[i] is not None]
        if waiting and len(waiting) == len(active):
            wait(waiting, return_when=FIRST_COMPLETED)
        for i in active:
            if self._pending[i] is not None:
                future, at_stop = self._pending[i]
                if not future.done():
                    end[i] = False
                    continue
                self._pending[i] = None
                message, finished = future.result()
                if finished or (message is None and at_stop):
                    end[i] = True
                    continue
                if message is not None:
                    self._queue[i].extend(self.frame(message, at_stop))
            if self._queue[i]:
                ids[i], reply[i], end[i] = self._queue[i].popleft(), True, False
                continue
            own[i] = True
            self._text[i].append(ids[i])
            may_end = ids[i] < len(self._may_end) and self._may_end[ids[i]]  # models pad their vocabulary
            if not (end[i] or left[i] == 0 or (may_end and left[i] > self._least)):
                continue
            text = self.tokenizer.decode(self._text[i][: len(self._text[i]) - end[i]], skip_special_tokens=False)
            if left[i] == 0 and not end[i]:  # the budget ends the row here: the environment may judge what is left
                if hasattr(self.envs[i], "end"):
                    self.envs[i].end(text)
                continue
            if getattr(self.envs[i], "ends_turn", _at_stop)(text, end[i]):
                self._pending[i] = (self.pool.submit(self.envs[i].turn, text, end[i]), end[i])
                self._text[i], end[i] = [], end[i] and left[i] == 0  # a stop on its last budget token ends the row
        device = tok.device
        return tok.new_tensor(ids), *(torch.tensor(x, device=device) for x in (own, reply, end))

    def states(self):
        """Each row's environment state (N dicts), once its last turn has finished."""
        wait([p[0] for p in self._pending if p is not None])
        return [check_state(env.state()) for env in self.envs]

    def probe(self, example):
        """The state of a fresh environment reset on `example`: its keys are reward fields (checked before a run)."""
        env = self.make()
        env.reset(example)
        return check_state(env.state())

    def _ids(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template's own control tokens


def _at_stop(text, stopped):  # an environment's default ends_turn: the row's own stop token ends its turn
    return stopped


def check_state(state):
    """state, if every value is a number (they are averaged into metrics), else ValueError naming the key."""
    for key, value in state.items():
        if type(value) not in (bool, int, float):
            raise ValueError(
                f"environment state {key!r} is {value!r:.40}: a state value must be a number (bool, int, float)"
            )
    return state


def opening_msg(message):
    return {"role": "user", "content": message} if isinstance(message, str) else message


def _after_mark(tokenizer, messages, add_generation_prompt, template_kwargs):
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    if MARK not in text:
        raise ValueError(f"this chat template drops an assistant message's content ({MARK!r}): no replies")
    return text.split(MARK, 1)[1]


# -----------------------------------------------------------------------------
# tools: ToolRow, a row's environment; Tools, the factory that makes them and shows the tools in the prompt; ToolEnv,
# the EnvDriver of a task's tools


def _call(fn, args, kwargs, box):
    try:
        box.append((str(fn(*args, **kwargs))[:MAX_RESULT_CHARS], False))
    except Exception as e:  # the row reads the error and goes on
        box.append((f"error: {str(e) or type(e).__name__}"[:MAX_RESULT_CHARS], True))


class Tools:
    """The factory of a task's ToolRows (EnvDriver's `make`): the tools, the call format, the prompt's rendering.
    format "json" when the chat template writes `<tool_call>` (Qwen2.5, Hermes), else "tags" (SmolLM2)."""

    turn_chars = ">"  # a call ends in '>' (byte-level BPE keeps '>', byte fallback writes <0x3E>)

    def __init__(self, tools, tokenizer, max_calls=4, timeout=2.0, format=None):
        if not tokenizer.chat_template:
            raise ValueError("tools need a tokenizer with a chat template")
        self.tools, self.max_calls, self.timeout = {f.__name__: f for f in tools}, max_calls, timeout
        self.format = format or ("json" if "<tool_call>" in str(tokenizer.chat_template) else "tags")
        if self.format not in ("json", "tags"):
            raise ValueError(f"format is 'json' or 'tags', not {self.format!r}")
        many = [n for n, f in self.tools.items() if len(inspect.signature(f).parameters) != 1]
        if self.format == "tags" and many:
            raise ValueError(f"the tags format (<NAME>INPUT</NAME>) takes one-argument tools, not {', '.join(many)}")
        json_format = self.format == "json"
        self.template_kwargs = {"tools": [get_json_schema(f) for f in self.tools.values()]} if json_format else {}
        names = "|".join(re.escape(n) for n in self.tools)
        self.tag_re = re.compile(rf"<({names})>(.*?)</\1>", re.S)  # only a registered name is a call: <think> is text

    def __call__(self):
        return ToolRow(self)

    def render(self, messages):
        """HF tool-use chat messages (an assistant's "tool_calls", "tool" results) -> (messages, template kwargs)
        as the tools are shown: unchanged with the tools' schemas ("json"); or with calls written as tags, results
        as user messages and one line on the syntax in the system message ("tags")."""
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

    def message(self, name, result):
        """A result as the reply message: a "tool" message (json), a user message "Result: ..." (tags)."""
        if self.format == "json":
            return {"role": "tool", "name": name or "", "content": result}
        return f"Result: {result}"

    def parse(self, text):
        """The first complete call in text -> (name, args, kwargs, end of the call in text); name None when it is
        malformed; None when there is no complete call."""
        if self.format == "tags":
            m = self.tag_re.search(text)
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

    def format_reward(self, completions, **_):
        """1.0 where a completion holds a well-formed call to a known tool (its result may still be an error): a
        small shaping reward for the format, fn(completions, **fields) as in rewards.py."""
        out = []
        for text in completions:
            call = self.parse(text)
            while call is not None and call[0] not in self.tools:
                text = text[call[3] :]
                call = self.parse(text)
            out.append(float(call is not None))
        return out


class ToolRow:
    """One row's tools: a turn at each complete call, whose reply is its result (or an error); state() counts the
    calls (errors and refusals included) and the errors. Past max_calls a call is refused with an error reply and
    the row goes on (it may still answer)."""

    def __init__(self, tools):
        self.tools = tools

    def reset(self, example):
        self.calls, self.errors = 0, 0

    def ends_turn(self, text, stopped):
        return not stopped and self.tools.parse(text) is not None

    def turn(self, text, stopped):
        name, args, kwargs, _ = self.tools.parse(text)
        result, error = self.run(name, args, kwargs)
        self.calls, self.errors = self.calls + 1, self.errors + error
        known = name if name in self.tools.tools else None  # a name the model made up never enters the frame
        return self.tools.message(known, result), False

    def run(self, name, args, kwargs):
        """A call -> (text, is_error). It runs in a daemon thread joined up to the timeout: a call past it is
        abandoned (Python cannot stop a thread), its result dropped; the calculator bounds its own work."""
        tools = self.tools
        if self.calls >= tools.max_calls:
            return "error: call limit reached; give your answer", True
        if name is None:
            return MALFORMED, True
        if name not in tools.tools:
            return f"error: unknown tool {name!r}; tools: {', '.join(tools.tools)}", True
        box = []
        thread = threading.Thread(target=_call, args=(tools.tools[name], args, kwargs, box), daemon=True)
        thread.start()
        thread.join(tools.timeout)
        if not box:
            return f"error: {name} timed out after {tools.timeout:g} s", True
        return box[0]

    def state(self):  # called: the row made a call (its mean: the call rate)
        return {"tool_calls": self.calls, "tool_errors": self.errors, "called": float(self.calls > 0)}


class ToolEnv(EnvDriver):
    """The EnvDriver of a task's tools: ToolEnv([calculator], tokenizer, max_calls=4) is what rollout.sample takes."""

    def __init__(self, tools, tokenizer, max_calls=4, timeout=2.0, format=None, max_reply_tokens=64):
        super().__init__(Tools(tools, tokenizer, max_calls, timeout, format), tokenizer, max_reply_tokens)
        self.format = self.make.format

    def reply(self, name, result):
        """The text fed to a row after its call to `name` returned `result`: the template's frame around it."""
        return self.tokenizer.decode(self.frame(self.make.message(name, result), False), skip_special_tokens=False)


# -----------------------------------------------------------------------------
# feedback: not a tool; the environment checks each finished answer and asks again when it is wrong


class FeedbackEnv:
    """One row's checker: at each answer (the row's stop token, or the budget's end) it extracts the answer as the task
    scores it (`extract`) and compares it with the example's (`match`); wrong with attempts left: the reply WRONG and
    the row tries again, else the row ends. state(): attempts, first_correct, final_correct (the last attempt's)."""

    WRONG = "Wrong; try again. End with a final line: #### <number>"

    def __init__(self, extract, match, max_attempts=2):
        self.extract, self.match, self.max_attempts = extract, match, max_attempts

    def reset(self, example):
        self.gold, self.results = example["answer"], []

    def turn(self, text, stopped):
        self.end(text)
        if self.results[-1] or len(self.results) >= self.max_attempts:
            return None, True
        return self.WRONG, False

    def end(self, text):  # an answer, judged: at the row's stop token, or where the budget cut it
        self.results.append(bool(self.match(self.extract(text), self.gold)))

    def state(self):
        first, final = (self.results[0], self.results[-1]) if self.results else (False, False)
        return {"attempts": len(self.results), "first_correct": float(first), "final_correct": float(final)}


# --- python: code in a sandboxed subprocess
# A fresh interpreter per call, started by a small wrapper (SANDBOX_MAIN) that confines itself, then execs it. The
# wrapper, not a preexec_fn, does the setup: a preexec_fn is unsafe in a process with threads (the rollout's).


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
        f"{limits['RLIMIT_FSIZE'] >> 20} MiB files, processes {nproc}), own process group, scrubbed env"
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
        parts.append("a process that leaves its process group may outlive the call")
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
    process group; without namespaces, every process of its uid, until none is left."""
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
