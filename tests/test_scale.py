"""LoRA (peft), FSDP2 under torchrun (gloo, two CPU processes), DCP checkpoints and the Hugging Face export,
end to end on the toy task and tiny Llama of tests/toy.py, in fp32.

Every comparison is against an independent computation: a fresh load of the base model, a 1-process
run, a run without the feature, or the export read back with plain transformers.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy  # noqa: E402
from conftest import assert_close_scaled  # noqa: E402
from toy import EVAL, REPO, TIMING, TOY_TRAIN, TRAIN, read_metrics, run_script, subprocess_env, train_args  # noqa: E402

import models  # noqa: E402
import scale  # noqa: E402
from rollout import token_logprobs  # noqa: E402

# peft is optional (CI installs it): without it the tests that use LoRA skip, and the rest run
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft: pip install peft")
CPU = torch.device("cpu")
LORA = ("--lora-rank", 4)


def batch(seed=0):
    """Rows of toy words (ids 8..47) with some right padding: input_ids, attention_mask (4, 14), C = 8."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, len(toy.VOCAB), (4, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    mask[3, -5:] = 0
    return ids, mask, 8


@torch.no_grad()
def logp(model, fn=token_logprobs):
    ids, mask, C = batch()
    return fn(model, ids, mask, C)[0]  # (4, C)


def fresh(model_dir):
    return models.load_model(model_dir, CPU, torch.float32, trainable=False)


def lora_from(out, merge=False):
    """The trained LoRA policy rebuilt from a run's ckpt.pt: a fresh base, peft adapters, the saved weights."""
    from eval import load_checkpoint_model

    return load_checkpoint_model(out, CPU, torch.float32, merge=merge)[0]


