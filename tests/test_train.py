"""End-to-end tests of train.py on a toy task with a dense reward and a tiny Llama (tests/toy.py).

Most runs are in-process (runpy, no interpreter start); resume runs in a fresh process and torchrun
in two, as a user would run them. A user mistake must end in SystemExit with a one-line message:
any other exception is the traceback the user would have seen.
"""

import inspect
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
import toy  # noqa: E402
from conftest import DECODE, EPS32, assert_close_scaled  # noqa: E402
from toy import REPO, TIMING, TOY_TRAIN, TRAIN, read_metrics, run_script, subprocess_env, train_args  # noqa: E402

REQUIRED = {
    "reward",
    "reward_std",
    "reward/even",
    "reward/first",
    "frac_zero_std",
    "kl",
    "clip_low",
    "clip_high",
    "clip",
    "entropy",
    "completion_len",
    "completion_len_max",
    "truncated",
    "grad_norm",
    "lr",
    "t_generate",
    "t_reference",
    "t_train",
    "gen_tok_s",
    "dlogp_max",
    "dlogp_p99",
    "dlogp_mean",
    "is_capped",
    "kl_max",
    "prompt_cut",
    "skipped",
    "loss",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
}
G = 4  # train_args: 2 prompts x 4 completions


@pytest.fixture(scope="module")
def run4(model_dir, tmp_path_factory):
    """4 steps, fp32, beta 0.04 (reference model), an entropy bonus, a checkpoint every 2 steps."""
    out = str(tmp_path_factory.mktemp("run4"))
    run_script(TRAIN, train_args(model_dir, out, "--entropy-coef", 0.01, "--config", "save_every=2", steps=4))
    return out


def initial_state(model_dir):
    return LlamaForCausalLM.from_pretrained(model_dir).state_dict()


