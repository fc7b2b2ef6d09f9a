"""A checkpoint cannot run code, and a run ends in one line however it is stopped.

Planted files hold a pickled call of os.system touching a marker file: each test looks for that file after the loader
refused the checkpoint, then unpickles the same file the unsafe way (`fires`) and sees the marker appear, so its
absence before proved the loader ran nothing, not that the payload was dead. Interruptions are real signals to this
process, delivered while train.py / eval.py are in each phase of their start (tests/toy.py's `fail`).
"""

import os
import pickle
import signal
import subprocess
import sys
import zipfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy  # noqa: E402
from toy import EVAL, TRAIN, error_of, read_metrics, run_script, train_args  # noqa: E402

import gsm8k  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
import run  # noqa: E402


class Payload:
    """Unpickling it runs a shell command that creates `path`: what a shared checkpoint could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def fires(path, marker):
    """Unpickle `path` as a loader without weights_only would (torch.load's zip format, or a bare pickle) and
    return whether the payload ran: the marker it creates must not exist before."""
    assert not marker.exists()
    if zipfile.is_zipfile(path):
        torch.load(path, weights_only=False)
    else:
        with open(path, "rb") as f:
            pickle.load(f)
    return marker.exists()


def plant(ckpt_path, marker, how):
    os.makedirs(os.path.dirname(ckpt_path), exist_ok=True)
    state = {"config": {"model": "x", "task": "toy"}, "step": 1, "model": Payload(marker)}
    if how == "torch.save":  # the zip format train.py writes
        torch.save(state, ckpt_path)
    else:  # a bare pickle, the legacy format torch.load also reads
        with open(ckpt_path, "wb") as f:
            pickle.dump(state, f, protocol=2)


# -----------------------------------------------------------------------------
# checkpoints: weights only


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
@pytest.mark.parametrize("entry", ["train --resume", "eval --ckpt"])
def test_a_planted_checkpoint_runs_nothing_and_is_one_line(model_dir, tmp_path, capsys, how, entry):
    """train.py --resume and eval.py --ckpt refuse a checkpoint holding a live payload, in one line. Fails if
    run.load_checkpoint reads it with torch.load(weights_only=False) (the marker appears) or lets the
    UnpicklingError through (a traceback)."""
    marker, ckpt = tmp_path / "ran", str(tmp_path / "shared" / "ckpt.pt")
    plant(ckpt, marker, how)
    if entry == "train --resume":
        code, line = error_of(TRAIN, ["--resume", os.path.dirname(ckpt)], capsys)
    else:
        code, line = error_of(EVAL, ["--ckpt", ckpt, "--task", "arith"], capsys)
    assert not marker.exists()  # the payload never ran
    assert code == 2 and ckpt in line and "nothing in it ran" in line, line
    if how == "pickle":  # protocol 2 names its globals: the line says what the file held
        assert "posix.system" in line or "nt.system" in line, line
    assert fires(ckpt, marker)  # the payload is live: unpickled unsafely, it runs


def test_a_checkpoint_train_py_wrote_loads_with_weights_only(model_dir, tmp_path):
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=1))
    path, ckpt = run.load_checkpoint(out)  # weights_only=True inside
    assert path == os.path.join(out, "ckpt.pt") and ckpt["step"] == 1
    # everything in it is a tensor, a number, a string or a plain container (what weights_only allows)
    plain = (torch.Tensor, int, float, str, bool, type(None))

    def walk(x):
        if isinstance(x, dict):
            return all(isinstance(k, (str, int)) and walk(v) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return all(walk(v) for v in x)
        return isinstance(x, plain)

    assert walk(ckpt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the test's own one-process save
def test_a_planted_dcp_folder_runs_nothing(model_dir, tmp_path, capsys):
    """An --fsdp run's checkpoint names a DCP folder beside it; DCP unpickles that folder's .metadata itself:
    a planted one is refused before DCP reads it (eval.py --ckpt; train.py --resume reads it the same way). Needs
    no optional library. Fails if scale.load_dcp leaves .metadata to DCP's own pickle.load (the marker appears)."""
    import torch.distributed.checkpoint as dcp

    marker, folder = tmp_path / "ran", tmp_path / "run"
    model = models.load_model(model_dir, torch.device("cpu"))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder / "dcp-000001"), no_dist=True)
    with open(folder / "dcp-000001" / ".metadata", "wb") as f:  # DCP's own file, replaced by a payload
        pickle.dump(Payload(marker), f)
    torch.save(
        {"config": {"model": model_dir, "task": "toy", "seed": 0}, "step": 1, "dcp": "dcp-000001"}, folder / "ckpt.pt"
    )
    code, line = error_of(EVAL, ["--ckpt", str(folder), "--task", "arith"], capsys)
    assert not marker.exists()
    assert code == 2 and "dcp-000001 is not a DCP checkpoint train.py wrote" in line and "system" in line, line
    assert fires(folder / "dcp-000001" / ".metadata", marker)  # the payload is live: unpickled unsafely, it runs
    # a name that leaves the run's folder is refused too
    torch.save({"config": {"model": model_dir}, "step": 1, "dcp": "../elsewhere"}, folder / "ckpt.pt")
    code, line = error_of(EVAL, ["--ckpt", str(folder), "--task", "arith"], capsys)
    assert code == 2 and "is not a train.py checkpoint" in line, line


