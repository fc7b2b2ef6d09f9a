"""Every user-facing failure path of train.py and eval.py, run through the real entry point.

A usage mistake ends in argparse's one-line `error:` and exit code 2, before the model loads where the
mistake is in the flags alone; a run that fails on the way (a reward fn that raises, a full disk) ends
in one `error:` line and exit code 1. Never a traceback. Most cases run in this process (tests/toy.py's
run_script: SystemExit); a few run in a fresh interpreter to see the real exit code and stderr.
"""

import errno
import json
import math
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy  # noqa: E402
from toy import EVAL, REPO, TOY_TRAIN, TRAIN, read_metrics, run_script, subprocess_env, train_args  # noqa: E402

import models  # noqa: E402
import tasks  # noqa: E402


def script_error(path, argv, capsys):
    """Run train.py / eval.py expecting a user error -> (exit code, the one message line).

    p.error prints usage and `prog: error: ...` to stderr and exits 2; sys.exit("error: ...") hands Python
    the message, which it prints to stderr before exiting 1."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_script(path, argv)
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
            del argv[i:i + 2]
    return argv


@pytest.fixture
def no_model_load(monkeypatch):
    """A flag checked 'before anything loads' must never reach the model: loading fails the test."""
    def forbidden(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(models, "load_model", forbidden)
    monkeypatch.setattr(models, "load_tokenizer", forbidden)

# -----------------------------------------------------------------------------
# numeric flags: type and range, before the model loads


@pytest.mark.parametrize("flag, value, message", [
    ("--top-p", 0, "--top-p must be (0, 1], got 0.0"),
    ("--top-p", 1.5, "--top-p must be (0, 1], got 1.5"),
    ("--temperature", 0, "--temperature must be > 0, got 0.0"),
    ("--temperature", -1, "--temperature must be > 0, got -1.0"),
    ("--top-k", -1, "--top-k must be >= 0, got -1"),
    ("--eps", -0.1, "--eps must be [0, 1), got -0.1"),
    ("--warmup-steps", -1, "--warmup-steps must be >= 0, got -1"),
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
    ("--is-cap", 0, "--is-cap must be > 0, got 0.0"),
    ("--max-resample", -1, "--max-resample must be >= 0, got -1"),
    ("--overlong-buffer", -1, "--overlong-buffer must be >= 0, got -1"),
    ("--max-prompt-tokens", 0, "--max-prompt-tokens must be >= 1, got 0"),
    ("--delta", 1.1, "--delta 1.1 must be > 1 + eps_high = 1.2"),
    ("--lr", "fast", "argument --lr: invalid float value: 'fast'"),
], ids=lambda x: str(x))
def test_bad_flag_is_refused_before_the_model_loads(model_dir, tmp_path, capsys, no_model_load, flag, value, message):
    out = tmp_path / "out"
    code, line = script_error(TRAIN, without(train_args(model_dir, str(out), steps=1), flag) + [flag, value], capsys)
    assert_one_line(code, line, 2, f"train.py: error: {message}")
    assert not (out / "metrics.jsonl").exists()  # nothing ran, not even a first rollout


@pytest.mark.parametrize("line, message", [
    ("lr = None", "--lr needs a value, got None"),
    ("group_size = 2.0", "--group-size must be an integer, got 2.0"),
    ("temperature = 'hot'", "argument --temperature: invalid float value: 'hot'"),  # argparse converts str defaults
    ("lr = float('nan')", "the value of 'lr' must be a literal"),
    ("lr = 1e999", "--lr must be a finite number, got inf"),
    ("mask_truncated = 1", "--mask-truncated must be True or False, got 1"),
    ("steps = True", "--steps must be an integer, got True"),
    ("top_p = 0", "--top-p must be (0, 1], got 0"),
], ids=["lr-None", "group_size-float", "temperature-str", "nan-call", "inf", "bool-int", "int-bool", "range"])
def test_config_value_of_the_wrong_type_is_refused(model_dir, tmp_path, capsys, no_model_load, line, message):
    """Config values reach argparse as defaults: a string is converted as on the command line, anything else
    is not, so cli.check must see the type as well as the range."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(line + "\n")
    flag = "--" + line.split("=")[0].strip().replace("_", "-")
    code, err = script_error(TRAIN, ["--config", cfg, *without(train_args(model_dir, str(tmp_path / "o")), flag)],
                             capsys)
    assert_one_line(code, err, 2, message)


