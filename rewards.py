r"""
Scoring completions: answer extraction, reward functions, and their weighted sum.

Every reward function has one signature:

    fn(completions: list[str], **fields) -> list[float]

`fields` are per-completion lists aligned with `completions` (the train loop repeats each
example's fields G times), e.g. `answer=[...]`, `prompt=[...]`, `num_tokens=[...]`.
A function takes the fields it needs by name and ignores the rest (`**_`).

Answer extraction follows the two references people compare against:
- strict: lm-evaluation-harness gsm8k "strict-match", regex `#### (\-?[0-9\.\,]+)`, first match
  (github.com/EleutherAI/lm-evaluation-harness/blob/main/lm_eval/tasks/gsm8k/gsm8k.yaml)
- boxed: Qwen2.5-Math's last `\\boxed{...}`, nested braces found by counting
  (github.com/QwenLM/Qwen2.5-Math/blob/main/evaluation/parser.py)
- flexible: the last number in the text, like lm-eval's "flexible-extract".
"""

import math
import re
from fractions import Fraction

import torch

# lm-eval-harness strict-match, verbatim: a space after ####, no `$`
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
# a number: optional sign and `$`, digits with thousands commas, optional decimals
NUMBER_RE = re.compile(r"-?\$?\d(?:[\d,]*\d)?(?:\.\d+)?")
FRAC_RE = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")

# -----------------------------------------------------------------------------
# answer extraction

def extract_gold(solution_text):
    """Gold answer from a GSM8K solution: the text after the last `####`, commas stripped.

    >>> extract_gold("2 + 3 = <<2+3=5>>5 so ...\\n#### 1,005")
    '1005'
    """
    if "####" not in solution_text:
        raise ValueError(f"no '#### <answer>' line in solution: {solution_text[-80:]!r}")
    gold = solution_text.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise ValueError(f"nothing after '####' in solution: {solution_text[-80:]!r}")
    return gold


def extract_strict(text):
    """The number on the first `#### N` line, or None.

    First match, as lm-eval-harness strict-match does. That is also what a researcher wants
    when a model runs on after answering (writes a made-up next question with its own
    `#### N`): the first `####` answers the question that was asked.

    >>> extract_strict("5 + 3 = 8\\n#### 8\\nQuestion: ...\\n#### 2")
    '8'
    """
    m = STRICT_RE.search(text)
    return m.group(1) if m else None


