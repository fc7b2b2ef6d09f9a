"""Every user-facing failure path of train.py and eval.py (its --plot too), run through the real entry point.

A usage mistake ends in argparse's one-line `error:` and exit code 2, before the model loads where the
mistake is in the flags alone; a run that fails on the way (a reward fn that raises, a full disk) ends
in one `error:` line and exit code 1; an interrupted run (Ctrl-C, SIGTERM) in one line that says how to
resume, exit code 130 (143 for SIGTERM). Never a traceback, and no temp file left behind. A run owns its
--out-dir (run.json marks it) and nothing else: no failure or --overwrite touches a file a run did not
write. eval.py writes its predictions whole or not at all. Most cases run in this process (tests/toy.py's
run_script: SystemExit); a few run in a fresh interpreter to see the real exit code and stderr.
"""

import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy  # noqa: E402
from toy import EVAL, REPO, TOY_TRAIN, TRAIN, read_metrics, run_script, subprocess_env, train_args  # noqa: E402

import grpo  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

PLOT = EVAL  # eval.py --plot draws the curves


def script_error(path, argv, capsys):
    """Run train.py / eval.py expecting a user error or an interruption -> (exit code, last stderr line).

    p.error prints usage and `prog: error: ...` to stderr and exits 2; sys.exit("error: ...") hands Python
    the message, which it prints to stderr before exiting 1; Ctrl-C prints its line and exits 130."""
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as e:
            run_script(path, argv)
    except KeyboardInterrupt:  # uncaught, it would end the whole pytest session
        pytest.fail("KeyboardInterrupt escaped the script (a traceback for the user), not a one-line exit")
    err = capsys.readouterr().err
    assert "Traceback" not in err
    code = e.value.code
    if isinstance(code, str):
        return 1, code
    return code, err.strip().splitlines()[-1]


def assert_one_line(code, line, want_code, *fragments):
    assert code == want_code, (code, line)
    assert "error:" in line and "\n" not in line, line
    for f in fragments:
        assert f in line, line


def without(argv, *flags):
    """argv with these flags and their values removed (so a config file's value is the one used)."""
    argv = list(argv)
    for flag in flags:
        if flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
    return argv


def forbid_model_load(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(models, "load_model", forbidden)
    monkeypatch.setattr(models, "load_tokenizer", forbidden)


@pytest.fixture
def no_model_load(monkeypatch):
    """A flag checked 'before anything loads' must never reach the model: loading fails the test."""
    forbid_model_load(monkeypatch)


def files(root, skip=(".lock",)):
    """{path relative to root: bytes} of every file under root (the run's lock file aside)."""
    found = {}
    for d, _, names in os.walk(root):
        for name in names:
            path = os.path.join(d, name)
            if os.path.relpath(path, root) not in skip:
                with open(path, "rb") as f:
                    found[os.path.relpath(path, root)] = f.read()
    return found


def leftovers(out):
    """Temp files and folders a write in progress leaves: *.tmp, .hf.* (export_hf's temp folder)."""
    return sorted(
        os.path.relpath(os.path.join(d, n), out)
        for d, dirs, names in os.walk(out)
        for n in dirs + names
        if n.endswith(".tmp") or n.startswith(".hf.")
    )


def ckpt_step(out):
    return torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=True)["step"]


def mentions(line, value, out):
    """`value` appears in line as a word of its own, out-dir paths aside (a tmp path may hold digits)."""
    return re.search(rf"(?<![\w.-]){re.escape(str(value))}(?!\w|\.\d)", line.replace(str(out), "")) is not None


# -----------------------------------------------------------------------------
# numeric flags: type and range, before the model loads


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--temperature", 0, "--temperature must be > 0, got 0.0"),
        ("--temperature", -1, "--temperature must be > 0, got -1.0"),
        ("--eps", -0.1, "--eps must be [0, 1), got -0.1"),
        ("--beta", -1, "--beta must be >= 0, got -1.0"),
        ("--eval-n", -1, "--eval-n must be >= 0, got -1"),
        ("--lr", 0, "--lr must be > 0, got 0.0"),
        ("--lr", -1, "--lr must be > 0, got -1.0"),
        ("--lr", "nan", "--lr must be a finite number, got nan"),
        ("--lr", "inf", "--lr must be a finite number, got inf"),
        ("--max-new-tokens", 0, "--max-new-tokens must be >= 1, got 0"),
        ("--micro-batch", 0, "--micro-batch must be >= 1, got 0"),
        ("--prompts-per-step", 0, "--prompts-per-step must be >= 1, got 0"),
        ("--prompts-per-step", -2, "--prompts-per-step must be >= 1, got -2"),
        ("--group-size", 1, "--group-size must be >= 2, got 1"),
        ("--mu", 0, "--mu must be >= 1, got 0"),
        ("--steps", 0, "--steps must be >= 1, got 0"),
        ("--overlong-buffer", -1, "--overlong-buffer must be >= 0, got -1"),
        ("--delta", 1.1, "--delta 1.1 must be > 1 + eps_high = 1.2"),
        ("--lr", "fast", "argument --lr: invalid float value: 'fast'"),
    ],
    ids=lambda x: str(x),
)
def test_bad_flag_is_refused_before_the_model_loads(model_dir, tmp_path, capsys, no_model_load, flag, value, message):
    out = tmp_path / "out"
    code, line = script_error(TRAIN, without(train_args(model_dir, str(out), steps=1), flag) + [flag, value], capsys)
    assert_one_line(code, line, 2, f"train.py: error: {message}")
    assert not (out / "metrics.jsonl").exists()  # nothing ran, not even a first rollout