def test_resume_named_in_a_config_file_is_honoured(model_dir, tmp_path):
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, steps=2))
    cfg = tmp_path / "more.py"
    cfg.write_text(f"resume = {out!r}\nsteps = 3\n")
    g = run_script(TRAIN, ["--config", cfg])  # every other flag comes from the checkpoint
    assert g["start_step"] == 2 and g["args"].out_dir == out
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 3

# -----------------------------------------------------------------------------
# rewards: weights on the command line, reward functions that fail


@pytest.mark.parametrize("item", ["even=abc", "even=nan", "even=inf", "nope=1", "even"])
def test_bad_reward_weight_is_one_line(model_dir, tmp_path, capsys, no_model_load, item):
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path), "--reward-weights", item), capsys)
    assert_one_line(code, line, 2, f"--reward-weights: '{item}' is not name=number with name in ['even', 'first']")


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


@pytest.mark.parametrize("kind, message", [
    ("raises", "reward 'broken' raised ZeroDivisionError: division by zero on completion 0"),
    ("nan", "reward 'broken' gave nan for completion 0"),
    ("count", "reward 'broken' returned 7 values for 8 completions"),
])
def test_reward_fn_that_fails_names_itself_and_exits_1(model_dir, tmp_path, capsys, monkeypatch, kind, message):
    fns = {**toy.TASK.reward_fns, "broken": failing_on_step_2(kind)}
    monkeypatch.setitem(tasks.TASKS, "toy_broken", toy.TASK._replace(
        reward_fns=fns, reward_weights={**toy.TASK.reward_weights, "broken": 1.0}))
    argv = without(train_args(model_dir, str(tmp_path), steps=3), "--task") + ["--task", "toy_broken"]
    code, line = script_error(TRAIN, argv, capsys)
    assert_one_line(code, line, 1, f"error: step 2: {message}")
    with open(tmp_path / "metrics.jsonl") as f:  # step 1 was logged, and the file is JSON to the last byte
        rows = [json.loads(x, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for x in f]
    assert [r["step"] for r in rows] == [1]

# -----------------------------------------------------------------------------
# data


def gsm8k_line(question="What is 2 + 3?", answer="2 + 3 = 5\n#### 5"):
    return json.dumps({"question": question, "answer": answer}) + "\n"


@pytest.mark.parametrize("content, message", [
    (b"", "no examples in {train}"),
    (b"\n  \n\t\n", "no examples in {train}"),
    (gsm8k_line().encode() + b'{"question": "caf\xe9", "answer": "#### 1"}\n', "{train}:2: byte 0xe9 is not UTF-8"),
    (gsm8k_line().encode() + gsm8k_line(answer="2 + 3 = 5\n####  ").encode(), "{train}:2: nothing after '####'"),
    (gsm8k_line().encode(), "the train split has 1 examples, fewer than --prompts-per-step 2"),
], ids=["empty", "blank-only", "non-utf8", "empty-gold", "too-short"])
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
    import shutil
    bad = tmp_path / "corrupt"
    shutil.copytree(model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 100)
    return str(bad)


def gpt2_folder(model_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    path = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(toy.VOCAB))).save_pretrained(path)
    toy.make_tokenizer().save_pretrained(path)
    return str(path)


