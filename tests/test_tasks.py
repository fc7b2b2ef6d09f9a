import os
import re
from pathlib import Path

import pytest

import tasks
from rewards import combine_rewards
from tasks import (ARITH_SYSTEM_PROMPT, SYSTEM_PROMPT, TASKS, DataError, load_arith, load_gsm8k)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def gsm8k_dir():
    """The canonical GSM8K jsonl files, kept beside the repo (no network in tests)."""
    d = Path(os.environ.get("GSM8K_DIR") or REPO.parent / "shared" / "data" / "gsm8k")
    if not (d / "test.jsonl").is_file():
        pytest.skip(f"no local GSM8K copy at {d}; set GSM8K_DIR")
    return d


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty cache, no GSM8K_DIR, and a download URL that cannot connect."""
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tasks, "GSM8K_URL", "http://127.0.0.1:9/{split}.jsonl")
    return tmp_path / "cache" / "gsm8k"

# -----------------------------------------------------------------------------
# gsm8k

def test_gsm8k_counts_and_first_gold(gsm8k_dir):
    train, test = load_gsm8k("train", gsm8k_dir), load_gsm8k("test", str(gsm8k_dir))
    assert (len(train), len(test)) == (7473, 1319)
    assert test[0]["answer"] == "18"
    assert test[0]["question"].startswith("Janet")
    assert test[0]["solution"].endswith("#### 18")
    assert all(e["answer"].lstrip("-").isdigit() for e in train + test)  # all golds are integers


def test_gsm8k_dir_from_env(gsm8k_dir, monkeypatch):
    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir))
    assert len(load_gsm8k("test")) == 1319


def test_gsm8k_bad_split(gsm8k_dir):
    with pytest.raises(ValueError, match=r"valid splits: \['train', 'test'\]"):
        load_gsm8k("validation", gsm8k_dir)


def test_gsm8k_missing_file_names_path(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "train.jsonl")) + ".*--data-dir"):
        load_gsm8k("train", tmp_path)


@pytest.mark.parametrize("bad_line, why", [
    ('{"question": "q2", "answer": "#### 2"', "not valid JSON"),
    ('{"question": "q2"}', "'question' and 'answer'"),
    ('["q2", "#### 2"]', "'question' and 'answer'"),
    ('{"question": "q2", "answer": "two"}', "####"),
])
def test_gsm8k_malformed_line_gives_file_and_line(tmp_path, bad_line, why):
    good = '{"question": "q1", "answer": "1 + 1 = 2\\n#### 2"}'
    (tmp_path / "test.jsonl").write_text(f"{good}\n{bad_line}\n{good}\n")
    with pytest.raises(DataError, match=f"test.jsonl:2: .*{why}"):
        load_gsm8k("test", tmp_path)


def test_gsm8k_offline_without_copy_says_what_to_do(offline_cache):
    with pytest.raises(DataError) as e:
        load_gsm8k("test")
    msg = str(e.value)
    assert "could not download GSM8K" in msg and "--data-dir" in msg and "GSM8K_DIR" in msg
    assert "\n" not in msg
    assert not offline_cache.exists() or not any(offline_cache.iterdir())  # nothing half-written


def test_gsm8k_download_checks_sha_and_caches(offline_cache, gsm8k_dir, monkeypatch):
    monkeypatch.setattr(tasks, "GSM8K_URL", gsm8k_dir.as_uri() + "/{split}.jsonl")  # file:// stands in
    assert len(load_gsm8k("test")) == 1319
    assert sorted(p.name for p in offline_cache.iterdir()) == ["test.jsonl"]
    monkeypatch.setattr(tasks, "GSM8K_URL", "http://127.0.0.1:9/{split}.jsonl")
    assert len(load_gsm8k("test")) == 1319  # second time from the cache, no download


def test_gsm8k_download_sha_mismatch(offline_cache, tmp_path, monkeypatch):
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    monkeypatch.setattr(tasks, "GSM8K_URL", tmp_path.as_uri() + "/{split}.jsonl")
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
    train = {e["question"] for seed in range(3)
             for e in load_arith("train", n=100_000, digits=digits, ops=ops, seed=seed)}
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
    with pytest.raises(ValueError, match="operator"):
        load_arith("train", ops="+/")
    with pytest.raises(ValueError, match="valid splits"):
        load_arith("dev")

# -----------------------------------------------------------------------------
# the task table

def test_tasks_table():
    assert set(TASKS) == {"gsm8k", "arith"}
    for task in TASKS.values():
        assert set(task.reward_weights) == set(task.reward_fns)
    assert TASKS["gsm8k"].reward_weights is not TASKS["arith"].reward_weights  # editing one leaves the other


def test_prompts_are_chat_messages():
    example = {"question": "What is 1 + 2?", "answer": "3"}
    assert TASKS["gsm8k"].prompt(example) == [{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": "What is 1 + 2?"}]
    assert TASKS["arith"].prompt(example)[0]["content"] == ARITH_SYSTEM_PROMPT
    assert "#### <number>" in SYSTEM_PROMPT and "#### <number>" in ARITH_SYSTEM_PROMPT


@pytest.mark.parametrize("completion, pred, strict, flexible, fmt", [
    ("1 + 2 = 3\n#### 3", "3", True, True, True),
    ("so \\boxed{3}", "3", True, True, True),
    ("The answer is 3.", None, False, True, False),
    ("#### 4", "4", False, False, True),
    ("I don't know", None, False, False, False),
])
def test_score(completion, pred, strict, flexible, fmt):
    for task in TASKS.values():
        s = task.score(completion, {"question": "What is 1 + 2?", "answer": "3"})
        assert s == {"pred": pred, "strict": strict, "flexible": flexible, "format": fmt}


def test_task_rewards_combine():
    task = TASKS["arith"]
    examples = load_arith("test", n=2)
    completions = [f"#### {examples[0]['answer']}", "no idea"]
    total, per_fn = combine_rewards(task.reward_fns, task.reward_weights, completions,
                                    answer=[e["answer"] for e in examples])
    assert total == pytest.approx([1.1, 0.0]) and per_fn["format"] == [1.0, 0.0]