def extract_boxed(text):
    """Contents of the last `\\boxed{...}` (nested braces allowed), or None if absent/unclosed.

    >>> extract_boxed(r"so \\boxed{\\frac{3}{4}}.")
    '\\\\frac{3}{4}'
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # truncated mid-answer


def extract_flexible(text):
    """The last number in the text (commas and `$` kept; answers_match strips them), or None.

    >>> extract_flexible("She pays $1,200.50 in total.")
    '$1,200.50'
    """
    found = NUMBER_RE.findall(text)
    return found[-1] if found else None


def extract_answer(text):
    """The final answer line used for correctness: strict `#### N`, else the last `\\boxed{}`."""
    strict = extract_strict(text)
    return strict if strict is not None else extract_boxed(text)


def has_final_answer(text):
    """True if the text has the required final-answer line (strict `#### N` or `\\boxed{}`) with a digit in it."""
    pred = extract_answer(text)
    return pred is not None and any(ch.isdigit() for ch in pred)


def _normalise(s):
    s = FRAC_RE.sub(r"\1/\2", s.strip())
    for junk in ("\\$", "$", "\\!", "\\,", "\\ ", ",", " "):
        s = s.replace(junk, "")
    return s.rstrip(".")


def answers_match(pred, gold):
    """True if pred equals gold as a number (or, if either is not a number, as a string).

    Ignores `$`, commas, spaces, a trailing `.`; `72.0 == 72`; simple fractions `3/4` and
    `\\frac{3}{4}` compare as numbers. A None or empty prediction never matches.

    >>> answers_match("$1,000.", "1000"), answers_match("72.0", "72"), answers_match(None, "1")
    (True, True, False)
    """
    if pred is None or gold is None:
        return False
    p, g = _normalise(str(pred)), _normalise(str(gold))
    if not p or not g:
        return False
    try:
        return Fraction(p) == Fraction(g)  # exact: Fraction("0.1") is 1/10
    except (ValueError, ZeroDivisionError):
        return p == g

# -----------------------------------------------------------------------------
# reward functions: fn(completions, **fields) -> list[float]

def correctness_reward(completions, answer, **_):
    """1.0 where the final-answer line (strict `#### N`, else `\\boxed{}`) matches the gold answer."""
    return [float(answers_match(extract_answer(c), a)) for c, a in zip(completions, answer)]


def format_reward(completions, **_):
    """1.0 where the required final-answer line is there: a strict `#### N` or a `\\boxed{}`."""
    return [float(has_final_answer(c)) for c in completions]


def length_reward(target):
    """A reward fn giving `-|target - length|`, the length reward of the seed write-ups.

    Length is in tokens when the train loop passes `num_tokens=[...]`, else in characters
    of the completion text; pick `target` in the same unit.
    """
    def length(completions, num_tokens=None, **_):
        lengths = num_tokens if num_tokens is not None else [len(c) for c in completions]
        return [-abs(float(target) - float(n)) for n in lengths]
    return length


def overlong_reward(max_len, buffer):
    """A reward fn for DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13):

        R(y) = 0                             if |y| <= L_max - L_cache
             = (L_max - L_cache - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
             = -1                            if |y| > L_max

    with L_max = max_len, L_cache = buffer and |y| = num_tokens: the completion's generated tokens,
    its stop token included (what the train loop passes). DAPO sets L_max to the generation limit,
    so a truncated completion gets -1; a smaller max_len punishes before the limit is reached.

    >>> overlong_reward(48, 16)(["a"] * 4, num_tokens=[32, 33, 40, 49])
    [0.0, -0.0625, -0.5, -1.0]
    """
    if max_len < 1 or not 0 < buffer <= max_len:
        raise ValueError(f"overlong reward needs max_len >= 1 and 0 < buffer <= max_len, "
                         f"got max_len={max_len}, buffer={buffer}")

    def overlong(completions, num_tokens=None, **_):
        if num_tokens is None:
            raise ValueError("overlong reward needs num_tokens=[...], the generated tokens of each completion")
        return [0.0 if n <= max_len - buffer else -1.0 if n > max_len else (max_len - buffer - n) / buffer
                for n in map(float, num_tokens)]
    return overlong


def reward_model_reward(model, tokenizer, batch_size=16, device=None):
    """Turn an `AutoModelForSequenceClassification` (num_labels=1) into a reward fn.

    The returned fn(completions, prompt, **_) scores `prompt + completion`; when `prompt` is a
    list of chat messages and the tokenizer has a chat template, the completion is added as the
    assistant turn and the template is applied. Scored in no_grad batches of `batch_size`.
    Texts are not truncated: keep them within the model's context length.

    Padding never changes a score: we pad on the right (the causal model cannot see it) with
    the model's own `pad_token_id`, which is what its last-token pooling looks for. If the
    model has none, it is set to the tokenizer's pad token, else its eos token.
    """
    if model.config.num_labels != 1:
        raise ValueError(f"reward model must have num_labels=1 (one score), got {model.config.num_labels}")
    text_config = model.config.get_text_config()
    if text_config.pad_token_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError("tokenizer has neither a pad nor an eos token; set tokenizer.pad_token first")
        text_config.pad_token_id = pad_id  # needed by the model's pooling for batches > 1
    pad_id = text_config.pad_token_id
    device = device or next(model.parameters()).device
    model.eval()  # no dropout in a judge

    def encode(prompt, completion):
        if isinstance(prompt, (list, tuple)) and getattr(tokenizer, "chat_template", None):
            msgs = list(prompt) + [{"role": "assistant", "content": completion}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False)
            return tokenizer(text, add_special_tokens=False)["input_ids"]  # template adds bos itself
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string, or chat messages with a tokenizer that has a chat template")
        return tokenizer(prompt + completion)["input_ids"]

    @torch.no_grad()
    def reward_model(completions, prompt, **_):
        ids = [encode(p, c) for p, c in zip(prompt, completions)]
        scores = []
        for i in range(0, len(ids), batch_size):
            chunk = ids[i:i + batch_size]
            T = max(len(x) for x in chunk)
            input_ids = torch.tensor([x + [pad_id] * (T - len(x)) for x in chunk], device=device)  # (B, T)
            mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in chunk], device=device)  # (B, T)
            logits = model(input_ids=input_ids, attention_mask=mask).logits  # (B, 1)
            scores += logits[:, 0].float().tolist()
        return scores
    return reward_model

# -----------------------------------------------------------------------------
# combining

class RewardError(ValueError):
    """A reward fn failed or gave a bad value; the one-line message names the fn and the completion."""


def _show(text, width=60):
    """A completion for a one-line message: repr keeps newlines escaped, long text is cut."""
    return repr(text[:width]) + ("..." if len(text) > width else "")


def _first_failure(fn, completions, fields):
    """(index, exception) of the first completion fn raises on when called on it alone, else None."""
    n = len(completions)
    for i in range(n):
        one = {k: v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in fields.items()}
        try:
            fn(completions[i:i + 1], **one)
        except Exception as e:
            return i, e
    return None


def combine_rewards(reward_fns, weights, completions, **fields):
    """Weighted sum of reward fns: total[i] = sum_k weights[k] * reward_fns[k](completions, **fields)[i].

    Every fn needs a weight (0.0 logs it without training on it). Returns
    (total, per_fn) with per_fn[name] the fn's own values, for logging.
    A fn that raises, or returns the wrong count or a value that is not a finite number, is a
    RewardError naming the fn and the first completion at fault: a nan would train silently.
    """
    unknown = sorted(set(weights) - set(reward_fns))
    if unknown:
        raise ValueError(f"unknown reward name(s) {unknown} in weights; valid names: {sorted(reward_fns)}")
    missing = sorted(set(reward_fns) - set(weights))
    if missing:
        raise ValueError(f"no weight for reward(s) {missing}; give each a weight (0 to only log it)")
    for name, w in weights.items():
        try:
            ok = math.isfinite(float(w))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise RewardError(f"weight {name}={w!r} is not a finite number; give reward {name!r} a weight like 1.0")
    n = len(completions)
    for key, values in fields.items():
        if isinstance(values, (list, tuple)) and len(values) != n:
            raise ValueError(f"field {key!r} has {len(values)} values for {n} completions; "
                             "repeat each example's fields once per completion")
    total = [0.0] * n
    per_fn = {}
    for name, fn in reward_fns.items():
        try:
            raw = fn(completions, **fields)
        except Exception as e:
            i, e = _first_failure(fn, completions, fields) or (None, e)
            where = f"completion {i} {_show(completions[i])}" if i is not None else f"the batch of {n}"
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:200]  # one line, however the fn words it
            raise RewardError(f"reward {name!r} raised {msg} on {where}; fix the function or its weight") from e
        try:
            raw = list(raw)
        except TypeError:
            raise RewardError(f"reward {name!r} returned a {type(raw).__name__}, not a list; "
                              "return one value per completion") from None
        if len(raw) != n:
            raise RewardError(f"reward {name!r} returned {len(raw)} values for {n} completions; "
                              "return one per completion")
        values = []
        for i, v in enumerate(raw):
            try:
                values.append(float(v))
            except (TypeError, ValueError):
                values.append(math.nan)
            if not math.isfinite(values[-1]):
                raise RewardError(f"reward {name!r} gave {v!r:.40} for completion {i} {_show(completions[i])}; "
                                  "return a finite number for every completion")
        per_fn[name] = values
        total = [t + float(weights[name]) * v for t, v in zip(total, values)]
    return total, per_fn
