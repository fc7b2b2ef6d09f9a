"""Tasks: where examples come from, how they are put to the model, how answers are scored (`evaluate`); `TASKS` maps a
name to a `Task`, `get` gives one with its task_options applied. To add one: a `load`, a prompt, a `TASKS` line.
- gsm8k: grade-school math (Cobbe et al. 2021, github.com/openai/grade-school-math).
- arith: generated "What is 7 + 5?": a 135M model knows sums, rarely writes `#### N`: it learns on a CPU in minutes.
Other tasks (process supervision, tools, ...) live in extra_tasks.py, imported only when one is named."""

import hashlib
import inspect
import math
import random
from functools import partial
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from rewards import answers_match, extract_answer, extract_flexible, has_final_answer
from rollout import Sampler, decode_dynamic, sample, stop_token_ids

# prompts: the one place to edit what the model is told. short: a 135M model reads it.
SYSTEM_PROMPT = (
    "Solve the problem step by step. Then give the final answer on its own "
    "last line as: #### <number> (or \\boxed{<number>})."
)
# one worked example: a 135M model rarely writes the #### line from the instruction alone
ARITH_SYSTEM_PROMPT = (
    "Answer the question. End with a final line: #### <number>\nExample:\nWhat is 3 + 4?\n3 + 4 = 7\n#### 7"
)


def chat_prompt(system, example):
    return [{"role": "system", "content": system}, {"role": "user", "content": example["question"]}]


class DataError(ValueError):
    """A user-facing data problem; train.py/eval.py print its one-line message and exit."""


class Task(NamedTuple):
    load: Callable  # load(split, data_dir=None, **options) -> list[dict] with "question", "answer"
    prompt: Callable  # prompt(example) -> chat messages
    reward_fns: dict  # name -> fn(completions, **fields): the task's own, beside rewards.REWARDS (a name replaces it)
    reward_weights: dict  # name -> weight: what the task trains on (--reward-weights reweights or adds any reward)
    score: Callable  # score(completion, example, state) -> dict for eval.py; state: the row's environment's, else {}
    step_rewards: Callable | None = None  # (completion, example) -> [(char_end, reward), ...]: see step_positions
    env: Callable | None = None  # env(tokenizer, **options) -> an envs.EnvDriver: an environment for each row


def check_generated(split, ops="+", n=None, data_dir=None):  # a generator's checks -> n: 200 test / 10,000 train
    if data_dir:
        raise DataError(f"--data-dir {data_dir}: this task generates its problems and reads no data (gsm8k does)")
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; valid splits: ['train', 'test']")
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"unknown arith operator(s) {sorted(set(ops) - set('+-*'))}; use a string of +-*, e.g. '+-'")
    return {"train": 10_000, "test": 200}[split] if n is None else n


def load_gsm8k(split, data_dir=None):  # GSM8K (Cobbe et al. 2021): gsm8k.py reads it, imported when a task uses it
    import gsm8k

    return gsm8k.load(split, data_dir)


# arith and its kin: generated, split by a hash of the problem
ARITH_DIGITS, ARITH_OPS = 1, "+-*"  # default difficulty: within reach of a 135M model, whose gain is mostly format
ARITH_TEST_PERCENT = 80  # test-only share: the default 255 problems hold >= 200 held-out, train ~51: must generalise
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _is_test(*problem):  # split by a hash of the problem, e.g. (7, "+", 5): whatever n or seed, test never in train
    h = hashlib.sha256("".join(map(str, problem)).encode()).digest()
    return int.from_bytes(h[:4], "little") % 100 < ARITH_TEST_PERCENT


def sample_split(space, split, n, rng):  # n distinct problems of `split` from an enumerated space, in rng's order
    pool = [p for p in space if _is_test(*p) == (split == "test")]
    return rng.sample(pool, min(n, len(pool)))


def load_arith(split, data_dir=None, n=None, digits=ARITH_DIGITS, ops=ARITH_OPS, seed=0):
    """n distinct problems {"question": "What is 7 + 5?", "answer": "12"}: operands of up to `digits` digits, operators
    from `ops`, for "-" a >= b; n is capped at the split's size; `seed` picks the problems, never the split."""
    n = check_generated(split, ops, n, data_dir)
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
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
    """`task` with task_options bound: each a keyword of its load (arith: digits, ops, seed, n) or of its environment
    (arith_retry: max_attempts), of its default's type (a float takes an int too); ValueError in one line otherwise."""
    takes = {}  # option -> (its function, its default)
    for fn in filter(None, (task.load, task.env)):
        params = inspect.signature(fn).parameters.values()
        takes.update({p.name: (fn, p.default) for p in params if p.default is not p.empty and p.name != "data_dir"})
    for key, value in options.items():
        if key not in takes:
            listing = ", ".join(f"{k}={d!r}" for k, (_, d) in takes.items()) or "no options"
            raise ValueError(f"task_options {key!r}: task {name} takes {listing}")
        default = takes[key][1]
        kinds = (int, float) if isinstance(default, float) else (type(default),)
        if default is not None and type(value) not in kinds:
            raise ValueError(f"task_options {key!r} must be like its default {default!r}, got {value!r}")
    task = task._replace(load=partial(task.load, **{k: v for k, v in options.items() if takes[k][0] is task.load}))
    if task.env:
        task = task._replace(env=partial(task.env, **{k: v for k, v in options.items() if takes[k][0] is task.env}))
    return task


