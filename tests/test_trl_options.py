"""TRL 1.16's GRPO options through train.py on the toy task and tiny Llama (tests/toy.py): each new knob runs a step,
lands in run.json, and refuses a bad value in one line before the model loads; steps_per_generation's optimizer steps,
GDPO's advantages and adaptive entropy's coefficient are checked against computations written out here."""

import inspect
import json
import math
import os
import sys

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import config  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import toy  # noqa: E402
from test_knobs import DECLS, WRONG, outside  # noqa: E402 (train.py's declarations, read by running its parser)
from toy import TRAIN, error_of, read_metrics, run_script, train_args  # noqa: E402

G = 4  # train_args: 2 prompts x 4 completions, micro-batches of 4
WEIGHTS = torch.tensor([toy.TASK.reward_weights[k] for k in ("even", "first")], dtype=torch.float64)  # 1, 0.5
NEW = [  # the knobs TRL 1.16's names brought, each declared once (train.py, grpo.Objective, rollout.Sampler)
    "steps_per_generation",
    "multi_objective_aggregation",
    "is_cap_min",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "off_policy_mask_threshold",
    "use_bias_correction_kl",
    "use_adaptive_entropy",
    "entropy_target",
    "entropy_coef_delta",
    "entropy_coef_min",
    "entropy_coef_max",
    "top_k",
    "top_p",
    "min_p",
]


def configs(**values):  # --config name=value for each, the value as a literal
    return [x for name, v in values.items() for x in ("--config", f"{name}={v!r}")]


def run(model_dir, out, *extra, steps=1, **values):
    """The toy run (no HF export) with these knobs as config lines -> train.py's globals."""
    return run_script(TRAIN, train_args(model_dir, str(out), *extra, *configs(export="none", **values), steps=steps))


def spy_loss(monkeypatch):
    """Every grpo.grpo_loss call's arguments by name, in call order (train.py looks it up at call time)."""
    calls, real = [], grpo.grpo_loss

    def spy(*a, **k):
        calls.append(inspect.signature(real).bind(*a, **k).arguments)
        return real(*a, **k)

    monkeypatch.setattr(grpo, "grpo_loss", spy)
    return calls


@pytest.fixture
def no_model_load(monkeypatch):
    """A value refused 'before anything loads' never reaches the model: loading one fails the test."""

    def forbidden(*a, **k):
        raise AssertionError("the model was loaded before the knobs were checked")

    monkeypatch.setattr(models, "load_model", forbidden)
    monkeypatch.setattr(models, "load_tokenizer", forbidden)


def toy_rewards(r):
    """(N, 2) float64: the toy task's reward fns (even, first) on the rollout's completions, written out here."""
    answers = [e["answer"] for e in r.examples]
    return torch.tensor([toy.frac_even(r.completions), toy.first_parity(r.completions, answers)]).double().T


