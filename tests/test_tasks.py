import doctest
import hashlib
import re
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
from conftest import FULL, FULL_COUNTS, VOCAB, make_tokenizer

import envs
import extra_tasks
import gsm8k
import tasks
from rewards import REWARDS, combine_rewards
from extra_tasks import PROMPT as ARITH_STEPS_SYSTEM_PROMPT
from extra_tasks import arith_step_rewards, load_arith_steps, step_positions
from config import DataError
from tasks import ARITH_SYSTEM_PROMPT, SYSTEM_PROMPT, TASKS, Task, load_arith, load_gsm8k

REPO = Path(__file__).resolve().parent.parent


def test_docstring_examples():
    result = doctest.testmod(extra_tasks)
    assert result.attempted > 0 and result.failed == 0  # a module whose examples were all lost runs none


@pytest.fixture
def gsm8k_full():
    """The canonical GSM8K jsonl files kept beside the repo, for what only they have (their sha256, their sizes)."""
    if not all((FULL / f"{split}.jsonl").is_file() for split in FULL_COUNTS):
        pytest.skip(
            f"needs the full canonical GSM8K train.jsonl and test.jsonl (their sha256 is tasks.py's) at "
            f"{FULL}; set GSM8K_DIR"
        )
    return FULL


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty cache, no GSM8K_DIR, and a download URL that cannot connect."""
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gsm8k, "GSM8K_URL", "http://127.0.0.1:9/{split}.jsonl")
    return tmp_path / "cache" / "gsm8k"


# -----------------------------------------------------------------------------
# gsm8k


def test_gsm8k_counts_and_first_gold(gsm8k_dir):
    d, counts = gsm8k_dir
    train, test = load_gsm8k("train", d), load_gsm8k("test", str(d))
    assert (len(train), len(test)) == (counts["train"], counts["test"])  # the full files: 7473, 1319
    assert test[0]["answer"] == "18"
    assert test[0]["question"].startswith("Janet")
    assert test[0]["solution"].endswith("#### 18")
    assert all(e["answer"].lstrip("-").isdigit() for e in train + test)  # all golds are integers


def test_gsm8k_sha256_and_counts_are_the_canonical_files(gsm8k_full):
    for split, n in FULL_COUNTS.items():
        assert hashlib.sha256((gsm8k_full / f"{split}.jsonl").read_bytes()).hexdigest() == gsm8k.GSM8K_SHA256[split]
        assert len(load_gsm8k(split, gsm8k_full)) == n


def test_gsm8k_dir_from_env(gsm8k_dir, monkeypatch):
    d, counts = gsm8k_dir
    monkeypatch.setenv("GSM8K_DIR", str(d))
    assert len(load_gsm8k("test")) == counts["test"]


def test_gsm8k_bad_split(tmp_path):
    with pytest.raises(ValueError, match=r"valid splits: \['train', 'test'\]"):  # before any file is looked for
        load_gsm8k("validation", tmp_path)


def test_gsm8k_missing_file_names_path(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "train.jsonl")) + ".*--data-dir"):
        load_gsm8k("train", tmp_path)


@pytest.mark.parametrize(
    "bad_line, why",
    [
        ('{"question": "q2", "answer": "#### 2"', "not valid JSON"),
        ('{"question": "q2"}', "'question' and 'answer'"),
        ('["q2", "#### 2"]', "'question' and 'answer'"),
        ('{"question": "q2", "answer": "two"}', "####"),
        ('{"question": "q2", "answer": "1 + 1 = 2\\n#### "}', "nothing after '####'"),
        ('{"question": "q2", "answer": "####\\n"}', "nothing after '####'"),
        ('{"question": 7, "answer": "#### 2"}', "'question' must be a non-empty string, got 7"),
        ('{"question": null, "answer": "#### 2"}', "'question' must be a non-empty string, got None"),
        ('{"question": " ", "answer": "#### 2"}', "'question' must be a non-empty string"),
    ],
)
def test_gsm8k_malformed_line_gives_file_and_line(tmp_path, bad_line, why):
    good = '{"question": "q1", "answer": "1 + 1 = 2\\n#### 2"}'
    (tmp_path / "test.jsonl").write_text(f"{good}\n{bad_line}\n{good}\n")
    with pytest.raises(DataError, match=f"test.jsonl:2: .*{why}") as e:
        load_gsm8k("test", tmp_path)
    assert "\n" not in str(e.value)


def test_gsm8k_bytes_not_utf8_gives_line(tmp_path):
    good = b'{"question": "q1", "answer": "#### 2"}\n'
    (tmp_path / "test.jsonl").write_bytes(good + good + b'{"question": "caf\xe9?", "answer": "#### 2"}\n')  # latin-1
    with pytest.raises(DataError, match=r"test.jsonl:3: byte 0xe9 is not UTF-8; save the file as UTF-8$"):
        load_gsm8k("test", tmp_path)


def test_gsm8k_utf8_with_bom_reads(tmp_path):
    (tmp_path / "test.jsonl").write_text('\ufeff{"question": "caf\u00e9?", "answer": "#### 2"}\n', encoding="utf-8")
    assert load_gsm8k("test", tmp_path) == [{"question": "caf\u00e9?", "answer": "2", "solution": "#### 2"}]


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_gsm8k_file_without_examples(tmp_path, text):
    (tmp_path / "test.jsonl").write_text(text)
    with pytest.raises(DataError, match=re.escape(f"no examples in {tmp_path / 'test.jsonl'};")) as e:
        load_gsm8k("test", tmp_path)
    assert "\n" not in str(e.value)


def test_gsm8k_offline_without_copy_says_what_to_do(offline_cache):
    with pytest.raises(DataError) as e:
        load_gsm8k("test")
    msg = str(e.value)
    assert "could not download GSM8K" in msg and "--data-dir" in msg and "GSM8K_DIR" in msg
    assert "\n" not in msg
    assert not offline_cache.exists() or not any(offline_cache.iterdir())  # nothing half-written


# gsm8k_dir first: offline_cache unsets GSM8K_DIR
def test_gsm8k_download_checks_sha_and_caches(gsm8k_dir, offline_cache, monkeypatch):
    d, counts = gsm8k_dir
    if counts != FULL_COUNTS:  # the sample: its sha256 stands in for the canonical file's (checked where that is)
        monkeypatch.setitem(gsm8k.GSM8K_SHA256, "test", hashlib.sha256((d / "test.jsonl").read_bytes()).hexdigest())
    monkeypatch.setattr(gsm8k, "GSM8K_URL", d.as_uri() + "/{split}.jsonl")  # file:// stands in
    assert len(load_gsm8k("test")) == counts["test"]
    assert sorted(p.name for p in offline_cache.iterdir()) == ["test.jsonl"]
    monkeypatch.setattr(gsm8k, "GSM8K_URL", "http://127.0.0.1:9/{split}.jsonl")
    assert len(load_gsm8k("test")) == counts["test"]  # second time from the cache, no download


def test_gsm8k_download_sha_mismatch(offline_cache, tmp_path, monkeypatch):
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    monkeypatch.setattr(gsm8k, "GSM8K_URL", tmp_path.as_uri() + "/{split}.jsonl")
    with pytest.raises(DataError, match="sha256"):
        load_gsm8k("test")
    assert not (offline_cache / "test.jsonl").exists()


# -----------------------------------------------------------------------------
# arith


def test_arith_deterministic_and_seeded():
    assert load_arith("train", seed=3) == load_arith("train", seed=3)
    assert load_arith("train", seed=3) != load_arith("train", seed=4)


@pytest.mark.parametrize("digits, ops", [(1, "+"), (2, "+-*")])
def test_arith_train_and_test_disjoint_for_any_n_and_seed(digits, ops):
    test = {e["question"] for seed in range(3) for e in load_arith("test", digits=digits, ops=ops, seed=seed)}
    train = {
        e["question"] for seed in range(3) for e in load_arith("train", n=100_000, digits=digits, ops=ops, seed=seed)
    }
    assert test and train and not (test & train)


def test_arith_one_digit_space_is_covered_and_200_held_out():
    train, test = load_arith("train"), load_arith("test", n=1000)
    questions = [e["question"] for e in train + test]
    # 100 sums + 55 non-negative differences + 100 products, capped at the space, no repeats
    assert len(questions) == len(set(questions)) == 100 + 55 + 100
    assert len(test) >= 200 and len(load_arith("test")) == 200  # issue 6: >= 200 held-out problems
    assert len(load_arith("test", n=5)) == 5


def test_arith_answers_are_right():
    for e in load_arith("test", n=50, digits=3, ops="+-*"):
        a, op, b = e["question"].removeprefix("What is ").removesuffix("?").split()
        assert str(eval(f"{a} {op} {b}")) == e["answer"]
        assert int(e["answer"]) >= 0 and len(a) <= 3 and len(b) <= 3


def test_arith_defaults_and_bad_args():
    assert (tasks.ARITH_DIGITS, tasks.ARITH_OPS) == (1, "+-*")
    assert {e["question"].split()[3] for e in load_arith("test")} == {"+", "-", "*"}
    with pytest.raises(ValueError, match="ops"):  # task_options are checked where they are bound
        tasks.get("arith", {"ops": "+/"})
    with pytest.raises(ValueError, match="valid splits"):
        load_arith("dev")


# -----------------------------------------------------------------------------
# arith_steps


def parse(question):
    """(a, op1, b, op2, c) from 'What is 3 + 4 * 2 - 5?'"""
    a, op1, b, op2, c = question.removeprefix("What is ").removesuffix("?").split()
    return int(a), op1, int(b), op2, int(c)


def test_arith_steps_precedence_by_hand():
    assert extra_tasks._evaluate(3, "+", 4, "*", 2) == 11  # 3 + 8, not 7 * 2
    assert extra_tasks._evaluate(1, "-", 2, "*", 3) == -5  # 1 - 6
    assert extra_tasks._evaluate(2, "*", 3, "-", 4) == 2
    assert extra_tasks._evaluate(9, "-", 2, "-", 3) == 4  # left to right, not 9 - (-1)
    assert extra_tasks._evaluate(9, "*", 9, "*", 9) == 729


def test_arith_steps_problems():
    train, test = load_arith_steps("train", n=10**6), load_arith_steps("test", n=10**6)
    questions = [e["question"] for e in train + test]
    assert len(questions) == len(set(questions)) == 10 * 10 * 10 * 3 * 3  # the whole space, no repeats
    assert len(load_arith_steps("test")) == 200 and len(train) >= 1000
    parts = [parse(q) for q in questions]
    assert {p[1] for p in parts} == {p[3] for p in parts} == {"+", "-", "*"}
    assert {p[0] for p in parts} == {p[2] for p in parts} == {p[4] for p in parts} == set(range(10))
    for e in train + test:
        assert str(eval(e["question"].removeprefix("What is ").removesuffix("?"))) == e["answer"]  # python's precedence
    assert min(int(e["answer"]) for e in test) == -81  # 0 - 9 * 9


def test_arith_steps_split_and_seed():
    assert load_arith_steps("train", seed=3) == load_arith_steps("train", seed=3)
    assert load_arith_steps("test", seed=3) != load_arith_steps("test", seed=4)
    tests = [{e["question"] for e in load_arith_steps("test", n=10**6, seed=s)} for s in range(2)]
    trains = [{e["question"] for e in load_arith_steps("train", n=10**6, seed=s)} for s in range(2)]
    assert tests[0] == tests[1] and trains[0] == trains[1]  # the seed never moves the split
    assert not tests[0] & trains[0]
    assert {parse(e["question"])[1] for e in load_arith_steps("test", ops="+")} == {"+"}
    with pytest.raises(ValueError, match="ops"):
        extra_tasks.get("arith_steps", {"ops": "+/"})


CHAIN = "4 * 2 = 8\n3 + 8 = 11\n11 - 5 = 6\n#### 6"  # 3 + 4 * 2 - 5


@pytest.mark.parametrize(
    "completion, gold, steps",
    [
        # line ends: 9 chars, then 10 + 10, 21 + 10, 32 + 6
        (CHAIN, "6", [(9, 1.0), (20, 1.0), (31, 1.0), (38, 1.0)]),
        ("4 * 2 = 8\n3 + 8 = 12\n12 - 5 = 7\n#### 7", "6", [(9, 1.0), (20, 0.0), (31, 1.0), (38, 0.0)]),  # one slip
        (CHAIN.replace("#### 6", "#### 5"), "6", [(9, 1.0), (20, 1.0), (31, 1.0), (38, 0.0)]),  # wrong final answer
        # "Let me think." 0-13, blank, "4*2=8" 15-20, spaces only, "So the answer is 6" 24-42, "#### 6" 43-49
        ("Let me think.\n\n4*2=8\n  \nSo the answer is 6\n#### 6\n", "6", [(13, 0.0), (20, 1.0), (42, 0.0), (49, 1.0)]),
        # windows newlines, trailing spaces: not part of a step: "4 x 2 = 8" 0-9, "3 + 8 = 11" 13-23, "#### 11" 25-32
        ("4 x 2 = 8  \r\n3 + 8 = 11\r\n#### 11 \r\n", "11", [(9, 1.0), (23, 1.0), (32, 1.0)]),
        # negatives and x: 0-10, 11-23, 24-34, 35-43
        ("0 - 9 = -9\n-9 \u00d7 9 = -81\n3 - -2 = 5\n#### -81", "-81", [(10, 1.0), (23, 1.0), (34, 1.0), (43, 1.0)]),
        # text around a calculation, ####N without the space, an answer with words: none is a step we can check
        ("so 4 * 2 = 8\n4 * 2 = 8 apples\n####6\n#### 6 apples", "6", [(12, 0.0), (29, 0.0), (35, 0.0), (49, 0.0)]),
        ("", "6", [(0, 0.0)]),
        (" \n\n", "6", [(3, 0.0)]),  # no step at all: one, at the end
    ],
)
def test_arith_step_rewards(completion, gold, steps):
    got = arith_step_rewards(completion, {"question": "q", "answer": gold})
    assert got == steps
    ends = [end for end, _ in got] if completion.strip() else []
    for end in ends:  # each step ends on its last visible character
        assert not completion[end - 1].isspace() and (end == len(completion) or completion[end].isspace())


def test_arith_steps_prompt_example_is_all_right():
    example = ARITH_STEPS_SYSTEM_PROMPT.split("Example:\n")[1]
    question, worked = example.split("\n", 1)
    gold = str(eval(question.removeprefix("What is ").removesuffix("?")))
    assert [r for _, r in arith_step_rewards(worked, {"answer": gold})] == [1.0, 1.0, 1.0]
    assert extra_tasks.EXTRA["arith_steps"].score(worked, {"answer": gold})["strict"]


# -----------------------------------------------------------------------------
# step_positions: each step's reward on the token that completes its last character


def word_steps(text, example):
    """One step per word, reward = its index * example["w"]; no word: one step at the end."""
    return [(m.end(), k * example["w"]) for k, m in enumerate(re.finditer(r"\S+", text))] or [(len(text), 0.0)]


def test_step_positions_by_hand():
    tok, w = make_tokenizer(), lambda *names: [VOCAB[n] for n in names]
    rows = [
        w("w1", "w2", "w3", "<|im_end|>"),  # 3 tokens, then the stop token
        w("w4", "<|im_start|>", "w5", "<|im_end|>"),  # a special token in between decodes as nothing
        w("<|im_end|>", "<|im_end|>", "<|im_end|>", "<|im_end|>"),  # empty: the stop token at once
        w("w6", "w7", "w8", "w9"),
    ]  # truncated: no stop token
    lengths = torch.tensor([3, 3, 0, 4])  # tokens before the stop token
    texts = ["w1 w2 w3", "w4 w5", "", "w6 w7 w8 w9"]
    assert [tok.decode(r[:n], skip_special_tokens=True) for r, n in zip(rows, lengths)] == texts
    rollout = SimpleNamespace(
        completion_ids=torch.tensor(rows),
        completion_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]),  # to the stop
        truncated=torch.tensor([False, False, False, True]),
        completions=texts,
        examples=[{"w": 1.0}, {"w": 1.0}, {"w": 0.5}, {"w": 0.5}],
    )
    ends, values, mask = step_positions(word_steps, tok, rollout)
    assert ends.dtype == torch.long and mask.dtype == torch.bool
    assert ends.tolist() == [[0, 1, 2, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 1, 2, 3]]  # padding steps: 0
    assert values.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0.5, 1, 1.5]]  # group 1: w = 0.5
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


@pytest.mark.real_model
def test_step_positions_is_the_token_that_completes_the_character(smol_tok):
    """A step ending at every character: it lands on the token holding the character just before char_end,
    including a character whose UTF-8 bytes are split over several tokens (where the character is complete)."""
    text = "Let me see: 12 * 3 = 36\ncafé ☕\n7 + 5 = 12\n#### 48"
    ids = smol_tok(text, add_special_tokens=False)["input_ids"]
    assert smol_tok.decode(ids) == text
    offsets = smol_tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]

    def every_char(t, ex):
        return [(i + 1, float(i)) for i in range(len(t))]

    rollout = SimpleNamespace(
        completion_ids=torch.tensor([ids + [smol_tok.eos_token_id]]),
        completion_mask=torch.ones(1, len(ids) + 1, dtype=torch.long),
        truncated=torch.tensor([False]),
        completions=[text],
        examples=[{}],
    )
    ends, values, mask = step_positions(every_char, smol_tok, rollout)
    assert mask.all() and values[0].tolist() == list(range(len(text)))
    for end, k in zip(range(1, len(text) + 1), ends[0].tolist()):
        # the last token whose span covers character end-1 (a split character: its last byte's token)
        want = max(i for i, (s, e) in enumerate(offsets) if s <= end - 1 < e)
        assert k == want, (end, text[:end], k, want)


@pytest.mark.real_model
def test_step_positions_of_arith_steps_are_each_lines_last_token(smol_tok):
    """arith_step_rewards on completions tokenized line by line, so each line's last token is known."""
    groups = {
        "11": [["4 * 2 = 8", "3 + 8 = 11", "1 + 1 = 3", "#### 11"], ["4 * 2 = 9", "#### 12"]],
        "6": [["I think", "5 - 2 = 3"], ["#### 6"]],
    }
    rows, want_ends, want_values, texts = [], [], [], []
    for gold, completions in groups.items():
        for lines in completions:
            ids, line_ends = [], []
            for i, line in enumerate(lines):
                ids += smol_tok(("\n" if i else "") + line, add_special_tokens=False)["input_ids"]
                line_ends.append(len(ids) - 1)
            texts.append(smol_tok.decode(ids, skip_special_tokens=True))
            assert texts[-1] == "\n".join(lines)
            rows.append(ids)
            want_ends.append(line_ends)
            want_values.append([r for _, r in arith_step_rewards(texts[-1], {"answer": gold})])
    C = max(map(len, rows)) + 1
    completion_ids = torch.tensor([r + [smol_tok.eos_token_id] * (C - len(r)) for r in rows])  # (4, C)
    rollout = SimpleNamespace(
        completion_ids=completion_ids,
        completion_mask=(torch.arange(C)[None] <= torch.tensor([len(r) for r in rows])[:, None]).long(),  # + stop
        truncated=torch.zeros(len(rows), dtype=torch.bool),
        completions=texts,
        examples=[{"answer": g} for g in groups for _ in range(2)],  # each row's example
    )
    ends, values, mask = step_positions(arith_step_rewards, smol_tok, rollout)
    assert [e[m].tolist() for e, m in zip(ends, mask)] == want_ends
    assert [v[m].tolist() for v, m in zip(values, mask)] == want_values == [[1, 1, 0, 1], [0, 0], [0, 1], [1]]
    assert values[mask].mean().item() == pytest.approx(5 / 9)  # what the loop logs as reward/step


