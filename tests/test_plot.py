"""eval.py --plot: the data side against hand computations, and one plot drawn from two runs (matplotlib, Agg)."""

import json
import sys

import pytest

import eval as ev
from plot import read_metrics, running_mean, series


def write_run(path, rows, tail=""):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return str(path)


def test_running_mean_by_hand():
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([2.0, 4.0], 5) == [2.0, 3.0]  # a window longer than the data averages what exists
    assert running_mean([2.0, 4.0], 1) == [2.0, 4.0]


def test_read_metrics_sorts_by_step_and_skips_blank_and_torn_lines(tmp_path):
    rows = [
        {"step": 0, "eval/strict_acc": 0.1},
        {"step": 2, "reward": 0.5},
        {"step": 1, "reward": 0.2},
        {"step": 2, "eval/strict_acc": 0.4},
        {"config": "no step"},
    ]
    # blank lines in the middle, and the last line torn by a kill in the middle of a write
    run = write_run(
        tmp_path / "a", rows[:2], "\n  \n" + "".join(json.dumps(r) + "\n" for r in rows[2:]) + '{"step": 3, "rew'
    )
    got = read_metrics(run)
    assert [r["step"] for r in got] == [0, 1, 2, 2]
    assert series(got, "reward") == ([1, 2], [0.2, 0.5])
    assert series(got, "eval/strict_acc") == ([0, 2], [0.1, 0.4])
    assert read_metrics(run + "/metrics.jsonl") == got  # the file itself, or its run dir
    with pytest.raises(ValueError, match="out-dir"):
        read_metrics(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics rows"):
        read_metrics(str(tmp_path / "empty"))


def test_series_leaves_out_null_values():
    rows = [{"step": 0, "kl": 0.5}, {"step": 1, "kl": None}, {"step": 2}, {"step": 3, "kl": 2}]
    assert series(rows, "kl") == ([0, 3], [0.5, 2])


def test_plot_draws_the_running_mean_and_the_eval_points(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    a = write_run(
        tmp_path / "a",
        [{"step": s, "reward": r} for s, r in enumerate([0.0, 1.0, 0.5, 0.5, 2.0])]
        + [{"step": 0, "eval/strict_acc": 0.25}, {"step": 4, "eval/strict_acc": 0.75}],
    )
    b = write_run(tmp_path / "b", [{"step": s, "reward": r} for s, r in enumerate([1.0, 3.0])])
    out = tmp_path / "curves.png"
    monkeypatch.setattr(sys, "argv", ["eval.py", "--plot", a, b, "--smooth", "2", "--out", str(out)])
    ev.main()
    fig = plt.gcf()
    train_ax, eval_ax = fig.axes
    (la, lb), (ea,) = train_ax.get_lines(), eval_ax.get_lines()  # run b logged no evals: no points
    assert list(la.get_xdata()) == [0, 1, 2, 3, 4] and list(la.get_ydata()) == [0.0, 0.5, 0.75, 0.5, 1.25]
    assert list(lb.get_xdata()) == [0, 1] and list(lb.get_ydata()) == [1.0, 2.0]
    assert list(ea.get_xdata()) == [0, 4] and list(ea.get_ydata()) == [0.25, 0.75]
    assert [t.get_text() for t in train_ax.get_legend().get_texts()] == ["a", "b"]  # labels: the run dirs
    plt.close("all")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == f"wrote {out}"