def error_line(script, argv, capsys):
    """Run a script expecting a user error: (exit code, the last stderr line); never a traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_script(script, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return e.value.code, err.strip().splitlines()[-1]


# -----------------------------------------------------------------------------
# LoRA


@pytest.fixture(scope="module")
def lora4(model_dir, tmp_path_factory):
    """4 LoRA steps, beta 0.04 (the reference is the base), a checkpoint every 2 steps, no export (the export
    merges the policy in place, and these tests look at the policy itself)."""
    out = str(tmp_path_factory.mktemp("lora4"))
    g = run_script(
        TRAIN, train_args(model_dir, out, *LORA, "--config", "save_every=2", "--config", "export=none", steps=4)
    )
    return out, g


@needs_peft
def test_lora_reference_is_the_base_model(lora4, model_dir):
    """The reference pass (the policy with its adapters disabled) gives exactly the base model's log-probs,
    while the trained adapters change them: no second copy of the weights is loaded."""
    _, g = lora4
    assert g["ref"] is g["policy"] and scale.is_lora(g["policy"])
    base = logp(fresh(model_dir))
    with g["as_reference"]():  # what train.py runs as the reference
        assert torch.equal(logp(g["policy"]), base)
    assert (logp(g["policy"]) - base).abs().max() > 1e-4  # the adapters moved the policy
    rows = read_metrics(lora4[0])
    assert rows[0]["kl"] == 0 < rows[-1]["kl"]  # B starts at 0: policy == base until the first update


@needs_peft
def test_lora_trains_the_adapters_and_leaves_the_base_bit_identical(lora4, model_dir):
    out, g = lora4
    policy, init = g["policy"], fresh(model_dir).state_dict()
    trained = {n for n, q in policy.named_parameters() if q.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert {id(q) for q in g["params"]} == {id(q) for n, q in policy.named_parameters() if n in trained}
    for name, q in policy.named_parameters():
        if name in trained:
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(q, init[key]), name  # frozen, bit for bit
    for name, q in policy.named_parameters():
        if "lora_B" in name:  # B starts at 0: non-zero means it received gradients and moved
            assert q.abs().min() > 0, name
    state = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert len(state["model"]) == len(trained) and all("lora_" in k for k in state["model"])  # adapters only
    for s in state["optimizer"]["state"].values():  # every adapter tensor's Adam state saw non-zero gradients
        assert s["exp_avg_sq"].max() > 0


@needs_peft
def test_lora_base_in_bfloat16_adapters_in_float32(model_dir, tmp_path):
    g = run_script(
        TRAIN, train_args(model_dir, str(tmp_path), *LORA, "--dtype", "bfloat16", "--config", "export=none", steps=1)
    )
    dtypes = set()
    for n, q in g["policy"].named_parameters():
        kind = "rest"
        if "proj" in n:
            kind = "base_linear"
        if "lora_" in n:
            kind = n.split(".")[-2]
        dtypes.add((kind, q.dtype))
    assert dtypes == {("default", torch.float32), ("base_linear", torch.bfloat16), ("rest", torch.float32)}
    [row] = read_metrics(str(tmp_path))
    assert row["kl"] == 0 and 0 < row["dlogp_max"] < 1  # the base in bf16 is the reference: same bits at step 0


@pytest.mark.slow
@needs_peft
def test_lora_resume_in_a_fresh_process_is_exact(lora4, model_dir, tmp_path):
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, *LORA, "--config", "save_every=2", "--config", "export=none", steps=2))
    proc = subprocess.run(
        [sys.executable, TOY_TRAIN, "--resume", out, "--steps", "4"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, want = read_metrics(out), read_metrics(lora4[0])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for got, ref in zip(rows[2:], want[2:]):
        for k in set(ref) - TIMING:
            assert got[k] == ref[k], (got["step"], k)  # bit for bit, as the weights below: same ops, same order
    a = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(lora4[0], "ckpt.pt"), weights_only=True)
    assert a["step"] == b["step"] == 4 and a["model"].keys() == b["model"].keys()
    for k, v in b["model"].items():
        assert torch.equal(a["model"][k], v), k


@needs_peft
def test_eval_ckpt_evaluates_a_lora_run(lora4, tmp_path):
    """eval.py --ckpt on a LoRA run: the adapters merged into the fp32 base, then evaluated."""
    out, g = lora4
    preds = str(tmp_path / "preds.jsonl")
    run_script(
        EVAL,
        [
            "--task",
            "toy",
            "--ckpt",
            out,
            "--limit",
            3,
            "--max-new-tokens",
            6,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--out",
            preds,
        ],
    )
    assert len(open(preds).readlines()) == 3
    # merged == the trained policy, to the fp32 rounding of W + s*B@A (see test_export_lora_merged)
    assert_close_scaled(logp(lora_from(out, merge=True)), logp(g["policy"]))


# -----------------------------------------------------------------------------
# the Hugging Face export


def test_export_full_fine_tune_loads_with_plain_transformers(model_dir, tmp_path):
    out = str(tmp_path)
    g = run_script(TRAIN, train_args(model_dir, out, steps=2))
    hf = os.path.join(out, "hf")
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    # fp32 weights written as they are: the same log-probs as the trained policy, to the bit
    assert torch.equal(logp(model), logp(g["policy"]))
    init = fresh(model_dir)
    assert (logp(model) - logp(init)).abs().max() > 1e-4  # and not the initial model's
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.get_vocab() == g["tokenizer"].get_vocab() and tok.chat_template == g["tokenizer"].chat_template
    assert model.generation_config.eos_token_id == toy.EOS
    assert not [f for f in os.listdir(out) if f.startswith(".hf.")]  # no temp directory left


def test_export_in_bfloat16_by_default_dtype(model_dir, tmp_path):
    out = str(tmp_path)
    args = train_args(model_dir, out, steps=1)
    args[args.index("--dtype") + 1] = "bfloat16"
    g = run_script(TRAIN, args)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
    assert json.load(open(os.path.join(out, "hf", "config.json")))["dtype"] == "bfloat16"
    for (k, v), q in zip(model.state_dict().items(), g["policy"].state_dict().values()):
        assert torch.equal(v, q.to(torch.bfloat16)), k  # the fp32 master weights, rounded once


@needs_peft
def test_export_lora_merged(model_dir, tmp_path):
    """Merged: W' = W + (alpha/r) B@A in fp32. The unmerged policy computes x W^T + s (x A^T) B^T instead;
    the two differ by fp32 rounding (~1e-7 relative per weight, a few ulps through 2 layers and the head),
    measured ~1e-6 (1.5 eps32) of log-probs up to ~5 here: 64 eps32 of their size (conftest.assert_close_scaled)
    leaves a margin and is far below what moving the adapters changes (0.02; > 1e-4 asserted)."""
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, *LORA, steps=2))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
    assert not hasattr(model, "peft_config") and type(model).__name__ == "LlamaForCausalLM"
    policy = lora_from(out)  # the trained adapters on a fresh base, unmerged
    assert_close_scaled(logp(model), logp(policy))
    assert (logp(model) - logp(fresh(model_dir))).abs().max() > 1e-4


@needs_peft
def test_export_lora_adapter_folder(model_dir, tmp_path):
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, *LORA, "--config", "export=adapter", steps=2))
    hf = os.path.join(out, "hf")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    model = AutoModelForCausalLM.from_pretrained(hf)  # transformers reads the base, then the adapters
    assert hasattr(model, "peft_config")
    assert torch.equal(logp(model), logp(lora_from(out)))  # the same fp32 adapters, the same ops


@needs_peft
def test_eval_export_from_checkpoints(lora4, model_dir, tmp_path):
    """eval.py --export DIR writes the same folder from a ckpt.pt as a run writes at its end."""
    out = str(tmp_path / "run")
    g = run_script(TRAIN, train_args(model_dir, out, "--config", "export=none", steps=2))
    run_script(EVAL, ["--ckpt", out, "--export", tmp_path / "full", "--dtype", "float32"])
    assert torch.equal(logp(AutoModelForCausalLM.from_pretrained(tmp_path / "full")), logp(g["policy"]))
    run_script(EVAL, ["--ckpt", lora4[0], "--export", tmp_path / "adapter", "--adapter"])
    assert torch.equal(logp(AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")), logp(lora4[1]["policy"]))
    run_script(EVAL, ["--ckpt", lora4[0], "--export", tmp_path / "merged", "--dtype", "float32"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_close_scaled(logp(merged), logp(lora4[1]["policy"]))  # merging rounds (test_export_lora_merged)


# -----------------------------------------------------------------------------
# user mistakes: one line


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--config", "export='adapter'"], "export = 'adapter' needs --lora-rank"),
        (["--fsdp"], "--fsdp shards over torchrun's processes"),
        (["--lora-rank", -1], "--lora-rank must be >= 0"),
        ([*LORA, "--config", "ref_sync_every=1"], "--lora-rank: the reference is the base"),
        (["--config", "export=nope"], "config key export 'nope': choose from"),
    ],
    ids=["adapter-without-lora", "fsdp-without-torchrun", "rank", "lora-ref-sync", "export"],
)
def test_bad_scale_flags_are_one_line_errors(model_dir, tmp_path, capsys, extra, message):
    code, last = error_line(TRAIN, train_args(model_dir, str(tmp_path / "out"), *extra, steps=1), capsys)
    assert code == 2 and message in last, last


@pytest.mark.parametrize(
    "extra",
    [LORA, ("--config", "ref_sync_every=1"), ("--dtype", "float16"), ("--ref-device", "cpu")],
    ids=["lora", "ref-sync", "float16", "ref-device"],
)
def test_what_fsdp_does_not_take_is_refused_before_any_process_group(model_dir, tmp_path, capsys, monkeypatch, extra):
    """Checked before torch.distributed starts: rank 0 of a 2-process run, as torchrun sets it up."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, last = error_line(TRAIN, train_args(model_dir, str(tmp_path / "out"), "--fsdp", *extra, steps=1), capsys)
    assert code == 2 and "--fsdp takes neither --lora-rank, ref_sync_every, --ref-device nor --dtype" in last, last


