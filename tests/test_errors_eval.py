"""eval.py's and plot.py's failure paths, through their real entry points: one line, never a traceback,
and no temp file left behind. A usage mistake is argparse's `prog: error: ...` and exit 2, before anything
loads; a failure on the way is one `error: ...` line and exit 1; Ctrl-C is one line and exit 130."""

import errno
import json
import os
import re
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import EVAL, REPO, run_script, subprocess_env  # noqa: E402

import models  # noqa: E402
import plot  # noqa: E402
import rollout  # noqa: E402


def eval_args(model_dir, *extra):
    return ["--task", "toy", "--model", model_dir, "--limit", 2, "--max-new-tokens", 4, "--device", "cpu",
            "--dtype", "float32", *extra]


def one_line_error(call, capsys):
    """call() expecting a user error -> (exit code, the last stderr line); never a traceback."""
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as e:
            call()
    except KeyboardInterrupt:  # uncaught, it would end the whole pytest session
        pytest.fail("Ctrl-C escaped as a KeyboardInterrupt (a traceback), not a one-line exit")
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if isinstance(e.value.code, str):  # sys.exit("error: ..."): Python prints it, exit status 1
        return 1, e.value.code
    return e.value.code, err.strip().splitlines()[-1]


def leftovers(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def no_model_load(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(models, "load_model", forbidden)
    monkeypatch.setattr(models, "load_tokenizer", forbidden)

# -----------------------------------------------------------------------------
# eval.py


def test_eval_out_is_an_existing_directory(model_dir, tmp_path, capsys, no_model_load):
    code, line = one_line_error(lambda: run_script(EVAL, eval_args(model_dir, "--out", tmp_path)), capsys)
    assert code == 2
    assert line == (f"eval.py: error: --out {tmp_path} is a directory; pass a file path such as "
                    f"{tmp_path}/predictions.jsonl")
    assert leftovers(tmp_path) == []


def test_eval_ctrl_c_is_one_line_exit_130_and_writes_nothing(model_dir, tmp_path, capsys, monkeypatch):
    calls = []

    def interrupted(*a, **k):  # Ctrl-C in the middle of the evaluation's first batch
        calls.append(1)
        raise KeyboardInterrupt
    monkeypatch.setattr(rollout, "sample", interrupted)  # eval.py, run afresh by runpy, imports it from here
    out = tmp_path / "preds.jsonl"
    code, line = one_line_error(lambda: run_script(EVAL, eval_args(model_dir, "--out", out)), capsys)
    assert calls == [1] and code == 130
    assert line == "error: interrupted; no predictions written"
    assert leftovers(tmp_path) == []


def fail_in_sample(monkeypatch):
    def raise_(*a, **k):
        raise RuntimeError("a bug, not a user mistake")
    monkeypatch.setattr(rollout, "sample", raise_)


def fail_while_writing(error):
    def patch(monkeypatch):  # the first prediction line reaches the temp file, then `error`
        real = json.dumps

        def dumps(obj, *a, **k):
            if isinstance(obj, dict) and "question" in obj and dumps.lines:
                raise error
            dumps.lines += isinstance(obj, dict) and "question" in obj
            return real(obj, *a, **k)
        dumps.lines = 0
        monkeypatch.setattr(json, "dumps", dumps)
    return patch


def fail_at_rename(monkeypatch):  # the temp file is whole; renaming it into place fails (a full disk)
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("preds.jsonl"):
            raise OSError(errno.ENOSPC, "No space left")
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("patch, code, message", [
    (fail_in_sample, None, None),
    (fail_while_writing(KeyboardInterrupt()), 130, "error: interrupted; no predictions written"),
    (fail_while_writing(OSError(errno.ENOSPC, "No space left on device")), 1,
     "error: could not write the predictions to {out} (No space left on device)"),
    (fail_at_rename, 1, "error: could not write the predictions to {out} (No space left)"),
], ids=["bug-in-sampling", "ctrl-c-while-writing", "disk-full-while-writing", "disk-full-at-rename"])
def test_eval_leaves_no_temp_file_on_any_failure(model_dir, tmp_path, capsys, monkeypatch, patch, code, message):
    out = tmp_path / "sub" / "preds.jsonl"
    patch(monkeypatch)
    if code is None:  # a bug is a traceback (not ours to hide), but still leaves nothing behind
        with pytest.raises(RuntimeError, match="a bug"):
            run_script(EVAL, eval_args(model_dir, "--out", out))
    else:
        got = one_line_error(lambda: run_script(EVAL, eval_args(model_dir, "--out", out)), capsys)
        assert got == (code, message.format(out=out))
    assert leftovers(tmp_path) == []  # no preds.jsonl, no preds.jsonl.tmp


@pytest.mark.parametrize("what", ["missing", "corrupt"])
def test_eval_bad_checkpoint_leaves_nothing(tmp_path, capsys, what):
    if what == "corrupt":
        (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    path = tmp_path / "missing" if what == "missing" else tmp_path
    code, line = one_line_error(lambda: run_script(EVAL, ["--task", "toy", "--ckpt", path, "--device", "cpu"]),
                                capsys)
    assert code == 2 and line.startswith("eval.py: error: ")
    assert leftovers(tmp_path) == (["ckpt.pt"] if what == "corrupt" else [])


@pytest.mark.slow
def test_eval_real_sigint_in_a_fresh_process(model_dir, tmp_path):
    out = tmp_path / "preds.jsonl"
    argv = ["--task", "arith", "--model", model_dir, "--n", 4, "--max-new-tokens", 64, "--device", "cpu",
            "--dtype", "float32", "--out", out]  # 200 problems, a minute of work: it cannot finish first
    proc = subprocess.Popen([sys.executable, EVAL, *map(str, argv)], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        err = b""
        while not re.search(rb"eval: .* [1-9]\d*/200 ", err):  # the bar has moved: inside the evaluation
            chunk = os.read(proc.stderr.fileno(), 4096)
            if not chunk:
                break
            err += chunk
        assert re.search(rb"eval: .* [1-9]\d*/200 ", err), err.decode()
        proc.send_signal(signal.SIGINT)
        err += proc.stderr.read()
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert "Traceback" not in err.decode()
    assert err.decode().strip().splitlines()[-1] == "error: interrupted; no predictions written"
    assert leftovers(tmp_path) == []

# -----------------------------------------------------------------------------
# plot.py


def write_run(path, rows, tail=""):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return str(path)


ROWS = [{"step": 0, "reward": 0.1, "kl": 0.0}, {"step": 1, "reward": 0.3, "kl": 0.01},
        {"step": 1, "eval/strict_acc": 0.2}]


def run_plot(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["plot.py", *map(str, argv)])
    plot.main()


@pytest.mark.parametrize("smooth", [0, -2])
def test_plot_smooth_below_one(tmp_path, monkeypatch, capsys, smooth):
    run = write_run(tmp_path / "a", ROWS)
    code, line = one_line_error(lambda: run_plot(monkeypatch, run, "--smooth", smooth, "--out", tmp_path / "c.png"),
                                capsys)
    assert (code, line) == (2, f"plot.py: error: --smooth must be >= 1 (steps in the running mean; 1 = raw), "
                               f"got {smooth}")
    assert not (tmp_path / "c.png").exists()


def test_plot_out_with_a_format_matplotlib_cannot_write(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "a", ROWS)
    code, line = one_line_error(lambda: run_plot(monkeypatch, run, "--out", tmp_path / "c.xyz"), capsys)
    assert code == 2 and line.startswith(f"plot.py: error: --out {tmp_path}/c.xyz: matplotlib writes only ")
    assert {".png", ".pdf", ".svg"} <= set(line.split("only ")[1].split())
    assert leftovers(tmp_path) == ["a/metrics.jsonl"]


def test_plot_out_into_a_missing_folder_creates_it(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    out = tmp_path / "new" / "deeper" / "c.pdf"
    run_plot(monkeypatch, write_run(tmp_path / "a", ROWS), "--out", out)
    assert out.read_bytes()[:5] == b"%PDF-"


@pytest.mark.parametrize("flag", ["--key", "--eval-key"])
def test_plot_a_key_no_run_has_names_the_keys_they_have(tmp_path, monkeypatch, capsys, flag):
    pytest.importorskip("matplotlib")
    a, b = write_run(tmp_path / "a", ROWS), write_run(tmp_path / "b", [{"step": 0, "reward/correct": 1.0}])
    code, line = one_line_error(lambda: run_plot(monkeypatch, a, b, flag, "rewrd", "--out", tmp_path / "c.png"),
                                capsys)
    assert (code, line) == (1, f"error: {flag} rewrd: no run logged it; the runs have eval/strict_acc, kl, reward, "
                               "reward/correct")
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize("content", ["", "\n\n", '{"step": 0, "rew'], ids=["empty", "blank", "torn-only"])
def test_plot_a_run_without_rows(tmp_path, monkeypatch, capsys, content):
    pytest.importorskip("matplotlib")
    a, b = write_run(tmp_path / "a", ROWS), write_run(tmp_path / "b", [], content)
    code, line = one_line_error(lambda: run_plot(monkeypatch, a, b, "--out", tmp_path / "c.png"), capsys)
    assert (code, line) == (1, f"error: {b}/metrics.jsonl has no metrics rows (empty, or the run has not logged a "
                               "step); nothing plotted")
    assert not (tmp_path / "c.png").exists()


def test_plot_rows_that_never_hold_the_key(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "a", [{"step": 0, "reward": None}, {"step": 1, "kl": 0.5}])  # null: non-finite
    code, line = one_line_error(lambda: run_plot(monkeypatch, run, "--out", tmp_path / "c.png"), capsys)
    assert (code, line) == (1, "error: --key reward: no run logged it; the runs have kl")
    assert not (tmp_path / "c.png").exists()


def test_plot_reads_a_torn_last_line_and_blank_lines(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "a", ROWS[:1], "\n\n" + json.dumps(ROWS[1]) + "\n" + '{"step": 2, "reward": 0.')
    run_plot(monkeypatch, run, "--out", tmp_path / "c.png")
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'c.png'}"
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    run = write_run(tmp_path / "a", ROWS)
    code, line = one_line_error(lambda: run_plot(monkeypatch, run, "--out", tmp_path / "c.png"), capsys)
    assert (code, line) == (1, "error: plotting needs matplotlib: pip install matplotlib")