def fake_gguf(model_dir, tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all" * 50)
    return str(tmp_path / "x.gguf")


@pytest.mark.parametrize("make, extra, message", [
    (corrupt_weights, [], "could not load model '{model}'"),
    (fake_gguf, [], "cannot read {model} as a GGUF model"),
    (lambda d, t: str(t / "no" / "such" / "model"), [], "could not load model '{model}'"),
    (gpt2_folder, ["--lean", "on"], "--lean on: lean cannot reproduce this model (GPT2LMHeadModel"),
    (lambda d, t: d, ["--max-new-tokens", 600], "--max-new-tokens 600 + prompt -88 exceed the model's context of 512"),
    (lambda d, t: d, ["--max-prompt-tokens", 501], "--max-new-tokens 12 + prompt 501 exceed the model's context"),
], ids=["corrupt-safetensors", "not-gguf", "missing", "lean-on-gpt2", "max-new-tokens>context",
        "prompt+new>context"])
def test_bad_model_is_one_line(model_dir, tmp_path, capsys, monkeypatch, make, extra, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "CACHE_DIR", str(tmp_path / "cache"))  # a GGUF conversion would land here
    model = make(model_dir, tmp_path)
    argv = without(train_args(model, str(tmp_path / "out"), steps=1), *extra[::2]) + extra
    code, line = script_error(TRAIN, argv, capsys)
    assert_one_line(code, line, 2, message.format(model=model))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()

# -----------------------------------------------------------------------------
# flags that need a package, a task feature or a device


@pytest.mark.parametrize("extra, message", [
    (["--supervision", "process"], "--supervision process needs per-step rewards; task toy has none"),
    (["--overlong-buffer", 13], "--overlong-buffer 13 must be <= --max-new-tokens 12"),
], ids=["process-without-step-rewards", "overlong-buffer>max-new"])
def test_flag_the_task_cannot_honour_is_one_line(model_dir, tmp_path, capsys, no_model_load, extra, message):
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path), *extra), capsys)
    assert_one_line(code, line, 2, message)


def test_log_to_wandb_without_wandb_names_the_install(model_dir, tmp_path, capsys, no_model_load):
    import importlib.util
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    code, line = script_error(TRAIN, train_args(model_dir, str(tmp_path), "--log-to", "wandb"), capsys)
    assert_one_line(code, line, 2, "--log-to wandb needs the package wandb: pip install wandb")


def test_full_kl_with_the_reference_on_another_device_is_one_line(model_dir, tmp_path, capsys, monkeypatch,
                                                                  no_model_load):
    """The full KL makes the reference's logits beside the policy's. A second device to put the reference on:
    the GPU where there is one; on a CPU-only machine "meta" stands in for it (resolve_device and check_dtype
    accept it here), so the check between the two devices is what the test reaches."""
    if torch.cuda.is_available():
        device, ref_device = "cpu", "cuda"
    else:
        device, ref_device = "cpu", "meta"
        monkeypatch.setattr(models, "check_dtype", lambda device, dtype: None)
    argv = train_args(model_dir, str(tmp_path), "--kl-estimator", "full", "--ref-device", ref_device)
    code, line = script_error(TRAIN, without(argv, "--device") + ["--device", device], capsys)
    assert_one_line(code, line, 2, "--kl-estimator full computes the reference's logits beside the policy's: "
                                   "--ref-device must be --device")

# -----------------------------------------------------------------------------
# the out dir: two runs never mix


def test_a_new_run_into_a_run_dir_is_refused(model_dir, tmp_path, capsys):
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, steps=1))
    before = open(os.path.join(out, "metrics.jsonl")).read()
    code, line = script_error(TRAIN, train_args(model_dir, out, steps=1), capsys)
    assert_one_line(code, line, 2, f"--out-dir {out} holds a run (metrics.jsonl, ckpt.pt, config.json)",
                    f"--resume {out}", "--overwrite")
    assert open(os.path.join(out, "metrics.jsonl")).read() == before  # nothing appended


def test_overwrite_replaces_the_run(model_dir, tmp_path):
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, steps=2))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 2
    run_script(TRAIN, train_args(model_dir, out, "--overwrite", "--save-every", 0, steps=1))
    assert [r["step"] for r in read_metrics(out)] == [1]  # one line per step, none of the old run's
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))  # eval.py --ckpt cannot pick up the old model
    assert json.load(open(os.path.join(out, "config.json")))["steps"] == 1

# -----------------------------------------------------------------------------
# a full disk while saving


