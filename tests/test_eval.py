"""eval.py: `evaluate` against an independent recomputation with task.score, and the command line."""

import json
import math
import os
import sys
from fractions import Fraction
from itertools import combinations
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy  # noqa: E402
from toy import EVAL, TRAIN, run_script, train_args  # noqa: E402

import eval as eval_  # noqa: E402
from eval import evaluate, load_checkpoint_model, pass_at_k  # noqa: E402
from rollout import Sampler  # noqa: E402

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
    settings = dict(max_new_tokens=6, batch_size=8, n=4, sampler=Sampler(temperature=1.0), seed=1, progress=False)
    summary, records = evaluate(model, tok, task, examples, **settings)
    assert all(len(r["completions"]) == 4 and r["completion"] == r["completions"][0] for r in records)
    strict = [[task.score(c, ex)["strict"] for c in r["completions"]] for r, ex in zip(records, examples)]
    assert summary["pass@4"] == pytest.approx(mean([float(any(s)) for s in strict]))  # pass@n: any is right
    assert summary["strict_acc"] == pytest.approx(mean([mean(s) for s in strict]))
    assert summary["pass@1"] == pytest.approx(summary["strict_acc"])  # pass@1 is the mean accuracy
    assert summary["pass@2"] == pytest.approx(mean([float(brute_pass_at_k(s, 2)) for s in strict]))
    assert summary["strict_acc"] < summary["pass@4"]  # some question is solved by some sample, not all
    again, _ = evaluate(model, tok, task, examples, **settings)
    assert again == summary  # seeded