@pytest.mark.parametrize(
    "line, message",
    [
        ("lr = None", "--lr needs a value, got None"),
        ("group_size = 2.0", "--group-size must be an integer, got 2.0"),
        ("temperature = 'hot'", "argument --temperature: invalid float value: 'hot'"),  # argparse converts str defaults
        ("lr = float('nan')", "the value of 'lr' must be a literal"),
        ("lr = 1e999", "--lr must be a finite number, got inf"),
        ("mask_truncated = 1", "--mask-truncated must be True or False, got 1"),
        ("steps = True", "--steps must be an integer, got True"),
        ("steps = 0", "--steps must be >= 1, got 0"),
    ],
    ids=["lr-None", "group_size-float", "temperature-str", "nan-call", "inf", "bool-int", "int-bool", "range"],
)
def test_config_value_of_the_wrong_type_is_refused(model_dir, tmp_path, capsys, no_model_load, line, message):
    """Config values reach argparse as defaults: a string is converted as on the command line, anything else
    is not, so the check must see the type as well as the range."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(line + "\n")
    flag = "--" + line.split("=")[0].strip().replace("_", "-")
    code, err = script_error(
        TRAIN, ["--config", cfg, *without(train_args(model_dir, str(tmp_path / "o")), flag)], capsys
    )
    assert_one_line(code, err, 2, message)


# config-only keys (no flag): a bad value names the key as the user wrote it, and what was wrong with it
CONFIG_ONLY = [
    ("is_cap", 0, ["is_cap", "0"]),
    ("is_cap", "high", ["is_cap", "high"]),
    ("task_options", {"no_such_option": 1}, ["task_options", "no_such_option", "toy"]),  # the task takes none
    ("task_options", [1], ["task_options", "dict"]),
    ("cispo_cap", 0.5, ["cispo_cap", "0.5"]),
    ("aggregation", "no-such-aggregation", ["aggregation", "no-such-aggregation", "dapo"]),
    ("sapo_temperature_neg", 0, ["sapo_temperature", "> 0"]),
    ("warmup_steps", -1, ["warmup_steps", "-1"]),
    ("weight_decay", -0.1, ["weight_decay", "-0.1"]),
    ("grad_clip", None, ["grad_clip", "None"]),
    ("grad_clip", -1, ["grad_clip", "-1"]),
    ("max_resample", -1, ["max_resample", "-1"]),
    ("ref_sync_every", 1.5, ["ref_sync_every", "1.5"]),
    ("save_every", -1, ["save_every", "-1"]),
    ("save_every", True, ["save_every", "True"]),
    ("log_completions", 0.5, ["log_completions", "0.5"]),
    ("lr_schedule", "no-such-schedule", ["lr_schedule", "no-such-schedule", "cosine"]),  # the choices: what to do
    ("export", "zip", ["export", "zip", "adapter"]),
    ("export", "adapter", ["adapter", "--lora-rank"]),  # an adapter needs adapters
    ("lr_scheule", "cosine", ["lr_scheule"]),  # a typo: unknown key
    ("no_such_key", 5, ["no_such_key"]),  # no such key
]


@pytest.mark.parametrize("source", ["file", "inline"])
@pytest.mark.parametrize("key, value, fragments", CONFIG_ONLY, ids=lambda x: str(x))
def test_bad_config_only_value_is_one_line_before_the_model_loads(
    model_dir, tmp_path, capsys, no_model_load, source, key, value, fragments
):
    """`--config key=value` reads value as a Python literal, else as a plain string: `is_cap=high` is 'high'."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"{key} = {value!r}\n")
    spec = cfg if source == "file" else f"{key}={value}"
    out = tmp_path / "out"
    code, line = script_error(TRAIN, train_args(model_dir, str(out)) + ["--config", spec], capsys)
    assert_one_line(code, line, 2, *fragments)
    assert not out.exists() or not os.listdir(out)  # refused before the run took the directory


@pytest.mark.parametrize("spec, fragment", [("save_every", "save_every"), ("=3", "=3")], ids=["no-value", "no-key"])
def test_malformed_inline_config_is_one_line(model_dir, tmp_path, capsys, no_model_load, spec, fragment):
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path)) + ["--config", spec], capsys)
    assert_one_line(code, line, 2, fragment)


def test_inline_config_value_that_is_no_literal_is_a_plain_string(model_dir, tmp_path):
    """`--config model=/a/path` is the string '/a/path' (not a division), as `--config export=none` is 'none'."""
    out = tmp_path / "out"
    run_script(TRAIN, without(train_args(model_dir, str(out), steps=1), "--model") + ["--config", f"model={model_dir}"])
    assert json.load(open(out / "run.json"))["model"] == model_dir


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--top-p", 0.9),
        ("--save-every", 1),
        ("--log-completions", 1),
        ("--lr-schedule", "cosine"),
        ("--export", "none"),
        ("--warmup-steps", 2),
        ("--log-to", "tensorboard"),
        ("--max-tool-calls", 2),
        ("--cispo-cap", 3.0),
    ],
    ids=lambda x: str(x),
)
def test_config_only_keys_are_not_flags(model_dir, tmp_path, capsys, no_model_load, flag, value):
    """A config key is set in a config file or as --config name=value; as a flag it is one line."""
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path), flag, value), capsys)
    assert_one_line(code, line, 2, flag)


def test_resume_named_in_a_config_file_is_honoured(model_dir, tmp_path):
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, steps=2))
    cfg = tmp_path / "more.py"
    cfg.write_text(f"resume = {out!r}\nsteps = 3\n")
    g = run_script(TRAIN, ["--config", cfg])  # every other flag comes from the checkpoint
    assert g["start_step"] == 2 and g["args"].out_dir == out
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert ckpt_step(out) == 3


# -----------------------------------------------------------------------------
# rewards: weights on the command line, reward functions that fail


@pytest.mark.parametrize("item", ["even=abc", "even=nan", "even=inf", "nope=1", "even"])
def test_bad_reward_weight_is_one_line(model_dir, tmp_path, capsys, no_model_load, item):
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path), "--reward-weights", item), capsys)
    assert_one_line(code, line, 2, "--reward-weights", f"'{item}'", "'even'", "'first'")  # the item, what to pass


def failing_on_step_2(kind):
    """A reward fn that is fine on the first step's batch and then raises / gives NaN / miscounts."""
    calls = []

    def broken(completions, **_):
        calls.append(1)
        if len(calls) == 1:
            return [0.5] * len(completions)
        if kind == "raises":
            raise ZeroDivisionError("division by zero")
        if kind == "nan":
            return [math.nan] * len(completions)
        return [0.5] * (len(completions) - 1)

    return broken


def with_reward(monkeypatch, name, fn):
    """Register task `toy_<name>`: the toy task plus reward fn `name` (weight 1) -> its --task value."""
    monkeypatch.setitem(
        tasks.TASKS,
        f"toy_{name}",
        toy.TASK._replace(
            reward_fns={**toy.TASK.reward_fns, name: fn}, reward_weights={**toy.TASK.reward_weights, name: 1.0}
        ),
    )
    return f"toy_{name}"


