"""Paths and outputs belong to the user, on every entry point (train.py, eval.py and its --plot):
a path is expanded (~, $VARS), in config files too; what a tool writes by default replaces nothing; a path that
must exist is checked before anything is created; two inputs of one base name stay apart; integer flags are
range-checked; a flag with no effect in the combination given is named or refused, in one line each."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import EVAL, TRAIN, error_of, read_metrics, run_script, train_args  # noqa: E402

import run  # noqa: E402

PLOT = EVAL  # eval.py --plot draws the curves


def tree(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, names in os.walk(root) for n in dirs + names)


@pytest.fixture
def a_run(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs") / "seed0")
    run_script(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=1))
    return out


def write_metrics(path, rewards):
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": i + 1, "reward": r}) + "\n" for i, r in enumerate(rewards))
    return path


# -----------------------------------------------------------------------------
# ~ and $VARS


def test_train_expands_user_paths_on_the_command_line_and_in_config_files(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    os.makedirs(tmp_path / "home")
    (tmp_path / "home" / "base.py").write_text('out_dir = "$RUNS/from_config"\n')
    argv = [a for a in train_args(model_dir, "unused", steps=1)]
    argv[argv.index("--out-dir") : argv.index("--out-dir") + 2] = []
    run_script(TRAIN, argv + ["--config", "~/base.py"])  # the config file by ~, its out_dir by $RUNS
    assert os.path.isfile(tmp_path / "runs" / "from_config" / "run.json")
    run_script(TRAIN, argv + ["--out-dir", "~/flag"])
    assert os.path.isfile(tmp_path / "home" / "flag" / "run.json")
    config = json.load(open(tmp_path / "home" / "flag" / "run.json"))
    assert config["out_dir"] == str(tmp_path / "home" / "flag")  # recorded expanded: a resume finds it


def test_eval_expands_user_paths(a_run, tmp_path, monkeypatch):
    """--ckpt $RUN and --out ~/...: fails if eval.py takes either literally. Needs no optional library (the plot's
    half, which needs matplotlib, is the next test: this one once skipped after running half)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUN", a_run)
    run_script(
        EVAL, ["--ckpt", "$RUN", "--task", "toy", "--limit", 2, "--max-new-tokens", 4, "--out", "~/preds/p.jsonl"]
    )
    assert len(open(tmp_path / "preds" / "p.jsonl").readlines()) == 2


def test_plot_expands_user_paths(a_run, tmp_path, monkeypatch):
    """--plot $RUN and --out ~/...: fails if eval.py --plot takes either literally."""
    pytest.importorskip("matplotlib", reason="pip install -r requirements-extra.txt")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUN", a_run)
    run_script(PLOT, ["--plot", "$RUN", "--out", "~/plots/c.png"])
    assert os.path.getsize(tmp_path / "plots" / "c.png") > 0


# -----------------------------------------------------------------------------
# what a tool writes by default replaces nothing


def test_eval_default_output_takes_a_fresh_name(a_run, tmp_path, monkeypatch):
    beside = os.path.join(a_run, "predictions_toy_test.jsonl")
    open(beside, "w").write("mine\n")  # a file the user keeps there
    argv = ["--ckpt", a_run, "--task", "toy", "--limit", 2, "--max-new-tokens", 4]
    run_script(EVAL, argv)
    run_script(EVAL, argv)
    assert open(beside).read() == "mine\n"
    fresh = [os.path.join(a_run, f"predictions_toy_test-{i}.jsonl") for i in (1, 2)]
    assert [len(open(f).readlines()) for f in fresh] == [2, 2]


def test_plot_default_output_takes_a_fresh_name(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="pip install -r requirements-extra.txt")
    monkeypatch.chdir(tmp_path)
    run = write_metrics(str(tmp_path / "a"), [0.1, 0.2])
    (tmp_path / "curves.png").write_bytes(b"a picture the user keeps")
    run_script(PLOT, ["--plot", run])
    assert (tmp_path / "curves.png").read_bytes() == b"a picture the user keeps"
    assert (tmp_path / "curves-1.png").read_bytes().startswith(b"\x89PNG")