def brute_pass_at_k(correct, k):
    """P(a k-subset of the samples holds a correct one), by enumerating every k-subset (exact)."""
    subsets = list(combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample():
    # the product form against enumeration; <= 6 float factors, each rounded by <= 2^-53: error << 1e-12
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert abs(pass_at_k(n, c, k) - brute_pass_at_k([True] * c + [False] * (n - c), k)) < 1e-12, (n, c, k)
    # C(2000, 1000) ~ 1e600 overflows a float; the product form does not, and matches the exact ratio
    exact = 1 - Fraction(math.comb(1997, 1000), math.comb(2000, 1000))
    assert abs(pass_at_k(2000, 3, 1000) - exact) < 1e-12


def stub_sample(correct, calls):
    """rollout.sample for toy prompts: example q's first correct[q] of n completions are right (toy.score)."""

    def sample(
        model, tokenizer, prompts, n, *, max_new_tokens, stop_ids, sampler, generator, dtype, env, examples, loop
    ):
        calls.append((len(prompts), n, sampler.temperature))
        outs = []
        for msgs in prompts:
            q = msgs[-1]["content"]
            right, wrong = ("w2", "w1") if toy.score("w2", {"answer": ANSWERS[q]})["strict"] else ("w1", "w2")
            outs += [right if i < correct[q] else wrong for i in range(n)]
        return SimpleNamespace(completions=outs, env_state=[{} for _ in outs])  # a Rollout without an environment

    return sample


ANSWERS = {ex["question"]: ex["answer"] for ex in toy.load("test")}


@pytest.mark.parametrize(
    "n, counts, ks",
    [(6, [0, 1, 3, 6, 2], [1, 2, 4, 6]), (4, [0, 1, 2, 4, 3], [1, 2, 4]), (3, [0, 3, 1, 2, 2], [1, 2, 3])],
)
def test_evaluate_reports_pass_at_k_for_powers_of_two_and_n(monkeypatch, n, counts, ks):
    examples = toy.load("test")[: len(counts)]
    correct = {ex["question"]: c for ex, c in zip(examples, counts)}
    calls = []
    monkeypatch.setattr(eval_, "sample", stub_sample(correct, calls))
    summary, records = evaluate(
        toy.make_model(),
        toy.make_tokenizer(),
        toy.TASK,
        examples,
        n=n,
        batch_size=2 * n,
        sampler=Sampler(temperature=0.7),
        progress=False,
    )
    assert calls == [(2, n, 0.7), (2, n, 0.7), (1, n, 0.7)]  # batch_size counts completions: 2 prompts a call
    assert [k for k in summary if k.startswith("pass@")] == [f"pass@{k}" for k in ks]
    for k in ks:
        want = mean([brute_pass_at_k([True] * c + [False] * (n - c), k) for c in counts])
        assert summary[f"pass@{k}"] == pytest.approx(float(want), abs=1e-12), k
    assert summary["strict_acc"] == pytest.approx(sum(counts) / (n * len(counts)))
    assert [r["strict"] for r in records] == [c / n for c in counts]


def test_progress_bar_goes_to_stderr_and_counts_problems(monkeypatch, capsys):
    examples = toy.load("test")[:5]
    monkeypatch.setattr(eval_, "sample", stub_sample({ex["question"]: 1 for ex in examples}, []))
    evaluate(toy.make_model(), toy.make_tokenizer(), toy.TASK, examples, n=2, batch_size=4, progress=True)
    out, err = capsys.readouterr()  # neither is a tty here, as in a job log
    assert out == "" and "eval:" in err and "/5 " in err, err  # the bar counts the 5 problems
    evaluate(toy.make_model(), toy.make_tokenizer(), toy.TASK, examples, n=2, batch_size=4, progress=False)
    assert capsys.readouterr() == ("", "")


def test_cli_writes_one_prediction_per_example(model_dir, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    run_script(
        EVAL,
        [
            "--task",
            "arith",
            "--model",
            model_dir,
            "--limit",
            4,
            "--max-new-tokens",
            8,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--out",
            out,
        ],
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert all({"question", "gold", "completion", "pred", "correct"} <= set(r) for r in rows)
    assert rows[0]["question"].startswith("What is ")
    assert "n_examples=4" in capsys.readouterr().out


def test_cli_ckpt_evaluates_the_trained_weights(trained, model_dir, capsys):
    run_script(
        EVAL,
        [
            "--task",
            "toy",
            "--ckpt",
            trained,
            "--limit",
            3,
            "--max-new-tokens",
            6,
            "--dtype",
            "float32",
            "--device",
            "cpu",
        ],
    )
    out = os.path.join(trained, "predictions_toy_test.jsonl")  # beside the checkpoint by default
    assert len(open(out).read().splitlines()) == 3
    assert out in capsys.readouterr().out
    model, _, cfg = load_checkpoint_model(trained, CPU, torch.float32)
    saved = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)["model"]
    init = toy.make_model().state_dict()
    assert cfg["model"] == model_dir
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]) and not torch.equal(v, init[k]), k


@pytest.mark.parametrize(
    "what, message", [("missing", "no checkpoint at"), ("corrupt", "not a checkpoint train.py wrote")]
)
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


@pytest.mark.parametrize("n, note", [(64, True), (4, False)])
def test_cli_notes_when_a_questions_samples_outnumber_the_batch(model_dir, tmp_path, capsys, n, note):
    """eval.py --n N --batch-size 4 decodes each question's N samples together, so a batch is N rows, not 4. Fails if
    the note that says so (naming --n and --batch-size with their values) is missing for N = 64, or printed where N
    fits the batch (N = 4)."""
    out = tmp_path / "preds.jsonl"
    argv = ["--task", "toy", "--model", model_dir, "--limit", 1, "--max-new-tokens", 2, "--n", n, "--batch-size", 4]
    run_script(EVAL, argv + ["--device", "cpu", "--dtype", "float32", "--out", out])
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:") and "--batch-size" in x]
    assert len(notes) == note, notes
    if note:
        assert "--n 64" in notes[0] and "--batch-size 4" in notes[0] and "64 samples decode together" in notes[0]
    assert len(json.loads(out.read_text())["completions"]) == n  # the evaluation ran, with all its samples
