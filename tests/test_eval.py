"""eval.py: `evaluate` against an independent recomputation with task.score, and the command line."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy  # noqa: E402
from toy import EVAL, TRAIN, run_script, train_args  # noqa: E402

from eval import evaluate, load_checkpoint_model  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """A 2-step train.py run dir (ckpt.pt inside)."""
    out = str(tmp_path_factory.mktemp("trained"))
    run_script(TRAIN, train_args(model_dir, out, steps=2))
    return out


def mean(xs):
    return sum(xs) / len(xs)


def test_greedy_summary_is_the_mean_of_task_scores():
    model, tok, task = toy.make_model(), toy.make_tokenizer(), toy.TASK
    examples = task.load("test")
    summary, records = evaluate(model, tok, task, examples, max_new_tokens=8, batch_size=5, progress=False)
    assert summary["n_examples"] == len(records) == len(examples) and "pass@1" not in summary
    scores = [task.score(r["completion"], ex) for r, ex in zip(records, examples)]
    assert [r["question"] for r in records] == [ex["question"] for ex in examples]  # order kept
    assert [r["gold"] for r in records] == [ex["answer"] for ex in examples]
    assert [r["pred"] for r in records] == [s["pred"] for s in scores]
    assert [r["correct"] for r in records] == [s["strict"] for s in scores]
    for key, name in (("strict", "strict_acc"), ("flexible", "flexible_acc"), ("format", "format_rate")):
        assert summary[name] == pytest.approx(mean([float(s[key]) for s in scores]))
    assert 0 < summary["strict_acc"] < 1  # not a vacuous all-or-nothing case
    # greedy decoding does not depend on how prompts are batched (left padding, positions)
    _, one_by_one = evaluate(model, tok, task, examples, max_new_tokens=8, batch_size=1, progress=False)
    assert [r["completion"] for r in one_by_one] == [r["completion"] for r in records]


def test_sampled_pass_at_n_is_any_correct():
    model, tok, task = toy.make_model(), toy.make_tokenizer(), toy.TASK
    examples = task.load("test")[:8]
    summary, records = evaluate(model, tok, task, examples, max_new_tokens=6, batch_size=8, n=4,
                                temperature=1.0, seed=1, progress=False)
    assert all(len(r["completions"]) == 4 and r["completion"] == r["completions"][0] for r in records)
    strict = [[task.score(c, ex)["strict"] for c in r["completions"]] for r, ex in zip(records, examples)]
    assert summary["pass@4"] == pytest.approx(mean([float(any(s)) for s in strict]))
    assert summary["strict_acc"] == pytest.approx(mean([mean(s) for s in strict]))
    assert summary["strict_acc"] < summary["pass@4"]  # some question is solved by some sample, not all
    again, _ = evaluate(model, tok, task, examples, max_new_tokens=6, batch_size=8, n=4, temperature=1.0,
                        seed=1, progress=False)
    assert again == summary  # seeded


def test_cli_writes_one_prediction_per_example(model_dir, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    run_script(EVAL, ["--task", "arith", "--model", model_dir, "--limit", 4, "--max-new-tokens", 8,
                      "--dtype", "float32", "--device", "cpu", "--out", out])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert all({"question", "gold", "completion", "pred", "correct"} <= set(r) for r in rows)
    assert rows[0]["question"].startswith("What is ")
    assert "n_examples=4" in capsys.readouterr().out


def test_cli_ckpt_evaluates_the_trained_weights(trained, model_dir, capsys):
    run_script(EVAL, ["--task", "toy", "--ckpt", trained, "--limit", 3, "--max-new-tokens", 6,
                      "--dtype", "float32", "--device", "cpu"])
    out = os.path.join(trained, "predictions_toy_test.jsonl")  # beside the checkpoint by default
    assert len(open(out).read().splitlines()) == 3
    assert out in capsys.readouterr().out
    model, _, cfg = load_checkpoint_model(trained, CPU, torch.float32)
    saved = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=False)["model"]
    init = toy.make_model().state_dict()
    assert cfg["model"] == model_dir
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]) and not torch.equal(v, init[k]), k


@pytest.mark.parametrize("what, message", [("missing", "no checkpoint at"), ("corrupt", "is unreadable")])
def test_cli_bad_ckpt_is_a_one_line_error(tmp_path, capsys, what, message):
    if what == "corrupt":
        (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    path = tmp_path / "missing" if what == "missing" else tmp_path
    with pytest.raises(SystemExit) as e:
        run_script(EVAL, ["--task", "arith", "--ckpt", path, "--limit", 1, "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err  # a usage error: argparse's one line
    assert "eval.py: error: " in err.strip().splitlines()[-1] and message in err.strip().splitlines()[-1], err
    assert not list(tmp_path.glob("*.tmp"))  # the output probe does not stay behind
