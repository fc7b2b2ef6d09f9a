"""plot.py's data side (matplotlib itself is optional and not needed here)."""

import json

import pytest

from plot import read_metrics, running_mean


def test_running_mean_by_hand():
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([2.0, 4.0], 5) == [2.0, 3.0]  # a window longer than the data averages what exists


def test_read_metrics_splits_train_and_eval_rows(tmp_path):
    rows = [{"step": 0, "eval/strict_acc": 0.1}, {"step": 2, "reward": 0.5}, {"step": 1, "reward": 0.2},
            {"step": 2, "eval/strict_acc": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, evals = read_metrics(str(tmp_path))
    assert [r["step"] for r in train] == [1, 2] and [r["reward"] for r in train] == [0.2, 0.5]
    assert [r["eval/strict_acc"] for r in evals] == [0.1, 0.4]
    with pytest.raises(FileNotFoundError, match="out-dir"):
        read_metrics(str(tmp_path / "missing"))
