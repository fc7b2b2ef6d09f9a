"""GDPO, VESPO, LUSPO, off-policy sequence masking, the bias-corrected KL, is_cap_min and adaptive entropy control
(grpo.py's dicts, variants.py's functions) against the papers' formulas written out here row by row and token by
token in fp64 (python floats, or 0-dim tensors where autograd must give the gradient), in fp64 and fp32, and against
TRL 1.16's GRPOTrainer where it is installed. Each test's docstring names the planted defect it catches."""

import collections
import dataclasses
import math
import statistics
import types

import pytest
import torch

from grpo import (
    AGGREGATIONS,
    BEHAVIOUR_MODES,
    FOLDS_BEHAVIOUR,
    LOSS_TYPES,
    REWARD_AGGREGATIONS,
    Objective,
    aggregate,
    behaviour_weights,
    grpo_loss,
)
from variants import EntropyControl, normalize_then_sum, off_policy_keep, vespo_surrogate

F64 = dict(dtype=torch.float64)
LOG_1E8 = math.log(1e-8)  # VESPO's floor on log w (TRL's get_gamma_weights)
DTYPES = [torch.float64, torch.float32]
# fp32 (normwise, loss and gradient): inputs, exps and logs each round at 2^-24 = 6e-8 relative; vespo's w is the exp
# of a sum of <= 5 rounded log-ratios and the loss a sum of ~30 terms, so ~10 roundings: the worst measured over the
# grid below is 4.6e-7; 2e-6 leaves 4x room and is still 50x below the smallest effect of a planted defect (1e-4: eps)
TOL = {torch.float64: 1e-10, torch.float32: 2e-6}


def _rel(a, b):  # normwise: max |a - b| / max |b|, blind to entries near 0 by cancellation
    a, b = torch.as_tensor(a, **F64), torch.as_tensor(b, **F64)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def _level(loss_type):  # the importance level Objective accepts with it (LUSPO: GSPO's sequence ratio)
    return "sequence" if loss_type == "luspo" else "token"


def _obj(loss_type, **kw):  # "k3": the unclamped estimator, as TRL's
    return Objective(kl_estimator="k3", loss_type=loss_type, importance_level=_level(loss_type), **{"beta": 0.0, **kw})


def _batch(dtype=torch.float64, lengths=(5, 2, 4, 1, 3, 5, 0, 4), T=5, seed=0):
    """A ragged batch with an empty row: logp, old, ref, sample (N, T), advantages (N,) of both signs, mask (N, T).
    old - sample is spread wide (sd 0.6) so that pi_old / pi_sample falls both below 0.7 and above 1.5."""
    g = torch.Generator().manual_seed(seed)
    N = len(lengths)
    logp = -2 * torch.rand(N, T, generator=g, **F64)  # (N, T)
    old = logp + 0.3 * torch.randn(N, T, generator=g, **F64)
    ref = logp + 0.3 * torch.randn(N, T, generator=g, **F64)
    sample = old + 0.6 * torch.randn(N, T, generator=g, **F64)
    adv = torch.randn(N, generator=g, **F64)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]  # (N, T)
    return *(x.to(dtype) for x in (logp, old, ref, sample, adv)), mask


# -----------------------------------------------------------------------------
# the loss written out: clip (grpo, luspo) and vespo, with every new knob


def _rule(mode, r, low, cap):
    """TRL's vllm_importance_sampling_mode on one ratio r, clip_min = low, clip_max = cap: *_truncate clips r to
    [low, cap], *_mask sets r outside [low, cap] to 0, none is 1."""
    if mode == "none":
        return 1.0
    if mode.endswith("truncate"):
        return min(max(r, low), cap)
    return 0.0 if r < low or r > cap else r


def _naive(obj, logp, old, ref, sample, adv, mask, num_sequences=None, num_tokens=None):
    """(loss, the rows the off-policy mask dropped), the loss built from logp's 0-dim entries (autograd gives its
    gradient). Per row i of L_i tokens, d_t = log pi_t - log pi_old,t:
      rho_t = e^d_t, or GSPO's e^(mean_t d_t) on the row (importance_level "sequence");
      w_t = _rule(is_mode) of pi_old / pi_sample, per token or (sequence_*) the row's e^(sum_t), 1 without sample;
      clip (DeepSeekMath eq. 3): p_t = min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) w_t;
      vespo (2602.10693): p_t = sg(phi(w)) A log pi_t, w = e^(sum_t clip(d_t, +-20) + sum_t clip(log w_t, log 1e-8, 20))
        clipped to [1e-8, e^20], phi(w) = e^lam w^k e^(-lam w), (k, lam) by the sign of A (A >= 0: _pos);
      off-policy mask (DeepSeek-V3.2 eq. 9): p_t = 0 for all t if A < 0 and mean_t (log pi_sample (or pi_old) - log pi)
        > threshold;
      l_t = -p_t + beta k3_t (times rho_t if use_bias_correction_kl), k3 = e^x - x - 1, x = log pi_ref - log pi;
    aggregated: grpo (1/N) sum_i mean_t l, dapo sum_it l / n_tokens, luspo (1/N) sum_it l (a row times its length)."""
    N = logp.shape[0]
    L = [int(m.sum()) for m in mask]
    n_seq = N if num_sequences is None else num_sequences
    n_tok = sum(L) if num_tokens is None else num_tokens
    low = 0.0 if obj.is_cap_min is None else obj.is_cap_min
    loss, dropped = torch.zeros((), **F64), set()
    for i in range(N):
        n, a = L[i], adv[i].item()
        if n == 0:
            continue
        lp = [logp[i, t] for t in range(n)]  # 0-dim, with grad
        o = [old[i, t].item() for t in range(n)]
        d = [lp[t] - o[t] for t in range(n)]
        rho = [torch.exp(sum(d) / n)] * n if obj.importance_level == "sequence" else [torch.exp(x) for x in d]
        w = [1.0] * n
        if sample is not None:
            s = [sample[i, t].item() for t in range(n)]
            if obj.is_mode.startswith("sequence"):
                r = [math.exp(sum(o) - sum(s))] * n
            else:
                r = [math.exp(o[t] - s[t]) for t in range(n)]
            w = [_rule(obj.is_mode, x, low, obj.is_cap) for x in r]
        if obj.loss_type == "vespo":
            log_w = sum(min(max(x.item(), -20.0), 20.0) for x in d)
            if sample is not None:
                log_w += sum(min(max(math.log(x), LOG_1E8), 20.0) if x > 0 else LOG_1E8 for x in w)
            log_w = min(max(log_w, LOG_1E8), 20.0)
            if a >= 0:
                k, lam = obj.vespo_k_pos, obj.vespo_lambda_pos
            else:
                k, lam = obj.vespo_k_neg, obj.vespo_lambda_neg
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            policy = [phi * a * x for x in lp]
        else:
            policy = [min(r * a, max(min(r, 1 + obj.eps_high), 1 - obj.eps) * a) * wt for r, wt in zip(rho, w)]
        if obj.off_policy_mask_threshold is not None:
            src = s if sample is not None else o
            if a < 0 and sum(src[t] - lp[t].item() for t in range(n)) / n > obj.off_policy_mask_threshold:
                policy = [0.0] * n
                dropped.add(i)
        row = sum(-p for p in policy)
        for t in range(n):
            x = ref[i, t].item() - lp[t]
            kl = torch.exp(x) - x - 1
            if obj.use_bias_correction_kl:
                kl = kl * rho[t]
            row = row + obj.beta * kl  # beta 0: no reference read, ref is finite here
        if obj.aggregation == "grpo":
            loss = loss + row / n / n_seq
        elif obj.aggregation == "dapo":
            loss = loss + row / n_tok
        else:
            assert obj.aggregation == "luspo"
            loss = loss + row / n_seq
    return loss, dropped