def get(name, options=None):
    """The task `name` (tasks.py's, extra_tasks.py's, rg:NAME) with `options` (train.py's task_options) applied;
    ValueError in one line for an unknown name or option."""
    if name in TASKS:
        return with_options(TASKS[name], name, options or {})
    import extra_tasks  # the other tasks, imported only when one is named

    return extra_tasks.get(name, options or {})


def pass_at_k(n, c, k):
    """Unbiased pass@k of one problem with c of n samples correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021,
    arXiv 2107.03374, eq. 1), as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials."""
    return 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    task,
    examples,
    *,
    max_new_tokens=256,
    batch_size=32,
    n=1,
    sampler=None,
    seed=0,
    progress=True,
    dtype=None,
    env=None,
    loop=decode_dynamic,
):
    """Score `examples` -> (summary, one record per example); n=1 is greedy, n>1 samples n completions each from
    `sampler` (mean accuracies, pass@k). dtype: sampling's compute dtype. progress: a bar on stderr. A task with an
    environment runs it (env: an envs.EnvDriver, else the task's): task.score reads the model's own words and the row's
    environment state, as the rewards do; each record keeps the trajectory; the states' means are env/ keys."""
    if task.env and env is None:
        env = task.env(tokenizer)
    if n == 1:
        sampler = Sampler(temperature=0.0)
    sampler = sampler or Sampler()
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    per_batch = max(1, batch_size // n)
    records, correct = [], []  # one record an example; how many of its n are right
    with tqdm(total=len(examples), desc="eval", unit="problem", disable=not progress, leave=False) as bar:
        for i in range(0, len(examples), per_batch):
            batch = examples[i : i + per_batch]
            r = sample(
                model,
                tokenizer,
                [task.prompt(ex) for ex in batch],
                n,
                max_new_tokens=max_new_tokens,
                stop_ids=stop_token_ids(tokenizer, model),
                sampler=sampler,
                generator=generator,
                dtype=dtype,
                env=env,
                examples=batch,
                loop=loop,
            )
            for j, ex in enumerate(batch):
                rows = range(j * n, (j + 1) * n)
                scores = [task.score(r.completions[k], ex, r.env_state[k]) for k in rows]
                correct.append(sum(bool(s["strict"]) for s in scores))
                record = {"question": ex["question"], "gold": ex["answer"], "completion": r.completions[j * n]}
                record.update(pred=scores[0]["pred"], correct=scores[0]["strict"], source=ex.get("source"))
                record.update({k: sum(s[k] for s in scores) / n for k in scores[0] if k != "pred"})  # strict, ...
                record["env"] = {k: sum(r.env_state[x][k] for x in rows) / n for k in r.env_state[j * n]}
                if n > 1:
                    record["completions"] = r.completions[j * n : (j + 1) * n]
                if env is not None:  # the conversation, replies included
                    record["trajectory"] = r.trajectories[j * n]
                records.append(record)
            bar.update(len(batch))
    m = max(len(records), 1)
    names = {"strict": "strict_acc", "flexible": "flexible_acc", "format": "format_rate", "score": "score"}
    summary = {"n_examples": len(records)}
    if records:  # accuracies, a partial-credit mean; the environments' states
        summary.update({names[k]: sum(x[k] for x in records) / m for k in records[0] if k in names})
        summary.update({f"env/{k}": sum(x["env"][k] for x in records) / m for k in records[0]["env"]})
    for source in sorted({x["source"] for x in records} - {None}):  # a mix: which task moved
        mine = [x["strict"] for x in records if x["source"] == source]
        summary[f"strict_acc/{source}"] = sum(mine) / len(mine)
    if n > 1:
        ks = sorted({2**j for j in range(n.bit_length())} | {n})  # 1, 2, 4, ... up to n, and n
        summary.update({f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / m for k in ks})
    return summary, records