# -----------------------------------------------------------------------------
# the task table


def test_tasks_table():
    """Fails if a task moves between the default path and extra_tasks.py, names a reward no dict holds, or
    extra_tasks.get accepts an unknown name."""
    assert {"gsm8k", "arith"} <= set(TASKS) and not set(TASKS) & set(extra_tasks.EXTRA)
    assert {"arith_steps", "arith_tool", "arith_mul", "arith_tool_mixed", "arith_retry", "gsm8k_python"} <= set(
        extra_tasks.EXTRA
    )
    every = {**TASKS, **extra_tasks.EXTRA}
    for task in every.values():  # each weight names a reward: the task's own, else rewards.REWARDS'
        assert set(task.reward_weights) <= {*REWARDS, *task.reward_fns, *(envs.REWARDS if task.env else ())}
    text = "4 * 2 = 8\n#### 8"
    assert extra_tasks.get("arith_steps").step_rewards(text, {"answer": "8"}) == arith_step_rewards(
        text, {"answer": "8"}
    )
    assert TASKS["gsm8k"].step_rewards is None and TASKS["arith"].step_rewards is None
    assert {"arith_tool", "arith_tool_mixed", "arith_retry", "gsm8k_python"} <= {n for n, t in every.items() if t.env}
    assert not every["arith_mul"].env
    with pytest.raises(ValueError, match="unknown task 'no-such-task'; tasks: .*arith_retry"):
        extra_tasks.get("no-such-task")
    assert Task(*range(5)).step_rewards is None  # five-field tasks still build