OPTIONS = {  # the new knobs, one at a time and together
    "plain": {},
    "kl": dict(beta=0.04),
    "bias_kl": dict(beta=0.04, use_bias_correction_kl=True),
    "off_policy": dict(off_policy_mask_threshold=0.05),
    "is_cap_min": dict(is_cap=1.5, is_cap_min=0.7),
    "all": dict(beta=0.04, use_bias_correction_kl=True, off_policy_mask_threshold=0.05, is_cap=1.5, is_cap_min=0.7),
}
# vespo folds the sampler's weights into its w per token: TRL refuses sequence_* modes with it (test below)
CASES = [
    (loss_type, mode)
    for loss_type in ("grpo", "luspo", "vespo")
    for mode in [None, *BEHAVIOUR_MODES]
    if not (loss_type in FOLDS_BEHAVIOUR and mode and mode.startswith("sequence"))
]


def _run(obj, dtype, mode):
    """grpo_loss's (loss, grad, metrics) and _naive's (loss, grad, dropped) on _batch in dtype."""
    logp, old, ref, sample, adv, mask = _batch(dtype)
    sample = None if mode is None else sample
    ours = logp.clone().requires_grad_()
    loss, metrics = grpo_loss(ours, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=obj, sample_logp=sample)
    (grad,) = torch.autograd.grad(loss, ours)
    up = [None if x is None else x.double().clone() for x in (logp, old, ref, sample, adv)]
    leaf = up[0].requires_grad_()
    want, dropped = _naive(obj, leaf, *up[1:], mask)
    (want_grad,) = torch.autograd.grad(want, leaf)
    return (loss, grad, metrics), (want, want_grad, dropped)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_type,mode", CASES)
def test_loss_and_gradient_match_the_written_out_formulas(loss_type, mode, options, dtype):
    """grpo (token clip), luspo (GSPO's ratio, length-weighted sum) and vespo with every is_mode, the off-policy mask,
    the bias-corrected KL and is_cap_min, against _naive: value and gradient. Fails if vespo's phi takes the mean
    log-ratio instead of the sum, its (k, lam) pair by the wrong sign, phi keeps its gradient, the behaviour weights
    are multiplied after vespo's phi (not only folded) or not folded; luspo divides by tokens or by each row's
    length; the off-policy mask tests A <= 0 or KL >= threshold, reads log pi - log pi_sample, or the old policy where
    a sampler is given; the KL term is not multiplied by rho, or by a detached rho; is_cap_min is ignored."""
    obj = _obj(loss_type, is_mode=mode or "token_truncate", **OPTIONS[options])
    (loss, grad, metrics), (want, want_grad, dropped) = _run(obj, dtype, mode)
    assert loss.dtype == dtype and _rel(loss.detach(), want.detach()) <= TOL[dtype]
    assert _rel(grad, want_grad) <= TOL[dtype]
    if obj.off_policy_mask_threshold is not None:
        assert dropped, "the batch needs a row the off-policy mask drops"
        assert metrics["off_policy_masked"].item() == pytest.approx(len(dropped) / 7, rel=1e-6, abs=0)  # 7 rows, fp32
    else:
        assert "off_policy_masked" not in metrics


def test_the_batch_reaches_every_branch():
    """The shared batch has what the grid above needs: A of both signs, pi_old / pi_sample below 0.7 and above 1.5 and
    2 on valid tokens, a ratio outside [0.8, 1.2], and vespo log w of both signs with phi not 1."""
    logp, old, _, sample, adv, mask = _batch()
    r = (old - sample).exp()[mask]
    assert (adv > 0).any() and (adv < 0).any()
    assert (r < 0.7).any() and (r > 2).any() and ((r > 0.7) & (r < 1.5)).any()
    rho = (logp - old).exp()[mask]
    assert (rho < 0.8).any() and (rho > 1.2).any()
    log_w = torch.where(mask, logp - old, 0.0).sum(1)
    assert (log_w[mask.any(1)] > 0.05).any() and (log_w[mask.any(1)] < -0.05).any()


@pytest.mark.parametrize("mode", [m for m in BEHAVIOUR_MODES if m.startswith("sequence")])
def test_vespo_folds_a_sequence_weight_once(mode):
    """VESPO's w is pi / pi_sample of the whole row: prod_t rho_t times the sampler's row weight, once. A sequence_*
    is_mode gives that row weight on every token; folding it per token raises it to the row's length. TRL refuses
    these modes with vespo; either refusal (ValueError naming vespo and the mode) or the row's weight once passes.
    Fails if the row's weight is folded as sum_t log w_t (w_seq^L)."""
    try:
        obj = _obj("vespo", is_mode=mode, is_cap=50.0)
    except ValueError as e:
        assert "vespo" in str(e) and mode in str(e)
        return
    logp, old, ref, sample, adv, mask = _batch()
    loss, _ = grpo_loss(logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=obj, sample_logp=sample)
    want = 0.0
    for i in range(logp.shape[0]):
        n, a = int(mask[i].sum()), adv[i].item()
        row_w = _rule(mode, math.exp(sum((old[i, :n] - sample[i, :n]).tolist())), 0.0, 50.0)
        log_w = min(max(sum((logp[i, :n] - old[i, :n]).tolist()) + math.log(max(row_w, 1e-8)), LOG_1E8), 20.0)
        k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
        want -= math.exp(lam + k * log_w - lam * math.exp(log_w)) * a * logp[i, :n].sum().item()
    assert loss.item() == pytest.approx(want / mask.sum().item(), rel=1e-10, abs=0)


@pytest.mark.parametrize("loss_type", ["luspo", "vespo"])
def test_unequal_micro_batches_sum_to_the_written_out_batch(loss_type):
    """Given the whole batch's num_sequences and num_tokens, micro-batches of 3 and 5 rows sum to _naive's loss and
    gradient of the whole batch. Fails if luspo divides by this call's rows, or vespo by this call's tokens."""
    obj = _obj(loss_type, **OPTIONS["all"])
    logp, old, ref, sample, adv, mask = _batch()
    acc, total = logp.clone().requires_grad_(), 0.0
    for s in (slice(0, 3), slice(3, 8)):
        part, _ = grpo_loss(
            acc[s],
            old_logp=old[s],
            ref_logp=ref[s],
            advantages=adv[s],
            mask=mask[s],
            obj=obj,
            sample_logp=sample[s],
            num_sequences=8,
            num_tokens=mask.sum(),
        )
        part.backward()
        total += part.item()
    leaf = logp.clone().requires_grad_()
    want, _ = _naive(obj, leaf, old, ref, sample, adv, mask)
    want.backward()
    assert total == pytest.approx(want.item(), rel=1e-10, abs=0)
    assert _rel(acc.grad, leaf.grad) <= 1e-10


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_with_every_new_knob_is_zero_and_finite(loss_type):
    """No valid token: loss 0, gradient 0, every metric 0 (off_policy_masked too), no NaN, whatever the padding holds.
    Fails if off_policy_masked divides by the rows with a valid token without clamp(min=1), or off_policy_keep's mean
    by the row's length without it (0 / 0 = NaN reaching the loss through 0 * NaN)."""
    logp, old, ref, sample, adv, mask = _batch()
    mask = torch.zeros_like(mask)
    kw = dict(off_policy_mask_threshold=0.0, use_bias_correction_kl=True, is_cap_min=0.5)
    obj = _obj(loss_type, beta=0.04, **kw)
    logp.requires_grad_()
    loss, m = grpo_loss(logp, old_logp=old, ref_logp=ref, advantages=-adv.abs(), mask=mask, obj=obj, sample_logp=sample)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0 and torch.equal(grad, torch.zeros_like(grad))
    assert "off_policy_masked" in m and {k: v.item() for k, v in m.items()} == dict.fromkeys(m, 0.0)


