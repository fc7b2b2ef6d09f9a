"""Tasks off the default path, imported only when one is named (`get`); each a `tasks.Task`:
- arith_steps: "What is 3 + 4 * 2 - 5?", a reward per line, for process supervision (DeepSeekMath §4.1.3): the step
  rewards and the token each step ends on (`step_positions`, for variants.process_advantages).
- arith_tool: "What is 482 * 937?" with a calculator (envs.py); arith_mul: the same without it; arith_tool_mixed: half
  of them one-digit products a 135M model does alone (each example's "difficulty": "easy" / "hard").
- arith_retry: arith with feedback (envs.FeedbackEnv): a wrong answer is told so and tried again, max_attempts in all;
  the reward is the last attempt's.
- gsm8k_python: GSM8K with a python tool, code run in a sandboxed interpreter (envs.python).
- rg:NAME, rg:A+B: a reasoning-gym dataset (github.com/open-thought/reasoning-gym, Apache-2.0), or a weighted mix,
  scored by the dataset's own `score_answer`; configured by `task_options` (train.py's config key)."""

import dataclasses
import difflib
import hashlib
import random
import re
from bisect import bisect_left
from functools import partial
from itertools import islice
from operator import itemgetter
from typing import Annotated

import torch

from config import Knob, bind
from rewards import answers_match, extract_answer, extract_flexible
from tasks import (
    ARITH_OPS,
    ARITH_SYSTEM_PROMPT,
    N_PROBLEMS,
    OPS,
    OPS_USED,
    SEED,
    TASKS,
    WEIGHTS,
    Task,
    chat_prompt,
    check_generated,
    load_arith,
    load_gsm8k,
    sample_split,
    score,
    with_options,
)


PROMPT = (
    "Work it out one calculation a line, as: a op b = c. End with a final line: "
    "#### <number>\nExample:\nWhat is 2 + 3 * 4?\n3 * 4 = 12\n2 + 12 = 14\n#### 14"
)
prompt = partial(chat_prompt, PROMPT)


def _evaluate(a, op1, b, op2, c):  # a op1 b op2 c with the usual precedence: `*` first, then left to right
    return OPS[op1](a, b * c) if op2 == "*" and op1 != "*" else OPS[op2](OPS[op1](a, b), c)


def load_arith_steps(split, data_dir=None, n: N_PROBLEMS = None, ops: OPS_USED = ARITH_OPS, seed: SEED = 0):
    """n distinct problems {"question": "What is 3 + 4 * 2 - 5?", "answer": "6"}: three one-digit operands, two
    operators from `ops`, answers may be negative; 1,000 * len(ops)**2 problems split and n as in load_arith."""
    n = check_generated(split, n, data_dir)
    ops = sorted(set(ops))
    space = [(a, o1, b, o2, c) for o1 in ops for o2 in ops for a in range(10) for b in range(10) for c in range(10)]
    return [
        {"question": "What is {} {} {} {} {}?".format(*p), "answer": str(_evaluate(*p))}
        for p in sample_split(space, split, n, random.Random(seed))
    ]


NUM = r"\s*(-?\d+)\s*"
STEP_RE = re.compile(rf"{NUM}([-+*x×]){NUM}={NUM}")  # a op b = c
FINAL_RE = re.compile(r"\s*#### (-?\d+)")  # #### N, one space as strict-match reads it
STEP_OPS = {**OPS, "x": OPS["*"], "×": OPS["*"]}


def _line_reward(line, gold):  # one line's reward in arith_step_rewards
    if step := STEP_RE.fullmatch(line):
        a, op, b, c = step.groups()
        return float(STEP_OPS[op](int(a), int(b)) == int(c))
    final = FINAL_RE.fullmatch(line)
    return float(final is not None and answers_match(final.group(1), gold))


def arith_step_rewards(completion, example):
    """(char_end, reward) per non-empty line, char_end the end of its text (trailing spaces, `\\r` left out):
    `a op b = c` 1.0 if the arithmetic is right (on its own: the outcome reward ties steps to the question),
    `#### N` 1.0 if N is the gold answer, any other line (`####N` too) 0.0. No such line: one step at the end.
    >>> arith_step_rewards("4 * 2 = 8\\n3 + 8 = 12\\n#### 11", {"answer": "11"})  # 3 + 4 * 2
    [(9, 1.0), (20, 0.0), (28, 1.0)]"""
    lines = re.finditer(r"[^\n]*\S", completion)  # each line up to its last non-space character
    return [(m.end(), _line_reward(m.group(), example["answer"])) for m in lines] or [(len(completion), 0.0)]