@pytest.mark.parametrize(
    "kind, fragments",
    [
        ("raises", ["reward 'broken' raised ZeroDivisionError: division by zero on completion 0"]),
        ("nan", ["reward 'broken' gave nan", "completion 0"]),
        ("count", ["reward 'broken' returned 7 values for 8 completions"]),
    ],
)
def test_reward_fn_that_fails_names_itself_and_exits_1(model_dir, tmp_path, capsys, monkeypatch, kind, fragments):
    task = with_reward(monkeypatch, "broken", failing_on_step_2(kind))
    argv = without(train_args(model_dir, str(tmp_path), steps=3), "--task") + ["--task", task]
    code, line = script_error(TRAIN, argv, capsys)
    assert_one_line(code, line, 1, "error: step 2: ", *fragments)
    with open(tmp_path / "metrics.jsonl") as f:  # step 1 was logged, and the file is JSON to the last byte
        rows = [json.loads(x, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for x in f]
    assert [r["step"] for r in rows] == [1]


@pytest.mark.parametrize(
    "make",
    [
        lambda n: {0: 1.0, 1: 1.0},
        lambda n: "11",
        lambda n: {i: 1.0 for i in range(n)},  # as many keys as completions: iterating it would give 0..n-1
        lambda n: "1" * n,  # as many characters as completions: iterating it would give n floats of 1.0
    ],
    ids=["dict", "str", "dict-of-n", "str-of-n"],
)
def test_reward_fn_that_returns_no_list_names_itself_and_exits_1(model_dir, tmp_path, capsys, monkeypatch, make):
    task = with_reward(monkeypatch, "weird", lambda completions, **_: make(len(completions)))
    argv = without(train_args(model_dir, str(tmp_path), steps=1), "--task") + ["--task", task]
    code, line = script_error(TRAIN, argv, capsys)
    assert_one_line(code, line, 1, "'weird'")


# -----------------------------------------------------------------------------
# data


def gsm8k_line(question="What is 2 + 3?", answer="2 + 3 = 5\n#### 5"):
    return json.dumps({"question": question, "answer": answer}) + "\n"


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "no examples in {train}"),
        (b"\n  \n\t\n", "no examples in {train}"),
        (gsm8k_line().encode() + b'{"question": "caf\xe9", "answer": "#### 1"}\n', "{train}:2: byte 0xe9 is not UTF-8"),
        (gsm8k_line().encode() + gsm8k_line(answer="2 + 3 = 5\n####  ").encode(), "{train}:2: nothing after '####'"),
        (gsm8k_line().encode(), "the train split has 1 examples, fewer than --prompts-per-step 2"),
    ],
    ids=["empty", "blank-only", "non-utf8", "empty-gold", "too-short"],
)
def test_bad_gsm8k_file_is_one_line(model_dir, tmp_path, capsys, content, message):
    data = tmp_path / "gsm8k"
    data.mkdir()
    (data / "train.jsonl").write_bytes(content)
    (data / "test.jsonl").write_text(gsm8k_line())
    argv = without(train_args(model_dir, str(tmp_path / "out")), "--task") + ["--task", "gsm8k", "--data-dir", data]
    code, line = script_error(TRAIN, argv, capsys)
    assert_one_line(code, line, 2, message.format(train=data / "train.jsonl"))


# -----------------------------------------------------------------------------
# models


def corrupt_weights(model_dir, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 100)
    return str(bad)


def fake_gguf(model_dir, tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all" * 50)
    return str(tmp_path / "x.gguf")


@pytest.mark.parametrize(
    "make, extra, fragments",
    [
        (corrupt_weights, [], ["could not load model '{model}'"]),
        (fake_gguf, [], ["cannot read {model} as a GGUF model"]),
        (lambda d, t: str(t / "no" / "such" / "model"), [], ["could not load model '{model}'"]),
        (lambda d, t: d, ["--max-new-tokens", 600], ["--max-new-tokens 600", "512"]),  # the model's context
    ],
    ids=["corrupt-safetensors", "not-gguf", "missing", "max-new-tokens>context"],
)
def test_bad_model_is_one_line(model_dir, tmp_path, capsys, monkeypatch, make, extra, fragments):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "CACHE_DIR", str(tmp_path / "cache"))  # a GGUF conversion would land here
    model = make(model_dir, tmp_path)
    argv = without(train_args(model, str(tmp_path / "out"), steps=1), *extra[::2]) + extra
    code, line = script_error(TRAIN, argv, capsys)
    assert_one_line(code, line, 2, *(f.format(model=model) for f in fragments))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# -----------------------------------------------------------------------------
# flags that need a package or a task feature


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--supervision", "process"], ["--supervision process", "per-step rewards", "task toy"]),
        (["--overlong-buffer", 13], ["--overlong-buffer", "<= --max-new-tokens 12"]),
    ],
    ids=["process-without-step-rewards", "overlong-buffer>max-new"],
)
def test_flag_the_task_cannot_honour_is_one_line(model_dir, tmp_path, capsys, no_model_load, extra, fragments):
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path), *extra), capsys)
    assert_one_line(code, line, 2, *fragments)


def test_log_to_wandb_without_wandb_names_the_install(model_dir, tmp_path, capsys, monkeypatch, no_model_load):
    """wandb hidden from find_spec, so the test runs whether or not it is installed here. Fails if train.py imports
    the tracker only when the first row is logged (a traceback after the model loaded) instead of checking first."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path), "--config", "log_to=wandb"), capsys)
    assert_one_line(code, line, 2, "log_to", "pip install wandb")


# -----------------------------------------------------------------------------
# the out dir: a run owns its directory (run.json says so) and nothing else


@pytest.mark.parametrize("where", ["missing", "empty", "lock-only"])
def test_a_new_run_into_a_missing_or_empty_dir_writes_run_json_first(model_dir, tmp_path, monkeypatch, where):
    """lock-only: what a run killed before it wrote run.json leaves (the lock is a run's own file)."""
    out = tmp_path / "new" / "run" if where == "missing" else tmp_path
    if where == "lock-only":
        (tmp_path / ".lock").write_text("")
    seen, real_sample = [], rollout.sample
    monkeypatch.setattr(
        rollout, "sample", lambda *a, **k: seen.append((out / "run.json").exists()) or real_sample(*a, **k)
    )
    run_script(TRAIN, train_args(model_dir, str(out), steps=1))
    assert seen and seen[0], "run.json was not there when the first rollout began"
    flags = json.load(open(out / "run.json"))
    assert (flags["steps"], flags["model"], flags["task"], flags["dtype"]) == (1, model_dir, "toy", "float32")
    assert [r["step"] for r in read_metrics(str(out))] == [1]


def test_a_new_run_into_a_run_dir_is_refused(model_dir, tmp_path, capsys):
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, steps=1))
    before = files(out)
    code, line = script_error(TRAIN, train_args(model_dir, out, steps=1), capsys)
    assert_one_line(code, line, 2, f"--out-dir {out}", f"--resume {out}", "--overwrite")
    assert files(out) == before  # nothing appended