@pytest.mark.parametrize("loss_type", ["grpo", "luspo", "vespo"])
def test_padding_garbage_changes_nothing_with_every_new_knob(loss_type):
    """NaN, inf and huge values at padding in logp, old, ref, sample and process advantages change neither loss,
    gradient nor metrics. Fails if vespo's sums or off_policy_keep's mean read padding (-inf log pi there: NaN)."""
    logp, old, ref, sample, adv, mask = _batch()
    adv_t = adv[:, None] * torch.linspace(0.5, 1.5, 5, **F64)  # (N, T)
    obj = _obj(loss_type, **OPTIONS["all"])

    def run(*xs):
        lp = xs[0].clone().requires_grad_()
        kw = dict(old_logp=xs[1], ref_logp=xs[2], sample_logp=xs[3], advantages=xs[4], mask=mask, obj=obj)
        loss, m = grpo_loss(lp, **kw)
        return loss, torch.autograd.grad(loss, lp)[0], {k: v.item() for k, v in m.items()}

    clean = run(logp, old, ref, sample, adv_t)
    junk = [
        torch.where(mask, x, v) for x, v in zip((logp, old, ref, sample, adv_t), (-math.inf, math.nan, 1e4, 1e4, 7))
    ]
    dirty = run(*junk)
    torch.testing.assert_close(dirty[0], clean[0])
    torch.testing.assert_close(dirty[1], clean[1])
    assert dirty[2] == clean[2] and torch.equal(dirty[1][~mask], torch.zeros_like(dirty[1][~mask]))


# -----------------------------------------------------------------------------
# VESPO: phi by hand


def _vespo(ratio, adv, logp=None, behaviour=None, k=(2.0, 3.0), lam=(3.0, 2.0)):
    ratio = torch.tensor(ratio, **F64)
    logp = torch.ones_like(ratio) if logp is None else logp
    mask = torch.ones_like(ratio, dtype=torch.bool)
    adv = torch.tensor(adv, **F64)[:, None]
    kw = dict(vespo_k_pos=k[0], vespo_lambda_pos=lam[0], vespo_k_neg=k[1], vespo_lambda_neg=lam[1])
    return vespo_surrogate(ratio, adv, logp=logp, mask=mask, behaviour=behaviour, **kw)


def test_vespo_phi_of_one_is_one_and_the_loss_is_minus_a_log_pi():
    """On-policy (w = 1) phi(1) = e^(lam - lam) = 1 exactly for any (k, lam), so the surrogate is A log pi and grpo_loss
    (dapo's sum over tokens / n_tokens) gives loss -sum A_i log pi / n and gradient -A_i / n. Fails if phi(w) is
    normalised otherwise (w^k e^(-lam w) alone, e^(lam - lam w) without w^k: both are not 1 at w = 1)."""
    logp = torch.tensor([[-0.5, -1.25], [-2.0, -0.75]], **F64)
    out = _vespo([[1.0, 1.0], [1.0, 1.0]], [1.5, -2.0], logp=logp, k=(0.5, 7.0), lam=(4.0, 0.25))
    assert torch.equal(out, torch.tensor([[1.5, 1.5], [-2.0, -2.0]], **F64)[:, :1] * logp)
    logp, _, _, _, adv, mask = _batch()
    logp.requires_grad_()
    loss, m = grpo_loss(logp, old_logp=None, ref_logp=None, advantages=adv, mask=mask, obj=_obj("vespo"))
    n = mask.sum().item()
    want = -sum(adv[i].item() * logp[i, mask[i]].sum().item() for i in range(len(adv))) / n
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=0)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.where(mask, -adv[:, None] / n, 0.0))
    assert m["ratio_min"] == m["ratio_max"] == 1


def test_vespo_phi_by_hand_for_both_signs_sums_the_row_and_has_no_gradient():
    """Rows of two tokens with rho = e^0.25, e^0.75 (w = e^1) and e^-0.5 twice (w = e^-1): phi(e) = e^(3 + 2 - 3e)
    for A > 0 (k 2, lam 3), e^(2 - 3 - 2/e) for A < 0 (k 3, lam 2), A = 0 gives 0. Fails if log w is the mean over
    tokens (e^0.5 / e^-0.5), the product's logs are not summed per row, the pairs are swapped, or phi reaches the
    ratio's gradient."""
    e = math.e
    ratio = torch.tensor([[math.exp(0.25), math.exp(0.75)], [math.exp(-0.5)] * 2, [1.0, 1.0]], **F64)
    ratio.requires_grad_()
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -0.5], [-1.0, -1.0]], **F64, requires_grad=True)
    mask = torch.ones(3, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0], [-1.0], [0.0]], **F64)
    kw = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    out = vespo_surrogate(ratio, adv, logp=logp, mask=mask, **kw)
    phi = [math.exp(3 + 2 - 3 * e), math.exp(2 - 3 - 2 / e)]
    want = [[-phi[0], -2 * phi[0]], [phi[1], 0.5 * phi[1]], [0.0, 0.0]]
    torch.testing.assert_close(out, torch.tensor(want, **F64), rtol=1e-12, atol=0)
    g_ratio, g_logp = torch.autograd.grad(out.sum(), (ratio, logp), allow_unused=True)
    assert g_ratio is None or torch.equal(g_ratio, torch.zeros_like(ratio))  # sg(phi)
    torch.testing.assert_close(g_logp, torch.tensor([[phi[0]] * 2, [-phi[1]] * 2, [0.0, 0.0]], **F64))


def test_vespo_padding_is_out_of_the_row_product():
    """Padding tokens (mask False) add nothing to log w even where their ratio is not 1. Fails if the sum over the row
    reads the padding: a padded rho = e^3 would make w = e^4 instead of e."""
    ratio = torch.tensor([[math.e, math.exp(3.0)]], **F64)
    mask = torch.tensor([[True, False]])
    kw = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    out = vespo_surrogate(ratio, torch.ones(1, 1, **F64), logp=torch.ones(1, 2, **F64), mask=mask, **kw)
    assert out[0, 0].item() == pytest.approx(math.exp(5 - 3 * math.e), rel=1e-12, abs=0)


def test_vespo_clamps_each_log_ratio_then_the_sum():
    """TRL's clamps: each log rho_t to [-20, 20] before the sum, log w to [log 1e-8, 20] after it. A row with log rho
    30 and -25 sums to 20 - 20 = 0 (phi 1), not 5; a row of -15 twice sums to -30, floored at log 1e-8 (phi = e^(2 +
    3 log 1e-8 - 2e-8) for A < 0). Fails if either clamp is dropped or moved."""
    out = _vespo([[math.exp(30.0), math.exp(-25.0)], [math.exp(-15.0)] * 2], [1.0, -1.0])
    assert out[0, 0].item() == pytest.approx(1.0, rel=1e-12, abs=0)
    assert out[1, 0].item() == pytest.approx(-math.exp(2 + 3 * LOG_1E8 - 2e-8), rel=1e-9, abs=0)


