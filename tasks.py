"""
Tasks: where examples come from, how they are put to the model, and how answers are scored.

A task is five plain things and an optional sixth (see `Task`); `TASKS` maps a name to one.
To add a task, write a `load` and a `prompt`, pick reward fns from rewards.py, and add a line
to `TASKS`.

- gsm8k: grade-school math word problems (Cobbe et al. 2021, github.com/openai/grade-school-math).
  Read from `--data-dir DIR` / `GSM8K_DIR=DIR` if given, else downloaded once into
  `$GRPO_CACHE/gsm8k` (default ~/.cache/grpo-mini/gsm8k) and checked by sha256.
- arith: generated arithmetic ("What is 7 + 5?"), no data files. Small enough that a 135M model
  can show learning on a CPU in minutes: SmolLM2-135M-Instruct often knows the sum but rarely writes
  the strict `#### N` line, so there is a format to learn (README: results).
- arith_steps: generated three-operand arithmetic ("What is 3 + 4 * 2 - 5?"), worked one
  calculation a line. Besides the outcome rewards it has `step_rewards`, a reward per line, for
  process supervision (DeepSeekMath §4.1.3).
"""

import hashlib
import json
import os
import random
import re
import tempfile
import urllib.request
from pathlib import Path
from typing import Callable, NamedTuple

from rewards import (answers_match, correctness_reward, extract_answer, extract_flexible,
                     extract_gold, format_reward, has_final_answer)

# -----------------------------------------------------------------------------
# prompts: the one place to edit what the model is told. short: a 135M model reads it.

SYSTEM_PROMPT = ("Solve the problem step by step. Then give the final answer on its own "
                 "last line as: #### <number> (or \\boxed{<number>}).")
# one worked example: a 135M model rarely writes the #### line from the instruction alone
ARITH_SYSTEM_PROMPT = ("Answer the question. End with a final line: #### <number>\n"
                       "Example:\nWhat is 3 + 4?\n3 + 4 = 7\n#### 7")

ARITH_STEPS_SYSTEM_PROMPT = ("Work it out one calculation a line, as: a op b = c. End with a final line: "
                             "#### <number>\nExample:\nWhat is 2 + 3 * 4?\n3 * 4 = 12\n2 + 12 = 14\n#### 14")

# arith default difficulty: one-digit +, -, *: within reach of a 135M model, whose gain is mostly format
ARITH_DIGITS = 1
ARITH_OPS = "+-*"