def test_a_model_folder_with_a_pickled_payload_runs_nothing(model_dir, tmp_path, capsys):
    """--model DIR with a pytorch_model.bin: transformers reads it with weights_only, so nothing runs. Fails if the
    model loads with torch.load(weights_only=False) (the marker appears)."""
    marker, folder = tmp_path / "ran", tmp_path / "model"
    folder.mkdir()
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(model_dir, name), folder / name)
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    code, line = error_of(TRAIN, train_args(str(folder), str(tmp_path / "out"), steps=1), capsys)
    assert not marker.exists() and code == 2 and "could not load model" in line, line
    assert fires(folder / "pytorch_model.bin", marker)  # the payload is live: unpickled unsafely, it runs


@pytest.mark.parametrize("state", [{"model": {}}, {"step": 1}, {"config": {"model": "x"}}, [1, 2]])
def test_a_file_without_config_and_step_is_not_a_checkpoint(tmp_path, state):
    """A file torch.load reads (weights only) but that lacks train.py's `config` and `step` is refused in one line
    naming it. Fails if run.load_checkpoint returns it (a later KeyError, or a model loaded from nothing) or accepts
    a file with only one of the two keys."""
    path = str(tmp_path / "ckpt.pt")
    assert run.save(state, path) is None  # the format train.py writes
    with pytest.raises(ValueError) as e:
        run.load_checkpoint(str(tmp_path))  # the run dir, as --resume and --ckpt pass it
    assert path in str(e.value) and "not a train.py checkpoint" in str(e.value) and "\n" not in str(e.value)


def test_the_line_after_an_interrupt_says_how_to_go_on(tmp_path):
    """What Ctrl-C prints (run.last_checkpoint): no checkpoint -> the same command again with --overwrite (a command
    of its own would drop the run's other flags); one before the last step -> --resume; one at the last step ->
    export it with eval.py. Fails if the branch for a finished run is dropped or its test is off by one (a finished
    run told to resume, which trains nothing), or if the first hint spells out a command that loses the flags."""
    out = str(tmp_path)
    line = run.last_checkpoint(out, 3)
    assert out in line and "the same command with --overwrite" in line and "python train.py" not in line, line
    assert run.save({"config": {}, "step": 3}, os.path.join(out, "ckpt.pt")) is None
    for steps in (4, 10):
        line = run.last_checkpoint(out, steps)
        assert "(step 3)" in line and f"python train.py --resume {out}" in line and "--export" not in line, line
    line = run.last_checkpoint(out, 3)
    assert os.path.join(out, "ckpt.pt") in line and "(step 3)" in line, line
    assert f"python eval.py --ckpt {out} --export DIR" in line and "--resume" not in line, line


# -----------------------------------------------------------------------------
# interruptions at any moment of a start, and what a kill leaves


def deliver(sig):
    """A stand-in for one phase of the start that receives `sig` while it runs."""

    def phase(*a, **k):
        toy.fail(sig)

    return phase


PHASES = {  # where the signal arrives: module, function
    "model loading": (models, "load_model"),
    "GSM8K download": (gsm8k.urllib.request, "urlopen"),
    "start-up probe": (rollout, "sharing_problem"),
    "checkpoint restore": (run, "restore"),
}