def test_vespo_caps_log_w_at_twenty_and_zeroes_an_overflowing_phi():
    """With k = 2960, lam = 2^-13: log w = 20 gives phi = e^(lam + 59200 - lam e^20) = e^-24.3, a number; unclamped,
    log w = 21 would underflow to 0. With k = 5000 phi overflows to inf, which is zeroed (TRL's nan_to_num), not
    propagated. Fails if log w is not capped at 20 or an infinite phi is kept."""
    ratio, lam = [[math.exp(10.5)] * 2], 2.0**-13  # lam dyadic: exact at any precision
    out = _vespo(ratio, [1.0], k=(2960.0, 3.0), lam=(lam, 2.0))
    want = math.exp(lam + 2960 * 20 - lam * math.exp(20))
    assert 1e-12 < want < 1e-9 and out[0, 0].item() == pytest.approx(want, rel=1e-8, abs=0)
    assert torch.equal(_vespo(ratio, [1.0], k=(5000.0, 3.0), lam=(lam, 2.0)), torch.zeros(1, 2, **F64))


def test_vespo_floors_lambda_at_1e_4():
    """lam is floored at 1e-4 (TRL's clamp): lam = 1e-6, k = 0, w = e give phi = e^(1e-4 (1 - e)), not e^(1e-6 (1 -
    e)). Fails if the floor is dropped."""
    out = _vespo([[math.e]], [1.0], k=(0.0, 3.0), lam=(1e-6, 2.0))
    assert out.item() == pytest.approx(
        math.exp(1e-4 * (1 - math.e)), rel=1e-10, abs=0
    )  # 1e-4 may be fp32's (next test)


def test_vespo_k_and_lambda_keep_the_ratios_precision():
    """In fp64, phi's (k, lam) are the Objective's floats, not rounded to fp32: lam = 0.1 (not dyadic), k = 0, w = e^3
    gives phi = e^(0.1 (1 - e^3)) to 1e-13. Fails where torch.where(A >= 0, k_pos, k_neg) of python floats makes an
    fp32 tensor (lam = 0.1 + 1.5e-9: phi off by 3e-8 relative; with w near e^20 the error reaches 1e-3, as in the
    test above with lam = 1e-4), the precision SAPO's temperatures keep by ratio.new_tensor."""
    out = _vespo([[math.exp(3.0)]], [1.0], k=(0.0, 3.0), lam=(0.1, 2.0))
    assert out.item() == pytest.approx(math.exp(0.1 * (1 - math.exp(3.0))), rel=1e-13, abs=0)


def test_vespo_folds_the_behaviour_weights_and_floors_a_masked_one():
    """behaviour w_t multiply into w before phi: rho = 1 with behaviour (e^0.5, e^0.5) is w = e; a 0 (token_mask) has
    its log floored at log 1e-8 before the sum, as TRL's: with rho = (e, 1) the row's log w is 1 + log 1e-8, not the
    final floor log 1e-8. Fails if behaviour is ignored, multiplied after phi, or log 0 = -inf reaches the sum."""
    assert "vespo" in FOLDS_BEHAVIOUR
    out = _vespo([[1.0, 1.0]], [1.0], behaviour=torch.tensor([[math.exp(0.5)] * 2], **F64))
    assert out[0, 0].item() == pytest.approx(math.exp(5 - 3 * math.e), rel=1e-12, abs=0)
    out = _vespo([[math.e, 1.0]], [1.0], behaviour=torch.tensor([[0.0, 1.0]], **F64))
    log_w = 1 + LOG_1E8
    assert out[0, 0].item() == pytest.approx(math.exp(3 + 2 * log_w - 3 * math.exp(log_w)), rel=1e-9, abs=0)


def test_vespo_clamps_each_log_behaviour_weight_at_twenty():
    """A behaviour weight above e^20 (is_cap may be 1e9) enters log w as 20, as TRL's: rho = e^-19.5 with behaviour
    e^21 is log w = 0.5, not 1.5. Fails if the per-token clamp of log w_t loses its upper bound or moves it."""
    out = _vespo([[math.exp(-19.5)]], [1.0], behaviour=torch.tensor([[math.exp(21.0)]], **F64))
    assert out.item() == pytest.approx(math.exp(3 + 2 * 0.5 - 3 * math.exp(0.5)), rel=1e-12, abs=0)


def test_vespo_a_nan_weight_gives_phi_zero_as_trl():
    """A NaN ratio on a valid token (a NaN old log-prob) makes log w NaN; TRL's nan_to_num turns that phi into 0, so
    the row adds 0, not A log pi. Fails if NaN becomes another number (1: the row would train unweighted)."""
    out = _vespo([[math.nan, 1.0]], [1.0], logp=torch.full((1, 2), -1.0, **F64))
    assert torch.equal(out, torch.zeros(1, 2, **F64))


# -----------------------------------------------------------------------------
# LUSPO's aggregation


def test_luspo_aggregation_is_each_rows_sum_averaged_over_rows():
    """AGGREGATIONS["luspo"]: sum_i sum_t l_it / N (TRL: (per_token_loss * mask).sum(-1).mean()), num_sequences the
    whole batch's N. Fails if luspo divides by tokens, by each row's length (grpo), or by the budget (dr_grpo)."""
    assert "luspo" in AGGREGATIONS and LOSS_TYPES["luspo"] == ("clip", "luspo")
    torch.manual_seed(0)
    lens = [5, 2, 4, 0]
    x = torch.randn(4, 6, **F64)
    mask = torch.arange(6)[None] < torch.tensor(lens)[:, None]
    x = torch.where(mask, x, 1e6)  # padding garbage
    rows = [sum(x[i, :L].tolist()) for i, L in enumerate(lens)]
    assert aggregate(x, mask, "luspo").item() == pytest.approx(sum(rows) / 4, rel=1e-14, abs=0)
    assert aggregate(x, mask, "luspo", num_sequences=10).item() == pytest.approx(sum(rows) / 10, rel=1e-14, abs=0)


def test_luspo_weights_each_row_by_its_length_against_gspo():
    """LUSPO is GSPO (sequence ratio, grpo's mean over a row) with each row's loss times its length: on-policy the
    gradient on each token is -A_i / N for LUSPO and -A_i / (N L_i) for GSPO. Fails if luspo drops the length."""
    logp, _, _, _, adv, mask = _batch()
    N, L = len(adv), mask.sum(1, keepdim=True)
    for loss_type, per_token in (("luspo", 1 / N), ("grpo", 1 / (N * L.clamp(min=1)))):
        lp = logp.clone().requires_grad_()
        obj = Objective(beta=0.0, loss_type=loss_type, importance_level="sequence")
        loss, _ = grpo_loss(lp, old_logp=None, ref_logp=None, advantages=adv, mask=mask, obj=obj)
        (grad,) = torch.autograd.grad(loss, lp)
        torch.testing.assert_close(grad, torch.where(mask, -adv[:, None] * per_token, 0.0))


# -----------------------------------------------------------------------------
# off-policy sequence masking


def test_off_policy_keep_by_hand():
    """threshold 0.25, logp 0, so the row's KL is the mean of sample over its valid tokens (padding holds 100):
      A -1, (0.25, 0.75) mean 0.5 > 0.25: dropped;   A -1, (0.5, 0.0) mean 0.25 = threshold: kept;
      A -1, (0.5 | pad) mean 0.5: dropped (over T = 2 it would be 0.25);   A -1, (0.125 | pad 100): kept;
      A -1, (-0.5, -1.0): kept (log pi - log pi_sample would be +0.75);   A +1 and A 0, KL 4: kept.
    Fails if the mask tests A <= 0, KL >= threshold, the sign of the KL, or averages over T or over the padding."""
    sample = torch.tensor(
        [[0.25, 0.75], [0.5, 0.0], [0.5, 100], [0.125, 100], [-0.5, -1.0], [4.0, 4.0], [4.0, 4.0]], **F64
    )
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 0], [1, 1], [1, 1], [1, 1]], dtype=torch.bool)
    adv = torch.tensor([-1.0, -1, -1, -1, -1, 1, 0], **F64)[:, None]
    keep = off_policy_keep(adv, torch.zeros(7, 2, **F64), sample, mask, 0.25)
    assert keep.dtype == torch.bool and keep.shape == (7, 1)
    assert keep[:, 0].tolist() == [False, True, False, True, True, True, True]


