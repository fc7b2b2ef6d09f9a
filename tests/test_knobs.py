"""Every knob's declaration, walked: what --resume does with each of train.py's knobs (its resume class), that a
resume uses the values it accepts, every task's and environment's options checked, an environment state that is no
number mid-run, and a run whose reward weights are all 0. The walks are parametrized over the declarations
themselves (config.declared, train.py's parser), so a new knob or task option gets these checks for free."""

import inspect
import os
import re
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import config  # noqa: E402
import envs  # noqa: E402
import extra_tasks  # noqa: E402
import run  # noqa: E402
import tasks  # noqa: E402
import toy  # noqa: E402
from rewards import RewardError  # noqa: E402
from toy import EVAL, REPO, TRAIN, error_of, read_metrics, run_script, subprocess_env, train_args  # noqa: E402


class Parsed(Exception):
    """train.py's parser and its args, raised from inside its config.parse: nothing after it runs, no model loads."""


def train_parser(argv=()):
    """(train.py's ArgumentParser with .decls, the args of `train.py argv`), read by running train.py itself."""
    real, old_argv = config.parse, sys.argv

    def stop(p, load_checkpoint, argv=None):
        raise Parsed(p, real(p, load_checkpoint, argv)[0])

    config.parse, sys.argv = stop, ["train.py", *map(str, argv)]
    try:
        runpy.run_path(TRAIN, run_name="__main__")
    except Parsed as e:
        return e.args
    finally:
        config.parse, sys.argv = real, old_argv
    raise AssertionError("train.py ran past config.parse")


DECLS = train_parser()[0].decls  # collected at import: parametrize needs the names


def another(d, tmp_path):
    """A valid value of knob d other than its default; a path knob's: a real folder, named relative to the cwd."""
    if d.knob.path:
        folder = tmp_path / f"{d.name}_elsewhere"
        folder.mkdir()
        return os.path.relpath(folder)
    if d.kind is bool:
        return not d.default
    if d.kind is dict:
        return {"n": 5}
    if isinstance(d.knob.check, (dict, tuple)):
        return next(c for c in d.knob.check if c != d.default)
    if d.kind is str:
        return f"{d.default or 'some'}-other"
    base = 1 if d.default is None else d.default
    for v in (base + 1, base * 2, base / 2, 2, 0.5):
        if d.kind(v) != d.default and config.problem(d, d.kind(v), d.name) is None:
            return d.kind(v)
    raise AssertionError(f"no other valid value for {d.name}: teach another() its kind")


def given(d, value):  # the argv that sets knob d to value: a flag on the command line, else --config name=value
    if d.knob.flag and d.kind is bool and value:
        return [config.flag_name(d.name)]
    if d.knob.flag and d.kind is not bool:
        return [config.flag_name(d.name), str(value)]
    return ["--config", f"{d.name}={value!r}"]


def fake_run(tmp_path, **changed):
    """A run dir holding run.json and a ckpt.pt at step 1 whose config is every knob's default (a plain parse's
    vars(args), out_dir that dir) with `changed` -> (its path, that config)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text("{}")
    saved = {**vars(train_parser()[1]), "out_dir": os.path.realpath(run_dir), **changed}
    torch.save({"config": saved, "step": 1}, run_dir / "ckpt.pt")
    return str(run_dir), saved


def resume(run_dir, *argv):  # config.parse of `train.py --resume run_dir argv` on a fresh parser
    p, _ = train_parser()
    return config.parse(p, run.load_checkpoint, ["--resume", run_dir, *map(str, argv)])[0]


def test_the_runs_identity_is_fixed_and_a_calls_settings_never_saved():
    """What a resume must not change, pinned: the walks below take each knob's class from its declaration, so they
    would pass a declaration that let a resume change the seed. Fails if a knob that makes the run what it is (its
    model, task and data, seed, batch, LoRA, FSDP sharding, moving reference, out dir) is declared CHANGES or NEVER,
    or if overwrite or resume is saved as the run's."""
    identity = "task data_dir model task_options seed prompts_per_step lora_rank fsdp ref_sync_every out_dir"
    assert {k: DECLS[k].knob.resume for k in identity.split()} == dict.fromkeys(identity.split(), config.FIXED)
    assert {DECLS[k].knob.resume for k in ("overwrite", "resume")} == {config.NEVER}


# no --steps below: the saved 100 steps are past the checkpoint's step 1, so `steps` is walked as any other knob


