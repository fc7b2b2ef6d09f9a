"""Tasks: where examples come from, how they are put to the model and scored; to add one: a `load`, a prompt, a `TASKS`
line. gsm8k: grade-school math (github.com/openai/grade-school-math). arith: generated "What is 7 + 5?"; a 135M model
knows sums, rarely writes `#### N`: it learns on a CPU in minutes. Others: extra_tasks.py, imported only when named."""

import hashlib
import random
import re
from functools import partial
from typing import Annotated, Callable, NamedTuple

from config import DataError, Knob, bind
from rewards import answers_match, extract_answer, extract_flexible, has_final_answer

SYSTEM_PROMPT = (  # the one place to edit what the model is told; short: a 135M model reads it
    "Solve the problem step by step. Then give the final answer on its own "
    "last line as: #### <number> (or \\boxed{<number>})."
)
ARITH_SYSTEM_PROMPT = (  # one worked example: a 135M model rarely writes the #### line from the instruction alone
    "Answer the question. End with a final line: #### <number>\nExample:\nWhat is 3 + 4?\n3 + 4 = 7\n#### 7"
)


def chat_prompt(system, example):
    return [{"role": "system", "content": system}, {"role": "user", "content": example["question"]}]


class Task(NamedTuple):
    load: Callable  # load(split, data_dir=None, **options) -> list[dict] with "question", "answer"
    prompt: Callable  # prompt(example) -> chat messages
    reward_fns: dict  # name -> fn(completions, **fields): the task's own, beside rewards.REWARDS (a name replaces it)
    reward_weights: dict  # name -> weight: what the task trains on (--reward-weights reweights or adds any reward)
    score: Callable  # score(completion, example, state) -> dict for eval.py; state: the row's environment's, else {}
    step_rewards: Callable | None = None  # (completion, example) -> [(char_end, reward), ...]: see step_positions
    env: Callable | None = None  # env(tokenizer, **options) -> an envs.EnvDriver: an environment for each row


def check_generated(split, n=None, data_dir=None):  # a generator's checks -> n: 200 test / 10,000 train
    if data_dir:
        raise DataError(
            f"--data-dir {data_dir}: this task generates its problems and reads no data (gsm8k and jsonl do)"
        )
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; valid splits: ['train', 'test']")
    return {"train": 10_000, "test": 200}[split] if n is None else n


def load_gsm8k(split, data_dir=None):  # GSM8K (Cobbe et al. 2021): gsm8k.py reads it, imported when a task uses it
    import gsm8k

    return gsm8k.load(split, data_dir)


ARITH_DIGITS, ARITH_OPS = 1, "+-*"  # default difficulty: within reach of a 135M model, whose gain is mostly format
ARITH_TEST_PERCENT = 80  # test-only share: the default 255 problems hold >= 200 held-out, train ~51: must generalise
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _is_test(*problem):  # split by a hash of the problem, e.g. (7, "+", 5): whatever n or seed, test never in train
    h = hashlib.sha256("".join(map(str, problem)).encode()).digest()
    return int.from_bytes(h[:4], "little") % 100 < ARITH_TEST_PERCENT


def sample_split(space, split, n, rng):  # n distinct problems of `split` from an enumerated space, in rng's order
    pool = [p for p in space if _is_test(*p) == (split == "test")]
    return rng.sample(pool, min(n, len(pool)))


# a generated task's options (task_options), declared as the flags are: each checked before anything loads
N_PROBLEMS = Annotated[int | None, Knob(">= 1", "problems in the split (None: 10,000 train, 200 test), capped")]
OPS_USED = Annotated[str, Knob(re.compile(r"[-+*]+"), "the operators drawn from, a string of +-*")]
SEED = Annotated[int, Knob("[0, 9e18]", "which problems (never which split)")]


def load_arith(
    split,
    data_dir=None,
    n: N_PROBLEMS = None,
    digits: Annotated[int, Knob("[1, 18]", "an operand's digits at most")] = ARITH_DIGITS,
    ops: OPS_USED = ARITH_OPS,
    seed: SEED = 0,
):
    """n distinct problems {"question": "What is 7 + 5?", "answer": "12"}, as its knobs say; for "-" a >= b."""
    n = check_generated(split, n, data_dir)
    rng = random.Random(seed)
    ops = sorted(set(ops))
    hi = 10**digits - 1  # the largest operand
    if len(ops) * (hi + 1) ** 2 <= 100_000:  # small space: enumerate it, so the cap is exact
        space = [(a, op, b) for op in ops for a in range(hi + 1) for b in range(hi + 1) if not (op == "-" and a < b)]
        problems = sample_split(space, split, n, rng)
    else:  # huge space: draw at random, 50 * n draws at most (n may be near the split's size)
        problems = {}  # a dict: repeats skipped, drawing order kept
        for _ in range(50 * n):
            a, op, b = rng.randint(0, hi), rng.choice(ops), rng.randint(0, hi)
            p = (b, op, a) if op == "-" and a < b else (a, op, b)
            if _is_test(*p) == (split == "test"):
                problems[p] = None
            if len(problems) == n:
                break
    return [{"question": f"What is {a} {op} {b}?", "answer": str(OPS[op](a, b))} for a, op, b in problems]


def score(completion, example, state=None):  # shared by the tasks whose environment (if any) judges nothing
    """strict: the final-answer line (`#### N` or `\\boxed{}`) is right; flexible: the last number is (lm-eval's)."""
    pred = extract_answer(completion)
    return {
        "pred": pred,
        "strict": answers_match(pred, example["answer"]),
        "flexible": answers_match(extract_flexible(completion), example["answer"]),
        "format": has_final_answer(completion),
    }


WEIGHTS = {"correct": 1.0, "format": 0.1}  # format: a small push towards the `####` line, which correct needs first
TASKS = {  # each task its own dicts: editing one task's weights leaves the others
    "gsm8k": Task(load_gsm8k, partial(chat_prompt, SYSTEM_PROMPT), {}, dict(WEIGHTS), score),
    "arith": Task(load_arith, partial(chat_prompt, ARITH_SYSTEM_PROMPT), {}, dict(WEIGHTS), score),
}


def with_options(task, name, options):
    """`task` with task_options bound: knobs its load or env declares (arith: n, digits, ops, seed), else ValueError."""
    bound = bind([fn for fn in (task.load, task.env) if fn], options, f"task {name}")
    task = task._replace(load=partial(task.load, **bound[task.load]))
    if task.env:
        task = task._replace(env=partial(task.env, **bound[task.env]))
    return task


def get(name, options=None):
    """The task `name` with `options` (task_options) applied, else ValueError; extra_tasks.get also knows the others."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks.py's: {', '.join(TASKS)}; the others are extra_tasks.py's")
    return with_options(TASKS[name], name, options or {})