def test_train_default_out_dir_never_replaces_what_it_did_not_write(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.makedirs("out/run")
    open("out/run/notes.txt", "w").write("mine")
    argv = [a for a in train_args(model_dir, "x", steps=1)]
    argv[argv.index("--out-dir") : argv.index("--out-dir") + 2] = []  # the default, out/run
    code, line = error_of(TRAIN, argv, capsys)
    assert code == 2 and "holds files that are not a run's (notes.txt)" in line, line
    code, line = error_of(TRAIN, argv + ["--overwrite"], capsys)  # not even with --overwrite
    assert code == 2 and open("out/run/notes.txt").read() == "mine" and tree("out") == ["run", "run/notes.txt"]


@pytest.mark.parametrize("count", [2, 3, 5])
def test_a_foreign_folder_is_refused_naming_at_most_three_of_its_files(tmp_path, count):
    """run.claim on a folder of files no run wrote: the line names the folder and its first three files (sorted),
    then ", ..." only when there are more, and says to pass a new or empty directory; nothing in it is touched.
    Fails if the listing names every file (a line as long as the folder), drops the ellipsis, or shows it for
    three or fewer."""
    names = [f"user{i}.txt" for i in range(count)]
    for name in names:
        (tmp_path / name).write_text("mine")
    line = run.claim(str(tmp_path), resume=False, overwrite=True)
    assert str(tmp_path) in line and "new or empty directory" in line, line
    shown = ", ".join(names[:3])
    if count > 3:
        shown += ", ..."
    assert f"({shown})" in line, line
    assert not any(name in line for name in names[3:]), line
    assert sorted(os.listdir(tmp_path)) == names and not run.HELD  # refused before taking the lock


# -----------------------------------------------------------------------------
# a path that must exist is checked before anything is created


def test_a_missing_input_creates_nothing(model_dir, tmp_path, capsys, monkeypatch):
    """Run from inside tmp_path, so a write into the working directory shows in its tree too. Fails if a script
    makes its --out-dir / --out folder, or any file, before it checks that its inputs exist."""
    monkeypatch.chdir(tmp_path)
    new = tmp_path / "new"
    code, line = error_of(
        TRAIN,
        train_args(model_dir, str(new / "run"), "--task", "gsm8k", "--data-dir", str(tmp_path / "no_data"), steps=1),
        capsys,
    )
    assert code == 2 and "GSM8K file not found" in line, line
    code, line = error_of(TRAIN, train_args(str(tmp_path / "no_model"), str(new / "run"), steps=1), capsys)
    assert code == 2 and "could not load model" in line, line
    code, line = error_of(
        EVAL, ["--ckpt", str(tmp_path / "no_run"), "--task", "toy", "--out", str(new / "p.jsonl")], capsys
    )
    assert code == 2 and "no checkpoint at" in line, line
    code, line = error_of(PLOT, ["--plot", str(tmp_path / "no_run"), "--out", str(new / "c.png")], capsys)
    assert code == 1 and "no metrics.jsonl" in line, line
    assert tree(tmp_path) == []


# -----------------------------------------------------------------------------
# two inputs with the same base name stay apart


def test_plot_keeps_runs_of_one_name_apart_and_refuses_one_run_twice(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason="pip install -r requirements-extra.txt")
    from matplotlib.axes import Axes

    a = write_metrics(str(tmp_path / "a" / "seed0"), [0.1, 0.2])
    b = write_metrics(str(tmp_path / "b" / "seed0"), [0.5, 0.6])
    labels, real = [], Axes.plot

    def plot(self, *args, **kw):
        labels.append(kw.get("label"))
        return real(self, *args, **kw)

    monkeypatch.setattr(Axes, "plot", plot)
    run_script(PLOT, ["--plot", a, b, "--out", str(tmp_path / "c.png")])
    assert labels == [a, b]  # both curves, each named by its whole path
    code, line = error_of(PLOT, ["--plot", a, a + "/", "--out", str(tmp_path / "d.png")], capsys)
    assert code == 2 and "is given twice" in line and not (tmp_path / "d.png").exists(), line


def test_eval_keeps_two_models_of_one_name_apart(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for d in ("a", "b"):
        os.makedirs(f"{d}/model")
        for name in os.listdir(model_dir):
            os.symlink(os.path.join(model_dir, name), f"{d}/model/{name}")
    for d in ("a", "b"):
        run_script(EVAL, ["--model", f"{d}/model", "--task", "toy", "--limit", 1, "--max-new-tokens", 4])
    assert sorted(f for f in os.listdir() if f.startswith("predictions")) == [
        "predictions-1.jsonl",
        "predictions.jsonl",
    ]


# -----------------------------------------------------------------------------
# integer flags: the range the code below them takes


@pytest.mark.parametrize("script", ["train", "eval"])
def test_a_seed_beyond_what_torch_takes_is_one_line(model_dir, tmp_path, capsys, monkeypatch, script):
    """Refused in one line before anything is written. Run from inside tmp_path: eval.py's default output is
    ./predictions.jsonl, so a write into the working directory shows in its tree. Fails if the seed is checked
    after a script writes (eval's --out probe, train's out dir) or is left to torch (a traceback)."""
    monkeypatch.chdir(tmp_path)
    seed = 2**64  # torch.Generator.manual_seed overflows past 2**64 - 1; the runs add step and rank to it
    if script == "train":
        code, line = error_of(TRAIN, train_args(model_dir, str(tmp_path / "run"), "--seed", seed), capsys)
    else:
        code, line = error_of(EVAL, ["--model", model_dir, "--task", "toy", "--seed", seed], capsys)
    assert code == 2 and "--seed must be [0, 9e18]" in line, line
    assert tree(tmp_path) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n", 0], "--n must be >= 1"),
        (["--batch-size", 0], "--batch-size must be >= 1"),
        (["--limit", -1], "--limit must be >= 1"),
        (["--max-new-tokens", 0], "--max-new-tokens must be >= 1"),
    ],
)
def test_eval_integer_ranges(model_dir, capsys, argv, message):
    code, line = error_of(EVAL, ["--model", model_dir, "--task", "toy", *argv], capsys)
    assert code == 2 and message in line, line


