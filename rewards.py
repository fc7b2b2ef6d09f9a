r"""Scoring: reward fns `fn(completions, **fields) -> list[float]` (a finite number per completion; fields by name, a
list each, `**_` the rest), REWARDS, their weighted sum, and answer extraction as lm-eval-harness gsm8k strict-match and
flexible-extract (lm_eval/tasks/gsm8k/gsm8k.yaml), Qwen2.5-Math's last `\boxed{...}` (evaluation/parser.py):
>>> text = "4 + 4 = 8\n#### 8\nQuestion: ...\n#### 2, \\boxed{\\frac{3}{4}}: she pays $1,200.50"
>>> extract_strict(text), extract_boxed(text), extract_flexible(text), answers_match("$1,000.", "1000")
('8', '\\frac{3}{4}', '$1,200.50', True)"""

import inspect
import math
import numbers
import re
from fractions import Fraction

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval-harness strict-match, verbatim: a space after ####, no `$`
NUMBER_RE = re.compile(r"-?\$?\d(?:[\d,]*\d)?(?:\.\d+)?")  # optional sign and `$`, thousands commas, decimals
FRAC_RE = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")


# --- answer extraction
def extract_strict(text):
    """The number on the first `#### N` line, or None (a model that runs on answered with its first)."""
    return m.group(1) if (m := STRICT_RE.search(text)) else None


def extract_boxed(text):
    """Contents of the last `\\boxed{...}` (nested braces allowed), or None if absent/unclosed."""
    _, box, rest = text.rpartition("\\boxed{")
    if not box:
        return None
    depth = 1
    for j, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return rest[:j].strip()
    return None  # absent, or truncated mid-answer


def extract_flexible(text):
    """The last number in the text (commas and `$` kept; answers_match strips them), or None."""
    return (NUMBER_RE.findall(text) or [None])[-1]


def extract_answer(text):
    """The final answer line used for correctness: strict `#### N`, else the last `\\boxed{}`."""
    return strict if (strict := extract_strict(text)) is not None else extract_boxed(text)


def has_final_answer(text):
    """True if the final-answer line (`#### N` or `\\boxed{}`) is there with a digit in it."""
    return any(ch.isdigit() for ch in extract_answer(text) or "")


def answers_match(pred, gold):
    """True if pred equals gold as a number (`$`, commas, spaces, a trailing `.` ignored; `3/4` and
    `\\frac{3}{4}` are numbers), else as a string. A None or empty prediction never matches."""
    p, g = ("" if x is None else FRAC_RE.sub(r"\1/\2", str(x).strip()) for x in (pred, gold))
    for junk in ("\\$", "$", "\\!", "\\,", "\\ ", ",", " "):
        p, g = p.replace(junk, ""), g.replace(junk, "")
    p, g = p.rstrip("."), g.rstrip(".")
    if not p or not g:
        return False
    try:
        return Fraction(p) == Fraction(g)  # exact: Fraction("0.1") is 1/10
    except (ValueError, ZeroDivisionError):
        return p == g


# --- reward fns: fn(completions, **fields)
def correctness_reward(completions, answer, **_):
    """1.0 where the final-answer line (strict `#### N`, else `\\boxed{}`) matches the gold answer."""
    return [float(answers_match(extract_answer(c), a)) for c, a in zip(completions, answer)]


def format_reward(completions, **_):
    """1.0 where the required final-answer line is there: a strict `#### N` or a `\\boxed{}`."""
    return [float(has_final_answer(c)) for c in completions]


# what --reward-weights NAME=W switches on for any task (a task's own reward_fns add to these or replace them)
REWARDS = {"correct": correctness_reward, "format": format_reward}  # envs.REWARDS: a tool task's