def test_off_policy_keep_reads_the_current_policy_detached_and_masks_per_token_advantages():
    """KL = mean(sample - logp) reads logp's values (logp -1 with sample 0 is KL 1); with process advantages (N, T)
    only the A_t < 0 tokens of a high-KL row are masked. Fails if the KL ignores logp, or the mask is a row's when the
    advantages are per token."""
    logp = torch.full((1, 3), -1.0, **F64, requires_grad=True)
    keep = off_policy_keep(
        torch.tensor([[-1.0, 2.0, -0.5]], **F64), logp, torch.zeros(1, 3, **F64), torch.ones(1, 3) > 0, 0.5
    )
    assert keep.tolist() == [[False, True, False]] and not keep.requires_grad
    keep = off_policy_keep(
        torch.tensor([[-1.0]], **F64), logp, torch.full((1, 3), -1.25, **F64), torch.ones(1, 3) > 0, 0.5
    )
    assert keep.tolist() == [[True]]


@pytest.mark.parametrize("source", ["sample", "old"])
def test_off_policy_mask_in_grpo_loss_drops_the_negative_high_kl_rows_only(source):
    """grpo_loss's mask: KL from sample_logp where given, else from old_logp (TRL's sampling_per_token_logps default).
    The loss equals _naive's with the dropped rows' policy term removed (the KL term stays), the metric is their share
    of the rows with a valid token; threshold None drops nothing and reports no metric. Fails if the mask reads
    old_logp while a sampler is given, masks the KL term, or counts an empty row in the metric."""
    logp, old, ref, sample, adv, mask = _batch()
    sample = sample if source == "sample" else None
    adv = torch.where(torch.arange(8) % 3 == 0, adv.abs(), -adv.abs())  # 5 rows with A < 0, 3 with A > 0
    counts = {}
    for threshold in (None, 0.0, 0.15, 0.5, 10.0):
        obj = _obj("grpo", beta=0.04, off_policy_mask_threshold=threshold, is_mode="none")
        lp = logp.clone().requires_grad_()
        loss, m = grpo_loss(lp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=obj, sample_logp=sample)
        leaf = logp.clone().requires_grad_()
        want, dropped = _naive(obj, leaf, old, ref, sample, adv, mask)
        assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=0)
        torch.testing.assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(want, leaf)[0])
        src = sample if sample is not None else old
        kls = [((src[i] - logp[i])[mask[i]].mean().item(), adv[i].item()) for i in range(8) if mask[i].any()]
        hand = sum(a < 0 and kl > threshold for kl, a in kls) if threshold is not None else 0
        assert len(dropped) == hand
        counts[threshold] = hand
        if threshold is None:
            assert "off_policy_masked" not in m
        else:
            assert m["off_policy_masked"].item() == pytest.approx(hand / 7, rel=1e-6, abs=0)  # a share in fp32
    assert counts[None] == counts[10.0] == 0 and counts[0.0] > counts[0.5]  # the thresholds bind differently


def test_off_policy_metric_counts_a_row_once_with_per_token_advantages():
    """Process advantages: a high-KL row with two A_t < 0 tokens counts once; a row with all A_t >= 0 is not counted;
    of one row with a valid token, masked, beside an empty one, the share is 1. Fails if the metric counts tokens, rows
    whose tokens were all kept, or divides by the row count clamped at 2 instead of 1."""
    logp = torch.zeros(3, 2, **F64)
    sample = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]], **F64)
    adv = torch.tensor([[-1.0, -1.0], [1.0, 0.0], [-1.0, -1.0]], **F64)
    obj = _obj("grpo", off_policy_mask_threshold=0.5, is_mode="none")
    _, m = grpo_loss(logp, old_logp=None, ref_logp=None, advantages=adv, mask=logp == 0, obj=obj, sample_logp=sample)
    assert m["off_policy_masked"].item() == pytest.approx(1 / 3, rel=1e-6, abs=0)  # a share in fp32
    mask = torch.tensor([[True, True], [False, False]])
    _, m = grpo_loss(
        logp[:2], old_logp=None, ref_logp=None, advantages=adv[:2], mask=mask, obj=obj, sample_logp=sample[:2]
    )
    assert m["off_policy_masked"].item() == 1


# -----------------------------------------------------------------------------
# the bias-corrected KL (DeepSeek-V3.2): rho k3


def _one_hot_rows(V=5, seed=0):
    """Logits z (V,) of pi and pi_ref, and logp (V, 1): row y is log pi(y) computed from its own copy of z (Z (V, V),
    with grad), so row y's gradient in Z is token y's alone."""
    g = torch.Generator().manual_seed(seed)
    z, z_ref = torch.randn(V, generator=g, **F64), torch.randn(V, generator=g, **F64)
    Z = z.repeat(V, 1).requires_grad_()
    logp = Z.log_softmax(-1).diagonal()[:, None]  # (V, 1)
    return z, z_ref, Z, logp


@pytest.mark.parametrize("bias", [True, False])
def test_bias_corrected_kl_gradient_is_the_reverse_kl_gradient_on_policy(bias):
    """Exact, over the whole vocabulary: E_{y ~ pi}[grad of rho k3 at y] = grad KL(pi || pi_ref) (the reverse KL, the
    one the objective penalises), while plain k3's is sum_y (pi - pi_ref) grad log pi = grad KL(pi_ref || pi) (the
    forward one). Fails if rho is detached (its value is 1 on-policy, its gradient is what corrects k3), or the KL is
    multiplied by anything but rho."""
    z, z_ref, Z, logp = _one_hot_rows()
    V = len(z)
    ref = z_ref.log_softmax(-1)[:, None]
    obj = Objective(beta=1.0, kl_estimator="k3", loss_type="dapo", use_bias_correction_kl=bias)
    loss, m = grpo_loss(logp, old_logp=None, ref_logp=ref, advantages=torch.zeros(V, **F64), mask=logp == logp, obj=obj)
    (g,) = torch.autograd.grad(loss, Z)  # (V, V): row y is (1 / V) grad of token y's term
    expected = (z.softmax(-1)[:, None] * V * g).sum(0)  # E_{y ~ pi}
    zz = z.clone().requires_grad_()
    p, p_ref = zz.softmax(-1), z_ref.softmax(-1)
    reverse = (p * (p.log() - p_ref.log())).sum()
    forward = (p_ref * (p_ref.log() - p.log())).sum()
    want = torch.autograd.grad(reverse if bias else forward, zz, retain_graph=True)[0]
    other = torch.autograd.grad(forward if bias else reverse, zz)[0]
    torch.testing.assert_close(expected, want, rtol=1e-12, atol=1e-14)
    assert _rel(expected, other) > 0.05
    # on-policy rho = 1: the value is plain k3 either way
    k3 = (ref - logp).exp() - (ref - logp) - 1
    assert m["kl"].item() == pytest.approx(k3.mean().item(), rel=1e-12, abs=0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_per_token_gradient_on_policy_is_the_log_ratio(level):
    """On-policy, d(rho k3)/d log pi_t = (1 - e^x) + k3 = -x = log pi - log pi_ref per token (token ratio); GSPO's
    sequence ratio spreads the k3 part over the row: (1 - e^x_t) + (1 / L) sum_u k3_u. Fails if the KL is not
    multiplied by rho, or rho's gradient does not reach the row's tokens at the sequence level."""
    logp, _, ref, _, _, mask = _batch()
    N, n = logp.shape[0], mask.sum().item()
    lp = logp.clone().requires_grad_()
    obj = Objective(beta=0.5, kl_estimator="k3", loss_type="dapo", importance_level=level, use_bias_correction_kl=True)
    loss, _ = grpo_loss(lp, old_logp=None, ref_logp=ref, advantages=torch.zeros(N, **F64), mask=mask, obj=obj)
    (grad,) = torch.autograd.grad(loss, lp)
    want = torch.zeros_like(logp)
    for i in range(N):
        L = int(mask[i].sum())
        xs = [(ref[i, t] - logp[i, t]).item() for t in range(L)]
        k3 = [math.exp(x) - x - 1 for x in xs]
        for t, x in enumerate(xs):
            want[i, t] = 0.5 / n * ((-x) if level == "token" else (1 - math.exp(x) + sum(k3) / L))
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-15)
    plain = Objective(beta=0.5, kl_estimator="k3", loss_type="dapo", importance_level=level)
    lp2 = logp.clone().requires_grad_()
    loss2, _ = grpo_loss(lp2, old_logp=None, ref_logp=ref, advantages=torch.zeros(N, **F64), mask=mask, obj=plain)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-14, abs=0)  # the same value, another gradient
    assert _rel(torch.autograd.grad(loss2, lp2)[0], grad) > 0.05