def hf_model_folder(model_dir, out):
    shutil.copytree(model_dir, out)  # a HF folder: config.json, model.safetensors, tokenizer files


def user_notes(model_dir, out):
    out.mkdir()
    (out / "notes.txt").write_text("lr 1e-3 looked better\n")


@pytest.mark.parametrize("extra", [[], ["--overwrite"]], ids=["new", "overwrite"])
@pytest.mark.parametrize("make", [hf_model_folder, user_notes], ids=["hf-folder", "notes"])
def test_a_dir_that_holds_no_run_is_refused_and_untouched(model_dir, tmp_path, capsys, make, extra):
    out = tmp_path / "out"
    make(model_dir, out)
    before = files(out, skip=())
    code, line = script_error(TRAIN, train_args(model_dir, str(out), *extra, steps=1), capsys)
    assert_one_line(code, line, 2, str(out), "--out-dir")
    assert files(out, skip=()) == before  # byte for byte, and no file added (not even a lock)


def test_overwrite_removes_only_what_a_run_writes(model_dir, tmp_path):
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=2))
    assert os.path.isfile(os.path.join(out, "hf", ".grpo-export"))  # the run's export says it is the run's
    mine = {"notes.txt": b"lr 1e-3 looked better\n", os.path.join("mine", "data.jsonl"): b'{"q": 1}\n'}
    left = ["ckpt.pt.tmp", os.path.join("dcp-7", "0.distcp"), os.path.join("tensorboard", "events.out.tfevents.1")]
    for name, content in [*mine.items(), *((x, b"a run's leftover") for x in left)]:
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        with open(os.path.join(out, name), "wb") as f:
            f.write(content)
    run_script(
        TRAIN, train_args(model_dir, out, "--overwrite", "--config", "save_every=0", "--config", "export=none", steps=1)
    )
    after = files(out)
    assert {k: after.get(k) for k in mine} == mine  # the user's files, byte for byte
    for gone in ("ckpt.pt", "ckpt.pt.tmp", "dcp-7", "hf", "tensorboard"):  # the old run's, all of them
        assert not os.path.exists(os.path.join(out, gone)), gone
    assert [r["step"] for r in read_metrics(out)] == [1]  # one line per step, none of the old run's
    assert json.load(open(os.path.join(out, "run.json")))["steps"] == 1


@pytest.mark.parametrize("how", ["overwrite", "resume"])
def test_an_hf_folder_the_run_did_not_export_is_never_replaced(model_dir, tmp_path, capsys, how):
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, steps=1))
    shutil.rmtree(os.path.join(out, "hf"))
    shutil.copytree(model_dir, os.path.join(out, "hf"))  # the user's own model where the export would go
    before = files(out)
    argv = train_args(model_dir, out, "--overwrite", steps=1) if how == "overwrite" else ["--resume", out, "--steps", 2]
    code, line = script_error(TRAIN, argv, capsys)
    assert_one_line(code, line, 2, os.path.join(out, "hf"))
    assert files(out) == before  # the user's hf/ and the run it sits in, both untouched


@pytest.mark.parametrize("second", ["resume", "overwrite"])
def test_a_second_run_on_a_dir_in_use_is_refused_at_once(model_dir, tmp_path, capsys, second):
    """The first run holds an flock on OUT/.lock for its lifetime; holding it here is the same, deterministic."""
    import fcntl

    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, steps=1))
    before = files(out)
    argv = ["--resume", out, "--steps", 2] if second == "resume" else train_args(model_dir, out, "--overwrite", steps=1)

    def waited(*_):
        pytest.fail("train.py waited for the lock instead of refusing at once")

    with open(os.path.join(out, ".lock"), "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail("the finished run still holds OUT/.lock")
        old = signal.signal(signal.SIGALRM, waited)
        signal.alarm(60)
        try:
            code, line = script_error(TRAIN, argv, capsys)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    assert_one_line(code, line, 2, out, "in use")
    assert files(out) == before  # the first run's run.json, metrics.jsonl, ckpt.pt, hf/


@pytest.mark.parametrize("flag", ["--model", "--task", "--lora-rank"])
def test_resume_with_another_model_task_or_lora_rank_is_refused(model_dir, tmp_path, capsys, monkeypatch, flag):
    """The refusal reads the checkpoint's config only: --lora-rank needs no peft here (peft hidden), so no case
    skips. Fails if run.IDENTITY drops the flag (the resume goes on) or the line names neither value."""
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, steps=1))
    if flag == "--model":  # the same weights and shape in another folder: still another model
        new, old = str(tmp_path / "copy"), model_dir
        shutil.copytree(model_dir, new)
    elif flag == "--task":
        monkeypatch.setitem(tasks.TASKS, "toy2", toy.TASK)
        new, old = "toy2", "toy"
    else:
        import importlib.util

        real = importlib.util.find_spec  # peft hidden, as on a machine with requirements.txt only
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
        new, old = "2", "0"
    before = files(out)
    code, line = script_error(TRAIN, ["--resume", out, "--steps", 2, flag, new], capsys)
    assert_one_line(code, line, 2, flag)
    assert mentions(line, new, out) and mentions(line, old, out), line
    assert files(out) == before


def test_resume_with_other_task_options_is_refused(model_dir, tmp_path, capsys):
    """A run of 1-digit sums resumed on 2-digit ones would mix two runs. Fails if run.IDENTITY drops task_options (the
    resume goes on with other data) or the line names neither value; the run's files stay as they were."""
    out = str(tmp_path / "run")
    argv = train_args(model_dir, out, "--config", "task_options={'digits': 1}", steps=1)
    argv[argv.index("toy")] = "arith"
    run_script(TRAIN, argv)
    before = files(out)
    code, line = script_error(TRAIN, ["--resume", out, "--steps", 2, "--config", "task_options={'digits': 2}"], capsys)
    assert_one_line(code, line, 2, "task_options", "'digits': 1", "'digits': 2")
    assert files(out) == before