# --- combining
def parse_weights(spec, reward_fns):
    """ "correct=1,format=0.1" -> {name: weight}; ValueError names the item that is not name=finite number."""
    weights = {}
    items = spec.split(",") if spec else []
    for item in items:
        name, _, w = item.partition("=")
        try:
            weights[name] = float(w)
        except ValueError:
            weights[name] = math.nan
        if name not in reward_fns or not math.isfinite(weights[name]):
            raise ValueError(f"--reward-weights: '{item}' is not name=number with name in {sorted(reward_fns)}")
    return weights


def check_fields(reward_fns, fields):
    """A one-line ValueError if a fn asks for a field not in `fields` (a parameter after completions, no default)."""
    for name, fn in reward_fns.items():
        params = list(inspect.signature(fn).parameters.values())[1:]
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        missing = [p.name for p in params if p.default is p.empty and p.kind in kinds and p.name not in fields]
        if missing:
            raise ValueError(
                f"reward {name!r} asks for the field {missing[0]!r}, which this task does not give (it gives "
                f"{', '.join(sorted(fields))}); give it a default or drop the reward's weight"
            )


class RewardError(ValueError):
    """A reward fn failed or broke the contract; the one-line message names the fn and what is wrong."""


def _show(text, width=60):  # a completion in a one-line message: repr escapes newlines, long text is cut
    return repr(text[:width]) + ("..." if len(text) > width else "")


def _blame(fn, completions, fields, error):  # fn rerun on one completion at a time: the first it raises on, if any
    for i, c in enumerate(completions):
        try:
            fn([c], **{k: v[i : i + 1] if isinstance(v, (list, tuple)) else v for k, v in fields.items()})
        except Exception as e:
            return f"completion {i} {_show(c)}", e
    return f"the batch of {len(completions)}", error


def _number(v):  # v as a finite float, or None: real numbers only (a str, a list, a complex is no reward)
    v = v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v  # numpy / 0-dim tensor scalars
    return float(v) if isinstance(v, numbers.Real) and math.isfinite(v) else None


def combine_rewards(reward_fns, weights, completions, **fields):
    """total[i] = sum_k weights[k] * reward_fns[k](completions, **fields)[i] -> (total, per_fn). A fn that raises, or
    gives other than N finite reals (list, tuple, 1-D array), is a RewardError: a nan would train silently."""
    if set(weights) != set(reward_fns):
        raise ValueError(
            f"weights for {sorted(weights)}, reward fns {sorted(reward_fns)}; give each fn a weight (0.0 only logs it)"
        )
    for name, w in weights.items():
        if _number(w) is None:
            raise RewardError(f"weight {name}={w!r} is not a finite number; give reward {name!r} a weight like 1.0")
    n = len(completions)
    for key, values in fields.items():
        if isinstance(values, (list, tuple)) and len(values) != n:
            raise ValueError(f"field {key!r} has {len(values)} values for {n} completions; give one per completion")
    total = [0.0] * n
    per_fn = {}
    hint = f"return a list of {n} numbers"
    for name, fn in reward_fns.items():
        try:
            raw = fn(completions, **fields)
        except Exception as e:
            where, e = _blame(fn, completions, fields, e)
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:200]  # one line, however the fn words it
            raise RewardError(f"reward {name!r} raised {msg} on {where}; fix the function or its weight") from e
        raw = raw.tolist() if getattr(raw, "ndim", None) == 1 and hasattr(raw, "tolist") else raw  # 1-D tensor/array
        if not isinstance(raw, (list, tuple)):
            raise RewardError(f"reward {name!r} returned a {type(raw).__name__}, not a list of numbers; {hint}")
        if len(raw) != n:
            raise RewardError(f"reward {name!r} returned {len(raw)} values for {n} completions; {hint}")
        values = [_number(v) for v in raw]
        if None in values:
            i = values.index(None)
            raise RewardError(
                f"reward {name!r} gave {raw[i]!r:.40} ({type(raw[i]).__name__}) for completion {i} "
                f"{_show(completions[i])}, not a finite number; {hint}"
            )
        per_fn[name] = values
        total = [t + float(weights[name]) * v for t, v in zip(total, values)]
    return total, per_fn