def test_disk_full_keeps_the_last_good_checkpoint_and_ends_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    save_until_full = toy.save_that_fails(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 1 / 3)  # a third in
    monkeypatch.setattr(torch, "save", save_until_full)
    out = str(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_script(TRAIN, train_args(model_dir, out, "--save-every", 1, steps=3))
    monkeypatch.undo()
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 1  # the last good one, whole
    assert not os.path.exists(os.path.join(out, "ckpt.pt.tmp"))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # the run went on after the failed save
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    warnings = [x for x in printed.out.splitlines() if x.startswith("warning: step")]
    assert [w.split(":")[1] for w in warnings] == [" step 2", " step 3"], warnings
    tensor_bytes = sum(v.numel() * v.element_size() for v in walk_tensors(ckpt))
    assert_one_line(1, e.value.code, 1, "error: the last checkpoint was not written: could not write "
                    f"{out}/ckpt.pt (No space left on device); about {math.ceil(tensor_bytes / 2**20)} MiB "
                    f"are needed in {out}")


def walk_tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from walk_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from walk_tensors(v)

# -----------------------------------------------------------------------------
# prompts longer than the limit


def test_long_prompts_keep_their_last_tokens_and_are_counted(model_dir, tmp_path, monkeypatch):
    import rollout
    seen, real_sample = [], rollout.sample
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: seen.append((a, real_sample(*a, **k))) or seen[-1][1])
    g = run_script(TRAIN, train_args(model_dir, str(tmp_path), "--max-prompt-tokens", 3, steps=1))
    assert read_metrics(str(tmp_path))[0]["prompt_cut"] == 1.0  # every toy prompt is longer than 3 tokens
    [(args, r)] = seen
    tok, prompts, G = g["tokenizer"], args[2], args[3]
    for i, messages in enumerate(prompts):
        full = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        want = full["input_ids"][-3:]
        for row in range(i * G, (i + 1) * G):
            assert r.prompt_mask[row].tolist() == [1, 1, 1]
            assert r.prompt_ids[row].tolist() == want


def test_prompts_within_the_limit_are_not_cut(model_dir, tmp_path):
    run_script(TRAIN, train_args(model_dir, str(tmp_path), steps=1))  # default limit: 512 - 12 tokens
    assert read_metrics(str(tmp_path))[0]["prompt_cut"] == 0.0

# -----------------------------------------------------------------------------
# eval.py


def eval_args(model_dir, *extra):
    return ["--task", "toy", "--model", model_dir, "--limit", 2, "--max-new-tokens", 4, "--device", "cpu",
            "--dtype", "float32", *extra]


def test_eval_out_into_a_new_folder_is_created_before_evaluating(model_dir, tmp_path):
    out = tmp_path / "new" / "deeper" / "preds.jsonl"
    run_script(EVAL, eval_args(model_dir, "--out", out))
    rows = [json.loads(x) for x in open(out)]
    assert len(rows) == 2 and all("completion" in r for r in rows)
    assert not os.path.exists(str(out) + ".tmp")


@pytest.mark.parametrize("extra, message", [
    (["--out", "{tmp}/afile/preds.jsonl"], "--out {tmp}/afile/preds.jsonl cannot be written"),
    (["--max-new-tokens", 0], "--max-new-tokens must be >= 1, got 0"),
    (["--n", 0], "--n must be >= 1, got 0"),
    (["--limit", 0], "--limit must be >= 1, got 0"),
    (["--batch-size", 0], "--batch-size must be >= 1, got 0"),
    (["--temperature", -1], "--temperature must be > 0, got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
], ids=["out-under-a-file", "max-new-tokens", "n", "limit", "batch-size", "temperature", "temperature-nan"])
def test_eval_bad_input_is_one_line_before_evaluating(model_dir, tmp_path, capsys, no_model_load, extra, message):
    # no_model_load rather than a patched eval.evaluate: runpy runs a fresh copy of eval.py's functions,
    # and a model that never loads is earlier still than an evaluation that never starts
    (tmp_path / "afile").write_text("a regular file, not a folder")
    extra = [str(x).replace("{tmp}", str(tmp_path)) for x in extra]
    argv = without(eval_args(model_dir), *extra[::2]) + extra
    code, line = script_error(EVAL, argv, capsys)
    assert_one_line(code, line, 2, "eval.py: error: " + message.replace("{tmp}", str(tmp_path)))

# -----------------------------------------------------------------------------
# in a fresh interpreter: the exit code and stderr a user sees


@pytest.mark.slow
def test_usage_error_in_a_fresh_process_exits_2_without_a_traceback(model_dir, tmp_path):
    proc = subprocess.run([sys.executable, TOY_TRAIN, *map(str, train_args(model_dir, str(tmp_path), "--lr", "nan"))],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "train.py: error: --lr must be a finite number, got nan"


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
    proc = subprocess.run([sys.executable, "-c", code, *map(str, train_args(model_dir, str(tmp_path)))], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: step 1: reward 'broken' raised KeyError: 'gold' on completion 0 ")