@pytest.mark.parametrize("steps", [None, 1, 2], ids=["the-checkpoint's", "1", "2"])
def test_resume_to_a_step_already_reached_is_refused(model_dir, tmp_path, capsys, steps):
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, steps=2))
    before = files(out)
    code, line = script_error(TRAIN, ["--resume", out] + ([] if steps is None else ["--steps", steps]), capsys)
    assert_one_line(code, line, 2, "--steps")
    assert mentions(line, 2, out), line  # the checkpoint's step
    assert files(out) == before


def test_resume_with_overwrite_is_refused(model_dir, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, steps=1))
    before = files(out)
    forbid_model_load(monkeypatch)
    code, line = script_error(TRAIN, ["--resume", out, "--overwrite", "--steps", 2], capsys)
    assert_one_line(code, line, 2, "--resume", "--overwrite")
    assert files(out) == before


def test_resume_of_a_run_whose_metrics_file_is_a_directory_is_one_line(model_dir, tmp_path, capsys):
    """Fails if --resume reads or appends to a metrics.jsonl that is a directory (defect 8 of issue 42: an
    IsADirectoryError traceback) instead of refusing in one line that names it, or touches that directory or the
    checkpoint."""
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, steps=1))
    metrics = os.path.join(out, "metrics.jsonl")
    os.remove(metrics)
    os.mkdir(metrics)
    with open(os.path.join(metrics, "notes.txt"), "w") as f:
        f.write("a user's notes")
    before = files(out)
    code, line = script_error(TRAIN, ["--resume", out, "--steps", 2], capsys)
    assert_one_line(code, line, 2, metrics, "not a file")
    assert files(out) == before and os.path.isdir(metrics) and ckpt_step(out) == 1


@pytest.mark.parametrize("where", ["another-run's-folder", "a-folder-of-no-run", "a-link-to-a-run's-ckpt.pt"])
def test_resume_continues_only_the_run_the_checkpoint_is_the_ckpt_pt_of(model_dir, tmp_path, capsys, where):
    """Issue 53, 2. A checkpoint file outside its run's folder: beside another run's files as other.pt, as ckpt.pt in a
    folder with no run.json (a user's copy), or a link to a run's ckpt.pt. Fails if --resume takes the file's folder
    for the run (it replaced the other run's ckpt.pt and rewrote its metrics, or wrote a run into a user's folder)
    rather than refusing in one line, or if a link does not continue the run it points to, in that run's folder."""
    a, b, folder = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "folder")
    run_script(TRAIN, train_args(model_dir, a, steps=1))
    run_script(TRAIN, train_args(model_dir, b, "--seed", 1, steps=2))
    os.makedirs(folder)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("a user's notes")
    target = {
        "another-run's-folder": os.path.join(b, "other.pt"),
        "a-folder-of-no-run": os.path.join(folder, "ckpt.pt"),
        "a-link-to-a-run's-ckpt.pt": os.path.join(folder, "link.pt"),
    }[where]
    if where.startswith("a-link"):
        os.symlink(os.path.join(a, "ckpt.pt"), target)
    else:
        shutil.copy(os.path.join(a, "ckpt.pt"), target)
    before = {d: files(d) for d in (a, b, folder)}
    if where.startswith("a-link"):
        run_script(TRAIN, ["--resume", target, "--steps", 2])
        assert ckpt_step(a) == 2 and [r["step"] for r in read_metrics(a)] == [1, 2]
        assert files(b) == before[b] and sorted(os.listdir(folder)) == ["link.pt", "notes.txt"]
        return
    code, line = script_error(TRAIN, ["--resume", target, "--steps", 3], capsys)
    assert_one_line(code, line, 2, "--resume", target, "--out-dir")
    assert {d: files(d) for d in (a, b, folder)} == before


