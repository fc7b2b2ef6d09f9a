"""reasoning-gym tasks (`rg:NAME`, `rg:A+B`; extra_tasks.py): scored by each dataset's own `score_answer`, split by
question, through train.py and eval.py on the tiny model. Skipped where reasoning-gym is not installed."""

import json
import os
from collections import Counter
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import extra_tasks  # noqa: E402
import eval as eval_  # noqa: E402
import toy  # noqa: E402
from toy import EVAL, REPO, TRAIN, error_of, read_metrics, run_script, subprocess_env, train_args  # noqa: E402

rg = pytest.importorskip("reasoning_gym")
ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # ~190 questions: seeds collide


def rg_args(model_dir, out, *extra, options=ONE_DIGIT):
    argv = train_args(model_dir, out, "--eval-n", 3, "--config", f"task_options={options!r}", *extra, steps=1)
    return [a if a != "toy" else "rg:chain_sum" for a in argv]


def test_extract_takes_the_last_tags_then_the_last_number_then_the_last_line():
    """Fails if the first tag pair is taken instead of the last (reasoning-gym takes the last), if the fallback for a
    model without tags is dropped (a 135M model's first answers would all score 0) or reads the first number."""
    for text in ["<answer>3</answer> then <answer> 4 </answer>", "x\n<answer>\nfoo bar\n</answer>\n"]:
        assert extra_tasks.rg_extract(text) == rg.utils.extract_answer(text)
    assert extra_tasks.rg_extract("2 + 5 = 7\nso 7.") == "7"
    assert extra_tasks.rg_extract("12 - 5 = 7") == "7"
    assert extra_tasks.rg_extract("first line\n  the answer: blue  \n\n") == "the answer: blue"
    assert extra_tasks.rg_extract("") is None


@pytest.mark.parametrize("name", ["chain_sum", "leg_counting", "word_sorting"])
def test_reward_and_eval_score_are_the_datasets_own_score_answer(name):
    """Fails if the reward rounds partial credit (to 0 or 1), scores against the gold string instead of the dataset's
    verifier, or if eval's strict accuracy counts a partial score as right."""
    task = extra_tasks.get(f"rg:{name}", {"size": 4})
    dataset = rg.create_dataset(name, seed=0, size=extra_tasks.RG_DRAWS)  # the same dataset, built independently
    for ex in task.load("test"):
        entry, gold = ex["entry"], ex["answer"]
        completions = [f"<answer>{gold}</answer>", "<answer>nothing like it</answer>", f"<answer>{gold} xyz</answer>"]
        want = [dataset.score_answer(rg.utils.extract_answer(c), entry) for c in completions]
        assert want[0] == 1.0 and want[1] < 1.0 and 0 < want[2] < 1.0, want  # right, wrong, partial
        assert task.reward_fns["correct"](completions, entry=[entry] * 3) == want
        assert [task.score(c, ex)["score"] for c in completions] == want
        assert [task.score(c, ex)["strict"] for c in completions] == [True, False, False]
    assert task.reward_fns["format"](["<answer>1</answer>", "1", "<answer> </answer>"]) == [1.0, 0.0, 0.0]


def questions(name, options, split):
    return {ex["question"] for ex in extra_tasks.get(name, options).load(split)}


def distinct(name, split, **config):  # reasoning-gym's own items of a small space, counted apart from load_rg
    dataset = rg.create_dataset(name, seed=9, size=extra_tasks.RG_DRAWS, **config)
    found = {dataset[i]["question"] for i in range(len(dataset))}
    return {q for q in found if extra_tasks.rg_is_test(q) == (split == "test")}


