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
    return solution_text.rsplit("####", 1)[1].strip().replace(",", "")


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
    """A reward function failed or returned something unusable; the message names it."""


def combine_rewards(reward_fns, weights, completions, **fields):
    """Weighted sum of reward fns: total[i] = sum_k weights[k] * reward_fns[k](completions, **fields)[i].

    Every fn needs a weight (0.0 logs it without training on it). Returns
    (total, per_fn) with per_fn[name] the fn's own values, for logging.
    """
    unknown = sorted(set(weights) - set(reward_fns))
    if unknown:
        raise ValueError(f"unknown reward name(s) {unknown} in weights; valid names: {sorted(reward_fns)}")
    missing = sorted(set(reward_fns) - set(weights))
    if missing:
        raise ValueError(f"no weight for reward(s) {missing}; give each a weight (0 to only log it)")
    n = len(completions)
    for key, values in fields.items():
        if isinstance(values, (list, tuple)) and len(values) != n:
            raise ValueError(f"field {key!r} has {len(values)} values for {n} completions; "
                             "repeat each example's fields once per completion")
    total = [0.0] * n
    per_fn = {}
    for name, fn in reward_fns.items():
        values = [float(v) for v in fn(completions, **fields)]
        if len(values) != n:
            raise ValueError(f"reward {name!r} returned {len(values)} values for {n} completions")
        per_fn[name] = values
        total = [t + weights[name] * v for t, v in zip(total, values)]
    return total, per_fn