def test_a_resumed_run_holds_no_mapping_of_the_checkpoint_it_resumed_from(model_dir, tmp_path):
    """Issue 53, 3. The checkpoint is read memory-mapped; once restored nothing may keep it mapped, or replacing it
    frees no space (a resumed run needs room for three checkpoints). Fails if the optimizer keeps the file's own
    tensors (AdamW's load_state_dict keeps a tensor already of the right dtype and device) or if train.py keeps the
    checkpoint's dict after run.restore: the run's objects, alive in `g`, still map the old ckpt.pt (now deleted)."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads /proc/self/maps (Linux)")
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=1))
    g = run_script(TRAIN, ["--resume", out, "--steps", 3])
    assert g["start_step"] == 1 and ckpt_step(out) == 3
    ckpt = os.path.join(out, "ckpt.pt")
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if ckpt in line]
    opened = [fd for fd in os.listdir("/proc/self/fd") if ckpt in os.path.realpath(f"/proc/self/fd/{fd}")]
    assert mapped == [] and opened == [], (mapped, opened)


@pytest.mark.parametrize("damage", ["torn", "blank"])
def test_resume_drops_a_torn_last_line_and_blank_lines_of_the_metrics(model_dir, tmp_path, damage):
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, steps=2))
    path = os.path.join(out, "metrics.jsonl")
    lines = open(path).read().splitlines(keepends=True)
    with open(path, "a" if damage == "torn" else "w") as f:
        f.write('{"step": 3, "rew' if damage == "torn" else "\n" + lines[0] + "\n  \n" + "".join(lines[1:]) + "\n")
    run_script(TRAIN, ["--resume", out, "--steps", 4])
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]  # every line JSON, each step once


# -----------------------------------------------------------------------------
# interruptions: Ctrl-C, SIGTERM, a kill mid-save, a failed export


def assert_interrupted(code, line, out, want=(130,)):
    assert code in want, (code, line)
    assert f"--resume {out}" in line, line  # where the checkpoint is, and how to go on
    assert leftovers(out) == []


def raise_on_call(real, n, error):
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == n:
            toy.fail(error)
        return real(*a, **k)

    return wrapped


def test_ctrl_c_mid_step_ends_in_one_line_and_the_run_resumes(model_dir, tmp_path, capsys, monkeypatch):
    out = str(tmp_path)
    monkeypatch.setattr(grpo, "grpo_loss", raise_on_call(grpo.grpo_loss, 5, signal.SIGINT))
    code, line = script_error(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=4), capsys)
    monkeypatch.undo()
    assert_interrupted(code, line, out)
    step = ckpt_step(out)  # loadable, and the step before the one interrupted
    assert 1 <= step < 4 and [r["step"] for r in read_metrics(out)] == list(range(1, step + 1))
    run_script(TRAIN, ["--resume", out])
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert ckpt_step(out) == 4


def test_ctrl_c_mid_save_keeps_the_last_good_checkpoint(model_dir, tmp_path, capsys, monkeypatch):
    out = str(tmp_path)
    save = toy.save_that_fails(signal.SIGINT, 1 / 2)  # step 2's checkpoint half written
    monkeypatch.setattr(torch, "save", save)
    code, line = script_error(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=3), capsys)
    monkeypatch.undo()
    assert_interrupted(code, line, out)
    assert ckpt_step(out) == 1
    run_script(TRAIN, ["--resume", out])
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def tokenizer_that_cannot_save(monkeypatch, error):
    """models.load_tokenizer hands train.py a tokenizer whose save_pretrained (the export's last write) raises."""
    real = models.load_tokenizer

    def load(*a, **k):
        tok = real(*a, **k)
        tok.save_pretrained = raise_on_call(tok.save_pretrained, 1, error)
        return tok

    monkeypatch.setattr(models, "load_tokenizer", load)


def test_ctrl_c_mid_export_leaves_no_temp_folder(model_dir, tmp_path, capsys, monkeypatch):
    out = str(tmp_path)
    tokenizer_that_cannot_save(monkeypatch, signal.SIGINT)
    code, line = script_error(TRAIN, train_args(model_dir, out, steps=2), capsys)
    assert code == 130 and leftovers(out) == [], (code, line)
    assert not os.path.exists(os.path.join(out, "hf"))  # no half export where a whole one belongs
    assert ckpt_step(out) == 2


def test_export_that_raises_is_one_line_and_keeps_the_checkpoint(model_dir, tmp_path, capsys, monkeypatch):
    out = str(tmp_path)
    tokenizer_that_cannot_save(monkeypatch, RuntimeError("disk full"))
    code, line = script_error(TRAIN, train_args(model_dir, out, steps=2), capsys)
    assert_one_line(code, line, 1, "disk full")
    assert leftovers(out) == [] and not os.path.exists(os.path.join(out, "hf"))
    assert ckpt_step(out) == 2 and [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("sig, codes", [(signal.SIGINT, (130,)), (signal.SIGTERM, (143,))], ids=["INT", "TERM"])
def test_a_signal_mid_run_ends_in_one_line_and_the_run_resumes(model_dir, tmp_path, sig, codes):
    out = str(tmp_path / "run")
    argv = train_args(model_dir, out, "--config", "save_every=1", steps=500)
    with open(tmp_path / "stderr", "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, TOY_TRAIN, *map(str, argv)],
            cwd=REPO,
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
        try:
            deadline = time.time() + 300
            while not os.path.exists(os.path.join(out, "ckpt.pt")):
                assert proc.poll() is None, open(tmp_path / "stderr").read()[-2000:]
                assert time.time() < deadline, "no checkpoint after 300 s"
                time.sleep(0.1)
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = open(tmp_path / "stderr").read()
    assert "Traceback" not in err, err[-2000:]
    assert_interrupted(proc.returncode, err.strip().splitlines()[-1], out, codes)
    step = ckpt_step(out)
    run_script(TRAIN, ["--resume", out, "--steps", step + 1])
    assert [r["step"] for r in read_metrics(out)] == list(range(1, step + 2))


# -----------------------------------------------------------------------------
# a full disk while saving


@pytest.mark.parametrize("raised", ["OSError", "RuntimeError"])
def test_disk_full_keeps_the_last_good_checkpoint_and_ends_in_one_line(
    model_dir, tmp_path, capsys, monkeypatch, raised
):
    """Either error a full disk gives: os.replace's OSError, or torch.save's RuntimeError ('unexpected pos ...',
    raised here by torch.save onto /dev/full, a device that is always full). Fails if run.save lets either through
    (a traceback, issue 53, 3) instead of the warning, the run going on and one line at the end that names the file
    and says make room; or if the temp file stays or the last good checkpoint is touched."""
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if raised == "RuntimeError":
        if not os.path.exists("/dev/full"):
            pytest.skip("needs /dev/full (Linux)")
        with pytest.raises(RuntimeError, match="unexpected pos") as full:
            torch.save({"x": torch.zeros(4096)}, "/dev/full")
        error = full.value
    save_until_full = toy.save_that_fails(error, 1 / 3)  # a third in
    monkeypatch.setattr(torch, "save", save_until_full)
    out = str(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_script(TRAIN, train_args(model_dir, out, "--config", "save_every=1", steps=3))
    monkeypatch.undo()
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 1  # the last good one, whole
    assert not os.path.exists(os.path.join(out, "ckpt.pt.tmp"))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # the run went on after the failed save
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    warnings = [x for x in printed.out.splitlines() if x.startswith("warning: step")]
    assert [w.split(":")[1] for w in warnings] == [" step 2", " step 3"], warnings
    assert_one_line(
        1,
        e.value.code,
        1,
        "the last checkpoint was not written",
        f"{out}/ckpt.pt",
        "No space left on device" if raised == "OSError" else "unexpected pos",
        "make room",
    )


# -----------------------------------------------------------------------------
# prompts longer than the context leaves them


def test_long_prompts_keep_their_last_tokens_and_are_counted(model_dir, tmp_path, monkeypatch):
    """A model with a context of 16 and --max-new-tokens 12: each prompt keeps its last 16 - 12 = 4 tokens."""
    import inspect
    from transformers import AutoModelForCausalLM

    short = str(tmp_path / "short")
    shutil.copytree(model_dir, short)
    m = AutoModelForCausalLM.from_pretrained(short)
    m.config.max_position_embeddings = 16
    m.save_pretrained(short)
    seen, real_sample = [], rollout.sample
    bind = inspect.signature(real_sample).bind
    monkeypatch.setattr(
        rollout, "sample", lambda *a, **k: seen.append((bind(*a, **k).arguments, real_sample(*a, **k))) or seen[-1][1]
    )
    g = run_script(TRAIN, train_args(short, str(tmp_path / "out"), steps=1))
    assert read_metrics(str(tmp_path / "out"))[0]["prompt_cut"] == 1.0  # every toy prompt is 8 tokens
    [(called, r)] = seen
    tok, G = g["tokenizer"], called["group_size"]
    for i, messages in enumerate(called["prompts"]):
        full = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert len(full["input_ids"]) == 8
        for row in range(i * G, (i + 1) * G):
            assert r.prompt_mask[row].tolist() == [1, 1, 1, 1]
            assert r.prompt_ids[row].tolist() == full["input_ids"][-4:]


def test_prompts_within_the_limit_are_not_cut(model_dir, tmp_path):
    run_script(TRAIN, train_args(model_dir, str(tmp_path), steps=1))  # the context 512 leaves 500 for a prompt
    assert read_metrics(str(tmp_path))[0]["prompt_cut"] == 0.0


# -----------------------------------------------------------------------------
# eval.py: no predictions file, whole or partial, unless the evaluation finished and was written whole


def eval_args(model_dir, *extra):
    return [
        "--task",
        "toy",
        "--model",
        model_dir,
        "--limit",
        2,
        "--max-new-tokens",
        4,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        *extra,
    ]


def test_eval_out_into_a_new_folder_is_created_before_evaluating(model_dir, tmp_path):
    out = tmp_path / "new" / "deeper" / "preds.jsonl"
    run_script(EVAL, eval_args(model_dir, "--out", out))
    rows = [json.loads(x) for x in open(out)]
    assert len(rows) == 2 and all("completion" in r for r in rows)
    assert not os.path.exists(str(out) + ".tmp")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "{tmp}"], "--out {tmp} is a directory; pass a file path such as {tmp}/predictions.jsonl"),
        (["--out", "{tmp}/afile/preds.jsonl"], "--out {tmp}/afile/preds.jsonl cannot be written"),
        (["--max-new-tokens", 0], "--max-new-tokens must be >= 1, got 0"),
        (["--n", 0], "--n must be >= 1, got 0"),
        (["--limit", 0], "--limit must be >= 1, got 0"),
        (["--batch-size", 0], "--batch-size must be >= 1, got 0"),
        (["--temperature", -1], "--temperature must be > 0, got -1.0"),
        (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    ],
    ids=[
        "out-is-a-dir",
        "out-under-a-file",
        "max-new-tokens",
        "n",
        "limit",
        "batch-size",
        "temperature",
        "temperature-nan",
    ],
)
def test_eval_bad_input_is_one_line_before_evaluating(
    model_dir, tmp_path, capsys, monkeypatch, no_model_load, extra, message
):
    """One line, before the model loads and before anything is written. Run from inside tmp_path: without --out the
    output (and its probe) is ./predictions.jsonl, so a write into the working directory shows in tmp_path. Fails if
    a flag is checked after the --out probe, or after the model loads."""
    # no_model_load rather than a patched eval.evaluate: runpy runs a fresh copy of eval.py's functions,
    # and a model that never loads is earlier still than an evaluation that never starts
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a regular file, not a folder")
    extra = [str(x).replace("{tmp}", str(tmp_path)) for x in extra]
    argv = without(eval_args(model_dir), *extra[::2]) + extra
    code, line = script_error(EVAL, argv, capsys)
    assert_one_line(code, line, 2, "eval.py: error: " + message.replace("{tmp}", str(tmp_path)))
    assert list(files(tmp_path)) == ["afile"]  # not even the probe of --out


def fail_in_sample(error):
    def patch(monkeypatch):  # the evaluation's first batch raises `error` (eval.py imports rollout.sample)
        def raise_(*a, **k):
            toy.fail(error)

        monkeypatch.setattr(rollout, "sample", raise_)  # eval.py, run afresh, imports it then

    return patch


def fail_while_writing(error):
    def patch(monkeypatch):  # the first prediction line reaches the temp file, then `error`
        real = json.dumps

        def dumps(obj, *a, **k):
            if isinstance(obj, dict) and "question" in obj and dumps.lines:
                toy.fail(error)
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


@pytest.mark.parametrize(
    "patch, code, message",
    [
        (fail_in_sample(RuntimeError("a bug, not a user mistake")), None, None),
        (fail_in_sample(signal.SIGINT), 130, "error: interrupted; no predictions written"),
        (fail_while_writing(signal.SIGINT), 130, "error: interrupted; no predictions written"),
        (
            fail_while_writing(OSError(errno.ENOSPC, "No space left on device")),
            1,
            "error: could not write the predictions to {out} (No space left on device)",
        ),
        (fail_at_rename, 1, "error: could not write the predictions to {out} (No space left)"),
    ],
    ids=[
        "bug-in-sampling",
        "ctrl-c-in-sampling",
        "ctrl-c-while-writing",
        "disk-full-while-writing",
        "disk-full-at-rename",
    ],
)
def test_eval_leaves_no_file_on_any_failure(model_dir, tmp_path, capsys, monkeypatch, patch, code, message):
    out = tmp_path / "sub" / "preds.jsonl"
    patch(monkeypatch)
    if code is None:  # a bug is a traceback (not ours to hide), but still leaves nothing behind
        with pytest.raises(RuntimeError, match="a bug"):
            run_script(EVAL, eval_args(model_dir, "--out", out))
    else:
        assert script_error(EVAL, eval_args(model_dir, "--out", out), capsys) == (code, message.format(out=out))
    assert files(tmp_path) == {}  # no preds.jsonl, no preds.jsonl.tmp


@pytest.mark.parametrize(
    "what, fragment", [("missing", "no checkpoint at"), ("corrupt", "not a checkpoint train.py wrote")]
)
def test_eval_bad_checkpoint_is_one_line_and_leaves_nothing(tmp_path, capsys, what, fragment):
    if what == "corrupt":
        (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    path = tmp_path / "missing" if what == "missing" else tmp_path
    code, line = script_error(EVAL, ["--task", "toy", "--ckpt", path, "--device", "cpu"], capsys)
    assert_one_line(code, line, 2, "eval.py: error: ", fragment)
    assert list(files(tmp_path)) == (["ckpt.pt"] if what == "corrupt" else [])


# -----------------------------------------------------------------------------
# eval.py --plot


def write_run(path, rows, tail=""):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return str(path)


ROWS = [
    {"step": 0, "reward": 0.1, "kl": 0.0},
    {"step": 1, "reward": 0.3, "kl": 0.01},
    {"step": 1, "eval/strict_acc": 0.2},
]


@pytest.mark.parametrize("smooth", [0, -2])
def test_plot_smooth_below_one(tmp_path, capsys, smooth):
    run = write_run(tmp_path / "a", ROWS)
    code, line = script_error(PLOT, ["--plot", run, "--smooth", smooth, "--out", tmp_path / "c.png"], capsys)
    assert (code, line) == (2, f"eval.py: error: --smooth must be >= 1, got {smooth}")
    assert not (tmp_path / "c.png").exists()


def test_plot_out_with_a_format_matplotlib_cannot_write(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "a", ROWS)
    code, line = script_error(PLOT, ["--plot", run, "--out", tmp_path / "c.xyz"], capsys)
    assert code == 2 and line.startswith(f"eval.py: error: --out {tmp_path}/c.xyz: matplotlib writes only ")
    assert {".png", ".pdf", ".svg"} <= set(line.split("only ")[1].split())
    assert list(files(tmp_path)) == [os.path.join("a", "metrics.jsonl")]


def test_plot_out_into_a_missing_folder_creates_it(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "new" / "deeper" / "c.pdf"
    run_script(PLOT, ["--plot", write_run(tmp_path / "a", ROWS), "--out", out])
    assert out.read_bytes()[:5] == b"%PDF-"


@pytest.mark.parametrize("flag", ["--key", "--eval-key"])
def test_plot_a_key_no_run_has_names_the_keys_they_have(tmp_path, capsys, flag):
    pytest.importorskip("matplotlib")
    a, b = write_run(tmp_path / "a", ROWS), write_run(tmp_path / "b", [{"step": 0, "reward/correct": 1.0}])
    code, line = script_error(PLOT, ["--plot", a, b, flag, "rewrd", "--out", tmp_path / "c.png"], capsys)
    assert (code, line) == (
        1,
        f"error: {flag} rewrd: no run logged it; the runs have eval/strict_acc, kl, reward, reward/correct",
    )
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize("content", ["", "\n\n", '{"step": 0, "rew'], ids=["empty", "blank", "torn-only"])
def test_plot_a_run_without_rows(tmp_path, capsys, content):
    pytest.importorskip("matplotlib")
    a, b = write_run(tmp_path / "a", ROWS), write_run(tmp_path / "b", [], content)
    code, line = script_error(PLOT, ["--plot", a, b, "--out", tmp_path / "c.png"], capsys)
    assert (code, line) == (
        1,
        f"error: {b}/metrics.jsonl has no metrics rows (empty, or the run has not logged a step); nothing plotted",
    )
    assert not (tmp_path / "c.png").exists()


def test_plot_rows_that_never_hold_the_key(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "a", [{"step": 0, "reward": None}, {"step": 1, "kl": 0.5}])  # null: non-finite
    code, line = script_error(PLOT, ["--plot", run, "--out", tmp_path / "c.png"], capsys)
    assert (code, line) == (1, "error: --key reward: no run logged it; the runs have kl")
    assert not (tmp_path / "c.png").exists()


def test_plot_reads_a_torn_last_line_and_blank_lines(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "a", ROWS[:1], "\n\n" + json.dumps(ROWS[1]) + "\n" + '{"step": 2, "reward": 0.')
    run_script(PLOT, ["--plot", run, "--out", tmp_path / "c.png"])
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'c.png'}"
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    run = write_run(tmp_path / "a", ROWS)
    code, line = script_error(PLOT, ["--plot", run, "--out", tmp_path / "c.png"], capsys)
    assert (code, line) == (1, "error: plotting needs matplotlib: pip install matplotlib")


# -----------------------------------------------------------------------------
# in a fresh interpreter: the exit code and stderr a user sees


@pytest.mark.slow
def test_usage_error_in_a_fresh_process_exits_2_without_a_traceback(model_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, TOY_TRAIN, *map(str, train_args(model_dir, str(tmp_path), "--lr", "nan"))],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "train.py: error: --lr must be a finite number, got nan"


@pytest.mark.slow
def test_unknown_inline_config_key_in_a_fresh_process_exits_2(model_dir, tmp_path):
    argv = train_args(model_dir, str(tmp_path / "out"), "--config", "lr_scheule=cosine")
    proc = subprocess.run(
        [sys.executable, TOY_TRAIN, *map(str, argv)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "error:" in line and "lr_scheule" in line, line
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


RUN_WITH_BROKEN_REWARD = """
import runpy, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import toy
from tasks import TASKS
def broken(completions, **_):
    raise KeyError("gold")
TASKS["toy"] = toy.TASK._replace(reward_fns={{**toy.TASK.reward_fns, "broken": broken}},
                                 reward_weights={{**toy.TASK.reward_weights, "broken": 1.0}})
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_failed_run_in_a_fresh_process_exits_1_without_a_traceback(model_dir, tmp_path):
    code = RUN_WITH_BROKEN_REWARD.format(repo=REPO, tests=os.path.join(REPO, "tests"), train=TRAIN)
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, train_args(model_dir, str(tmp_path)))],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: step 1: reward 'broken' raised KeyError: 'gold' on completion 0 ")
    )


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"])
def test_eval_real_signal_in_a_fresh_process(model_dir, tmp_path, sig, code):
    out = tmp_path / "preds.jsonl"
    argv = [
        "--task",
        "arith",
        "--model",
        model_dir,
        "--n",
        4,
        "--max-new-tokens",
        64,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--out",
        out,
    ]  # 200 problems, a minute of work: it cannot finish first
    proc = subprocess.Popen(
        [sys.executable, EVAL, *map(str, argv)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        err = b""
        while not re.search(rb"eval: .* [1-9]\d*/200 ", err):  # the bar has moved: inside the evaluation
            chunk = os.read(proc.stderr.fileno(), 4096)
            if not chunk:
                break
            err += chunk
        assert re.search(rb"eval: .* [1-9]\d*/200 ", err), err.decode()
        proc.send_signal(sig)
        err += proc.stderr.read()
        assert proc.wait(timeout=60) == code
    finally:
        proc.kill()
    assert "Traceback" not in err.decode()
    assert err.decode().strip().splitlines()[-1] == "error: interrupted; no predictions written"
    assert files(tmp_path) == {}