def step_positions(step_rewards, tokenizer, r):
    """Steps as tensors for variants.process_advantages: row i of the Rollout r has the steps step_rewards(its output,
    its example), each ending on the token that holds its last character among its own tokens before its stop token
    -> ends (N, S) long, values (N, S), mask (N, S) bool (False: padding; S: the most steps of a row). That token is the
    first whose decoded prefix holds the text up to char_end: exact whatever a tokenizer does to bytes and spaces (a
    character split over byte tokens decodes as U+FFFD until its last byte)."""
    lengths = r.completion_mask.sum(1) - (~r.truncated).long()  # (N,) the tokens before the stop token
    steps = [step_rewards(text, example) for text, example in zip(r.completions, r.examples)]
    N, S = len(steps), max(len(s) for s in steps)
    ends, values, mask = torch.zeros(N, S, dtype=torch.long), torch.zeros(N, S), torch.zeros(N, S, dtype=torch.bool)
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    for i, row in enumerate(steps):
        ids = r.completion_ids[i, : int(lengths[i])].tolist()
        text = decode(ids)
        for j, (end, value) in enumerate(row):  # the last token of the shortest prefix holding text[:end]
            ends[i, j] = bisect_left(range(1, len(ids)), True, key=lambda k: decode(ids[:k])[:end] == text[:end])
            values[i, j], mask[i, j] = value, True
    return ends, values, mask


# arith_tool / arith_mul: 3-digit products, with and without a calculator
MUL_PROMPT = "Answer the question. End with a final line: #### <number>\nExample:\nWhat is 12 * 34?\n#### 408"
TOOL_PROMPT = "Answer the question. Use the calculator for arithmetic. End with a final line: #### <number>"