def test_prompts_are_chat_messages():
    example = {"question": "What is 1 + 2?", "answer": "3"}
    assert TASKS["gsm8k"].prompt(example) == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "What is 1 + 2?"},
    ]
    assert TASKS["arith"].prompt(example)[0]["content"] == ARITH_SYSTEM_PROMPT
    assert extra_tasks.EXTRA["arith_steps"].prompt(example)[0]["content"] == ARITH_STEPS_SYSTEM_PROMPT
    assert all("#### <number>" in p for p in (SYSTEM_PROMPT, ARITH_SYSTEM_PROMPT, ARITH_STEPS_SYSTEM_PROMPT))


@pytest.mark.parametrize(
    "completion, pred, strict, flexible, fmt",
    [
        ("1 + 2 = 3\n#### 3", "3", True, True, True),
        ("so \\boxed{3}", "3", True, True, True),
        ("The answer is 3.", None, False, True, False),
        ("#### 4", "4", False, False, True),
        ("I don't know", None, False, False, False),
    ],
)
def test_score(completion, pred, strict, flexible, fmt):
    for task in TASKS.values():
        s = task.score(completion, {"question": "What is 1 + 2?", "answer": "3"})
        assert s == {"pred": pred, "strict": strict, "flexible": flexible, "format": fmt}


def active(task):
    """The reward fns a task trains on by default: its weights' names, its own fns before rewards.REWARDS'."""
    return {k: {**REWARDS, **task.reward_fns}[k] for k in task.reward_weights}


def test_task_rewards_combine():
    task = TASKS["arith"]
    examples = load_arith("test", n=2)
    completions = [f"#### {examples[0]['answer']}", "no idea"]
    total, per_fn = combine_rewards(
        active(task), task.reward_weights, completions, answer=[e["answer"] for e in examples]
    )
    assert total == pytest.approx([1.1, 0.0]) and per_fn["format"] == [1.0, 0.0]


def test_arith_steps_rewards_combine():
    task = extra_tasks.EXTRA["arith_steps"]
    example = {"question": "What is 3 + 4 * 2 - 5?", "answer": "6"}
    completions = [CHAIN, CHAIN.replace("#### 6", "#### 5"), "6"]
    total, _ = combine_rewards(
        active(task),
        task.reward_weights,
        completions,
        num_tokens=[20, 20, 1],
        **{k: [v] * 3 for k, v in example.items()},
    )
    assert total == pytest.approx([1.1, 0.1, 0.0])  # correct + 0.1 format, format only, neither