SPLITS = ("train", "test")
GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
GSM8K_SHA256 = {
    "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}
GSM8K_HINT = "pass --data-dir DIR or set GSM8K_DIR=DIR to a directory holding train.jsonl and test.jsonl"


class DataError(ValueError):
    """A user-facing data problem; train.py/eval.py print its one-line message and exit."""


class Task(NamedTuple):
    load: Callable            # load(split, data_dir=None) -> list[dict] with "question", "answer"
    prompt: Callable          # prompt(example) -> chat messages
    reward_fns: dict          # name -> fn(completions, **fields) -> list[float]
    reward_weights: dict      # name -> default weight (train.py --reward-weights overrides by name)
    score: Callable           # score(completion, example) -> dict for eval.py
    # step_rewards(completion, example) -> [(char_end, reward), ...], one per step, for process supervision
    step_rewards: Callable | None = None


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")

# -----------------------------------------------------------------------------
# gsm8k

def load_gsm8k(split, data_dir=None):
    """GSM8K examples {"question", "answer" (gold number), "solution" (full answer text)}.

    From data_dir, else $GSM8K_DIR, else the cache (downloaded on first use). A local copy is
    read as is (no checksum), so an edited file works; downloads are checked by sha256.
    """
    _check_split(split)
    data_dir = data_dir or os.environ.get("GSM8K_DIR")
    if data_dir:
        path = Path(data_dir).expanduser() / f"{split}.jsonl"
        if not path.is_file():
            raise DataError(f"GSM8K file not found: {path}; {GSM8K_HINT}")
    else:
        cache = Path(os.environ.get("GRPO_CACHE") or "~/.cache/grpo-mini").expanduser() / "gsm8k"
        path = cache / f"{split}.jsonl"
        if not path.is_file():
            _download(GSM8K_URL.format(split=split), path, GSM8K_SHA256[split])
    return _read_jsonl(path)


def _download(url, path, sha256):
    """Fetch url to path via a temp file in the same dir, renamed only once the sha256 checks out."""
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            data = r.read()
    except OSError as e:  # URLError, timeouts, refused connections are all OSErrors
        raise DataError(f"could not download GSM8K from {url} ({e}); {GSM8K_HINT}") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise DataError(f"downloaded {url} has sha256 {got}, expected {sha256}; {GSM8K_HINT}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except BaseException:
        os.unlink(tmp)
        raise


def _read_jsonl(path):
    examples = []
    with open(path, "rb") as f:  # bytes, so a bad byte is reported with its line number
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig")  # -sig: a file saved with a BOM reads the same
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: byte {raw[e.start]:#04x} is not UTF-8; "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, solution = row["question"], row["answer"]
                gold = extract_gold(solution)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except (KeyError, TypeError) as e:
                raise DataError(f"{path}:{lineno}: expected an object with 'question' and 'answer' ({e!r})") from None
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: {e}; fix or remove the line") from None
            if not isinstance(question, str) or not question.strip():
                raise DataError(f"{path}:{lineno}: 'question' must be a non-empty string, got {question!r:.40}; "
                                "fix or remove the line")
            examples.append({"question": question, "answer": gold, "solution": solution})
    if not examples:
        raise DataError(f"no examples in {path}; {GSM8K_HINT}")
    return examples


def gsm8k_prompt(example):
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": example["question"]}]

# -----------------------------------------------------------------------------
# arith

ARITH_N_TEST = 200
ARITH_N_TRAIN = 10_000
# share of the problem space that is test-only. 80% so that the default space (255 problems) holds
# >= 200 held-out ones; training sees the other ~51 and must generalise to the test set.
ARITH_TEST_PERCENT = 80
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _is_test(*problem):
    """Fixed split by a hash of the problem, e.g. (7, "+", 5): no test problem is ever in train,
    whatever n or seed."""
    h = hashlib.sha256("".join(map(str, problem)).encode()).digest()
    return int.from_bytes(h[:4], "little") % 100 < ARITH_TEST_PERCENT


def _sample_split(space, split, n, rng):
    """n distinct problems of `split` from an enumerated space, in rng's order."""
    pool = [p for p in space if _is_test(*p) == (split == "test")]
    return rng.sample(pool, min(n, len(pool)))


def _check_ops(ops):
    bad = sorted(set(ops) - set(OPS))
    if not ops or bad:
        raise ValueError(f"unknown arith operator(s) {bad}; use a string of {''.join(OPS)}, e.g. '+-'")


def load_arith(split, data_dir=None, n=None, digits=ARITH_DIGITS, ops=ARITH_OPS, seed=0):
    """n distinct generated problems {"question": "What is 7 + 5?", "answer": "12"}.

    Operands have up to `digits` digits; `ops` is a string of operators from "+-*"; for "-" the
    first operand is >= the second, so answers are never negative. n defaults to 200 for test
    and 10,000 for train, and is capped at the size of the split: one-digit sums have only 100
    problems: 20 train and 80 test (the train loop cycles over train). `seed` picks which
    problems and their order; the train/test split itself does not depend on it.
    data_dir is ignored (nothing to read).
    """
    _check_split(split)
    _check_ops(ops)
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    n = n if n is not None else (ARITH_N_TEST if split == "test" else ARITH_N_TRAIN)
    want_test = split == "test"
    rng = random.Random(seed)
    ops = sorted(set(ops))
    hi = 10 ** digits - 1
    if len(ops) * (hi + 1) ** 2 <= 100_000:  # small space: enumerate it, so the cap is exact
        space = [(a, op, b) for op in ops for a in range(hi + 1) for b in range(hi + 1) if not (op == "-" and a < b)]
        problems = _sample_split(space, split, n, rng)
    else:  # huge space: draw at random, repeats are rare and skipped
        problems, seen = [], set()
        for _ in range(50 * n):  # bounded, in case n is near the split's size
            if len(problems) == n:
                break
            a, op, b = rng.randint(0, hi), rng.choice(ops), rng.randint(0, hi)
            if op == "-" and a < b:
                a, b = b, a
            if (a, op, b) not in seen and _is_test(a, op, b) == want_test:
                seen.add((a, op, b))
                problems.append((a, op, b))
    return [{"question": f"What is {a} {op} {b}?", "answer": str(OPS[op](a, b))} for a, op, b in problems]


def arith_prompt(example):
    return [{"role": "system", "content": ARITH_SYSTEM_PROMPT}, {"role": "user", "content": example["question"]}]

# -----------------------------------------------------------------------------
# arith_steps: a ? b ? c, one-digit operands, worked one calculation a line

def _evaluate(a, op1, b, op2, c):
    """a op1 b op2 c with the usual precedence: `*` first, then left to right."""
    if op2 == "*" and op1 != "*":
        return OPS[op1](a, b * c)
    return OPS[op2](OPS[op1](a, b), c)


def load_arith_steps(split, data_dir=None, n=None, ops=ARITH_OPS, seed=0):
    """n distinct generated problems {"question": "What is 3 + 4 * 2 - 5?", "answer": "6"}.

    Three one-digit operands, two operators from `ops`; answers may be negative. The space is
    1,000 * len(ops)**2 problems (9,000 for "+-*"), split by hash as in load_arith (~80% test);
    n defaults as there. `seed` picks which problems and their order. data_dir is ignored.
    """
    _check_split(split)
    _check_ops(ops)
    n = n if n is not None else (ARITH_N_TEST if split == "test" else ARITH_N_TRAIN)
    ops = sorted(set(ops))
    digits = range(10)
    space = [(a, o1, b, o2, c) for o1 in ops for o2 in ops for a in digits for b in digits for c in digits]
    return [{"question": "What is {} {} {} {} {}?".format(*p), "answer": str(_evaluate(*p))}
            for p in _sample_split(space, split, n, random.Random(seed))]


def arith_steps_prompt(example):
    return [{"role": "system", "content": ARITH_STEPS_SYSTEM_PROMPT}, {"role": "user", "content": example["question"]}]


NUM = r"\s*(-?\d+)\s*"
STEP_RE = re.compile(rf"{NUM}([-+*x×]){NUM}={NUM}")  # a op b = c
FINAL_RE = re.compile(r"\s*#### (-?\d+)")  # #### N, one space as strict-match reads it
STEP_OPS = {**OPS, "x": OPS["*"], "×": OPS["*"]}


def arith_step_rewards(completion, example):
    """Process rewards: one step per non-empty line, as (char_end, reward) pairs.

    char_end is the exclusive end of the line's text in `completion` (trailing spaces and `\\r`
    left out), so the reward lands on the step's last character. A line `a op b = c` gets 1.0
    if the arithmetic is right, `#### N` gets 1.0 if N is the gold answer, any other line 0.0
    (`####N` too: the outcome rewards read only `#### N`).
    A step is checked on its own, not for whether it helps: the outcome reward ties the steps
    to the question. No non-empty line at all: one step, (len(completion), 0.0).

    >>> arith_step_rewards("4 * 2 = 8\\n3 + 8 = 12\\n#### 11", {"answer": "11"})  # 3 + 4 * 2
    [(9, 1.0), (20, 0.0), (28, 1.0)]
    """
    steps = []
    for m in re.finditer(r"[^\n]+", completion):
        text = m.group().rstrip()
        if not text:
            continue
        if step := STEP_RE.fullmatch(text):
            a, op, b, c = step.groups()
            reward = float(STEP_OPS[op](int(a), int(b)) == int(c))
        elif final := FINAL_RE.fullmatch(text):
            reward = float(answers_match(final.group(1), example["answer"]))
        else:
            reward = 0.0
        steps.append((m.start() + len(text), reward))
    return steps or [(len(completion), 0.0)]

# -----------------------------------------------------------------------------
# scoring, shared by all tasks

def score(completion, example):
    """What eval.py reports: strict = the final-answer line (`#### N` or `\\boxed{}`) is right,
    flexible = the last number in the text is right (lm-eval's flexible-extract)."""
    pred = extract_answer(completion)
    return {
        "pred": pred,
        "strict": answers_match(pred, example["answer"]),
        "flexible": answers_match(extract_flexible(completion), example["answer"]),
        "format": has_final_answer(completion),
    }


# format gets a small weight: a push towards the `####` line, which correctness needs first
TASKS = {
    "gsm8k": Task(load_gsm8k, gsm8k_prompt, {"correct": correctness_reward, "format": format_reward},
                  {"correct": 1.0, "format": 0.1}, score),
    "arith": Task(load_arith, arith_prompt, {"correct": correctness_reward, "format": format_reward},
                  {"correct": 1.0, "format": 0.1}, score),
    "arith_steps": Task(load_arith_steps, arith_steps_prompt, {"correct": correctness_reward, "format": format_reward},
                        {"correct": 1.0, "format": 0.1}, score, arith_step_rewards),
}