@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_signal_in_any_phase_of_the_start_is_one_line(model_dir, tmp_path, capsys, monkeypatch, phase, sig):
    out = str(tmp_path / "run")
    argv = train_args(model_dir, out, "--config", "save_every=1", steps=1)
    if phase == "checkpoint restore":  # a run to resume from
        run_script(TRAIN, argv)
        argv = ["--resume", out, "--steps", 2]
    if phase == "GSM8K download":  # an empty cache: the download starts
        monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("GSM8K_DIR", raising=False)
        argv = train_args(model_dir, out, steps=1) + ["--task", "gsm8k"]
    monkeypatch.setattr(*PHASES[phase], deliver(sig))
    code, line = error_of(TRAIN, argv, capsys)
    assert code == 128 + sig and line.startswith("error: interrupted; "), (code, line)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")] if os.path.isdir(out) else True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_signal_while_eval_loads_its_model_is_one_line(model_dir, tmp_path, capsys, monkeypatch, sig):
    monkeypatch.setattr(models, "load_model", deliver(sig))
    monkeypatch.setattr(models, "load_tokenizer", deliver(sig))
    out = tmp_path / "preds" / "p.jsonl"
    code, line = error_of(EVAL, ["--model", model_dir, "--task", "arith", "--out", str(out)], capsys)
    assert (code, line) == (128 + sig, "error: interrupted; no predictions written")
    assert not (tmp_path / "preds").exists()  # the output's folder is made once the model is there


def test_a_kill_mid_export_leaves_nothing_the_next_start_keeps(model_dir, tmp_path):
    """What a kill during an export leaves (its temp folder, hf.old, a temp checkpoint) is the run's own:
    the next start removes it; a user's file stays."""
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=1))
    for folder in ("hf.old", ".hf.abc123", "dcp-000002.tmp"):
        os.makedirs(os.path.join(out, folder))
    for name in ("ckpt.pt.tmp", "run.json.tmp", "metrics.jsonl.tmp", "notes.tmp"):  # notes.tmp: not a run's name
        open(os.path.join(out, name), "w").close()
    run_script(TRAIN, ["--resume", out, "--steps", 2])
    assert sorted(f for f in os.listdir(out) if f.endswith((".tmp", ".old")) or f.startswith(".hf.")) == ["notes.tmp"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "resume"])
def test_the_next_claim_removes_an_export_s_leftover_hf_old(tmp_path, overwrite):
    """An export killed between its two renames leaves OUT_DIR/hf.old (the previous export): the next train.py
    --overwrite or --resume claims the folder and removes it, with what a kill leaves (.hf.*, *.tmp); a user's
    file stays. Fails if run._own does not count hf.old as a run's (it stays, beside the new hf/, forever)."""
    out = str(tmp_path / "run")
    for folder in ("hf.old", ".hf.abc123"):
        os.makedirs(os.path.join(out, folder))
        open(os.path.join(out, folder, "model.safetensors"), "w").close()
    for name in ("run.json", "ckpt.pt.tmp", "notes.txt"):
        open(os.path.join(out, name), "w").close()
    try:
        assert run.claim(out, resume=not overwrite, overwrite=overwrite) is None
    finally:
        while run.HELD:  # the lock claim took
            run.HELD.pop().close()
    kept = {".lock", "notes.txt"} | ({"run.json"} if not overwrite else set())  # --resume keeps the run's files
    assert set(os.listdir(out)) == kept


@pytest.mark.slow
def test_sigterm_during_model_loading_in_a_real_process(model_dir, tmp_path):
    """The same as a user sees it: a fresh process killed while it loads; exit 143, one line, no traceback."""
    code = (
        "import os, signal, sys, runpy; sys.path[:0] = ['tests', '.']; import models, toy; "
        "real = models.load_model\n"
        "def load(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM); return real(*a, **k)\n"
        "models.load_model = load; from tasks import TASKS; TASKS['toy'] = toy.TASK\n"
        f"sys.argv = ['train.py'] + {list(map(str, train_args(model_dir, str(tmp_path / 'run'), steps=1)))}\n"
        "runpy.run_path('train.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=toy.REPO,
        env=toy.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: interrupted; no checkpoint was written")