def group_normalised(x):  # (N,) -> (x - its group's mean) / (unbiased std + 1e-4); a flat group 0
    g = x.view(-1, G)
    flat = (g == g[:, :1]).all(1, keepdim=True)
    return torch.where(flat, 0.0, (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten()


def logprobs(model, r):
    """(N, C) log-probs of the rollout's completions from the model's full logits over whole rows (no KV cache)."""
    ids, mask, P = r.input_ids, r.attention_mask, r.prompt_ids.size(1)  # (N, P+C)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return logits[:, P - 1 : -1].log_softmax(-1).gather(-1, r.completion_ids[..., None]).squeeze(-1)


# -----------------------------------------------------------------------------
# one step of each option


OPTIONS = {  # option -> its config lines
    "luspo": {"loss_type": "luspo", "importance_level": "sequence"},
    "vespo": {"loss_type": "vespo"},
    "gdpo": {"multi_objective_aggregation": "normalize_then_sum"},
    "off_policy_mask": {"off_policy_mask_threshold": 0.0},
    "bias_corrected_kl": {"use_bias_correction_kl": True},
    "adaptive_entropy": {"use_adaptive_entropy": True},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.5},
    "min_p": {"min_p": 0.5},
    "steps_per_generation": {"steps_per_generation": 2},
    "is_cap_min": {"is_cap_min": 0.5},
}
METRIC = {
    "off_policy_mask": "off_policy_masked",
    "adaptive_entropy": "entropy_coef",
    "steps_per_generation": "update2/loss",
}


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_trains_a_step_and_is_saved_in_run_json(option, model_dir, tmp_path):
    """One fp32 step with the option: run.json holds its values (and every new knob), the objective or sampler that
    ran holds them, the metrics are finite with a gradient, the option's own metric is logged, only adaptive entropy
    checkpoints an entropy controller, and the first pass is on-policy: |log pi_sample - log pi_train| < 1e-3 (fp32,
    before any update). Fails if a knob is dropped between its config line and the objective or sampler (a new field
    not in config.declared's walk), left out of run.json, crashes the step or makes it non-finite, if a truncated
    sampler (top_k/top_p/min_p) is scored by the trainer over the whole vocabulary (a gap of log the kept mass, ~1),
    or if steps_per_generation measures the sampler gap on log-probs taken after its first update."""
    values = OPTIONS[option]
    g = run(model_dir, tmp_path, **values)
    saved = json.load(open(tmp_path / "run.json"))
    assert {k: saved[k] for k in values} == values and not set(NEW) - set(saved)
    ran = {**vars(g["args"]), **vars(g["sampler"]), **vars(g["obj"])}  # what ran: the objective's, the sampler's
    assert {k: ran[k] for k in values} == values
    [row] = read_metrics(str(tmp_path))
    assert all(math.isfinite(v) for v in row.values()), row
    assert row["grad_norm"] > 0 and (option not in METRIC or METRIC[option] in row), sorted(row)
    if option == "off_policy_mask":
        assert 0 <= row["off_policy_masked"] <= 1
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ("entropy" in ckpt) == (option == "adaptive_entropy")
    assert row["dlogp_max"] < 1e-3, f"|log pi_sample - log pi_train| up to {row['dlogp_max']} before any update"


def test_top_k_one_samples_and_scores_a_single_token_of_mass_one(model_dir, tmp_path, monkeypatch):
    """top_k=1: each position's kept set is one token, so every sampled log-prob is exactly 0 (the set renormalised)
    and the trainer scores each token so too (log-prob 0, entropy 0). Fails if top_k does not reach the sampler (the
    sampled log-probs of a 48-token vocabulary, ~-3), or if the trainer scores under the whole vocabulary instead of
    the kept set the sampler recorded."""
    calls = spy_loss(monkeypatch)
    g = run(model_dir, tmp_path, "--beta", 0, top_k=1)
    r = g["r"]
    own = r.completion_mask.bool()
    assert (r.sample_logp[own] == 0).all()
    for call in calls:
        assert call["logp"][call["mask"].bool()].abs().max() < 1e-6
    [row] = read_metrics(str(tmp_path))
    assert row["entropy"] < 1e-6


# -----------------------------------------------------------------------------
# steps_per_generation: the batch's parts, an optimizer step each


def test_steps_per_generation_two_is_an_optimizer_step_on_each_half_by_hand(model_dir, tmp_path):
    """k=2, one step: two optimizer steps, the first on rows 0-3 (group 1), the second on rows 4-7 with the old
    log-probs taken before the first, written out here: full-row log-probs, grpo_loss on each half (num_sequences 4),
    clip to 1, torch's AdamW with train.py's settings, from the run's own weights after the first step. The first
    update's ratio is exactly 1, the second's not; update1/ and update2/ carry each step's loss and gradient norm,
    grad_norm their mean. Fails if an update takes the whole batch or the other half, if the old log-probs are
    retaken before the second update (its ratio 1), if the parts are not disjoint and contiguous, or if the metrics
    are not each update's own."""
    after = []  # the policy's weights after each of the run's optimizer steps
    hook = register_optimizer_step_post_hook(
        lambda opt, a, k: after.append([q.detach().clone() for q in opt.param_groups[0]["params"]])
    )
    try:
        g = run(model_dir, tmp_path, steps_per_generation=2)
    finally:
        hook.remove()
    [row] = read_metrics(str(tmp_path))
    assert len(after) == 2
    assert row["update1/ratio_min"] == row["update1/ratio_max"] == 1.0
    assert max(row["update2/ratio_max"] - 1, 1 - row["update2/ratio_min"]) > 1e-3
    assert row["grad_norm"] == pytest.approx((row["update1/grad_norm"] + row["update2/grad_norm"]) / 2, rel=1e-6)

    r = g["r"]
    adv = group_normalised(toy_rewards(r) @ WEIGHTS)  # (N,)
    m = r.completion_mask
    model = LlamaForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    old = logprobs(model, r).detach()  # (N, C): the old policy's and the reference's (beta 0.04)
    for i, (rows, weights) in enumerate(zip((slice(0, 4), slice(4, 8)), after), 1):
        loss, _ = grpo.grpo_loss(
            logprobs(model, r)[rows],
            old_logp=old[rows],
            ref_logp=old[rows],
            advantages=adv[rows].float(),
            mask=m[rows],
            obj=grpo.Objective(max_new_tokens=12),
            sample_logp=r.sample_logp[rows],
            num_sequences=torch.tensor(4.0),
            num_tokens=m[rows].sum().float(),
        )
        opt.zero_grad()
        loss.backward()
        grads = [q.grad.clone() for q in model.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert row[f"update{i}/loss"] == pytest.approx(loss.item(), abs=1e-6), i
        assert row[f"update{i}/grad_norm"] == pytest.approx(norm.item(), rel=1e-5), i
        opt.step()
        checked = 0
        for q, want, grad in zip(model.parameters(), weights, grads):
            big = grad.abs() > 1e-4  # where the gradient is well above its rounding (~1e-9): AdamW moves by ~lr
            torch.testing.assert_close(q.detach()[big], want[big], atol=1e-6, rtol=0, msg=f"update {i}")
            checked += int(big.sum())
        assert checked > 0.3 * sum(q.numel() for q in model.parameters()), checked
        with torch.no_grad():  # the next update starts from the run's weights, not from these
            for q, want in zip(model.parameters(), weights):
                q.copy_(want)


@pytest.mark.parametrize("k, lrs", [(1, [5e-4, 1e-3]), (2, [5e-4, 1e-3, 5.5e-4, 1e-4])])
def test_steps_per_generation_counts_its_updates_in_the_schedule(k, lrs, model_dir, tmp_path):
    """2 steps, a 1-update warmup then cosine: k optimizer steps a step, the schedule over steps x k updates (k=2: the
    lrs of tests/test_train.py's 4-update cosine), the checkpoint's scheduler and AdamW at 2k steps; k=1 is the plain
    step (no update{i}/ keys, no old-log-prob pass). Fails if the schedule counts steps x mu alone (k=2's cosine would
    end at update 2), if the parts take fewer or more optimizer steps, or if k=1 leaves the plain path."""
    g = run(model_dir, tmp_path, steps=2, steps_per_generation=k, warmup_steps=1, lr_schedule="cosine")
    rows = read_metrics(str(tmp_path))
    if k == 1:
        assert [r["lr"] for r in rows] == pytest.approx(lrs)
        assert not [key for r in rows for key in r if key.startswith("update")] and g["old_logp"] is None
    else:
        assert [r[f"update{i}/lr"] for r in rows for i in range(1, k + 1)] == pytest.approx(lrs)
        assert not [key for r in rows for key in r if key.startswith(f"update{k + 1}/")]
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["scheduler"]["last_epoch"] == 2 * k
    assert {int(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {2 * k}


# -----------------------------------------------------------------------------
# GDPO: each reward fn normalised in its group, weighted, summed, normalised over the batch


def gdpo(rewards, weights):
    """GDPO (arXiv 2601.05242) written out: rewards (N, K), weights (K,) -> (N,); a group flat in all weighted fns 0."""
    per_fn = [group_normalised(rewards[:, j]) for j in range(rewards.size(1))]
    total = sum(w * a for w, a in zip(weights, per_fn))  # (N,)
    adv = (total - total.mean()) / (total.std() + 1e-4)
    flat = torch.stack([(rewards[:, j].view(-1, G) == rewards[::G, j, None]).all(1) for j in range(len(weights))])
    flat = (flat | (weights == 0)[:, None]).all(0)  # (N/G,)
    return torch.where(flat.repeat_interleave(G), 0.0, adv)


def test_gdpo_advantages_are_normalize_then_sum_of_the_rollouts_rewards(model_dir, tmp_path, monkeypatch, capsys):
    """multi_objective_aggregation normalize_then_sum with the toy task's two fns (even 1, first 0.5), and
    --scale-rewards batch beside it: a note that scale_rewards has no effect, and the advantages that reach the loss
    are GDPO's computed here from the fns rerun on the completions, not the weighted sum's group advantages (they
    differ on this batch). Fails if the aggregation is not passed through, if it reads the summed reward, drops the
    weights or the per-fn columns' order, normalises by the batch the wrong way, or lets scale_rewards change it."""
    calls = spy_loss(monkeypatch)
    g = run(model_dir, tmp_path, "--scale-rewards", "batch", multi_objective_aggregation="normalize_then_sum")
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert any("scale_rewards" in line for line in notes), notes
    rewards = toy_rewards(g["r"])
    torch.testing.assert_close(g["r"].rewards.double(), rewards, atol=1e-6, rtol=0)  # the columns: even, first
    got = torch.cat([call["advantages"][:, 0] for call in calls]).double()  # (N,): the micro-batches in row order
    want = gdpo(rewards, WEIGHTS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    summed = group_normalised(rewards @ WEIGHTS)
    assert (want - summed).abs().max() > 1e-2 and want.abs().max() > 0.1


# -----------------------------------------------------------------------------
# adaptive entropy (Skywork-OR1): the coefficient steered toward entropy_target, an optimizer step at a time


@pytest.mark.parametrize("target, start, want", [(10.0, 0.05, [0.08, 0.1]), (0.5, 0.09, [0.06, 0.05])])
def test_adaptive_entropy_steps_the_coefficient_toward_the_target(
    target, start, want, model_dir, tmp_path, monkeypatch
):
    """2 steps, delta 0.03 within [0.05, 0.1]: the toy's entropy (~3.5 nats) is below a target of 10 (the coefficient
    rises: 0.05 -> 0.08 -> 0.1, capped) and above 0.5 (it falls: 0.09 -> 0.06 -> 0.05, floored); entropy_coef is
    logged each step, and the loss uses the coefficient only once an entropy at or below the target was measured
    (none at step 1). Fails if the direction is reversed, delta or a bound is ignored, the coefficient is not logged
    or not updated each step, or the loss uses another coefficient (the fixed --entropy-coef)."""
    calls = spy_loss(monkeypatch)
    bounds = dict(entropy_coef_delta=0.03, entropy_coef_min=0.05, entropy_coef_max=0.1)
    extra = ("--entropy-coef", start)
    run(model_dir, tmp_path, *extra, steps=2, use_adaptive_entropy=True, entropy_target=target, **bounds)
    rows = read_metrics(str(tmp_path))
    assert all(0.5 < r["entropy"] < 10 for r in rows)
    assert [r["entropy_coef"] for r in rows] == pytest.approx(want)
    applied = want[0] if rows[0]["entropy"] <= target else 0.0  # step 2's loss: step 1's coefficient, or none
    assert [call["obj"].entropy_coef for call in calls] == pytest.approx([0.0, 0.0, applied, applied])  # 2 a step


def test_adaptive_entropy_resumes_from_the_saved_coefficient(model_dir, tmp_path, monkeypatch):
    """steps_per_generation 2 (two optimizer steps a step, the coefficient moved after each), entropy below the
    target: an uninterrupted 2-step run against 1 step, saved, then --resume for step 2. The checkpoint holds the
    coefficient and the last entropy; the resumed step uses and logs the same coefficients as the uninterrupted run's
    (0.11 and 0.14 in its loss, 0.17 logged), and keeps the run's knobs. Fails if the controller is not saved or not
    restored (the resumed run starts over at --entropy-coef 0.05, with no measured entropy: 0 in its loss), if it moves
    once a step instead of once an optimizer step, or if a resume drops use_adaptive_entropy or steps_per_generation."""
    values = dict(use_adaptive_entropy=True, entropy_target=10.0, entropy_coef_delta=0.03, steps_per_generation=2)
    calls = spy_loss(monkeypatch)
    run(model_dir, tmp_path / "whole", "--entropy-coef", 0.05, steps=2, **values)
    whole = [call["obj"].entropy_coef for call in calls]  # an update a call: micro-batches of one part
    assert whole == pytest.approx([0.0, 0.05 + 0.03, 0.05 + 0.06, 0.05 + 0.09])
    assert [r["entropy_coef"] for r in read_metrics(str(tmp_path / "whole"))] == pytest.approx([0.11, 0.17])

    part = tmp_path / "part"
    run(model_dir, part, "--entropy-coef", 0.05, "--config", "save_every=1", steps=1, **values)
    ckpt = torch.load(part / "ckpt.pt", weights_only=True)
    assert ckpt["entropy"]["coef"] == pytest.approx(0.11) and ckpt["entropy"]["last"] < 10
    calls.clear()
    g = run_script(TRAIN, ["--resume", part, "--steps", 2])
    assert (g["args"].use_adaptive_entropy, g["args"].steps_per_generation) == (True, 2)
    assert [call["obj"].entropy_coef for call in calls] == pytest.approx(whole[2:])
    rows = read_metrics(str(part))
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["entropy_coef"] == pytest.approx(0.17)
    assert "update2/loss" in rows[1]


# -----------------------------------------------------------------------------
# refusals: one line, exit code 2, before the model loads


def test_the_new_knobs_are_declared_and_may_change_on_resume():
    """Fails if a knob of TRL's name is renamed or dropped (its config key would be unknown), or declared other than
    "may change on resume" (tests/test_knobs.py walks every declared knob's resume with that class)."""
    assert {name: DECLS[name].knob.resume for name in NEW if name in DECLS} == dict.fromkeys(NEW, config.CHANGES)


def bad_values(d):
    """A value of another type, then one out of its range or choices (None: it has neither)."""
    if isinstance(d.knob.check, (dict, tuple)):
        return WRONG[d.kind], "no-such-choice"
    return WRONG[d.kind], outside(d)


@pytest.mark.parametrize("name", NEW)
def test_each_new_knob_refuses_a_bad_type_and_range_in_one_line(name, model_dir, tmp_path, capsys, no_model_load):
    """Each new knob given a value of another type, then one out of its range or choices: exit code 2, one line
    naming the knob and the value, before the model loads. Fails if a knob's Knob(...) loses its range or choices,
    or if a value reaches the objective, the sampler or the loop unchecked."""
    d = DECLS[name]
    for bad in bad_values(d):
        if bad is None:
            continue
        code, line = error_of(TRAIN, train_args(model_dir, str(tmp_path / "out"), *configs(**{name: bad})), capsys)
        assert code == 2 and name in line and repr(bad) in line, (bad, line)
        assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


CONFLICTS = {  # a combination refused: its argv, the words its line must hold
    "luspo-token": (["--loss-type", "luspo"], ["luspo", "--importance-level sequence"]),
    "vespo-sequence": (
        ["--loss-type", "vespo", "--importance-level", "sequence"],
        ["vespo", "--importance-level token"],
    ),
    "is_cap_min>=is_cap": (configs(is_cap_min=2.0), ["is_cap_min", "is_cap", "2.0"]),
    "entropy_coef_min>max": (
        configs(entropy_coef_min=0.5, entropy_coef_max=0.1),
        ["entropy_coef_min", "entropy_coef_max"],
    ),
    "full-kl-top_k": (["--kl-estimator", "full", *configs(top_k=5)], ["full", "top_k"]),
    "k-not-dividing": (configs(steps_per_generation=3), ["steps_per_generation", "8"]),
    "k-not-dividing-token-cap": (configs(steps_per_generation=3, micro_batch_tokens=60), ["steps_per_generation", "8"]),
    "micro-batch-x-k": (configs(steps_per_generation=4), ["--micro-batch 4", "steps_per_generation", "8"]),
}


@pytest.mark.parametrize("name", CONFLICTS)
def test_a_combination_the_options_cannot_honour_is_one_line(name, model_dir, tmp_path, capsys, no_model_load):
    """LUSPO needs sequence-level ratios and VESPO token-level ones; is_cap_min must be below is_cap (2) and
    entropy_coef_min at most entropy_coef_max; the exact KL sums over a whole vocabulary a truncated sampler does not
    draw from; steps_per_generation must split the 8 completions into parts of whole micro-batches. Each: exit code 2,
    one line naming what to change, before the model loads. Fails if a check is dropped (a run that trains something
    other than what was asked, or fails later with a traceback) or its line loses the knob."""
    argv, words = CONFLICTS[name]
    code, line = error_of(TRAIN, train_args(model_dir, str(tmp_path / "out"), *argv), capsys)
    assert code == 2 and all(w in line for w in words), line