@pytest.mark.parametrize(
    "name, options",
    [
        ("rg:chain_sum", ONE_DIGIT),
        ("rg:chain_sum+products", {"chain_sum": ONE_DIGIT, "products": ONE_DIGIT}),
        ("rg:chain_sum+products", {"chain_sum": {**ONE_DIGIT, "weight": 3}, "products": ONE_DIGIT}),
    ],
)
def test_train_and_test_share_no_question_whatever_the_seeds(name, options):
    """Fails if the split is by index or seed instead of by question (reasoning-gym draws item i from Random(seed + i):
    seed 1's item 1 is seed 2's item 0), or if a split repeats a question."""
    seeds = [0, 1, 2, 7]
    train = [questions(name, {**options, "seed": s}, "train") for s in seeds]
    test = [questions(name, {**options, "seed": s}, "test") for s in seeds]
    assert all(len(q) > 50 for q in train + test)
    assert all(not (a & b) for a in train for b in test)
    assert test[0] == test[1]  # a small space: every seed holds the whole test split
    one = extra_tasks.get(name, options).load("test")
    assert len(one) == len({ex["question"] for ex in one})


@pytest.mark.parametrize("weights", [(1, 1), (3, 1), (1, 4)])
def test_a_mixs_train_split_holds_its_sources_by_weight(weights, capsys):
    """Fails if a mix's train split holds its sources in other proportions than their weights (reasoning-gym's
    composite draw, repeats skipped: ~90 one-digit sums against thousands of products at 1:1), if a source short of
    its share is not repeated to it, evenly, or is repeated without a line saying so, if a source with enough
    questions repeats one, or if the split differs between two loads with the same seed."""
    n = 400
    options = {"chain_sum": {**ONE_DIGIT, "weight": weights[0]}, "products": {"weight": weights[1]}, "seed": 1}
    task = extra_tasks.get("rg:chain_sum+products", options)
    capsys.readouterr()
    got = task.load("train", n=n)
    line = capsys.readouterr().out
    want = {"chain_sum": n * weights[0] // sum(weights), "products": n * weights[1] // sum(weights)}
    assert Counter(ex["source"] for ex in got) == want
    assert not any(extra_tasks.rg_is_test(ex["question"]) for ex in got)
    sums = Counter(ex["question"] for ex in got if ex["source"] == "chain_sum")
    space = distinct("chain_sum", "train", **ONE_DIGIT)  # every 1-digit sum of the train split, ~90
    products = [ex["question"] for ex in got if ex["source"] == "products"]
    assert len(set(products)) == want["products"]  # 1-5 digit products: a large space, no repeats
    if want["chain_sum"] > len(space):
        assert set(sums) == space and max(sums.values()) - min(sums.values()) <= 1
        assert f"chain_sum's 30,000 draws hold {len(space)} distinct train questions" in line and "repeated" in line
    else:
        assert len(sums) == want["chain_sum"] and set(sums) <= space and line == ""
    assert task.load("train", n=n) == got


def test_a_test_split_holds_size_or_one_line_says_why(capsys):
    """Fails if fewer test questions than asked come back without a line saying so (the count, the size asked, the fix:
    lower size), if a size the dataset holds is cut or printed about, if a mix's test split leaves a short source's
    remainder to nobody or repeats a question, or if its sources are not spread by weight (train.py evaluates the
    first eval_n)."""
    space = distinct("chain_sum", "test", **ONE_DIGIT)  # every 1-digit sum of the test split, ~110

    def load(name, options):
        got = extra_tasks.get(name, options).load("test")
        assert len({ex["question"] for ex in got}) == len(got)
        assert all(extra_tasks.rg_is_test(ex["question"]) for ex in got)
        return got, capsys.readouterr().out

    capsys.readouterr()
    got, line = load("rg:chain_sum", {**ONE_DIGIT, "size": len(space) - 10})
    assert len(got) == len(space) - 10 and line == ""
    got, line = load("rg:chain_sum", {**ONE_DIGIT, "size": len(space) + 50})
    assert {ex["question"] for ex in got} == space
    assert f"{len(space)} questions of the {len(space) + 50} asked" in line and "lower size" in line, line
    size = 300  # 150 each by weight; the sums hold ~110: the products take the rest
    got, line = load("rg:chain_sum+products", {"chain_sum": ONE_DIGIT, "size": size})
    sources = Counter(ex["source"] for ex in got)
    assert len(got) == size and sources == {"chain_sum": len(space), "products": size - len(space)}
    assert f"chain_sum's 30,000 draws hold {len(space)} distinct test questions" in line, line
    got, line = load("rg:chain_sum+products", {"chain_sum": ONE_DIGIT, "products": {"weight": 3}, "size": 200})
    assert Counter(ex["source"] for ex in got) == {"chain_sum": 200 // 4, "products": 200 * 3 // 4} and line == ""
    for k in (8, 40, 101):  # any prefix holds the weights' mix, to one question
        assert abs(sum(ex["source"] == "chain_sum" for ex in got[:k]) - k / 4) <= 1


def test_evaluate_reports_each_sources_strict_accuracy():
    """Fails if a mix's per-source accuracy mixes sources or divides by all examples instead of the source's."""
    task = extra_tasks.get("rg:chain_sum+leg_counting", {"size": 12})
    examples = task.load("test")
    right = {ex["question"] for ex in examples[::3]}

    def sample(model, tokenizer, prompts, n, *a, **k):  # every third question answered right, the rest wrong
        gold = {ex["question"]: ex["answer"] for ex in examples}
        outs = [f"<answer>{gold[p[-1]['content']]}</answer>" if p[-1]["content"] in right else "x" for p in prompts]
        return type("R", (), {"completions": outs, "env_state": [{} for _ in outs]})

    mp = pytest.MonkeyPatch()
    mp.setattr(eval_, "sample", sample)
    try:
        summary, records = eval_.evaluate(toy.make_model(), toy.make_tokenizer(), task, examples, progress=False)
    finally:
        mp.undo()
    sources = {ex["source"] for ex in examples}
    assert sources == {"chain_sum", "leg_counting"}
    for s in sources:
        mine = [ex["question"] in right for ex in examples if ex["source"] == s]
        assert summary[f"strict_acc/{s}"] == sum(mine) / len(mine)
    assert summary["strict_acc"] == len(right) / len(examples)


def test_an_rg_task_trains_and_eval_follows_the_run(model_dir, tmp_path, capsys):
    """Fails if train.py drops task_options (the run would train on another config than the one saved), if the reward
    fns do not reach the rg rewards, if eval.py --ckpt without --task scores GSM8K instead of the run's task, or if
    train.py or eval.py say nothing of a test split smaller than the size asked (200; 1-digit sums hold ~110)."""
    out = str(tmp_path / "run")
    options = {**ONE_DIGIT, "seed": 3}
    note = f"rg:chain_sum test: {len(distinct('chain_sum', 'test', **ONE_DIGIT))} questions of the 200 asked"
    capsys.readouterr()
    g = run_script(TRAIN, rg_args(model_dir, out, options=options))
    assert note in capsys.readouterr().out
    assert g["train_set"][0]["question"] == extra_tasks.get("rg:chain_sum", options).load("train")[0]["question"]
    assert json.load(open(os.path.join(out, "run.json")))["task_options"] == options
    logged = {k for row in read_metrics(out) for k in row}
    assert {"reward/correct", "reward/format", "eval/score", "eval/strict_acc"} <= logged
    capsys.readouterr()
    run_script(EVAL, ["--ckpt", out, "--limit", 2, "--max-new-tokens", 4, "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "task rg:chain_sum, its options (from the run; --task to change)"
    assert lines[1].startswith(note)
    assert lines[2].startswith("rg:chain_sum/test ") and "score=" in lines[2]
    preds = [json.loads(x) for x in open(os.path.join(out, "predictions_rg-chain_sum_test.jsonl"))]
    assert [p["question"] for p in preds] == [ex["question"] for ex in g["test_set"][:2]]
    run_script(EVAL, ["--ckpt", out, "--task", "toy", "--limit", 1, "--max-new-tokens", 4, "--device", "cpu"])
    assert capsys.readouterr().out.startswith("toy/test ")  # a given --task wins, no line about the run


def loaded(*a, **k):
    raise AssertionError("the model loaded before the check")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--config", "task_options={'min_digitz': 1}"], "'min_digitz'; the config fields are chain_sum's: min_terms,"),
        (["--config", "task_options=[1]"], "config key task_options must be a dict literal"),
        (["--config", "task_options={'size': 0}"], "task_options 'size' must be >= 1"),
        (["--task", "rg:chain_sums"], "unknown reasoning-gym dataset 'chain_sums'; pass rg:NAME"),
    ],
)
def test_bad_rg_input_is_one_line_before_the_model_loads(model_dir, tmp_path, capsys, monkeypatch, extra, message):
    """Fails if a bad dataset name or config field reaches reasoning-gym's own traceback, if the line does not say
    what to pass instead (the dataset's fields, the nearest names), or if the model loads first."""
    monkeypatch.setattr("models.load_model", loaded)
    argv = rg_args(model_dir, str(tmp_path / "run"))
    if extra[0] == "--task":
        argv[argv.index("rg:chain_sum")] = extra[1]
    else:
        argv += extra
    code, line = error_of(TRAIN, argv, capsys)
    assert code == 2 and message in line, line
    if extra[0] == "--task":
        assert "e.g. chain_sum" in line, line  # the nearest name first


def test_missing_reasoning_gym_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """Fails if a missing library is a traceback (ModuleNotFoundError) instead of one line with the install command."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    code, line = error_of(TRAIN, rg_args(model_dir, str(tmp_path / "run")), capsys)
    assert code == 2 and "pip install reasoning-gym==0.1.25" in line, line
    code, line = error_of(EVAL, ["--task", "rg:chain_sum", "--model", model_dir], capsys)
    assert code == 2 and "pip install reasoning-gym==0.1.25" in line, line


def test_options_a_task_does_not_take_are_one_line(model_dir, tmp_path, capsys):
    """Fails if a task_options key the task does not take passes silently (train.py) or is ignored (eval.py): one
    line each, naming the key and the task."""
    argv = train_args(model_dir, str(tmp_path / "run"), "--config", "task_options={'seed': 1}", steps=1)
    code, line = error_of(TRAIN, argv, capsys)
    assert code == 2 and "task_options 'seed'" in line and "toy" in line, line
    argv = ["--task", "arith", "--task-options", "{'no_such_option': 1}", "--model", model_dir]
    code, line = error_of(EVAL, argv, capsys)
    assert code == 2 and "'no_such_option'" in line and "arith" in line and "digits" in line, line


CHECK_IMPORTS = """
import runpy, sys
sys.argv = ["train.py", "--task", sys.argv[1], "--micro-batch", "3"]  # an error after the task is resolved
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit:
    pass
print(sorted(m for m in ("extra_tasks", "reasoning_gym", "matplotlib") if m in sys.modules))
"""


def test_the_default_path_imports_no_reasoning_gym():
    """Fails if train.py or a module of its default path imports extra_tasks or reasoning_gym (~1 s, matplotlib)."""
    env = {**subprocess_env(), "GRPO_CACHE": "/nonexistent"}
    got = {
        t: subprocess.run([sys.executable, "-c", CHECK_IMPORTS, t], cwd=REPO, env=env, capture_output=True, text=True)
        for t in ("arith", "rg:chain_sum")
    }
    assert got["arith"].stdout.strip() == "[]", got["arith"].stderr[-500:]
    assert "micro-batch 3 must divide" in got["arith"].stderr
    assert got["rg:chain_sum"].stdout.strip() == "['extra_tasks', 'matplotlib', 'reasoning_gym']"