def train_error(argv, capsys):
    """Run train.py expecting a user error: (exit code, the last stderr line)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_script(TRAIN, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return e.value.code, err.strip().splitlines()[-1]


# -----------------------------------------------------------------------------
# end to end


def test_end_to_end_logs_every_metric_saves_and_trains(run4, model_dir):
    """Four fp32 steps: every metric logged, finite and in range, the checkpoint and run.json as asked, every
    parameter trained. Step 1's reference is the policy itself in the same numerics, so its KL is exactly 0 (not
    < 1e-6). Fails if a metric goes missing, or if the reference pass rounds otherwise than the policy's (e.g. whole
    rows against the shared prompt: a KL of ~1e-14)."""
    rows = read_metrics(run4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one line per step
    for r in rows:
        assert not REQUIRED - set(r), f"missing metrics {sorted(REQUIRED - set(r))}"
        assert all(math.isfinite(v) for v in r.values()), r
        # the logged total is the weighted sum of the logged reward fns (weights even=1, first=0.5)
        assert r["reward"] == pytest.approx(r["reward/even"] + 0.5 * r["reward/first"], abs=1e-5)
        assert 0 <= r["frac_zero_std"] <= 1 and 0 <= r["truncated"] <= 1
        assert 0 <= r["clip_low"] <= r["clip"] <= 1 and 0 <= r["clip_high"] <= r["clip"]
        assert 1 <= r["completion_len"] <= r["completion_len_max"] <= 12
        assert 0 < r["entropy"] <= math.log(len(toy.VOCAB)) + 1e-4  # nats, temperature 1
        assert r["lr"] == pytest.approx(1e-3) and r["grad_norm"] > 0
        assert min(r[k] for k in TIMING) > 0
    assert rows[0]["kl"] == rows[0]["kl_max"] == 0.0 < rows[-1]["kl"]  # fp32 policy == reference before an update
    assert len({r["reward"] for r in rows}) > 1 and max(r["reward_std"] for r in rows) > 0

    config = json.load(open(os.path.join(run4, "run.json")))
    assert (config["task"], config["steps"], config["entropy_coef"], config["eps_high"]) == ("toy", 4, 0.01, 0.2)
    assert (config["save_every"], config["log_completions"], config["lr_schedule"]) == (2, 1, "constant")
    ckpt = torch.load(os.path.join(run4, "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 4 and ckpt["config"]["out_dir"] == run4 and len(ckpt["rng"]) == 1
    assert not os.path.exists(os.path.join(run4, "ckpt.pt.tmp"))
    init = initial_state(model_dir)
    unchanged = [k for k, v in ckpt["model"].items() if torch.equal(v, init[k])]
    assert not unchanged, f"parameters that never changed: {unchanged}"


def test_max_dlogp_float32_is_tiny(run4):
    """fp32 samples from the policy itself and the first pass is on-policy: the two log-probs agree."""
    assert max(r["dlogp_max"] for r in read_metrics(run4)) < 1e-3


def toy_rewards(completions, prompts):
    """The toy task's total reward (even + 0.5 first) of each completion, its answer looked up by question."""
    answers = {e["question"]: e["answer"] for e in toy.load("train")}
    gold = [answers[prompts[i // G][-1]["content"]] for i in range(len(completions))]
    return [toy.frac_even([c])[0] + 0.5 * toy.first_parity([c], [a])[0] for c, a in zip(completions, gold)]


@pytest.mark.parametrize(
    "extra",
    [(), ("--micro-batch", 8), ("--gradient-checkpointing",)],
    ids=["prompts-shared", "two-prompts-a-call", "whole-rows"],
)
def test_first_step_loss_and_gradient_are_grpo_loss_by_hand(model_dir, tmp_path, monkeypatch, capsys, extra):
    """Step 1 against an independent computation on the rollout it sampled: rewards from the toy fns,
    advantages (r - mean) / (std + 1e-4) per group written out here, log-probs from the initial model's full
    (N, C, V) logits over whole rows (no KV cache, no micro-batches), the reference == the policy. The logged
    loss and pre-clip gradient norm must be grpo_loss's on those, and the update AdamW's first step on that
    gradient. By default each group's prompt runs once through the KV cache (one group a micro-batch, or two
    prompts of other lengths in one); with --gradient-checkpointing (no cache in training) whole rows run,
    and one line says so.
    Bounds: fp32 on both sides, only the summation order differs (prompt pass apart, micro-batches): log-probs
    agree to ~1e-6, the norm (~1) to ~1e-6 relative (rtol 1e-5). AdamW's first update is lr * g / (|g| + 1e-8)
    after clipping, i.e. lr * sign(g) to 1e-4 where |g| > 1e-4, far above the gradients' rounding (~1e-6)."""
    sampled = []
    real = rollout.sample

    def spy(*a, **k):
        sampled.append((a[2], real(*a, **k)))
        return sampled[-1][1]

    monkeypatch.setattr(rollout, "sample", spy)
    out = str(tmp_path)
    g = run_script(TRAIN, train_args(model_dir, out, *extra, steps=1))
    sharing_off = [x for x in capsys.readouterr().out.splitlines() if x.startswith("prompt sharing off:")]
    checkpointing = "--gradient-checkpointing" in extra
    assert g["passes"]["share"] is not checkpointing
    assert sharing_off == (
        []
        if not checkpointing
        else [
            "prompt sharing off: gradient checkpointing: transformers drops the KV cache in training; "
            "the log-prob passes run whole rows"
        ]
    )
    [(prompts, r)] = sampled
    [row] = read_metrics(out)

    rewards = torch.tensor(toy_rewards(r.completions, prompts), dtype=torch.float64).view(-1, G)  # (prompts, G)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()  # (N,)
    assert row["reward"] == pytest.approx(rewards.mean().item(), abs=1e-6) and adv.abs().max() > 0.1
    model = LlamaForCausalLM.from_pretrained(model_dir).train()
    ids, mask, P = r.input_ids, r.attention_mask, r.prompt_ids.size(1)  # (N, P+C)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = logits[:, P - 1 : -1].log_softmax(-1).gather(-1, r.completion_ids[..., None]).squeeze(-1)  # (N, C)
    m = r.completion_mask
    assert_close_scaled(r.sample_logp, (logp * m).detach(), DECODE)  # sampled from the policy (conftest)
    loss, _ = grpo.grpo_loss(
        logp,
        old_logp=None,
        ref_logp=logp.detach(),
        advantages=adv.float(),
        mask=m,
        obj=grpo.Objective(max_new_tokens=12),
        sample_logp=r.sample_logp,
        num_sequences=torch.tensor(8.0),
        num_tokens=m.sum().float(),
    )
    loss.backward()
    grads = {n: q.grad for n, q in model.named_parameters()}
    norm = torch.cat([x.flatten() for x in grads.values()]).norm()
    assert row["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert row["grad_norm"] == pytest.approx(norm.item(), rel=1e-5) and norm > 1e-3
    after = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["model"]
    checked = 0
    for n, q in model.named_parameters():
        big = grads[n].abs() > 1e-4
        step = (q.detach() - after[n]) / 1e-3  # (w0 - w1) / lr
        torch.testing.assert_close(step[big], grads[n].sign()[big], atol=1e-3, rtol=0, msg=n)
        checked += int(big.sum())
    assert checked > 0.5 * sum(q.numel() for q in model.parameters())
    assert row["dlogp_max"] < 1e-3  # sample() runs in eval mode: HF keeps its KV cache under checkpointing


def test_bfloat16_samples_from_the_fp32_policy_and_the_reference_matches_it(model_dir, tmp_path, capsys):
    """bf16: no second copy of the policy for sampling (the model's own forward under autocast), and the
    reference model computes in the policy's numerics: at step 1, before any update, policy == reference
    gives a KL of exactly 0, not bf16 noise. Prompt sharing stays on (its probe allows bf16 rounding)."""
    g = run_script(TRAIN, train_args(model_dir, str(tmp_path), "--dtype", "bfloat16", steps=2))
    assert g["passes"]["share"] and "prompt sharing off" not in capsys.readouterr().out
    assert {p.dtype for p in g["policy"].parameters()} == {torch.float32}  # master weights
    rows = read_metrics(str(tmp_path))
    assert rows[0]["kl"] == 0.0 < rows[1]["kl"]
    # the sampling pass runs other kernels than the training pass, in bf16: close, not equal (the toy
    # model's logits are O(1), so bf16 rounding moves a log-prob by ~1e-2 at most)
    assert all(0 < r["dlogp_max"] < 0.1 for r in rows)


def test_dtype_auto_records_the_dtype_that_ran(model_dir, tmp_path, capsys):
    """auto: bf16 where this CPU runs it natively, else fp32 with one line saying so; the run's files keep
    the resolved dtype, so a resume on another machine computes in the same one."""
    out = str(tmp_path / "run")
    run_script(TRAIN, train_args(model_dir, out, "--dtype", "auto", steps=1))
    native = models.native(torch.device("cpu"), torch.bfloat16)
    want = "bfloat16" if native else "float32"
    assert json.load(open(os.path.join(out, "run.json")))["dtype"] == want
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["config"]["dtype"] == want
    assert ("dtype auto -> float32: cpu has no native bf16 matmuls" in capsys.readouterr().out) == (not native)


def test_another_architecture_trains_through_its_own_modules(model_dir, tmp_path, capsys):
    """GPT-2 (learned positions, a fused qkv Conv1D, no rope): the log-prob passes call its own decoder and
    lm_head, so it trains as it is; prompt sharing is on when the probe finds the KV cache path equal to
    whole rows, else one line says why. Either way the first pass is on-policy (fp32)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    # no dropout (GPT-2's default is 0.1): the policy trains in train mode, and dropout would move its
    # log-probs away from the sampler's by ~0.1, hiding what this test looks at
    GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=16,
            n_head=2,
            vocab_size=len(toy.VOCAB),
            n_positions=64,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
            bos_token_id=toy.BOS,
            eos_token_id=toy.EOS,
        )
    ).save_pretrained(gpt2)
    toy.make_tokenizer().save_pretrained(gpt2)
    g = run_script(TRAIN, train_args(str(gpt2), str(tmp_path / "out"), steps=1))
    [row] = read_metrics(str(tmp_path / "out"))
    assert row["grad_norm"] > 0 and row["dlogp_max"] < 1e-3
    assert g["passes"]["share"] == ("prompt sharing off" not in capsys.readouterr().out)


def test_logged_lr_is_the_one_the_step_used(model_dir, tmp_path):
    """Linear warmup over 3 optimizer steps: steps 1, 2 update with lr * 1/4, lr * 2/4."""
    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--config", "warmup_steps=3", steps=2))
    assert [r["lr"] for r in read_metrics(str(tmp_path))] == pytest.approx([2.5e-4, 5e-4])


def test_eval_rows_at_start_every_n_steps_and_end(model_dir, tmp_path):
    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--eval-every", 1, "--eval-n", 3, steps=2))
    rows = read_metrics(str(tmp_path))
    evals = [r for r in rows if "eval/strict_acc" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(r["eval/n_examples"] == 3 and 0 <= r["eval/format_rate"] <= 1 for r in evals)
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]


# -----------------------------------------------------------------------------
# checkpoints and resume


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_exact(run4, model_dir, tmp_path):
    """2 steps, then --resume DIR --steps 4 in a new process == the 4-step run, metrics and weights."""
    out = str(tmp_path)
    run_script(TRAIN, train_args(model_dir, out, "--entropy-coef", 0.01, "--config", "save_every=2", steps=2))
    proc = subprocess.run(
        [sys.executable, TOY_TRAIN, "--resume", out, "--steps", "4"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, want = read_metrics(out), read_metrics(run4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for got, ref in zip(rows[2:], want[2:]):
        for k in set(ref) - TIMING:
            assert got[k] == ref[k], (got["step"], k)  # bit for bit, as the weights below: same ops, same order
    a = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(run4, "ckpt.pt"), weights_only=True)
    assert a["step"] == b["step"] == 4
    for k, v in b["model"].items():
        assert torch.equal(a["model"][k], v), k
    config = json.load(open(os.path.join(out, "run.json")))
    assert (config["steps"], config["resume"], config["entropy_coef"], config["save_every"]) == (4, out, 0.01, 2)


def test_resume_flags_on_top_of_the_checkpoint_config(run4, tmp_path):
    """--eps-high defaults to --eps: a resumed run given only --eps must not keep the old eps_high; the
    checkpoint's config-only keys (save_every=2) stay unless a --config changes them. The run is a copy of run4's
    ckpt.pt and run.json (a resume continues only a ckpt.pt beside its run.json), without its metrics."""
    for name in ("ckpt.pt", "run.json"):
        shutil.copy(os.path.join(run4, name), tmp_path / name)
    g = run_script(TRAIN, ["--resume", tmp_path, "--eps", 0.3, "--steps", 5, "--config", "log_completions=0"])
    assert (g["args"].eps, g["obj"].eps_high, g["args"].steps, g["start_step"]) == (0.3, 0.3, 5, 4)
    assert (g["args"].out_dir, g["args"].save_every, g["args"].log_completions) == (str(tmp_path), 2, 0)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [5]
    config = json.load(open(tmp_path / "run.json"))
    assert (config["eps"], config["eps_high"], config["entropy_coef"]) == (0.3, 0.3, 0.01)


class Killed(BaseException):
    """What a SIGKILL mid-write looks like from the inside: nothing after it runs."""


def test_a_kill_mid_save_keeps_the_last_good_checkpoint(model_dir, tmp_path, monkeypatch):
    save_then_die = toy.save_that_fails(Killed(), 1 / 2)  # half the bytes, then the kill
    calls = save_then_die.calls
    monkeypatch.setattr(torch, "save", save_then_die)
    with pytest.raises(Killed):
        run_script(TRAIN, train_args(model_dir, str(tmp_path), "--config", "save_every=1", steps=2))
    monkeypatch.undo()
    assert len(calls) == 2
    ckpt = torch.load(os.path.join(tmp_path, "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 1


# -----------------------------------------------------------------------------
# config files


def test_config_file_sets_defaults_and_the_command_line_wins(model_dir, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(
        f"# lab notes\ngroup_size = 2  # small groups\nmax_new_tokens = 6\nlr = 5e-4\n"
        f"micro_batch = 2\nmodel = {model_dir!r}\nsave_every = 0  # a config-only key\n"
    )
    out = str(tmp_path / "out")
    g = run_script(
        TRAIN,
        [
            "--config",
            cfg,
            "--task",
            "toy",
            "--out-dir",
            out,
            "--steps",
            1,
            "--lr",
            1e-3,
            "--micro-batch",
            4,
            "--eval-n",
            0,
            "--dtype",
            "float32",
            "--device",
            "cpu",
        ],
    )
    a = g["args"]
    assert (a.group_size, a.max_new_tokens, a.model) == (2, 6, model_dir)  # from the file
    assert (a.lr, a.micro_batch) == (1e-3, 4)  # the command line over the file
    assert (a.save_every, a.warmup_steps) == (0, 0)  # a config-only key from the file, another's default
    assert json.load(open(os.path.join(out, "run.json")))["group_size"] == 2
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))
    assert read_metrics(out)[0]["completion_len_max"] <= 6


def test_later_config_file_wins(model_dir, tmp_path):
    (tmp_path / "base.py").write_text("max_new_tokens = 6\nlr = 5e-4\n")
    (tmp_path / "ablation.py").write_text("max_new_tokens = 3\n")
    argv = train_args(model_dir, str(tmp_path / "out"), steps=1)
    for flag in ("--max-new-tokens", "--lr"):
        i = argv.index(flag)
        del argv[i : i + 2]
    g = run_script(TRAIN, ["--config", tmp_path / "base.py", "--config", tmp_path / "ablation.py", *argv])
    assert (g["args"].max_new_tokens, g["args"].lr) == (3, 5e-4)
    # an inline name=value is one more config, in order: after the files it wins, before them it loses
    for i, (configs, want) in enumerate(
        [
            (["--config", tmp_path / "base.py", "--config", "max_new_tokens=2"], 2),
            (["--config", "max_new_tokens=2", "--config", tmp_path / "ablation.py"], 3),
        ]
    ):
        argv[argv.index("--out-dir") + 1] = str(tmp_path / f"out{i}")
        assert run_script(TRAIN, [*configs, *argv])["args"].max_new_tokens == want


def test_save_every_zero_saves_nothing(model_dir, tmp_path):
    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--config", "save_every=0", steps=2))
    assert len(read_metrics(str(tmp_path))) == 2 and not os.path.exists(os.path.join(tmp_path, "ckpt.pt"))


@pytest.mark.parametrize(
    "line, message",
    [
        ("bogus_key = 1", "unknown key 'bogus_key'"),
        ("lr = 1e-3 * 2", "the value of 'lr' must be a literal"),
        ("lr = some_name", "the value of 'lr' must be a literal"),
        ("import os", "only `name = value` lines"),
        ("group_size = ", "cannot read config"),
        # values for flags with choices must be checked too: argparse checks choices only on the command line
        ("task = 'nope'", "task"),
        ("loss_type = 'nope'", "--loss-type 'nope': choose from"),
    ],
    ids=["unknown-key", "expression", "name", "import", "syntax", "bad-task-choice", "bad-loss-type-choice"],
)
def test_config_file_errors_are_one_line(model_dir, tmp_path, capsys, line, message):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"steps = 1\n{line}\n")
    argv = train_args(model_dir, str(tmp_path / "out"), steps=1)
    flag = "--" + line.split("=")[0].strip().replace("_", "-")
    if flag in argv:  # leave the key to the file: the command line would win
        i = argv.index(flag)
        del argv[i : i + 2]
    code, last = train_error(["--config", cfg, *argv], capsys)
    assert code != 0 and "error:" in last and message in last, last


# -----------------------------------------------------------------------------
# user mistakes: a non-zero exit and a one-line message, never a traceback


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--task", "nope"], "unknown task 'nope'; tasks: arith, arith_mul, arith_retry, arith_steps, arith_tool"),
        (["--model", "{tmp}/no/such/model"], "smollm2-135m"),
        (["--group-size", 1], "--group-size must be >= 2"),
        (["--micro-batch", 3], "--micro-batch 3 must divide the 8 completions"),
        (["--eps", 0.2, "--eps-high", 0.1], "--eps-high 0.1 < --eps 0.2"),
        (["--loss-type", "nope"], "invalid choice: 'nope'"),
        (["--resume", "{tmp}/missing"], "--resume"),
        (["--resume", "{tmp}/corrupt"], "not a checkpoint train.py wrote; nothing in it ran"),
        (["--out-dir", "{tmp}/afile/sub"], "is not writable"),
        (["--device", "cuda"], "device 'cuda' is not usable here"),
        (["--top-entropy-quantile", 0], "--top-entropy-quantile must be (0, 1], got 0.0"),
        (["--mu", 0], "--mu must be >= 1, got 0"),
        (["--config", "cispo_cap=-3.0"], "config key cispo_cap must be >= 1, got -3.0"),
        (["--config", "lr_schedule='nope'"], "config key lr_schedule 'nope': choose from constant, cosine"),
    ],
    ids=[
        "task",
        "model",
        "group-size",
        "micro-batch",
        "eps-high",
        "loss-type",
        "resume-missing",
        "resume-corrupt",
        "out-dir",
        "cuda",
        "entropy-quantile",
        "mu",
        "a-field-config-key",
        "lr-schedule",
    ],
)
def test_bad_input_is_a_one_line_error(model_dir, tmp_path, capsys, monkeypatch, extra, message):
    if extra == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "ckpt.pt").write_bytes(b"\x80\x02garbage, not a checkpoint" * 10)
    (tmp_path / "afile").write_text("a regular file, not a directory")
    extra = [str(x).replace("{tmp}", str(tmp_path)) for x in extra]
    code, last = train_error(train_args(model_dir, str(tmp_path / "out"), steps=1) + extra, capsys)
    assert code != 0 and "error:" in last and message in last, last


# -----------------------------------------------------------------------------
# objective variants: one step each, each flag seen in the loss


DEFAULT = {
    "beta": 0.04,
    "level": "token",
    "loss_type": "grpo",
    "eps_high": 0.2,
    "delta": None,
    "quantile": 1.0,
    "mask_truncated": False,
    "scale": "group",
}
VARIANTS = [  # (flags, the options of the hand computation below that they change)
    (["--mu", 2], {}),
    (["--beta", 0], {"beta": 0}),
    (["--config", "ref_sync_every=1"], {}),
    (["--mu", 2, "--importance-level", "sequence"], {"level": "sequence"}),  # at mu 1 every ratio is 1
    (["--loss-type", "dapo"], {"loss_type": "dapo"}),
    (["--loss-type", "dr_grpo"], {"loss_type": "dr_grpo"}),
    (["--mask-truncated"], {"mask_truncated": True}),
    (["--top-entropy-quantile", 0.5], {"quantile": 0.5}),
    (["--scale-rewards", "batch"], {"scale": "batch"}),
    # the second pass at lr 3e-3 has ratios in (1.2, 1.28] with A > 0 and above 1.3 with A < 0 (measured up to 1.7)
    (["--mu", 2, "--lr", 3e-3, "--eps-high", 0.28, "--delta", 1.3], {"eps_high": 0.28, "delta": 1.3}),
]


def hand_advantages(g, scale):
    """(r - group mean) / (std + 1e-4), the std unbiased over the group ("group") or all 8 rewards ("batch"), from the
    toy reward fns on the step's completions -> (N,) float64, and a bound on fp32's error in them: the centred
    rewards are off by a few eps32 of max|r|, which the division by std amplifies."""
    prompts = [toy.prompt(e) for e in g["r"].examples[::G]]  # the rows' examples, one a group
    r = torch.tensor(toy_rewards(g["r"].completions, prompts), dtype=torch.float64)
    r = r.view(-1, G)
    std = (r.std(1, keepdim=True) if scale == "group" else r.std()) + 1e-4
    adv = ((r - r.mean(1, keepdim=True)) / std).flatten()
    return adv, 16 * EPS32 * (r.abs().max() / std.min() + adv.abs().max()).item()


def hand_mask(g, rows, c, mask_truncated):
    r = g["r"]
    return r.completion_mask[rows, :c].bool() & (~r.truncated[rows, None] if mask_truncated else True)


def hand_loss(call, adv, m, n_tok, beta, level, loss_type, eps_high, delta, quantile, **_):
    """One micro-batch's loss by DeepSeekMath eq. 3 written out in float64 (eps 0.2; k3 with x clamped to +-20 and
    k3 to <= 10; the weights against the sampled log-probs, truncated) over a batch of 8 rows of <= 12 new tokens,
    n_tok of them valid
    -> (loss, the same aggregate of |terms|: the size fp32's rounding of the loss is relative to)."""

    def f(x):
        return torch.where(m, x.detach().double(), 0.0)

    logp = f(call["logp"])
    log_ratio = logp - (logp if call["old_logp"] is None else f(call["old_logp"]))  # (n, c)
    if level == "sequence":  # GSPO: the row's mean log-ratio on every token of the row
        log_ratio = (log_ratio.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    ratio, A = log_ratio.exp(), adv[:, None]
    capped = ratio if delta is None else ratio.clamp(max=delta)
    base = logp if call["old_logp"] is None else f(call["old_logp"])
    w = (base - f(call["sample_logp"])).exp().clamp(max=2.0)  # pi_old / pi_sample, truncated at is_cap 2 (TIS)
    terms = -torch.minimum(capped * A, ratio.clamp(0.8, 1 + eps_high) * A) * w
    if quantile < 1:  # the policy term only on this call's tokens with entropy >= its (1 - quantile) quantile
        h = f(call["entropy"])
        terms = terms * (h >= float(np.quantile(h[m].numpy(), 1 - quantile)))
    if beta:
        x = (f(call["ref_logp"]) - logp).clamp(-20, 20)
        terms = terms + beta * (x.exp() - 1 - x).clamp(max=10)

    def agg(t):
        t = torch.where(m, t, 0.0)
        return {
            "grpo": (t.sum(1) / m.sum(1).clamp(min=1)).sum() / 8,
            "dapo": t.sum() / n_tok,
            "dr_grpo": t.sum() / (8 * 12),
        }[loss_type].item()

    return agg(terms), agg(terms.abs())


@pytest.mark.parametrize("extra, opts", VARIANTS, ids=["".join(map(str, x)).lstrip("-") for x, _ in VARIANTS])
def test_variant_runs_one_step_and_reaches_the_loss(model_dir, tmp_path, monkeypatch, extra, opts):
    """One step with a variant flag. Every grpo_loss call's mask, advantages and loss must be the hand computation
    with the flag's options, and each option must change that computation on this step's data: a flag that did not
    reach the loss fails one or the other."""
    calls, real = [], grpo.grpo_loss

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append({**inspect.signature(real).bind(*a, **k).arguments, "loss": out[0].item()})
        return out

    monkeypatch.setattr(grpo, "grpo_loss", spy)
    g = run_script(TRAIN, train_args(model_dir, str(tmp_path), *extra, steps=1))
    [row] = read_metrics(str(tmp_path))
    assert all(math.isfinite(v) for v in row.values()), row
    assert row["grad_norm"] > 0
    if "--beta" in extra:  # no reference model is even loaded
        assert g["ref"] is None and "kl" not in row and row["entropy"] > 0  # entropy is logged always
    else:
        assert g["ref"] is not None and "kl" in row
    mu = 2 if "--mu" in extra else 1
    if mu == 2:  # the second pass is off-policy: old log-probs, ratios away from 1
        assert g["old_logp"] is not None and (row["ratio_max"] > 1 or row["ratio_min"] < 1)
    else:
        assert g["old_logp"] is None
    if "ref_sync_every=1" in extra:  # the reference is reset to the policy and checkpointed
        for r, q in zip(g["ref"].parameters(), g["policy"].parameters()):
            assert torch.equal(r, q)
        assert torch.load(os.path.join(tmp_path, "ckpt.pt"), weights_only=True)["ref"] is not None

    o, micro = {**DEFAULT, **opts}, 4  # train_args: micro-batches of one group, two a pass
    adv, adv_tol = hand_advantages(g, o["scale"])
    rows = [slice(j % 2 * micro, (j % 2 + 1) * micro) for j in range(len(calls))]
    masks = [hand_mask(g, rows[j], call["mask"].size(1), o["mask_truncated"]) for j, call in enumerate(calls)]
    assert len(calls) == mu * 2
    n_tok = int(masks[0].sum() + masks[1].sum())
    for j, call in enumerate(calls):
        assert torch.equal(call["mask"].bool(), masks[j]), j
        torch.testing.assert_close(call["advantages"][:, 0].double(), adv[rows[j]], atol=adv_tol, rtol=0)
        want, size = hand_loss(call, adv[rows[j]], masks[j], n_tok, **o)
        # fp32 sums of <= 48 terms: rounding <= 48 eps32 (6e-6) of the sum of the terms' sizes
        assert call["loss"] == pytest.approx(want, rel=0, abs=1e-5 * size), j
    total = sum(abs(call["loss"]) for call in calls)  # the logged loss: the calls' fp32 sum over mu
    assert row["loss"] == pytest.approx(sum(call["loss"] for call in calls) / mu, rel=0, abs=4 * EPS32 * total)

    # each option moves the hand computation on this data by far more than that bound (beta 0: no reference
    # is even loaded, asserted above)
    for key in opts.keys() - {"beta"}:
        if key == "scale":
            assert (hand_advantages(g, "group")[0] - adv).abs().max() > 1e-2, key
        elif key == "mask_truncated":
            assert not torch.equal(hand_mask(g, slice(None), None, True), hand_mask(g, slice(None), None, False))
        else:
            gaps = []
            for j, call in enumerate(calls):
                (a, size), (b, _) = (
                    hand_loss(call, adv[rows[j]], masks[j], n_tok, **x) for x in (o, {**o, key: DEFAULT[key]})
                )
                gaps.append(abs(a - b) / (1e-5 * size))
            assert max(gaps) > 10, (key, gaps)


# -----------------------------------------------------------------------------
# torchrun: two CPU processes (gloo)


def torchrun(args, tmp_path, **env):
    return toy.torchrun(args, **env)


@pytest.mark.slow
def test_torchrun_two_processes_average_gradients(model_dir, tmp_path):
    out, dump = str(tmp_path / "out"), str(tmp_path / "params")
    proc = torchrun(train_args(model_dir, out, steps=2), tmp_path, TOY_DUMP_PARAMS=dump)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # rank 0 alone writes
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 2 and len(ckpt["rng"]) == 2  # each rank's RNG state, for an exact resume
    p0, p1 = torch.load(dump + ".rank0.pt"), torch.load(dump + ".rank1.pt")
    init = initial_state(model_dir)
    for k, v in p0.items():  # each rank trained on its own prompt: equal only if gradients were averaged
        assert torch.equal(v, p1[k]), k
        assert not torch.equal(v, init[k]), k
        assert torch.equal(v, ckpt["model"][k]), k


@pytest.mark.slow
def test_torchrun_prompts_not_divisible_by_ranks_fails_clearly(model_dir, tmp_path):
    proc = torchrun(train_args(model_dir, str(tmp_path / "out"), "--prompts-per-step", 3, steps=1), tmp_path)
    assert proc.returncode != 0
    assert "--prompts-per-step must be a multiple of the 2 processes" in proc.stderr
    assert 'train.py", line' not in proc.stderr  # torchrun's own report may have one; train.py must not


def test_cosine_schedule_by_hand(model_dir, tmp_path):
    """Warmup 1 update, then cosine from 1 to 0.1 over the remaining 3 of 4 updates: the logged lr of
    updates 0..3 is lr * [1/2, 1, (0.1 + 0.45 * (1 + cos(pi/2))) = 0.55, 0.1]."""
    run_script(
        TRAIN,
        train_args(model_dir, str(tmp_path), "--config", "warmup_steps=1", "--config", "lr_schedule='cosine'", steps=4),
    )
    assert [r["lr"] for r in read_metrics(str(tmp_path))] == pytest.approx([5e-4, 1e-3, 5.5e-4, 1e-4])


def test_lower_lr_warning_after_three_runaway_steps(tmp_path, capsys):
    """MetricsLog.write warns once, at the 3rd training step in a row whose kl (or dlogp_p99) is above 1: not at
    the 2nd, not again at the 4th; a step at or below 1 starts the count over; each key counts on its own; an
    eval row (no "reward") neither counts nor breaks a streak. Every row lands in metrics.jsonl, nan/inf as null."""
    import run

    kl = [2, 2, 2, 2, 1.0, 1.5, 1.5, 1.5, 0.2, 2, 2]  # above 1 at steps 1-4 (warn at 3), 6-8 (warn at 8), 10-11
    p99 = [0.5, 0.5, 2, 2, 2, 0.9, 3, 3, 0, 2, 2]  # above 1 at steps 3-5 (warn at 5), 7-8, 10-11
    rows = [
        {"step": s, "reward": 0.5, "kl": float(k), "dlogp_p99": float(d)} for s, (k, d) in enumerate(zip(kl, p99), 1)
    ]
    rows[0]["loss"], rows[1]["grad_norm"], rows[2]["loss"] = math.nan, math.inf, -math.inf
    rows.insert(2, {"step": 2, "eval/strict_acc": 0.5, "kl": 5.0})  # would make step 2 the 3rd if it counted
    rows.insert(8, {"step": 6, "eval/strict_acc": 0.5, "kl": 0.0})  # would break steps 6-8 if it counted
    log, seen = run.MetricsLog(str(tmp_path)), []
    capsys.readouterr()
    for row in rows:
        log.write(row)
        seen += [(row["step"], line) for line in capsys.readouterr().out.splitlines()]
    log.close()
    want = [(3, "kl"), (5, "dlogp_p99"), (8, "kl")]
    assert [s for s, _ in seen] == [s for s, _ in want], seen
    for (step, line), (_, key) in zip(seen, want):
        assert line.startswith(f"warning: step {step}: {key} > 1 for 3 steps: ") and line.endswith("lower --lr"), line
    nulled = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows]
    assert run.read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) == nulled  # nan would read back as nan != None


@pytest.mark.parametrize("tokens", [1, 60])
def test_micro_batch_tokens_changes_the_micro_batches_not_the_training(model_dir, tmp_path, tokens):
    """micro_batch_tokens caps a micro-batch's rows x their padded width: 1 gives micro-batches of one row, 60 of
    one or two (the toy's rows are ~20-30 tokens wide); the loss aggregates over the whole batch, so two steps train
    as --micro-batch 4 alone does (the same rewards and loss, weights to toy.assert_same_training's bounds). Fails if
    the cap is not applied (the captured micro-batch sizes), or if the optimizer step counts the micro-batches wrong
    (a partial one dropped, the loss averaged over the wrong count)."""
    seen = []
    real = rollout.micro_batches

    def spy(r, size):
        seen.append((size, r.input_ids.size(1)))
        return real(r, size)

    runs = []
    for i, extra in enumerate([[], ["--config", f"micro_batch_tokens={tokens}"]]):
        out = str(tmp_path / str(i))
        rollout.micro_batches = spy
        try:
            run_script(TRAIN, train_args(model_dir, out, *extra, "--config", "export=none", steps=2))
        finally:
            rollout.micro_batches = real
        runs.append((read_metrics(out), torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["model"]))
    capped = seen[len(seen) // 2 :]
    assert all(size == max(1, min(4, tokens // width)) for size, width in capped), capped
    assert any(size < 4 for size, _ in capped)
    (want, want_w), (got, got_w) = runs
    for a, b in zip(want, got):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    toy.assert_same_training(want_w, got_w)