# -----------------------------------------------------------------------------
# is_cap_min: the sampler weights' lower bound

# d = log pi_old - log pi_sample; row 0's sum is 0 (ratio exactly 1, on the low bound), row 1's -1.5
_D = [[-2.0, 0.0, 0.5, 1.5], [-1.0, -0.5, 0.0, 0.0]]
_M = [[True] * 4, [True, True, False, False]]


@pytest.mark.parametrize("low", [1.0, None])
@pytest.mark.parametrize("mode", BEHAVIOUR_MODES)
def test_is_cap_min_by_hand(mode, low):
    """low 1, cap 2 on ratios e^-2, 1, e^0.5, e^1.5 | e^-1, e^-0.5 (sequence_*: the rows' 1 | e^-1.5): *_truncate
    clips to [1, 2], *_mask zeroes outside it, keeping a ratio equal to low; low None is no lower bound; none is 1.
    is_capped counts the valid tokens whose weight is not their ratio. Fails if a mode ignores low, masks w <= low,
    truncates in a mask mode, or grpo_loss does not pass is_cap_min (None as 0)."""
    d = torch.tensor(_D, **F64)
    mask = torch.tensor(_M)
    seq = mode.startswith("sequence")
    lo = 0.0 if low is None else low
    want, capped = [], 0
    for i, row in enumerate(_D):
        n = sum(_M[i])
        ratios = [math.exp(sum(row[:n]))] * n if seq else [math.exp(x) for x in row[:n]]
        ws = [_rule(mode, r, lo, 2.0) for r in ratios]
        capped += sum(w != r for w, r in zip(ws, ratios)) if mode != "none" else 0
        want.append(ws + [1.0] * (4 - n))
    w, m = behaviour_weights(d, torch.zeros(2, 4, **F64), mask, mode, 2.0, lo)
    torch.testing.assert_close(w, torch.tensor(want, **F64), rtol=1e-15, atol=0)
    assert m["is_capped"].item() == pytest.approx(capped / 6, rel=1e-6, abs=0)  # a share in fp32
    if mode != "none" and low is not None:
        assert capped >= 2  # low binds on this batch (row 1; row 0 sits on it: kept)
    if mode.startswith("token") and low is None:
        assert w[0, 0].item() == pytest.approx(math.exp(-2), rel=1e-15, abs=0)  # no lower bound: e^-2 passes
    # through grpo_loss: the policy term of each token times its weight (dapo: sum / tokens, A = 1, on-policy rho 1)
    obj = Objective(beta=0.0, loss_type="dapo", is_mode=mode, is_cap=2.0, is_cap_min=low)
    loss, m2 = grpo_loss(
        d,
        old_logp=d,
        ref_logp=None,
        advantages=torch.ones(2, **F64),
        mask=mask,
        obj=obj,
        sample_logp=torch.zeros(2, 4, **F64),
    )
    assert loss.item() == pytest.approx(-sum(sum(r[: sum(k)]) for r, k in zip(want, _M)) / 6, rel=1e-14, abs=0)
    assert m2["is_capped"].item() == m["is_capped"].item()


# -----------------------------------------------------------------------------
# GDPO: normalize_then_sum