def test_lora_without_peft_is_a_one_line_install_hint(model_dir, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    code, last = error_line(TRAIN, train_args(model_dir, str(tmp_path / "out"), *LORA, steps=1), capsys)
    assert code == 2 and last.endswith("--lora-rank needs peft: pip install peft"), last


def test_eval_export_needs_a_checkpoint_and_a_new_directory(model_dir, tmp_path, capsys):
    code, last = error_line(EVAL, ["--model", model_dir, "--export", tmp_path / "x"], capsys)
    assert code == 2 and "--export needs --ckpt" in last
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("someone's file")
    code, last = error_line(EVAL, ["--ckpt", tmp_path, "--export", tmp_path / "full"], capsys)
    assert code == 2 and "exists and is not an empty directory" in last


# -----------------------------------------------------------------------------
# FSDP2: two CPU processes, gloo


def torchrun(args, **env):
    # 300 s as test_train's: 120 s, here in the module fixture three_runs, could end a setup on a loaded machine
    proc = toy.torchrun(args, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def fp32_state(path):
    """The weights a run ended with: its HF export read by plain transformers, or a ckpt.pt's model."""
    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path).state_dict()
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def three_runs(model_dir, tmp_path_factory):
    """The same 2 steps (4 completions x 2 prompts, an eval row each step) on 1 process, on 2 processes
    averaging gradients, and on 2 processes with --fsdp. The toy gradient norms (~1.5) exceed --grad-clip 1,
    so clipping is active and must use the global norm."""
    root = tmp_path_factory.mktemp("three")
    runs = {k: str(root / k) for k in ("one", "ddp", "fsdp")}
    extra = ("--eval-every", 1, "--eval-n", 2)
    g = run_script(TRAIN, train_args(model_dir, runs["one"], *extra, steps=2))
    ddp = torchrun(train_args(model_dir, runs["ddp"], *extra, steps=2))
    fsdp = torchrun(train_args(model_dir, runs["fsdp"], *extra, "--fsdp", steps=2))
    # each group's prompt ran once through the KV cache in all three (under FSDP2 the decoder's units then
    # run twice a micro-batch: the prompt pass, the completion pass): what is compared is the shared path
    assert g["passes"]["share"] and all("prompt sharing: on" in p.stdout for p in (ddp, fsdp))
    return runs


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process_and_the_all_reduce_path(three_runs, model_dir):
    """Parameters after 2 steps, to the bounds of toy.assert_same_training (FSDP reduce-scatters each
    micro-batch's gradient: another order of the same fp32 sums), prompts shared through the KV cache in all.
    AdamW does not see a gradient's scale, so the logged global gradient norm checks the averaging and the
    clipping: equal to 1e-5 relative. Fails if a rank's gradients are left out of the average, summed instead of
    averaged, or clipped by the rank's own norm."""
    init = fresh(model_dir).state_dict()
    one = fp32_state(os.path.join(three_runs["one"], "ckpt.pt"))
    for k in one:
        assert (one[k] - init[k]).abs().max() > 1e-4, k  # every tensor trained
    toy.assert_same_training(one, fp32_state(os.path.join(three_runs["ddp"], "ckpt.pt")))
    toy.assert_same_training(one, fp32_state(os.path.join(three_runs["fsdp"], "hf")))
    rows = {k: read_metrics(v) for k, v in three_runs.items()}
    assert [r["step"] for r in rows["fsdp"]] == [0, 1, 1, 2, 2]  # eval rows at 0, 1, 2 and the two steps
    for name in ("ddp", "fsdp"):
        for got, want in zip(rows[name], rows["one"]):
            for k in set(want) - TIMING:
                assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (name, got["step"], k)
    assert min(r["grad_norm"] for r in rows["one"] if "grad_norm" in r) > 1  # clipping was active


@pytest.mark.slow
def test_fsdp_resume_from_its_dcp_checkpoint_is_exact(three_runs, model_dir, tmp_path):
    out = str(tmp_path)
    extra = ("--eval-every", 1, "--eval-n", 2, "--fsdp")
    torchrun(train_args(model_dir, out, *extra, steps=1))
    assert sorted(f for f in os.listdir(out) if f.startswith("dcp-")) == ["dcp-000001"]
    torchrun(["--resume", out, "--steps", 2])
    assert sorted(f for f in os.listdir(out) if f.startswith("dcp-")) == ["dcp-000002"]  # the old one removed
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["dcp"] == "dcp-000002"
    want, got = fp32_state(os.path.join(three_runs["fsdp"], "hf")), fp32_state(os.path.join(out, "hf"))
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    rows, ref = read_metrics(out), read_metrics(three_runs["fsdp"])
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for a, b in zip(rows, ref):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


@pytest.mark.parametrize("error", [None, "the last checkpoint was not written: disk full"], ids=["done", "failed"])
def test_a_torchrun_worker_ends_in_scale_end_without_the_interpreter_s_teardown(error):
    """Issue 53, 6: FSDP2 keeps its gloo group alive past destroy_process_group; a thread of it still freeing tensors
    during the interpreter's teardown aborted a worker at random ('terminate called without an active exception').
    Fails if scale.end returns (or exits through the teardown: the atexit line appears), loses the output printed
    before it, or does not end with the error line and exit code 1 (0 without one)."""
    script = (
        f"import atexit, sys; sys.path.insert(0, {REPO!r}); import scale, torch.distributed as dist\n"
        "def nothing(*a, **k):\n    pass\n"
        "dist.barrier = dist.destroy_process_group = nothing  # one process: no group to leave\n"
        "atexit.register(print, 'teardown ran')\n"
        "print('the run', end='')\n"
        f"scale.end({error!r})\n"
        "print('scale.end returned')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.stdout == "the run", proc.stdout
    assert proc.returncode == (1 if error else 0) and proc.stderr == (f"error: {error}\n" if error else ""), proc


@pytest.mark.slow
def test_eval_export_and_eval_from_a_dcp_run(three_runs, tmp_path):
    """One process reads the shards of both ranks: the same weights as the run's own (gathered) export."""
    run = three_runs["fsdp"]
    run_script(EVAL, ["--ckpt", run, "--export", tmp_path / "hf", "--dtype", "float32"])
    want, got = fp32_state(os.path.join(run, "hf")), fp32_state(str(tmp_path / "hf"))
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    preds = str(tmp_path / "preds.jsonl")
    run_script(
        EVAL,
        [
            "--task",
            "toy",
            "--ckpt",
            run,
            "--limit",
            2,
            "--max-new-tokens",
            6,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--out",
            preds,
        ],
    )
    assert len(open(preds).readlines()) == 2


@pytest.mark.slow
@needs_peft
def test_lora_on_two_processes_starts_alike_and_averages_the_adapters(model_dir, tmp_path):
    """peft draws A from the global RNG, which train.py seeds per rank: the adapters are drawn from --seed
    instead, so both ranks start from, and keep, the same adapters, and 2 processes train as 1 does. Fails if the
    adapters are drawn from each rank's seed (the ranks differ), or their gradients are not averaged."""
    one, two, dump = str(tmp_path / "one"), str(tmp_path / "two"), str(tmp_path / "params")
    run_script(TRAIN, train_args(model_dir, one, *LORA, "--config", "export=none", steps=2))
    proc = torchrun(train_args(model_dir, two, *LORA, "--config", "export=none", steps=2), TOY_DUMP_PARAMS=dump)
    assert "prompt sharing: on" in proc.stdout  # the adapters run on the shared-prompt path too
    p0, p1 = torch.load(dump + ".rank0.pt"), torch.load(dump + ".rank1.pt")
    for k, v in p0.items():
        assert torch.equal(v, p1[k]), k
    a, b = (torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)["model"] for d in (one, two))
    toy.assert_same_training(a, b)