@pytest.mark.parametrize("name", DECLS)
def test_a_resume_restores_each_knob_but_a_setting_of_one_call(name, tmp_path):
    """A resume without the knob: the run's value, saved as other than the default, is in args (NEVER: the default,
    or for --resume this call's own). Fails if a knob is dropped from what a resume restores, if overwrite or resume
    is restored from the checkpoint (a resume of a run started with --overwrite would be refused), or if a knob's
    resume class is none of config.FIXED, CHANGES, NEVER."""
    d = DECLS[name]
    assert d.knob.resume in (config.FIXED, config.CHANGES, config.NEVER), (name, d.knob.resume)
    value = config.absolute(another(d, tmp_path), d)
    run_dir, _ = fake_run(tmp_path, **{name: value})
    args = resume(run_dir)
    want = {config.NEVER: d.default, config.FIXED: value, config.CHANGES: value}[d.knob.resume]
    if name in ("resume", "out_dir"):  # this call's --resume; the run's own dir, wherever it moved, not the saved one
        want = os.path.realpath(run_dir)
    assert getattr(args, name) == want


@pytest.mark.parametrize("name", [k for k, d in DECLS.items() if d.knob.resume != config.NEVER])
def test_a_resume_given_another_value_uses_it_or_refuses_it_in_one_line(name, tmp_path, capsys):
    """A resume given another value: CHANGES -> that value in args (a path: absolute); FIXED -> exit code 2, one line
    naming the knob and both values. (NEVER is left out: its given value is this call's by construction, --resume,
    or refused beside --resume whatever it was, --overwrite.) Fails if parse stops refusing a FIXED knob's other
    value, or its line loses the knob or a value, if a CHANGES knob given on resume is refused or replaced by the
    checkpoint's (a flag's default set after the checkpoint's), or if a path knob is not made absolute."""
    d = DECLS[name]
    run_dir, saved = fake_run(tmp_path)
    value = another(d, tmp_path)
    new = config.absolute(value, d)
    if d.knob.resume == config.CHANGES:
        assert getattr(resume(run_dir, *given(d, value)), name) == new
        return
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        resume(run_dir, *given(d, value))
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert e.value.code == 2 and "Traceback" not in err
    assert re.search(rf"{config.flag_name(name)}\b|\b{name}\b", line), line
    assert repr(saved[name]) in line and repr(new) in line, line


# -----------------------------------------------------------------------------
# a resume uses what it accepts (the toy task, tests/toy.py)


@pytest.fixture(scope="module")
def run1(model_dir, tmp_path_factory):
    """1 fp32 step of the toy run, lr 1e-3, a 3-update warmup, the reference synced every step."""
    out = str(tmp_path_factory.mktemp("run1"))
    extra = ("--config", "warmup_steps=3", "--config", "ref_sync_every=1")
    run_script(TRAIN, train_args(model_dir, out, *extra, steps=1))
    return out


