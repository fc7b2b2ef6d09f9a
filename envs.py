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
import inspect
import json
import math
import operator
import re
import threading
from collections import deque
from functools import partial
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch
from transformers.utils import get_json_schema

import sandbox
from rewards import RewardError


def tool_reward(completions, tool_calls, tool_errors, **_):
    """1.0 where a tool call ran (a call answered with an error aside): a push towards calling."""
    return [float(c > e) for c, e in zip(tool_calls, tool_errors)]


def tool_cost(completions, tool_calls, **_):
    """-1 per tool call (errors and refusals count): with a small weight, a price on calling that only a right
    answer without the tool avoids."""
    return [-float(c) for c in tool_calls]


# what --reward-weights NAME=W switches on for any task with an environment, beside rewards.REWARDS (train.py)
REWARDS = {"tool": tool_reward, "tool_cost": tool_cost}


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
        self._tail = _after_mark(tokenizer, DUMMY, add_generation_prompt=False)  # the template's end of a turn
        # the shortest reply; framing one checks the template
        self._least = len(self.frame({"role": "user", "content": "0"}, stopped=False))
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
        openings = [_guarded(i, env.reset, examples[i // group_size]) for i, env in enumerate(self.envs)]
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
        suffix = _after_mark(self.tokenizer, DUMMY + [{**message, "content": REPLY}], add_generation_prompt=True)
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
        active = [i for i, d in enumerate(done.tolist()) if not d]  # one read of the device's tensor, not N
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
                message, finished = _guarded(i, future.result)
                if finished or (message is None and at_stop):
                    end[i] = True
                    continue
                if message is not None:
                    self._queue[i].extend(self.frame(message, stopped=at_stop))
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
                    _guarded(i, self.envs[i].end, text)
                continue
            if getattr(self.envs[i], "ends_turn", _at_stop)(text, end[i]):
                self._pending[i] = (self.pool.submit(self.envs[i].turn, text, end[i]), end[i])
                self._text[i], end[i] = [], end[i] and left[i] == 0  # a stop on its last budget token ends the row
        device = tok.device
        return tok.new_tensor(ids), *(torch.tensor(x, device=device) for x in (own, reply, end))

    def texts(self, tokens, words, reply, is_stop):
        """A rollout's rows, tokens (N, C), the model's own words (its tokens less each turn's stop token), the replies
        and its stop tokens (N, C) each -> (its words, a turn a line; the conversation as the template writes it,
        replies included, the row's final stop token left out; each row's environment state)."""
        completions = []
        for row, own, fed in zip(tokens.tolist(), words.tolist(), reply.tolist()):
            turns = [[]]
            for x, is_own, is_reply in zip(row, own, fed):
                if is_reply and turns[-1]:
                    turns.append([])
                if is_own:
                    turns[-1].append(x)
            completions.append(
                "\n".join(self.tokenizer.batch_decode([t for t in turns if t], skip_special_tokens=True))
            )
        n = (words | reply | is_stop).sum(1)  # (N,)
        ends = n - is_stop.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1).long()  # (N,)
        decode = partial(self.tokenizer.decode, skip_special_tokens=False)
        return completions, [decode(row[:e]) for row, e in zip(tokens.tolist(), ends.tolist())], self.states()

    def states(self):
        """Each row's environment state (N dicts), once its last turn has finished."""
        wait([p[0] for p in self._pending if p is not None])
        return [check_state(env.state(), row) for row, env in enumerate(self.envs)]

    def probe(self, example):
        """The state of a fresh environment reset on `example`: its keys are reward fields (checked before a run)."""
        env = self.make()
        env.reset(example)
        return check_state(env.state())

    def _ids(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template's own control tokens


def _guarded(row, fn, *args):
    """fn(*args) of row's environment; an exception it raises becomes a one-line RewardError naming the row (the run
    ends on it in one line, never a traceback)."""
    try:
        return fn(*args)
    except Exception as e:
        what = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise RewardError(f"the environment of row {row} raised {what}") from e


def _at_stop(text, stopped):  # an environment's default ends_turn: the row's own stop token ends its turn
    return stopped


def check_state(state, row=None):
    """state, if every value is a number (they are averaged into metrics, read as reward fields), else a RewardError
    naming the key and the row (None: a fresh environment's, at start-up)."""
    for key, value in state.items():
        if type(value) not in (bool, int, float):
            raise RewardError(
                f"environment state {key!r} {'' if row is None else f'of row {row} '}is {value!r:.40}: a state value "
                "must be a number (bool, int, float)"
            )
    return state


def opening_msg(message):
    return {"role": "user", "content": message} if isinstance(message, str) else message


def _after_mark(tokenizer, messages, *, add_generation_prompt):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
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
        abandoned (Python cannot stop a thread), its result dropped; the calculator bounds its own work. timeout None:
        joined until it returns (python bounds its own time and returns once all it started has ended)."""
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
        framed = self.frame(self.make.message(name, result), stopped=False)
        return self.tokenizer.decode(framed, skip_special_tokens=False)


# -----------------------------------------------------------------------------
# feedback: not a tool; the environment checks each finished answer and asks again when it is wrong


class FeedbackEnv:
    """One row's checker: at each answer (the row's stop token, or where the budget cut it) check(text, example) gives
    None when it is right, else the reply (arith_retry's: WRONG; a game's: a hint); with attempts left the row reads
    the reply and tries again, else it ends. state(): attempts, first_correct, final_correct (the last attempt's)."""

    def __init__(self, check, max_attempts=2):
        self.check, self.max_attempts = check, max_attempts

    def reset(self, example):
        self.example, self.results, self.reply = example, [], None

    def turn(self, text, stopped):
        self.end(text)
        if self.results[-1] or len(self.results) >= self.max_attempts:
            return None, True
        return self.reply, False

    def end(self, text):  # an answer, judged: at the row's stop token, or where the budget cut it
        self.reply = self.check(text, self.example)
        self.results.append(self.reply is None)

    def state(self):
        first, final = (self.results[0], self.results[-1]) if self.results else (False, False)
        return {"attempts": len(self.results), "first_correct": float(first), "final_correct": float(final)}


# --- python: code run by sandbox.py, its reply made for the model


def python(code: str) -> str:
    """Run a Python program (standard library only) in a sandbox and return what it prints.

    Args:
        code: the program; print the result, e.g. "print(48 / 2 + 48)"
    """
    text, status = sandbox.run_python(code)
    if status is None:
        return text or "(no output: print the result)"
    start = sandbox.error_start(text)  # a traceback's exception: its name first, as a reply keeps its head
    first, _, rest = text[start:].strip().partition("\n")
    if status.startswith("exit") and first:
        raise RuntimeError("\n".join(x for x in (f"{first} ({status})", rest, text[:start].rstrip()) if x))
    raise RuntimeError(f"{status}\n{text}".rstrip())
