"""Tasks off the default path, imported only when one is named (`get`); each a `tasks.Task`:
- arith_steps: "What is 3 + 4 * 2 - 5?", a reward per line, for process supervision (DeepSeekMath §4.1.3): the step
  rewards and the token each step ends on (`step_positions`, for grpo.process_advantages).
- arith_tool: "What is 482 * 937?" with a calculator (envs.py); arith_mul: the same without it; arith_tool_mixed: half
  of them one-digit products a 135M model does alone (each example's "difficulty": "easy" / "hard").
- arith_retry: arith with feedback (envs.FeedbackEnv): a wrong answer is told so and tried again, max_attempts in all;
  the reward is the last attempt's."""

import random
import re
from bisect import bisect_left
from functools import partial

import torch

from rewards import answers_match, extract_answer
from tasks import (
    ARITH_OPS,
    ARITH_SYSTEM_PROMPT,
    OPS,
    REWARDS,
    TASKS,
    WEIGHTS,
    Task,
    chat_prompt,
    check_generated,
    load_arith,
    sample_split,
    score,
)


PROMPT = (
    "Work it out one calculation a line, as: a op b = c. End with a final line: "
    "#### <number>\nExample:\nWhat is 2 + 3 * 4?\n3 * 4 = 12\n2 + 12 = 14\n#### 14"
)
prompt = partial(chat_prompt, PROMPT)


def _evaluate(a, op1, b, op2, c):  # a op1 b op2 c with the usual precedence: `*` first, then left to right
    return OPS[op1](a, b * c) if op2 == "*" and op1 != "*" else OPS[op2](OPS[op1](a, b), c)


def load_arith_steps(split, data_dir=None, n=None, ops=ARITH_OPS, seed=0):
    """n distinct problems {"question": "What is 3 + 4 * 2 - 5?", "answer": "6"}: three one-digit operands, two
    operators from `ops`, answers may be negative; 1,000 * len(ops)**2 problems split and n as in load_arith."""
    n, ops = check_generated(split, ops, n, data_dir), sorted(set(ops))
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


def step_positions(step_rewards, tokenizer, completion_ids, lengths, completions, examples, group_size):
    """Steps as tensors for grpo.process_advantages: row i's steps are step_rewards(completions[i], examples[i //
    group_size]), each ending on the token that holds its last character among the lengths[i] tokens of completion_ids
    (N, C) before the stop token -> ends (N, S) long, values (N, S), mask (N, S) bool (False: padding; S: the most steps
    of a row). That token is the first whose decoded prefix holds the text up to char_end: exact whatever a tokenizer
    does to bytes and spaces (a character split over byte tokens decodes as U+FFFD until its last byte)."""
    steps = [step_rewards(text, examples[i // group_size]) for i, text in enumerate(completions)]
    N, S = len(steps), max(len(s) for s in steps)
    ends, values, mask = torch.zeros(N, S, dtype=torch.long), torch.zeros(N, S), torch.zeros(N, S, dtype=torch.bool)
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    for i, row in enumerate(steps):
        ids = completion_ids[i, : int(lengths[i])].tolist()
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


def tool_reward(completions, tool_calls, tool_errors, **_):  # 1.0 where a tool call ran (an error's reply aside)
    return [float(c > e) for c, e in zip(tool_calls, tool_errors)]


def calculator(tokenizer, max_calls=4, max_reply_tokens=64, **_):  # the task's tools in their environment (envs.py)
    import envs

    return envs.ToolEnv([envs.calculator], tokenizer, max_calls, max_reply_tokens=max_reply_tokens)


def load_mixed(split, data_dir=None, n=None, seed=0):
    """One-digit products (what the model does alone, "easy") and three-digit ones ("hard"), interleaved (test: 89 of
    each, all there are)."""
    n = check_generated(split, "*", n, data_dir)
    easy, hard = (load_arith(split, n=n // 2, digits=d, ops="*", seed=seed) for d in (1, 3))
    if split == "train":  # only ~11 one-digit products are train problems: repeated to half the split
        easy = easy * (len(hard) // len(easy) + 1)
    pairs = zip(({**e, "difficulty": "easy"} for e in easy), ({**h, "difficulty": "hard"} for h in hard))
    return [x for pair in pairs for x in pair]


def feedback(tokenizer, max_calls=4, max_reply_tokens=64, max_attempts=2, **_):  # arith_retry's environment
    import envs

    make = partial(envs.FeedbackEnv, extract_answer, answers_match, max_attempts)
    return envs.EnvDriver(make, tokenizer, max_reply_tokens)


def final_attempt_reward(completions, final_correct, **_):  # 1.0 where the row's last answer was right
    return [float(c) for c in final_correct]


def final_attempt_score(completion, example):  # score() of the text from the last `####` on: the last attempt
    head, mark, last = completion.rpartition("####")
    return score(mark + last if mark else completion, example)


load_mul = partial(load_arith, digits=3, ops="*")
EXTRA = {  # a call that ran is worth a little (0.2): without it the calls die out (BENCHMARKS.md)
    "arith_steps": Task(load_arith_steps, prompt, dict(REWARDS), dict(WEIGHTS), score, arith_step_rewards),
    "arith_tool": Task(
        load_mul,
        tool_prompt,
        {**REWARDS, "tool": tool_reward},
        {**WEIGHTS, "tool": 0.2},
        score,
        tools=calculator,
    ),
    "arith_mul": Task(load_mul, partial(chat_prompt, MUL_PROMPT), dict(REWARDS), dict(WEIGHTS), score),
    "arith_tool_mixed": Task(
        load_mixed, tool_prompt, {**REWARDS, "tool": tool_reward}, {**WEIGHTS, "tool": 0.2}, score, tools=calculator
    ),
    "arith_retry": Task(
        load_arith,
        partial(chat_prompt, ARITH_SYSTEM_PROMPT),
        {**REWARDS, "correct": final_attempt_reward},
        dict(WEIGHTS),
        final_attempt_score,
        tools=feedback,
    ),
}


def get(name):
    """The task called `name`; ValueError in one line naming every task when there is none."""
    if name not in EXTRA:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(sorted({**TASKS, **EXTRA}))}")
    return EXTRA[name]