# -----------------------------------------------------------------------------
# a flag with no effect in the combination given


@pytest.mark.parametrize(
    "extra, note",
    [
        (["--eval-every", 1], "note: eval_every has no effect in this run (--eval-n 0)"),
        (["--is-mode", "none", "--config", "is_cap=3"], "note: is_cap has no effect in this run (--is-mode none)"),
        (
            ["--beta", 0, "--kl-estimator", "k1"],
            "note: kl_estimator has no effect in this run (--beta 0: no reference)",
        ),
        (["--is-mode", "none", "--config", "is_cap=3.0"], "note: is_cap has no effect in this run (--is-mode none)"),
        (["--config", "cispo_cap=3"], "note: cispo_cap has no effect in this run (not --loss-type cispo)"),
    ],
)
def test_train_names_a_value_that_changes_nothing(model_dir, tmp_path, capsys, extra, note):
    capsys.readouterr()
    run_script(TRAIN, train_args(model_dir, str(tmp_path), *extra, steps=1))
    assert note in capsys.readouterr().out.splitlines()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]


def test_train_names_nothing_for_the_defaults(model_dir, tmp_path, capsys):
    capsys.readouterr()
    run_script(TRAIN, train_args(model_dir, str(tmp_path), steps=1))
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]


@pytest.mark.parametrize("script", ["train", "eval"])
def test_a_data_dir_for_a_task_that_reads_none_is_refused(model_dir, tmp_path, capsys, monkeypatch, script):
    """Refused in one line before anything is written, run from inside tmp_path (eval.py's default output is
    ./predictions.jsonl). Fails if --data-dir is ignored for arith, or checked after a script writes."""
    monkeypatch.chdir(tmp_path)
    if script == "train":
        argv = train_args(model_dir, str(tmp_path / "run"), "--task", "arith", "--data-dir", str(tmp_path))
    else:
        argv = ["--model", model_dir, "--task", "arith", "--data-dir", str(tmp_path)]
    code, line = error_of(TRAIN if script == "train" else EVAL, argv, capsys)
    assert code == 2 and "this task generates its problems and reads no data" in line, line
    assert tree(tmp_path) == []


def test_eval_names_or_refuses_what_has_no_effect(model_dir, a_run, tmp_path, capsys):
    capsys.readouterr()
    run_script(
        EVAL,
        [
            "--model",
            model_dir,
            "--task",
            "toy",
            "--limit",
            1,
            "--max-new-tokens",
            4,
            "--temperature",
            0.5,
            "--out",
            str(tmp_path / "p.jsonl"),
        ],
    )
    assert "note: --temperature has no effect with --n 1 (greedy); pass --n > 1 to sample" in capsys.readouterr().out
    code, line = error_of(EVAL, ["--ckpt", a_run, "--adapter"], capsys)
    assert code == 2 and "--adapter writes a LoRA run's adapters with --export DIR" in line, line
    code, line = error_of(EVAL, ["--ckpt", a_run, "--export", str(tmp_path / "hf"), "--n", 4], capsys)
    assert code == 2 and "it does not evaluate: drop --n" in line and not (tmp_path / "hf").exists(), line
