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