def copy_of(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return str(tmp_path / "run")


@pytest.mark.slow
def test_a_resume_trains_with_the_new_lr_and_weight_decay(run1, tmp_path):
    """Resumed with --lr 2e-3 and weight_decay=0.1: step 2 updates with 2e-3 x the warmup's 2/4, and the optimizer
    and scheduler saved after it hold the new values. Fails if the restored optimizer state's lr or weight decay (the
    old run's) wins over the ones given, or if the scheduler keeps the old base lr (the next step's lr 1e-3 x 3/4)."""
    out = copy_of(run1, tmp_path)
    run_script(TRAIN, ["--resume", out, "--steps", 2, "--lr", 2e-3, "--config", "weight_decay=0.1"])
    assert [r["lr"] for r in read_metrics(out)] == pytest.approx([1e-3 / 4, 2e-3 * 2 / 4])
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    group = ckpt["optimizer"]["param_groups"][0]
    assert ckpt["step"] == 2 and group["weight_decay"] == 0.1
    assert group["lr"] == pytest.approx(2e-3 * 3 / 4) and ckpt["scheduler"]["base_lrs"] == [2e-3]


@pytest.mark.slow
def test_a_float32_run_resumes_in_float16(run1, tmp_path, capsys):
    """--dtype may change on resume: a float32 run continued in float16 (a CPU runs it, tests/test_ref_device.py)
    trains its step with a loss scaler of its own and records the dtype that ran. Fails if the resume loads the
    float32 run's disabled scaler state into the fp16 one (GradScaler refuses an empty state: a traceback) or keeps
    the checkpoint's dtype."""
    out = copy_of(run1, tmp_path)
    g = run_script(TRAIN, ["--resume", out, "--steps", 2, "--dtype", "float16"])
    assert "Traceback" not in capsys.readouterr().err
    assert g["args"].dtype == "float16" and g["scaler"].is_enabled()
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 2 and ckpt["config"]["dtype"] == "float16" and ckpt["scaler"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.slow
def test_a_resume_keeps_the_runs_ref_sync_every_and_refuses_another(run1, tmp_path, capsys):
    """ref_sync_every is fixed by the run (the reference it saved moves with it): a resume given 0 ends in exit code
    2, one line naming it and both values; one without it continues with the run's 1. Fails if ref_sync_every is
    declared CHANGES (the other value used) or NEVER (the run's 1 dropped: its moved reference reset to the base)."""
    out = copy_of(run1, tmp_path)
    code, line = error_of(TRAIN, ["--resume", out, "--steps", 2, "--config", "ref_sync_every=0"], capsys)
    assert code == 2 and "ref_sync_every" in line and "1" in line and "0" in line, line
    g = run_script(TRAIN, ["--resume", out, "--steps", 2])
    assert g["args"].ref_sync_every == 1 and g["synced_ref"] is not None


# -----------------------------------------------------------------------------
# every task's and environment's options


ALL_TASKS = {**tasks.TASKS, **extra_tasks.EXTRA}
RG = "rg:chain_sum"  # an rg: task's own options (seed, size) are checked before reasoning-gym is imported
WRONG = {int: "1", float: "x", str: 5, bool: "x", dict: 5}  # a value of another type, per kind


def owners(name):  # the functions that declare a task's options: its load and env (the unbound TASKS / EXTRA entries)
    if name == RG:
        return [extra_tasks.rg_options]
    return [f for f in (ALL_TASKS[name].load, ALL_TASKS[name].env) if f]


def outside(d):  # a value of the right type that its range or pattern refuses; None: it has neither
    check = d.knob.check
    if isinstance(check, re.Pattern):
        return next(s for s in ("", "/", "?x") if not check.fullmatch(s))
    if not isinstance(check, str):
        return None
    if check[0] in "([":
        return d.kind(float(check[1:-1].split(",")[0]) - 1)  # below the low end
    op, bound = check.split()
    return d.kind(float(bound) - (op == ">="))


@pytest.mark.parametrize("name", [*sorted(ALL_TASKS), RG])
def test_every_task_option_of_the_wrong_type_or_range_is_one_error_naming_it(name):
    """Each option its load or environment declares, given a value of another type, then one out of its range or
    pattern: a ValueError naming the option; its default passes. An unknown option names every known one. Fails if
    a keyword of a load or an environment is no declared option (its Knob dropped: unknown to task_options), if a
    task's options are not checked before anything loads (a wrong type reaching load_arith's range(), a calculator's
    max_tool_calls of -1), or if an environment's options are left out of the check (arith_tool's max_tool_calls)."""
    decls = config.declared(*owners(name))
    takes = {k for fn in owners(name) for k in inspect.signature(fn).parameters} - {"split", "data_dir", "tokenizer"}
    assert takes == set(decls), f"{name}: keywords without a Knob: {sorted(takes - set(decls))}"
    if name != RG:  # every default passes its own check (an rg: task would import reasoning-gym here)
        extra_tasks.get(name, {opt: d.default for opt, d in decls.items()})
    for opt, d in decls.items():
        for bad in (WRONG[d.kind], outside(d)):
            if bad is None:
                continue
            with pytest.raises(ValueError) as e:
                extra_tasks.get(name, {opt: bad})
            assert opt in str(e.value), (opt, bad, str(e.value))
    if name != RG:  # an rg: task's other options are its dataset's config, checked by reasoning-gym
        with pytest.raises(ValueError) as e:
            extra_tasks.get(name, {"no_such_option": 1})
        assert "no_such_option" in str(e.value) and all(k in str(e.value) for k in decls), str(e.value)


def test_eval_refuses_a_bad_task_option_before_the_model(tmp_path):
    """eval.py --task arith --task-options "{'n': 0}": exit code 2, one line naming n, no traceback, before any
    model loads (the model named does not exist: were it loaded first, that would be the error). Fails if eval.py
    stops checking --task-options, or checks them after loading the model."""
    argv = ["--task", "arith", "--task-options", "{'n': 0}", "--model", str(tmp_path / "no_model")]
    proc = subprocess.run(
        [sys.executable, EVAL, *argv], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "'n'" in line and "0" in line and "no_model" not in line, line


# -----------------------------------------------------------------------------
# an environment state that is no number, mid-run; a run whose reward weights are all 0


class WordsEnv(toy.WordToolEnv):  # its state is a number until the row makes a call (a word of toy.WORDS)
    def state(self):
        return {**super().state(), "called": "yes" if self.calls else 0.0}


class Words(toy.WordTools):
    def __call__(self):
        return WordsEnv(self)


def words_env(tokenizer, *, max_tool_calls=4, max_reply_tokens=64):
    return envs.EnvDriver(Words(max_tool_calls, calls=toy.WORDS), tokenizer, max_reply_tokens)


def test_an_environment_state_that_is_no_number_mid_run_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """A toy environment whose state is a number at start-up (the probe passes) but a string once a row made a call:
    the run ends with exit code 1 in one line naming the step, the row and the key, no traceback. Fails if
    EnvDriver.states stops checking the states (a string would reach the metrics' torch.tensor: a traceback), if the
    message loses the row, or if train.py's collect stops turning a RewardError into `error: step N`."""
    monkeypatch.setitem(tasks.TASKS, "toy_words", toy.TASK._replace(env=words_env))
    code, message = error_of(TRAIN, train_args(model_dir, str(tmp_path), "--task", "toy_words", steps=1), capsys)
    assert code == 1 and "\n" not in message, message
    assert message.startswith("error: step 1:") and re.search(r"row \d+", message) and "'called'" in message


def test_an_environment_that_raises_is_a_reward_error_naming_its_row():
    """envs._guarded(2, f): f's exception, in one line naming row 2. Fails if the row or the exception is lost."""

    def broken():
        raise KeyError("the\nkey")

    with pytest.raises(RewardError) as e:
        envs._guarded(2, broken)
    assert "row 2" in str(e.value) and "KeyError" in str(e.value) and "\n" not in str(e.value)


def test_all_reward_weights_zero_is_a_note_and_the_run_starts(model_dir, tmp_path, capsys):
    """--reward-weights even=0,first=0 (the toy task's two rewards): a `note:` line naming --reward-weights, and
    the run still trains its step. Fails if the note is dropped or if the zero weights are refused."""
    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--reward-weights", "even=0,first=0", steps=1))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert any("--reward-weights" in line for line in notes), notes
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]


def test_the_readme_lists_each_knob_under_its_resume_class():
    """Fails if a knob's resume class changes (a seed that may change, an lr fixed by the run) or a knob is added
    without README's --resume paragraph following: its two lists are the FIXED and NEVER knobs, every other knob's
    class is CHANGES."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = " ".join(f.read().split())
    fixed = text.split("*Fixed by the run*")[1].split("*A setting")[0]
    never = text.split("*A setting of one call*")[1].split("Every other knob")[0]
    listed = {
        cls: set(re.findall(r"`([a-z_]+)`", part)) for cls, part in ((config.FIXED, fixed), (config.NEVER, never))
    }
    for cls in (config.FIXED, config.NEVER):
        assert listed[cls] == {k for k, d in DECLS.items() if d.knob.resume == cls}, cls
    assert {d.knob.resume for k, d in DECLS.items() if k not in set().union(*listed.values())} == {config.CHANGES}


def test_a_fixed_path_is_compared_as_the_place_it_names(tmp_path, monkeypatch):
    """A fixed path knob given on resume as another spelling of the run's folder (relative, from another directory)
    is the same value: accepted; another folder is refused. Fails if the check compares the strings as typed (a
    config file's relative data_dir refused on the run it made), or if a run saved with a relative path (written
    before paths were made absolute) is refused on a resume that gives no path at all."""
    data = tmp_path / "data"
    data.mkdir()
    run_dir, _ = fake_run(tmp_path, data_dir=str(data))
    monkeypatch.chdir(tmp_path)
    assert resume(run_dir, "--data-dir", "data").data_dir == str(data)
    with pytest.raises(SystemExit):
        resume(run_dir, "--data-dir", str(tmp_path))
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.json").write_text("{}")
    saved = {**vars(train_parser()[1]), "out_dir": str(old), "data_dir": "data"}  # relative, as typed
    torch.save({"config": saved, "step": 1}, old / "ckpt.pt")
    assert resume(str(old)).data_dir == str(data)