def _gdpo(rewards, weights, G, eps=1e-4):
    """GDPO written out: column k of group g normalised by its mean and unbiased std (+ eps), 0 if the group is flat in
    it; the weighted sum; then (x - mean) / (std + eps) over the batch (unbiased); a group flat in every column of
    nonzero weight 0. rewards: rows of K floats -> (advantages, share of such groups)"""
    N, K = len(rewards), len(weights)
    per, flat = [[0.0] * K for _ in range(N)], []
    for g in range(N // G):
        rows = range(g * G, g * G + G)
        all_flat = True
        for k in range(K):
            col = [rewards[i][k] for i in rows]
            if len(set(col)) == 1:
                continue
            all_flat = all_flat and weights[k] == 0
            mean, std = statistics.mean(col), statistics.stdev(col)
            for i in rows:
                per[i][k] = (rewards[i][k] - mean) / (std + eps)
        flat.append(all_flat)
    total = [sum(w * p for w, p in zip(weights, row)) for row in per]
    mean, std = statistics.mean(total), statistics.stdev(total)
    return [0.0 if flat[i // G] else (t - mean) / (std + eps) for i, t in enumerate(total)], sum(flat) / len(flat)


def _group(rewards, G, eps=1e-4):  # the summed reward's group advantages (DeepSeekMath §4.1.2), a flat group 0
    out = []
    for g in range(0, len(rewards), G):
        col = rewards[g : g + G]
        flat = len(set(col)) == 1
        out += [0.0 if flat else (r - statistics.mean(col)) / (statistics.stdev(col) + eps) for r in col]
    return out


# groups of 4, 3 reward fns: random | flat in every fn | flat in the sum, not per fn (fns of unequal std) |
# flat in fns 0 and 2, not in fn 1 | random
_R = [
    [0.3, 1.0, 0.0], [0.9, 0.0, 0.5], [0.1, 1.0, 0.25], [0.6, 0.0, 1.0],
    [1.0, 0.5, 2.0], [1.0, 0.5, 2.0], [1.0, 0.5, 2.0], [1.0, 0.5, 2.0],
    [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0],
    [0.5, 0.0, 0.75], [0.5, 1.0, 0.75], [0.5, 0.5, 0.75], [0.5, 0.0, 0.75],
    [0.2, 0.7, 0.1], [0.4, 0.2, 0.8], [0.0, 0.9, 0.3], [1.0, 0.4, 0.6],
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0), (1.0, 0.0, 2.0), (0.5, 2.0, 1.0)])
def test_normalize_then_sum_matches_gdpo_written_out(weights, dtype):
    """normalize_then_sum against _gdpo (fp64 python): values and the flat share; a group flat in every weighted fn is
    exactly 0. Weights (1, 0, 2) make group 3 (flat in fns 0 and 2, not 1) such a group: fn 1's spread must not give
    it an advantage. Fails if a column is normalised over the batch instead of its group, the std is the population
    one, eps is dropped, the batch step is left out, a flat group is found from the sum, or a 0-weight fn's spread
    keeps a group alive, or fp64 weights promote fp32 rewards' advantages."""
    adv, share = normalize_then_sum(torch.tensor(_R, dtype=dtype), torch.tensor(weights, **F64), 4)
    rewards = torch.tensor(_R, dtype=dtype).double().tolist()
    want, want_share = _gdpo(rewards, weights, 4)
    assert adv.shape == (20,) and adv.dtype == dtype and _rel(adv, want) <= TOL[dtype]
    assert share.item() == pytest.approx(want_share, rel=1e-7, abs=0)
    assert torch.equal(adv[4:8], torch.zeros(4, dtype=adv.dtype))  # flat in every fn
    assert torch.equal(adv[12:16] == 0, torch.full((4,), weights[1] == 0))


def test_normalize_then_sum_gives_a_group_flat_in_the_sum_an_advantage():
    """GDPO's point (arXiv 2601.05242 §3): three fns that each succeed on different completions sum to a flat reward,
    so sum_then_normalize gives that group 0, while normalize_then_sum separates fns of unequal spread: the completion
    solving fn 2 (half the group) differs from those solving fn 0 or 1 alone. Fails if GDPO sums before normalising."""
    group = torch.tensor(_R[8:12], **F64)
    rest = torch.tensor(_R[:4], **F64)
    rewards, w = torch.cat([group, rest]), torch.ones(3, **F64)
    adv, share = REWARD_AGGREGATIONS["normalize_then_sum"](rewards, rewards.sum(1), w, 4, "group")
    summed, _ = REWARD_AGGREGATIONS["sum_then_normalize"](rewards, rewards.sum(1), w, 4, "group")
    assert torch.equal(summed[:4], torch.zeros(4, **F64)) and (adv[:4] != 0).all() and share.item() == 0
    assert adv[0] == adv[1] and adv[2] == adv[3] and adv[0] > 0 > adv[2]  # the rarer success is worth more


@pytest.mark.parametrize("aggregation", REWARD_AGGREGATIONS)
def test_reward_aggregations_written_out_and_a_flat_group_is_exactly_zero(aggregation):
    """Every REWARD_AGGREGATIONS entry, fn(rewards (N, K), total (N,), weights (K,), G, scale) -> (A (N,), flat
    share), against its formula (sum_then_normalize: the summed reward's group advantages; normalize_then_sum: GDPO);
    a group flat in every fn gives exactly 0 and counts as flat; an all-flat batch gives 0, not NaN. Fails if an
    entry ignores its weights or returns another shape."""
    w = torch.tensor([1.0, 0.5, 2.0], **F64)
    rewards = torch.tensor(_R, **F64)
    total = rewards @ w
    adv, share = REWARD_AGGREGATIONS[aggregation](rewards, total, w, 4, "group")
    if aggregation == "sum_then_normalize":
        want, want_share = _group(total.tolist(), 4), 0.2
    else:
        want, want_share = _gdpo(_R, w.tolist(), 4)
    assert (
        adv.shape == (20,) and _rel(adv, want) <= 1e-10 and share.item() == pytest.approx(want_share, rel=1e-6, abs=0)
    )
    assert torch.equal(adv[4:8], torch.zeros(4, **F64))
    flat = torch.tensor(_R[4:8] * 2, **F64)
    adv, share = REWARD_AGGREGATIONS[aggregation](flat, flat @ w, w, 4, "group")
    assert torch.equal(adv, torch.zeros(8, **F64)) and share.item() == 1


# -----------------------------------------------------------------------------
# adaptive entropy control (Skywork-OR1 §3.2; TRL's use_adaptive_entropy)


def test_entropy_control_sequence_by_hand():
    """coef 0.25, delta 0.125, target 0.5, bounds [0.125, 0.5] (dyadic: exact). Before any measurement the bonus is 0;
    entropy <= target (equal included) steps coef up, above it down, within the bounds; the coef applies only while
    the last entropy is <= target. Fails if the first step applies coef, the comparison is <, the step's sign is
    swapped, or a bound is ignored."""
    ec = EntropyControl(coef=0.25, target=0.5, delta=0.125, low=0.125, high=0.5)
    assert ec.applied() == 0.0 and ec.last == math.inf
    steps = [  # (entropy measured, coef after, applied after)
        (0.25, 0.375, 0.375),
        (0.5, 0.5, 0.5),  # equal to the target: up
        (0.0, 0.5, 0.5),  # capped at high
        (0.75, 0.375, 0.0),  # above: down, and not applied
        (1.0, 0.25, 0.0),
        (1.0, 0.125, 0.0),
        (1.0, 0.125, 0.0),  # floored at low
        (0.5, 0.25, 0.25),
    ]
    for entropy, coef, applied in steps:
        ec.update(entropy)
        assert (ec.coef, ec.last, ec.applied()) == (coef, entropy, applied)


def test_entropy_control_of_an_objective_reads_its_knobs():
    """EntropyControl.of(obj) starts at entropy_coef with the target, step and bounds use_adaptive_entropy names, and no
    measurement yet. Fails if a knob is read into the wrong field or the start is not entropy_coef."""
    obj = Objective(
        entropy_coef=0.3,
        use_adaptive_entropy=True,
        entropy_target=0.4,
        entropy_coef_delta=0.05,
        entropy_coef_min=0.1,
        entropy_coef_max=0.9,
    )
    assert EntropyControl.of(obj) == EntropyControl(coef=0.3, target=0.4, delta=0.05, low=0.1, high=0.9, last=math.inf)


def test_entropy_control_checkpoint_round_trip():
    """state_dict keeps coef and the last entropy (inf before the first step); a fresh controller loaded from it goes on
    exactly as the original. Fails if last is not saved (the resumed run would apply its coef a step late or early)."""
    a = EntropyControl(coef=0.25, target=0.5, delta=0.125, low=0.0, high=1.0)
    fresh = EntropyControl(coef=0.25, target=0.5, delta=0.125, low=0.0, high=1.0)
    fresh.load_state_dict(a.state_dict())
    assert fresh.applied() == 0.0 and fresh.last == math.inf
    for e in (0.25, 0.75, 0.25):
        a.update(e)
    b = EntropyControl(coef=0.0, target=0.5, delta=0.125, low=0.0, high=1.0, last=0.0)
    b.load_state_dict(a.state_dict())
    assert (b.coef, b.last, b.applied()) == (a.coef, a.last, a.applied()) == (0.375, 0.25, 0.375)
    for e in (0.75, 0.25):
        a.update(e)
        b.update(e)
        assert (b.coef, b.last, b.applied()) == (a.coef, a.last, a.applied())


# -----------------------------------------------------------------------------
# Objective: the new knobs' checks

REFUSED = [
    (dict(loss_type="luspo"), ("luspo", "sequence")),
    (dict(loss_type="vespo", importance_level="sequence"), ("vespo", "token")),
    (dict(is_cap_min=2.0), ("is_cap_min", "is_cap")),
    (dict(is_cap=1.5, is_cap_min=3.0), ("is_cap_min", "1.5")),
    (dict(is_cap_min=0.0), ("is_cap_min", "0")),
    (dict(entropy_coef_min=0.5, entropy_coef_max=0.25), ("entropy_coef_min", "entropy_coef_max")),
    (dict(vespo_k_pos=-1.0), ("vespo_k_pos",)),
    (dict(vespo_k_neg=-1.0), ("vespo_k_neg",)),
    (dict(vespo_lambda_pos=0.0), ("vespo_lambda_pos",)),
    (dict(vespo_lambda_neg=-1.0), ("vespo_lambda_neg",)),
    (dict(off_policy_mask_threshold=-0.1), ("off_policy_mask_threshold",)),
    (dict(entropy_target=-1.0), ("entropy_target",)),
    (dict(entropy_coef_delta=-0.5), ("entropy_coef_delta",)),
    (dict(entropy_coef_min=-0.5), ("entropy_coef_min",)),
    (dict(use_bias_correction_kl=1), ("use_bias_correction_kl",)),
    (dict(use_adaptive_entropy="yes"), ("use_adaptive_entropy",)),
]


@pytest.mark.parametrize("kw,facts", REFUSED, ids=[str(kw) for kw, _ in REFUSED])
def test_objective_refuses_a_bad_new_knob_and_names_it(kw, facts):
    """Fails if a check is dropped, or its message does not name the knob (and the other value it needs)."""
    with pytest.raises(ValueError) as e:
        Objective(**kw)
    assert all(f in str(e.value) for f in facts), str(e.value)


def test_objective_accepts_the_edges_and_has_trls_defaults():
    """luspo at the sequence level, vespo at the token level, is_cap_min just below is_cap, entropy_coef_min equal
    to entropy_coef_max, threshold 0 are all accepted; the defaults are TRL 1.16's GRPOConfig's. Fails if a check is
    one step too strict (<= for <), or a default moves."""
    Objective(loss_type="luspo", importance_level="sequence")
    Objective(loss_type="vespo", importance_level="token")
    Objective(is_cap=2.0, is_cap_min=1.999, entropy_coef_min=0.5, entropy_coef_max=0.5, off_policy_mask_threshold=0.0)
    o = Objective()
    want = dict(
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        off_policy_mask_threshold=None,
        use_bias_correction_kl=False,
        use_adaptive_entropy=False,
        entropy_target=0.2,
        entropy_coef_delta=0.005,
        entropy_coef_min=0.0,
        entropy_coef_max=1.0,
        is_cap_min=None,
    )
    assert {k: getattr(o, k) for k in want} == want


# -----------------------------------------------------------------------------
# TRL 1.16 on the same tensors (fp32), in addition to the formulas above


def _trl():
    return pytest.importorskip("trl.trainer.grpo_trainer", reason="pip install trl==1.16.0").GRPOTrainer


def test_trl_config_defaults_are_ours():
    trl = pytest.importorskip("trl", minversion="1.16.0", reason="pip install trl==1.16.0")
    fields = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    o = Objective()
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold"):
        assert fields[name] == getattr(o, name), name
    for name in ("use_adaptive_entropy", "entropy_target", "entropy_coef_delta"):
        assert fields[name] == getattr(o, name), name
    assert fields["use_bias_correction_kl"] and not o.use_bias_correction_kl  # ours is the paper's KL (README)
    assert (fields["entropy_coef_min"], fields["entropy_coef_max"]) == (o.entropy_coef_min, o.entropy_coef_max)
    assert fields["vllm_importance_sampling_clip_min"] == o.is_cap_min


def test_vespo_phi_and_the_off_policy_mask_match_trls_static_methods():
    """vespo_surrogate / (A log pi) against GRPOTrainer.get_gamma_weights, off_policy_keep against
    get_off_policy_mask, on the shared batch (token behaviour weights, both advantage signs, several thresholds)."""
    trainer = _trl()
    logp, old, _, sample, adv, mask = _batch(torch.float32)
    w = torch.where(mask, (old - sample).exp().clamp(max=2.0), 1.0)  # TRL's token_truncate ratio, 1 at padding
    A = adv[:, None]
    for behaviour in (None, w):
        theirs = trainer.get_gamma_weights(A, logp - old, mask.float(), behaviour) * A
        ratio = torch.where(mask, (logp - old).exp(), 1.0)
        kw = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
        ours = vespo_surrogate(ratio, A, logp=torch.ones_like(logp), mask=mask, behaviour=behaviour, **kw)[:, :1]
        assert _rel(ours, theirs) <= 1e-6
    for threshold in (0.0, 0.05, 0.2):
        theirs = trainer.get_off_policy_mask(A, logp, sample, mask.float(), threshold)
        assert torch.equal(off_policy_keep(A, logp, sample, mask, threshold).float(), theirs)


class _OneProcess:  # the accelerate calls _compute_loss makes, for one process
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x


def _trl_trainer(obj, accumulation, sampler):
    """A GRPOTrainer with only what _compute_loss reads (trl/trainer/grpo_trainer.py, 1.16.0)."""
    t = _trl().__new__(_trl())
    t.args = types.SimpleNamespace(
        use_bias_correction_kl=obj.use_bias_correction_kl,
        delta=None,
        steps_per_generation=accumulation,
        **{k: getattr(obj, k) for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    )
    t.loss_type, t.importance_sampling_level, t.beta = obj.loss_type, obj.importance_level, obj.beta
    t.epsilon_low, t.epsilon_high = obj.eps, obj.eps_high
    t.top_entropy_quantile, t.off_policy_mask_threshold = 1.0, obj.off_policy_mask_threshold
    t.current_gradient_accumulation_steps = accumulation
    t.use_vllm = t.vllm_importance_sampling_correction = sampler
    t.model, t.accelerator = types.SimpleNamespace(training=True), _OneProcess()
    t._entropy_bonus_enabled, t.aux_loss_enabled = False, False
    t._metrics = {"train": collections.defaultdict(list)}
    return t


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("sampler", [False, True])
@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("loss_type", ["luspo", "vespo"])
def test_luspo_and_vespo_match_trl_compute_loss(loss_type, options, sampler, accumulation):
    """Loss of each micro-batch and the accumulated gradient against GRPOTrainer._compute_loss; the sampler's weights
    TRL's way (exp(masked old - sample), clipped to [is_cap_min, is_cap], token_truncate) from sample_logp."""
    _trl()
    logp, old, ref, sample, adv, mask = _batch(torch.float32)
    logp, old, ref, sample, adv, mask = logp[:6], old[:6], ref[:6], sample[:6], adv[:6], mask[:6]  # equal halves
    obj = _obj(loss_type, **OPTIONS[options])
    trainer = _trl_trainer(obj, accumulation, sampler)
    w = ((old - sample) * mask).exp().clamp(min=obj.is_cap_min or 0.0, max=obj.is_cap)  # TRL's importance ratio
    trl_logp, our_logp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    N, n_tokens = logp.shape[0], mask.sum()
    for rows in torch.arange(N).chunk(accumulation):

        def logps_and_entropies(*args, rows=rows, **kwargs):
            return trl_logp[rows], torch.zeros_like(trl_logp[rows]), None

        trainer._get_per_token_logps_and_entropies = logps_and_entropies
        inputs = {
            "prompt_ids": torch.zeros(len(rows), 1, dtype=torch.long),
            "prompt_mask": torch.ones(len(rows), 1),
            "completion_ids": torch.zeros(len(rows), logp.shape[1], dtype=torch.long),
            "completion_mask": mask[rows].float(),
            "advantages": adv[rows],
            "old_per_token_logps": old[rows],
            "ref_per_token_logps": ref[rows],
            "num_items_in_batch": n_tokens,
        }
        if sampler:
            inputs.update(importance_sampling_ratio=w[rows], sampling_per_token_logps=sample[rows])
        theirs = trainer._compute_loss(None, inputs)
        ours, _ = grpo_loss(
            our_logp[rows],
            old_logp=old[rows],
            ref_logp=ref[rows],
            advantages=adv[rows],
            mask=mask[rows],
            obj=obj,
            sample_logp=sample[rows] if sampler else None,
            num_sequences=N,
            num_tokens=n_tokens,
        )
        assert _rel(ours.detach(), theirs.detach()) <= 1e-6  # fp32, sums in another order: ~16 ulp
        theirs.backward()
        ours.backward()
    assert our_logp.grad.abs().max() > 0
    assert _rel(our_logp.grad, trl_logp.grad) <= 1e-6
