r"""jsonl: your own data, a task read from a local JSONL file (one JSON object a line). `--data-dir` names the data: a
`.jsonl` file (split by a seeded hash of each prompt's text) or a folder holding train.jsonl and test.jsonl (its own
split). `task_options` say which field is the prompt, which the answer, and how a completion's answer is found:
    task = "jsonl"
    data_dir = "my_data.jsonl"
    task_options = {"prompt_field": "problem", "answer_field": "solution", "extract": "last_number"}
Imported only when the task is named (extra_tasks.get). The file's text is data: it goes into the chat messages as
their text, which rollout.encode_prompts tokenizes as text (a control token's string in it stays text)."""

import hashlib
import json
import math
import re
from functools import partial
from pathlib import Path
from typing import Annotated

from config import DataError, Knob, bind
from rewards import answers_match, extract_answer, extract_boxed, extract_flexible, extract_strict
from tasks import WEIGHTS, Task, chat_prompt

# how a completion's answer is found: a plain dict, its keys the choices of task_options' `extract` (a fork adds one)
EXTRACTIONS = {
    "final": extract_answer,  # `#### N`, else the last `\boxed{}` (as gsm8k and arith score)
    "strict": extract_strict,  # `#### N` only (lm-eval's strict-match)
    "boxed": extract_boxed,  # the last `\boxed{...}` (Qwen2.5-Math's)
    "last_number": extract_flexible,  # the last number in the text (lm-eval's flexible-extract)
}
SYSTEM = "Answer the question. End with a final line: #### <answer>"  # short: a 135M model reads it
HINT = "pass --data-dir FILE.jsonl (split by a hash) or --data-dir DIR holding train.jsonl and test.jsonl"

# the task's options (task_options), declared as the flags are: each checked before anything loads
FIELD = Annotated[str, Knob(re.compile(r".+"), "the field of each line that holds it")]
NONBLANK = re.compile(r"(?s)\s*\S.*")  # a string with a non-space character


def read(path, prompt_field, answer_field):
    """The examples {"question", "answer"} of a JSONL file, the answer a string (a number's str()); a blank line is
    skipped, a bad one is a DataError in one line naming file:line and what to do."""
    examples = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), 1):  # bytes: a bad byte is reported with its line
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8-sig")  # -sig: a file saved with a BOM reads the same
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: byte {raw[e.start]:#04x} is not UTF-8; save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg}); write one JSON object a line") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: not a JSON object ({line.strip()[:30]!r}); write one JSON object a line")
        question = field(row, prompt_field, "prompt_field", where)
        examples.append({"question": question, "answer": field(row, answer_field, "answer_field", where)})
    return examples


def field(row, key, option, where):  # row[key] as a non-empty string, else a DataError naming the line and the fix
    if key not in row:
        fields = ", ".join(map(repr, row))[:80] or "none"
        raise DataError(f"{where}: no field {key!r} (it has {fields}); add it or set task_options {option}")
    value = row[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (isinstance(value, str) or number):
        raise DataError(f"{where}: field {key!r} is {value!r:.40}, not a string or a finite number; write one there")
    if not str(value).strip():
        raise DataError(f"{where}: field {key!r} is empty; write the {option.removesuffix('_field')} there")
    return str(value)


def is_test(text, seed, test_percent):
    """A question's split from the sha256 of (seed, its text) alone: whatever the file's order or length, a question
    (each copy of it) is never in both splits."""
    h = hashlib.sha256(f"{seed}\n{text}".encode()).digest()
    return int.from_bytes(h[:8], "little") % 100 < test_percent


def load(
    split,
    data_dir=None,
    prompt_field: FIELD = "question",
    answer_field: FIELD = "answer",
    test_percent: Annotated[int, Knob("[1, 99]", "one file's questions held out for test, in percent")] = 10,
    seed: Annotated[int, Knob("[0, 9e18]", "one file's hash split: which questions are held out")] = 0,
):
    """The examples {"question", "answer"} of `split`, in the file's order: data_dir/{split}.jsonl for a folder,
    else the questions of the file data_dir that is_test puts in `split` (test_percent and seed: a file's only)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; valid splits: ['train', 'test']")
    if not data_dir:
        raise DataError(f"task jsonl reads your own data: {HINT}")
    path = Path(data_dir).expanduser()
    if path.is_dir():
        path = path / f"{split}.jsonl"
        if not path.is_file():
            raise DataError(f"{path} not found; {HINT}")
        examples = read(path, prompt_field, answer_field)
        empty = f"no examples in {path}; add lines to it"
    elif path.is_file():
        every = read(path, prompt_field, answer_field)
        examples = [e for e in every if is_test(e["question"], seed, test_percent) == (split == "test")]
        empty = f"no {split} examples among the {len(every)} of {path} (test_percent {test_percent}); add lines"
        if every:
            empty += " or change test_percent"
    else:
        raise DataError(f"--data-dir {data_dir}: no such file or folder; {HINT}")
    if not examples:
        raise DataError(empty)
    return examples


def correct(extract, completions, answer, **_):  # 1.0 where the chosen extraction of the completion is the answer
    return [float(answers_match(extract(c), a)) for c, a in zip(completions, answer)]


def found(extract, completions, **_):  # 1.0 where the chosen extraction finds an answer: the format it asks for
    return [float(bool((extract(c) or "").strip())) for c in completions]


def score(extract, completion, example, state=None):
    r"""eval.py's: strict, the chosen extraction matches the answer; flexible, the last number does (lm-eval's).
    >>> score(extract_boxed, "\\boxed{12}, or 13", {"answer": "12"})
    {'pred': '12', 'strict': True, 'flexible': False, 'format': True}"""
    pred = extract(completion)
    return {
        "pred": pred,
        "strict": answers_match(pred, example["answer"]),
        "flexible": answers_match(extract_flexible(completion), example["answer"]),
        "format": bool(found(extract, [completion])[0]),
    }


def prompt_and_scoring(
    extract: Annotated[str, Knob(EXTRACTIONS, "how a completion's answer is found (file_task.EXTRACTIONS)")] = "final",
    system: Annotated[str, Knob(NONBLANK, "the system prompt: ask for what `extract` finds")] = SYSTEM,
):
    """The task's options that are not its load's, declared as the flags are -> (the extraction, the system prompt)."""
    return EXTRACTIONS[extract], system


def task(options):
    """The jsonl Task with `options` (train.py's task_options) checked as a flag is (ValueError in one line, before
    anything loads): its rewards `correct` and `format` and its score read the chosen extraction."""
    bound = bind([load, prompt_and_scoring], options, "task jsonl")
    extract, system = prompt_and_scoring(**bound[prompt_and_scoring])
    return Task(
        partial(load, **bound[load]),
        partial(chat_prompt, system),
        {"correct": partial(correct, extract), "format": partial(found, extract)},
        dict(WEIGHTS),
        partial(score, extract),
    )