def tool_prompt(example):  # one worked call as earlier turns (HF's tool-call format): else a 135M model rarely calls
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234 * 56"}}}
    return [
        {"role": "system", "content": TOOL_PROMPT},
        {"role": "user", "content": "What is 1234 * 56?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "69104"},
        {"role": "assistant", "content": "#### 69104"},
        {"role": "user", "content": example["question"]},
    ]


# an environment's options (task_options), declared as the flags are
CALLS = Annotated[int, Knob(">= 0", "tool calls a row may make (a call past them is refused)")]
REPLY_TOKENS = Annotated[int, Knob(">= 1", "tokens of a reply the model reads at most (its end cut)")]


def calculator(tokenizer, *, max_tool_calls: CALLS = 4, max_reply_tokens: REPLY_TOKENS = 64):  # a calculator (envs.py)
    import envs

    return envs.ToolEnv([envs.calculator], tokenizer, max_calls=max_tool_calls, max_reply_tokens=max_reply_tokens)


def load_mixed(
    split,
    data_dir=None,
    n: Annotated[int | None, Knob(">= 2", "problems in the split, half of each kind (None: 10,000, 200)")] = None,
    seed: SEED = 0,
):
    """One-digit products (what the model does alone, "easy") and three-digit ones ("hard"), interleaved (test: 89 of
    each, all there are)."""
    n = check_generated(split, n, data_dir)
    easy, hard = (load_arith(split, n=n // 2, digits=d, ops="*", seed=seed) for d in (1, 3))
    if split == "train":  # only ~11 one-digit products are train problems: repeated to half the split
        easy = easy * (len(hard) // len(easy) + 1)
    pairs = zip(({**e, "difficulty": "easy"} for e in easy), ({**h, "difficulty": "hard"} for h in hard))
    return [x for pair in pairs for x in pair]


WRONG = "Wrong; try again. End with a final line: #### <number>"


def retry_check(text, example):  # arith_retry's judge: None for a right answer (as score reads it), else WRONG
    if answers_match(extract_answer(text), example["answer"]):
        return None
    return WRONG


def feedback(
    tokenizer,
    *,
    max_attempts: Annotated[int, Knob(">= 1", "answers a row may give, the feedback between them")] = 2,
    max_reply_tokens: REPLY_TOKENS = 64,
):  # arith_retry's environment: answers it judges
    import envs

    return envs.EnvDriver(partial(envs.FeedbackEnv, retry_check, max_attempts), tokenizer, max_reply_tokens)


def final_attempt_reward(completions, final_correct, **_):  # 1.0 where the environment judged the last answer right
    return [float(c) for c in final_correct]


def final_attempt_score(completion, example, state):  # the environment's judgement, as the reward's; the rest: the
    head, mark, last = completion.rpartition("####")  # last attempt's text, from the last `####` on
    return {**score(mark + last if mark else completion, example), "strict": bool(state["final_correct"])}


load_mul = partial(load_arith, digits=3, ops="*")
EXTRA = {  # a call that ran is worth a little (0.2): without it the calls die out (BENCHMARKS.md)
    "arith_steps": Task(load_arith_steps, prompt, {}, dict(WEIGHTS), score, step_rewards=arith_step_rewards),
    "arith_tool": Task(load_mul, tool_prompt, {}, {**WEIGHTS, "tool": 0.2}, score, env=calculator),
    "arith_mul": Task(load_mul, partial(chat_prompt, MUL_PROMPT), {}, dict(WEIGHTS), score),
    "arith_tool_mixed": Task(load_mixed, tool_prompt, {}, {**WEIGHTS, "tool": 0.2}, score, env=calculator),
    "arith_retry": Task(
        load_arith,
        partial(chat_prompt, ARITH_SYSTEM_PROMPT),
        {"correct": final_attempt_reward},
        dict(WEIGHTS),
        final_attempt_score,
        env=feedback,
    ),
}


# gsm8k_python: GSM8K with a python tool (envs.python, a sandboxed interpreter)
PYTHON_PROMPT = (
    "Solve the problem. Use the python tool for the arithmetic: write a short program that prints the result. "
    "End with a final line: #### <number>"
)
EXAMPLE_QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)


def python_prompt(example):  # one worked call as earlier turns, as tool_prompt's
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(48 + 48 // 2)"}}}
    return [
        {"role": "system", "content": PYTHON_PROMPT},
        {"role": "user", "content": EXAMPLE_QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "72"},
        {"role": "assistant", "content": "#### 72"},
        {"role": "user", "content": example["question"]},
    ]


def python_tool(tokenizer, *, max_tool_calls: CALLS = 4, max_reply_tokens: REPLY_TOKENS = 64):  # a sandboxed python
    import envs
    import sandbox

    try:
        print(sandbox.sandbox_protections(), flush=True)
    except RuntimeError as e:  # no confined interpreter starts here: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    # no timeout of the row's own: a call returns at its own timeout, once all it started has ended, so the pool's
    # workers bound the sandboxes running at once
    return envs.ToolEnv(
        [envs.python], tokenizer, max_calls=max_tool_calls, timeout=None, max_reply_tokens=max_reply_tokens
    )


EXTRA["gsm8k_python"] = Task(load_gsm8k, python_prompt, {}, {**WEIGHTS, "tool": 0.2}, score, env=python_tool)


# rg:NAME: reasoning-gym, imported only here (~1 s, matplotlib with it) and only when such a task is named
RG_HINT = "reasoning-gym tasks need it: pip install reasoning-gym==0.1.25 (its pycosat compiles: gcc, Python headers)"
# reasoning-gym's own convention (utils.SYSTEM_PROMPTS) in short, with one worked example: else a 135M model rarely
# writes the tags
RG_PROMPT = (
    "Answer the question. End with a final line: <answer>your answer</answer>\n"
    "Example:\nWhat is 3 + 4?\n3 + 4 = 7\n<answer>7</answer>"
)
RG_TEST_PERCENT = 50  # test-only share of the questions: a small space (1-digit sums) still holds ~100 of each
RG_DRAWS = 30_000  # items generated per source and split at most: 3x the 10,000 train questions (repeats skipped)
TAG_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils.extract_answer's pattern


def rg_is_test(question):  # split by a hash of the question text: whatever the seeds, test never meets train
    h = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(h[:4], "little") % 100 < RG_TEST_PERCENT


def rg_extract(completion):
    """The answer reasoning-gym's prompts ask for: the last `<answer>...</answer>`, stripped; without tags (a small
    model before it learns them) the last number, else the last non-empty line; None for an empty completion."""
    tagged = TAG_RE.findall(completion)
    if tagged:
        return tagged[-1].strip()
    number = extract_flexible(completion)
    if number is not None:
        return number
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


def rg_score(dataset, completion, entry):  # the dataset's own verifier, partial credit kept
    try:
        return float(dataset.score_answer(rg_extract(completion), entry))
    except Exception:  # a verifier may raise on what a model wrote (sympy, int()): that answer scores 0
        return 0.0


def rg_correct(dataset, completions, entry, **_):
    return [rg_score(dataset, c, e) for c, e in zip(completions, entry)]


def rg_format(completions, **_):  # 1.0 where the last tags hold an answer
    return [float(bool((TAG_RE.findall(c) or [""])[-1].strip())) for c in completions]


def rg_score_example(dataset, completion, example, state=None):  # eval.py's: strict counts only a full score
    score = rg_score(dataset, completion, example["entry"])
    return {
        "pred": rg_extract(completion),
        "strict": score == 1.0,
        "flexible": answers_match(extract_flexible(completion), example["answer"]),
        "format": rg_format([completion])[0] == 1.0,
        "score": score,
    }


def rg_draw(source, split):  # a source's distinct questions of `split`, in its order, from its RG_DRAWS items
    seen = set()
    for i in range(len(source)):
        entry = source[i]
        q = entry["question"]
        if q not in seen and rg_is_test(q) == (split == "test"):
            seen.add(q)
            yield {"question": q, "answer": str(entry["answer"]), "entry": entry}


def rg_shares(n, weights, held=None):
    """n split by weight w: source i's share is round(n * W_i / W) - round(n * W_(i-1) / W), W_i the weights up to
    and with i's, so the shares sum to n; a source in `held` keeps that many and the rest is split among the others."""
    shares = dict(held or {})
    rest = [k for k in weights if k not in shares]
    left, total, below = n - sum(shares.values()), sum(weights[k] for k in rest), 0
    for k in rest:
        shares[k] = round(left * (below + weights[k]) / total) - round(left * below / total)
        below += weights[k]
    return shares


def load_rg(name, sources, weights, test_n, split, data_dir=None, n=None):
    """n questions of `split` (test: test_n by default) {"question", "answer", "entry" (reasoning-gym's item),
    "source" (a mix's)}: each source's share of n by weight (rg_shares), drawn from its own RG_DRAWS items, the
    sources spread evenly so that any prefix holds the mix. A source with fewer distinct questions than its share is
    repeated to it in a mix's train split (the weights hold, as load_mixed); in a test split (and one dataset's train
    split) it gives what it has, the others' shares take the rest, never a question twice. One line at load says
    where a mix's train split repeats or a test split holds fewer than n or other proportions than the weights'."""
    if n is None and split == "test":
        n = test_n
    n = check_generated(split, n, data_dir)
    repeat = split == "train" and len(sources) > 1
    draws = {k: rg_draw(source, split) for k, source in sources.items()}
    pools, ran_out = {k: [] for k in sources}, {}  # ran_out: the sources short of their share, their questions
    while True:  # a test split's source short of its share keeps what it has, the others' shares grow to fill it
        shares = rg_shares(n, weights, ran_out)
        for k, share in shares.items():
            pools[k] += islice(draws[k], max(share - len(pools[k]), 0))
        short = {k: len(pools[k]) for k in sources if len(pools[k]) < shares[k]}
        if repeat or not short:
            break
        ran_out.update(short)
    asked = rg_shares(n, weights)
    if repeat:  # each source to its share: a short one's questions again, in the same order
        ran_out = {k: len(pool) for k, pool in pools.items() if len(pool) < asked[k]}
        for k, c in ran_out.items():
            if not c:
                raise ValueError(f"{name}: {k}'s {len(sources[k]):,} draws hold no {split} question; widen its config")
            pools[k] = (pools[k] * (asked[k] // c + 1))[: asked[k]]
    counts = {k: len(pool) for k, pool in pools.items()}
    if ran_out and (repeat or split == "test" and counts != asked):  # one dataset's train split holds what it has
        mix = ""
        if len(sources) > 1:
            by_weight = ", ".join(f"{a:,}" for a in asked.values())
            mix = f" ({', '.join(f'{k} {c:,}' for k, c in counts.items())}; by weight {by_weight})"
        why = "; ".join(
            f"{k}'s {len(sources[k]):,} draws hold {c:,} distinct {split} questions" for k, c in ran_out.items()
        )
        fix = ", each repeated to its share (a small space: widen its config, e.g. larger max_* fields)"
        if not repeat:
            fix = " (a small space: widen the config, e.g. larger max_* fields, or lower size)"
        print(f"{name} {split}: {sum(counts.values()):,} questions of the {n:,} asked{mix}: {why}{fix}")
    examples = []
    for k, pool in pools.items():
        for j, ex in enumerate(pool):  # spread evenly: eval_n's or --limit's prefix holds the weights' mix
            examples.append(((j + 0.5) / len(pool), {**ex, "source": k} if len(sources) > 1 else ex))
    return [ex for _, ex in sorted(examples, key=itemgetter(0))]


def rg_dataset(names, options, seed):
    """The reasoning-gym dataset of `names` (one, or a mix: options[name] its config and "weight", default 1) with
    RG_DRAWS items from `seed`; ValueError in one line for a missing library, name or config field."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError(f"{RG_HINT} ({e})") from None
    known = sorted(set(reasoning_gym.factory.DATASETS) - {"composite"})
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, 3) or known[:3]
            raise ValueError(
                f"unknown reasoning-gym dataset {name!r}; pass rg:NAME, NAME one of reasoning_gym.factory.DATASETS "
                f"({len(known)}), e.g. {', '.join(near)}"
            )
    fields = {k: v for k, v in options.items() if k not in ("seed", "size")}
    try:
        if len(names) == 1:
            return reasoning_gym.create_dataset(names[0], seed=seed, size=RG_DRAWS, **fields)
        for key, value in fields.items():
            if key not in names or not isinstance(value, dict):
                raise ValueError(f"{key!r} is not one of {names} with a dict of its config")
        specs = [
            reasoning_gym.composite.DatasetSpec(n, fields.get(n, {}).get("weight", 1), fields.get(n, {})) for n in names
        ]
        for spec in specs:
            spec.config = {k: v for k, v in spec.config.items() if k != "weight"}
        return reasoning_gym.create_dataset("composite", seed=seed, size=RG_DRAWS, datasets=specs)
    except (TypeError, ValueError, AssertionError, KeyError) as e:  # its config dataclass and validate() raise these
        own = {n: [f.name for f in dataclasses.fields(reasoning_gym.factory.DATASETS[n][1])] for n in names}
        hint = "; ".join(f"{n}'s: {', '.join(f for f in fs if f not in ('seed', 'size'))}" for n, fs in own.items())
        raise ValueError(f"task_options for rg:{'+'.join(names)}: {e}; the config fields are {hint}") from None


def rg_options(seed: SEED = 0, size: Annotated[int, Knob(">= 1", "questions in the test split")] = 200):
    """An rg: task's own options, declared as the flags are; the others are its dataset's config (reasoning-gym's)."""
    return seed, size


def rg_task(name, options):
    """rg:NAME or rg:A+B (a mix) as a Task: the dataset's questions, RG_PROMPT, its score_answer as the reward."""
    own = bind([rg_options], {k: v for k, v in options.items() if k in ("seed", "size")}, f"task {name}")
    seed, size = rg_options(**own[rg_options])
    names = name.removeprefix("rg:").split("+")
    dataset = rg_dataset(names, options, seed)
    sources, weights = {names[0]: dataset}, {names[0]: 1}
    if len(names) > 1:  # a CompositeDataset: one dataset per source (seed + i + 1), drawn apart to hold the weights
        sources, weights = dataset.datasets, dict(zip(dataset.dataset_names, dataset.weights))
    return Task(
        partial(load_rg, name, sources, weights, size),
        partial(chat_prompt, RG_PROMPT),
        {"correct": partial(rg_correct, dataset), "format": rg_format},
        dict(WEIGHTS),
        partial(rg_score_example, dataset),
    )


def get(name, options=None):
    """Any task, tasks.py's, this file's or rg:NAME, with its options checked (an rg: task's: seed, size and its
    dataset's config); ValueError in one line naming every task when there is none."""
    if name.startswith("rg:"):
        return rg_task(name, options or {})
    if name == "jsonl":  # your own data (file_task.py): imported only when named
        import file_task

        return file_task.task(options or {})
    if name not in {**TASKS, **EXTRA}:
        raise ValueError(
            f"unknown task {name!r}; tasks: {', '.join(sorted({**TASKS, **EXTRA}))}, jsonl, rg:NAME (reasoning-gym)"
        )
    return with_options({**TASKS, **EXTRA}[name], name, options or {})
