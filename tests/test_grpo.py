"""Tests for grpo.py: each function against a hand calculation or an independent computation (CPU, fp64)."""

import dataclasses
import doctest
import math
import statistics

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

import grpo
from grpo import (
    LOSS_TYPES,
    Objective,
    aggregate,
    behaviour_weights,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    importance_ratio,
    informative_groups,
    kl_estimate,
)
from variants import full_kl, pick_rows, process_advantages, top_entropy_mask

F64 = dict(dtype=torch.float64)
CLIPPED = [k for k, (surrogate, _) in LOSS_TYPES.items() if surrogate == "clip"]  # cispo, sapo: test_objectives.py


def _accepts(loss_type, level):  # Objective's own rule (luspo: sequence only), so a new pairing needs no edit here
    try:
        Objective(loss_type=loss_type, importance_level=level)
    except ValueError:
        return False
    return True


CLIPPED_LEVELS = [(t, level) for t in CLIPPED for level in ("token", "sequence") if _accepts(t, level)]
LEVEL = {t: next(level for level in ("token", "sequence") if _accepts(t, level)) for t in LOSS_TYPES}


def _batch(lengths=(7, 3, 5, 1, 6, 2), T=7, seed=0):
    """A ragged batch: logp, old, ref (N, T), advantages (N,), mask (N, T) bool, entropy (N, T)."""
    g = torch.Generator().manual_seed(seed)
    N = len(lengths)
    logp = -3 * torch.rand(N, T, generator=g, **F64)  # (N, T)
    old = logp + 0.3 * torch.randn(N, T, generator=g, **F64)  # some tokens outside the clip range
    ref = logp + 0.3 * torch.randn(N, T, generator=g, **F64)
    adv = torch.randn(N, generator=g, **F64)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]  # (N, T)
    entropy = 2 * torch.rand(N, T, generator=g, **F64)
    return logp, old, ref, adv, mask, entropy


# -----------------------------------------------------------------------------
# advantages


def _unbiased(rs):
    m, s = statistics.mean(rs), statistics.stdev(rs)  # stdev divides by n - 1
    return [(r - m) / (s + 1e-4) for r in rs]


def test_group_advantages_hand_example_unbiased_std():
    rewards = [-2.0, -2, -5, 0, -5, -1, -1, -3]
    adv, frac = group_advantages(torch.tensor(rewards, **F64), 4)
    expected = _unbiased(rewards[:4]) + _unbiased(rewards[4:])
    torch.testing.assert_close(adv, torch.tensor(expected, **F64))
    assert [round(a, 2) for a in adv.tolist()[:4]] == [0.12, 0.12, -1.33, 1.09]
    # the population-std (/G) numbers of the write-up must NOT come out
    assert not torch.allclose(adv, torch.tensor([0.14, 0.14, -1.54, 1.26, -1.51, 0.90, 0.90, -0.30], **F64), atol=0.01)
    assert frac.item() == 0.0


def test_group_advantages_zero_mean_per_group_and_scales():
    torch.manual_seed(0)
    r = torch.randn(12, **F64)
    for scale in ("group", "batch", "none"):
        adv, _ = group_advantages(r, 3, scale=scale)
        torch.testing.assert_close(adv.view(4, 3).mean(1), torch.zeros(4, **F64))
    centred = (r.view(4, 3) - r.view(4, 3).mean(1, keepdim=True)).view(-1)
    torch.testing.assert_close(group_advantages(r, 3, scale="none")[0], centred)
    batch_std = statistics.stdev(r.tolist())  # over all 12 rewards
    torch.testing.assert_close(group_advantages(r, 3, scale="batch")[0], centred / (batch_std + 1e-4))
    expected = [a for i in range(4) for a in _unbiased(r.tolist()[3 * i : 3 * i + 3])]
    torch.testing.assert_close(group_advantages(r, 3, scale="group")[0], torch.tensor(expected, **F64))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_zero_variance_group_is_exactly_zero(scale):
    # the float mean of three 0.1s is not 0.1, so r - mean alone would leave ~1e-17 / 1e-4 noise
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.2], **F64)  # (6,)
    adv, frac = group_advantages(r, 3, scale=scale)
    assert torch.equal(adv[:3], torch.zeros(3, **F64))
    assert adv[3:].abs().min() > 0
    assert frac.item() == 0.5


def test_informative_groups_hand_example_and_agrees_with_group_advantages():
    # groups of 3: all 1 (solved), mixed, three 0.1s (flat, though their float mean is not 0.1), all 0
    r = torch.tensor([1.0, 1, 1, 0, 1, 0, 0.1, 0.1, 0.1, 0, 0, 0], **F64)
    keep = informative_groups(r, 3)
    assert keep.tolist() == [False, True, False, False]
    adv, frac = group_advantages(r, 3)
    assert frac.item() == 0.75  # 3 of 4 groups flat = 1 - keep.float().mean()
    assert torch.equal(adv.view(4, 3)[~keep], torch.zeros(3, 3, **F64))
    assert (adv.view(4, 3)[keep] != 0).all()


def test_pick_rows_first_informative_in_sampling_order_then_the_last_flat_ones():
    # groups of 2: attempt 0 is flat, informative, flat; attempt 1 is informative, flat, informative
    r0, r1 = torch.tensor([1.0, 1, 0, 1, 0, 0]), torch.tensor([1.0, 0, 1, 1, 0, 1])

    def pick(attempts, count):  # as (attempt, group, informative), each attempt of 3 groups
        informative = informative_groups(torch.cat(attempts), 2)
        rows, keep = pick_rows(informative, count, 2)
        groups = rows[::2] // 2  # (count,): each picked group's rows are its 2 rows, in order
        assert torch.equal(rows, torch.stack([2 * groups, 2 * groups + 1], 1).flatten())
        assert torch.equal(keep, informative[groups].repeat_interleave(2))  # a flat group's rows are not kept
        return [(g // 3, g % 3, bool(informative[g])) for g in groups.tolist()]

    assert pick([r0, r1], 2) == [(0, 1, True), (1, 0, True)]  # enough: the first two informative
    assert pick([r0, r1], 3) == [(0, 1, True), (1, 0, True), (1, 2, True)]
    # shortfall: all 3 informative, then flat ones from the last back: (1, 1), then (0, 2), then (0, 0)
    assert pick([r0, r1], 4) == [(0, 1, True), (1, 0, True), (1, 1, False), (1, 2, True)]
    assert pick([r0, r1], 5) == [(0, 1, True), (0, 2, False), (1, 0, True), (1, 1, False), (1, 2, True)]
    assert pick([r0], 3) == [(0, 0, False), (0, 1, True), (0, 2, False)]  # one attempt, 1 informative
    assert pick([r0], 2) == [(0, 1, True), (0, 2, False)]


def test_process_advantages_hand_example():
    # group of 2 outputs x 2 steps, rewards 0, 4 | 4, 4: mean 3, unbiased std sqrt(12 / 3) = 2,
    # normalised -1.5, 0.5 | 0.5, 0.5. Output 0 steps end at tokens 1, 4; output 1 at tokens 2, 3.
    adv = process_advantages(
        torch.tensor([[0.0, 4], [4, 4]], **F64),
        torch.tensor([[1, 4], [2, 3]]),
        torch.ones(2, 2, dtype=torch.bool),
        group_size=2,
        seq_len=5,
        eps=0.0,
    )
    expected = [
        [-1.5 + 0.5, -1.5 + 0.5, 0.5, 0.5, 0.5],
        [0.5 + 0.5, 0.5 + 0.5, 0.5 + 0.5, 0.5, 0.0],
    ]  # token 4 of output 1 is after its last step
    torch.testing.assert_close(adv, torch.tensor(expected, **F64))


def test_process_advantages_with_padding_steps_matches_loop():
    torch.manual_seed(0)
    N, S, T, G = 4, 3, 6, 2
    rewards = torch.randn(N, S, **F64)
    ends = torch.tensor([[0, 2, 5], [1, 3, 99], [4, 99, 99], [0, 1, 2]])  # 99: padding steps
    smask = ends < T
    adv = process_advantages(rewards, ends, smask, G, T)
    for g in range(N // G):
        rows = range(g * G, g * G + G)
        vals = [rewards[i, j].item() for i in rows for j in range(S) if smask[i, j]]
        m, s = statistics.mean(vals), statistics.stdev(vals)
        for i in rows:
            for t in range(T):
                want = sum((rewards[i, j].item() - m) / (s + 1e-4) for j in range(S) if smask[i, j] and ends[i, j] >= t)
                assert adv[i, t].item() == pytest.approx(want, abs=1e-12)


# -----------------------------------------------------------------------------
# KL and entropy


def test_k3_nonnegative_and_zero_iff_equal():
    torch.manual_seed(0)
    logp = -3 * torch.rand(1000, **F64)
    ref = logp + torch.randn(1000, **F64).clamp(-5, 5)
    ref[:100] = logp[:100]
    k3 = kl_estimate(logp, ref, "k3")
    assert (k3 >= 0).all()
    assert torch.equal(k3[:100], torch.zeros(100, **F64))
    assert (k3[100:][(ref != logp)[100:]] > 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_unbiased_monte_carlo(estimator):
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(6, generator=g, **F64).softmax(0), torch.randn(6, generator=g, **F64).softmax(0)
    exact = (p * (p.log() - q.log())).sum()
    n = 100_000
    x = torch.multinomial(p, n, replacement=True, generator=g)  # samples from pi
    k = kl_estimate(p.log()[x], q.log()[x], estimator)  # (n,)
    # 5 standard errors, with the estimator's exact per-sample std under pi
    per_value = kl_estimate(p.log(), q.log(), estimator)  # (V,)
    std = ((p * per_value**2).sum() - exact**2).sqrt()
    assert abs(k.mean() - exact) < 5 * std / math.sqrt(n)


def test_k1_k2_hand_values():
    logp, ref = torch.tensor([-1.0, -2.0], **F64), torch.tensor([-1.5, -1.0], **F64)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0], **F64))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5], **F64))
    torch.testing.assert_close(kl_estimate(logp, ref), torch.tensor([math.exp(-0.5) + 0.5 - 1, math.e - 2], **F64))


def test_k3_clamped_hand_values_and_gradient():
    # x = ref - logp; k3 = e^x - x - 1, d k3 / d logp = -(e^x - 1); clamped: x to [-20, 20], value to <= 10
    #   x = 0    -> 0,                          grad 0
    #   x = 0.5  -> e^0.5 - 1.5 = 0.1487213,    grad -(e^0.5 - 1) = -0.6487213
    #   x = 2    -> e^2 - 3 = 4.3890561,        grad -(e^2 - 1) = -6.3890561
    #   x = -5   -> e^-5 + 4 = 4.0067379,       grad 1 - e^-5 = 0.9932621
    #   x = 25   -> clamp to 20: e^20 - 21 ~ 4.9e8 -> 10, grad 0
    #   x = -30  -> clamp to -20: 19 + e^-20 -> 10,      grad 0
    x = torch.tensor([0.0, 0.5, 2, -5, 25, -30], **F64)
    logp = torch.full_like(x, -1.0, requires_grad=True)
    k = kl_estimate(logp, logp.detach() + x, "k3_clamped")
    e = math.exp
    torch.testing.assert_close(k, torch.tensor([0, e(0.5) - 1.5, e(2) - 3, e(-5) + 4, 10, 10], **F64))
    (grad,) = torch.autograd.grad(k.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([0, 1 - e(0.5), 1 - e(2), 1 - e(-5), 0, 0], **F64))
    assert Objective().kl_estimator == "k3_clamped"
    # equal to plain k3 wherever neither clamp binds (-11 < x < 2.61)
    small = torch.linspace(-10.9, 2.6, 101, **F64)
    torch.testing.assert_close(
        kl_estimate(-small, torch.zeros_like(small), "k3_clamped"),
        kl_estimate(-small, torch.zeros_like(small), "k3"),
        rtol=0,
        atol=0,
    )
    # fp32, x = 100: plain k3 overflows to inf, the clamped one stays finite with a finite gradient
    lp32 = torch.tensor([-100.0], requires_grad=True)
    assert torch.isinf(kl_estimate(lp32, torch.zeros(1), "k3")).all()
    k32 = kl_estimate(lp32, torch.zeros(1), "k3_clamped")
    assert k32.item() == 10 and torch.autograd.grad(k32.sum(), lp32)[0].item() == 0


def test_full_kl_matches_torch_distributions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, **F64, requires_grad=True)
    ref = torch.randn(2, 5, 7, **F64)
    want = kl_divergence(Categorical(logits=logits), Categorical(logits=ref))  # (2, 5)
    got = full_kl(logits, ref)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), logits)
    (g_want,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g_got, g_want)
    torch.testing.assert_close(full_kl(logits[1], ref[1]), want[1])  # (n, V) rows: the log-prob pass's chunks
    mask = torch.rand(2, 5) > 0.5
    torch.testing.assert_close(full_kl(logits, ref, mask), torch.where(mask, want, 0.0))
    # bf16 in: the math runs in fp32 and comes back fp32
    low = full_kl(logits.detach().bfloat16(), ref.bfloat16())
    assert low.dtype == torch.float32
    p_bf, q_bf = Categorical(logits=logits.detach().bfloat16().double()), Categorical(logits=ref.bfloat16().double())
    want_bf = kl_divergence(p_bf, q_bf)
    torch.testing.assert_close(low.double(), want_bf, atol=1e-5, rtol=1e-4)


def test_top_entropy_mask_keeps_top_fraction_of_valid_tokens():
    h = torch.tensor([[0.0, 1, 2, 3, 4, 100], [5, 6, 7, 8, 9, 100]], **F64)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[:, 5] = False  # padding with huge entropy must neither be kept nor move the threshold
    keep = top_entropy_mask(h, mask, 0.3)
    assert keep.sum() == 3 and torch.equal(h[keep].sort().values, torch.tensor([7.0, 8, 9], **F64))
    assert torch.equal(top_entropy_mask(h, mask, 1.0), mask)
    assert torch.equal(top_entropy_mask(h, mask, 0.2), (h >= 8) & mask)


# -----------------------------------------------------------------------------
# sampler/trainer mismatch

# d = train_logp - sample_logp on a 2x3 batch, row 1 has 2 valid tokens (cap = 2):
#   token ratios e^d:  [e^0.5 = 1.6487213, e^-1 = 0.3678794, e^1 = 2.7182818] | [e^0.2 = 1.2214028, e^3 = 20.09, pad]
#   sequence ratios e^(sum of d): row 0 e^0.5 = 1.6487213 (GSPO's mean would give e^(0.5/3)), row 1 e^3.2 = 24.53
_D = [[0.5, -1.0, 1.0], [0.2, 3.0, 0.0]]
_E = math.exp
_WANT = {  # (weights, fraction of the 5 valid tokens capped or masked)
    "none": ([[1, 1, 1], [1, 1, 1]], 0.0),
    "token_truncate": ([[_E(0.5), _E(-1), 2], [_E(0.2), 2, 1]], 2 / 5),
    "token_mask": ([[_E(0.5), _E(-1), 0], [_E(0.2), 0, 1]], 2 / 5),
    "sequence_truncate": ([[_E(0.5)] * 3, [2, 2, 1]], 2 / 5),
    "sequence_mask": ([[_E(0.5)] * 3, [0, 0, 1]], 2 / 5),
}


@pytest.mark.parametrize("case", list(_WANT))
def test_behaviour_weights_hand_example(case):
    want, capped = _WANT[case]
    train = torch.tensor([[-1.0, -2, -0.5], [-3, -0.1, -2]], **F64, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    sample = train.detach() - torch.tensor(_D, **F64)
    sample[1, 2] = math.nan  # padding garbage must reach neither weights nor metrics
    w, m = behaviour_weights(train, sample, mask, case, cap=2.0)
    torch.testing.assert_close(w, torch.tensor(want, **F64))
    assert not w.requires_grad and all(v.dim() == 0 and not v.requires_grad for v in m.values())
    # |d| on valid tokens: 0.5, 1, 1, 0.2, 3 -> mean 5.7 / 5 = 1.14, max 3,
    # p99 (linear, sorted 0.2 0.5 1 1 3): position 0.99 * 4 = 3.96 -> 1 + 0.96 * (3 - 1) = 2.92
    assert m["is_capped"].item() == pytest.approx(capped)
    torch.testing.assert_close(m["dlogp_mean"], torch.tensor(1.14, **F64))
    torch.testing.assert_close(m["dlogp_p99"], torch.tensor(2.92, **F64))
    assert m["dlogp_max"].item() == 3.0


def test_behaviour_weights_all_masked_gives_finite_metrics():
    w, m = behaviour_weights(torch.zeros(2, 3), torch.full((2, 3), math.nan), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(w, torch.ones(2, 3)) and all(v.item() == 0 for v in m.values())


K3 = Objective(beta=0.1, kl_estimator="k3")  # eps 0.2: clip to [0.8, 1.2]


def test_behaviour_weights_multiply_the_policy_term_only():
    """The loss written out token by token, to 1e-12, on a batch asserted to reach both clips (r > 1.2 with A > 0,
    r < 0.8 with A < 0), as _batch says it does. Fails if the weights multiply the KL term too, or are clipped with
    the ratio, or if the clip of eq. 3 is dropped or one-sided."""
    logp, old, ref, adv, mask, _ = _batch()
    r, A = (logp - old).exp()[mask], adv[:, None].expand_as(logp)[mask]  # (valid tokens,)
    assert ((r > 1.2) & (A > 0)).any() and ((r < 0.8) & (A < 0)).any(), "the batch must reach both clips"
    logp.requires_grad_()
    w = 0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(1), **F64)  # below is_cap 2: not cut
    sample = (old - w.log()).requires_grad_()  # pi_old (the trainer's, old_logp) / pi_sample = w
    loss, _ = grpo_loss(logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=K3, sample_logp=sample)
    # written out: (1/N) sum_i (1/|o_i|) sum_t [-min(r A, clip(r, 0.8, 1.2) A) w + 0.1 (e^x - x - 1)]
    want, lp = 0.0, logp.detach()
    for i in range(6):
        L = int(mask[i].sum())
        row = 0.0
        for t in range(L):
            r, a, x = math.exp(lp[i, t] - old[i, t]), adv[i].item(), (ref[i, t] - lp[i, t]).item()
            row += -min(r * a, min(max(r, 0.8), 1.2) * a) * w[i, t].item() + 0.1 * (math.exp(x) - x - 1)
        want += row / L / 6
    assert loss.item() == pytest.approx(want, rel=1e-12)
    g_logp, g_w = torch.autograd.grad(loss, (logp, sample), allow_unused=True)
    assert g_w is None  # the weights are used detached
    # weight 0 everywhere (token_mask: every ratio e^10 above the cap) leaves exactly the KL term's gradient
    masked = dataclasses.replace(K3, is_mode="token_mask")
    zero, _ = grpo_loss(logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=masked, sample_logp=old - 10)
    kl_only, _ = grpo_loss(logp, old_logp=old, ref_logp=ref, advantages=torch.zeros_like(adv), mask=mask, obj=K3)
    torch.testing.assert_close(torch.autograd.grad(zero, logp)[0], torch.autograd.grad(kl_only, logp)[0])


# -----------------------------------------------------------------------------
# policy term


def test_clip_gradient_zero_exactly_where_the_clipped_branch_is_active():
    # (A, rho): eps_low=0.2, eps_high=0.28 (clip-higher)
    cases = [(1, 1.5), (1, 1.25), (1, 0.5), (1, 1.0), (-1, 0.5), (-1, 0.75), (-1, 0.9), (-1, 1.5)]
    A = torch.tensor([[a for a, _ in cases]], **F64)  # (1, 8)
    old = torch.full((1, 8), -1.0, **F64)
    logp = (old + torch.tensor([[r for _, r in cases]], **F64).log()).requires_grad_()
    mask = torch.ones(1, 8, dtype=torch.bool)
    loss, m = grpo_loss(
        logp, old_logp=old, ref_logp=None, advantages=A, mask=mask, obj=Objective(beta=0, eps_high=0.28)
    )
    (grad,) = torch.autograd.grad(loss, logp)
    clipped = torch.tensor([[True, False, False, False, True, True, False, False]])
    assert torch.equal(grad[clipped], torch.zeros(3, **F64))
    assert (grad[~clipped] != 0).all()
    want = [min(r * a, min(max(r, 0.8), 1.28) * a) for a, r in cases]
    torch.testing.assert_close(loss, -torch.tensor(want, **F64).mean())
    assert (m["clip_high"].item(), m["clip_low"].item(), m["clip"].item()) == (1 / 8, 2 / 8, 3 / 8)
    # without clip-higher, rho=1.25 with A>0 is clipped too
    (grad_sym,) = torch.autograd.grad(
        grpo_loss(logp, old_logp=old, ref_logp=None, advantages=A, mask=mask, obj=Objective(beta=0))[0], logp
    )
    assert grad_sym[0, 1] == 0 and grad[0, 1] != 0


def test_delta_caps_ratio_for_negative_advantages():
    ratio = torch.tensor([[10.0, 3.0, 10.0]], **F64, requires_grad=True)
    A = torch.tensor([[-1.0, -1.0, 1.0]], **F64)
    capped = clipped_surrogate(ratio, A, eps=0.2, delta=4.0)
    torch.testing.assert_close(capped, torch.tensor([[-4.0, -3.0, 1.2]], **F64))
    torch.testing.assert_close(clipped_surrogate(ratio, A, eps=0.2), torch.tensor([[-10.0, -3.0, 1.2]], **F64))
    (grad,) = torch.autograd.grad(capped.sum(), ratio)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0, 0.0]], **F64))  # no gradient above delta


def test_gspo_sequence_ratio_is_exp_of_masked_mean_log_ratio():
    logp, old, _, _, mask, _ = _batch()
    ratio = importance_ratio(logp, old, mask, "sequence")
    for i in range(logp.shape[0]):
        L = int(mask[i].sum())
        s = math.exp(sum((logp[i, t] - old[i, t]).item() for t in range(L)) / L)
        torch.testing.assert_close(ratio[i], torch.full_like(ratio[i], s))
    torch.testing.assert_close(importance_ratio(logp, old, mask), torch.where(mask, (logp - old).exp(), 1.0))


@pytest.mark.parametrize("loss_type,level", CLIPPED_LEVELS)
def test_mu1_value_is_advantage_and_gradient_is_minus_A_times_weight(loss_type, level):
    logp, _, _, adv, mask, _ = _batch()
    logp.requires_grad_()
    N, T = logp.shape
    obj = Objective(beta=0, loss_type=loss_type, importance_level=level, max_new_tokens=10)
    loss, m = grpo_loss(logp, old_logp=None, ref_logp=None, advantages=adv, mask=mask, obj=obj)
    lens = mask.sum(1, keepdim=True).double()  # (N, 1)
    n = mask.sum()
    weight = {"grpo": 1 / (lens * N), "bnpo": 1 / n, "dr_grpo": 1 / (N * 10), "dapo": 1 / n, "luspo": 1 / N}[loss_type]
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.where(mask, -adv[:, None] * weight, 0.0))
    torch.testing.assert_close(loss, -(torch.where(mask, adv[:, None] * weight, 0.0)).sum())
    assert m["ratio_min"] == m["ratio_max"] == 1


# -----------------------------------------------------------------------------
# masks and aggregation


@pytest.mark.parametrize("loss_type,level", CLIPPED_LEVELS)
def test_padding_changes_neither_loss_nor_gradient(loss_type, level):
    logp, old, ref, adv, mask, ent = _batch()
    adv_t = adv[:, None] * torch.linspace(0.5, 1.5, 7, **F64)  # (N, T) process-style advantages

    def run(logp, old, ref, adv_t, ent):
        logp, ent = logp.clone().requires_grad_(), ent.clone().requires_grad_()
        obj = Objective(
            beta=0.04,
            delta=4.0,
            loss_type=loss_type,
            importance_level=level,
            entropy_coef=0.01,
            top_entropy_quantile=0.5,
        )
        loss, metrics = grpo_loss(logp, old_logp=old, ref_logp=ref, advantages=adv_t, mask=mask, obj=obj, entropy=ent)
        return loss, torch.autograd.grad(loss, (logp, ent)), metrics

    loss, grads, metrics = run(logp, old, ref, adv_t, ent)
    pad = ~mask

    def bad(x, v):
        return torch.where(pad, torch.full_like(x, v), x)

    loss2, grads2, metrics2 = run(
        bad(logp, -math.inf), bad(old, math.nan), bad(ref, 1e4), bad(adv_t, math.nan), bad(ent, 1e6)
    )
    torch.testing.assert_close(loss2, loss)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g2, g)
        assert torch.equal(g2[pad], torch.zeros_like(g2[pad]))
    for k in metrics:
        torch.testing.assert_close(metrics2[k], metrics[k])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_row_and_all_masked_call_are_finite(loss_type):
    """A row with no valid token gets exactly no gradient, the others a finite one; a call with none has loss 0 and
    every metric exactly 0. Fails if a mean over no tokens divides by 0 without clamp(min=1) (NaN), or an empty
    call's metric takes another value (a ratio_min of 1, an inf max)."""
    logp, old, ref, adv, mask, ent = _batch()
    mask[2] = False
    logp.requires_grad_()
    obj = Objective(beta=0.1, loss_type=loss_type, importance_level=LEVEL[loss_type])
    loss, m = grpo_loss(logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=obj, entropy=ent)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.equal(grad[2], torch.zeros(7, **F64))
    loss, m = grpo_loss(
        logp, old_logp=old, ref_logp=ref, advantages=adv, mask=torch.zeros_like(mask), obj=obj, entropy=ent
    )
    assert loss.item() == 0 and {k: v.item() for k, v in m.items()} == dict.fromkeys(m, 0.0)


@pytest.mark.parametrize("loss_type", CLIPPED)
def test_aggregate_formulas_on_ragged_lengths(loss_type):
    torch.manual_seed(0)
    lens = [5, 2, 4]
    x = torch.randn(3, 6, **F64)  # (N, T)
    mask = torch.arange(6)[None] < torch.tensor(lens)[:, None]
    x = torch.where(mask, x, 1e6)  # padding garbage
    rows = [x[i, :L] for i, L in enumerate(lens)]
    want = {
        "grpo": sum(r.mean() for r in rows) / 3,
        "bnpo": sum(r.sum() for r in rows) / 11,
        "dr_grpo": sum(r.sum() for r in rows) / (3 * 8),
        "dapo": sum(r.sum() for r in rows) / 20,
        "luspo": sum(r.sum() for r in rows) / 3,  # each row's loss times its length (LUSPO)
    }[loss_type]
    got = aggregate(x, mask, loss_type, max_new_tokens=8, num_tokens=20 if loss_type == "dapo" else None)
    torch.testing.assert_close(got, want)


def test_grpo_differs_from_bnpo_on_ragged_lengths_only():
    torch.manual_seed(0)
    x = torch.randn(3, 6, **F64)
    ragged = torch.arange(6)[None] < torch.tensor([[5], [2], [4]])
    equal = torch.arange(6)[None] < torch.tensor([[4], [4], [4]])
    assert not torch.allclose(aggregate(x, ragged, "grpo"), aggregate(x, ragged, "bnpo"))
    torch.testing.assert_close(aggregate(x, equal, "grpo"), aggregate(x, equal, "bnpo"))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_two_micro_batches_accumulate_to_one_batch(loss_type):
    logp, old, ref, adv, mask, _ = _batch()
    obj = Objective(beta=0.04, eps_high=0.28, loss_type=loss_type, max_new_tokens=7)
    full = logp.clone().requires_grad_()
    loss, _ = grpo_loss(full, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=obj)
    loss.backward()
    acc = logp.clone().requires_grad_()
    total = 0
    for s in (slice(0, 2), slice(2, 6)):  # unequal micro-batches
        part, _ = grpo_loss(
            acc[s],
            old_logp=old[s],
            ref_logp=ref[s],
            advantages=adv[s],
            mask=mask[s],
            obj=obj,
            num_sequences=6,
            num_tokens=mask.sum(),
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, loss.detach())
    torch.testing.assert_close(acc.grad, full.grad)


BNPO = Objective(beta=0, loss_type="bnpo")


def test_bnpo_micro_batches_average_their_token_means():
    logp, old, _, adv, mask, _ = _batch()
    parts = [
        grpo_loss(logp[s], old_logp=old[s], ref_logp=None, advantages=adv[s], mask=mask[s], obj=BNPO, num_sequences=6)[
            0
        ]
        for s in (slice(0, 3), slice(3, 6))
    ]
    alone = [
        grpo_loss(logp[s], old_logp=old[s], ref_logp=None, advantages=adv[s], mask=mask[s], obj=BNPO)[0]
        for s in (slice(0, 3), slice(3, 6))
    ]
    torch.testing.assert_close(sum(parts), sum(alone) / 2)
    # with equal token counts per micro-batch that is the full-batch token mean
    even = torch.arange(7)[None] < torch.tensor([[4], [2], [3], [3], [2], [4]])  # 9 tokens in each half
    parts = [
        grpo_loss(logp[s], old_logp=old[s], ref_logp=None, advantages=adv[s], mask=even[s], obj=BNPO, num_sequences=6)[
            0
        ]
        for s in (slice(0, 3), slice(3, 6))
    ]
    torch.testing.assert_close(
        sum(parts), grpo_loss(logp, old_logp=old, ref_logp=None, advantages=adv, mask=even, obj=BNPO)[0]
    )


# -----------------------------------------------------------------------------
# the combined loss: KL, entropy, metrics, dtypes


def test_kl_entropy_terms_and_metrics():
    logp, old, ref, adv, mask, ent = _batch()
    logp.requires_grad_()
    base, _ = grpo_loss(logp, old_logp=old, ref_logp=None, advantages=adv, mask=mask, obj=Objective(beta=0))
    loss, m = grpo_loss(
        logp,
        old_logp=old,
        ref_logp=ref,
        advantages=adv,
        mask=mask,
        obj=Objective(beta=0.1, entropy_coef=0.01),
        entropy=ent,
    )
    k3 = kl_estimate(logp, ref)
    lens = mask.sum(1).double()

    def seq_mean(x):
        return (torch.where(mask, x, 0.0).sum(1) / lens).mean()

    torch.testing.assert_close(loss, base + 0.1 * seq_mean(k3) - 0.01 * seq_mean(ent))
    torch.testing.assert_close(m["kl"], k3.detach()[mask].mean())
    torch.testing.assert_close(m["entropy"], ent[mask].mean())
    ratio = (logp - old).detach().exp()[mask]
    torch.testing.assert_close(m["ratio_mean"], ratio.mean())
    assert m["ratio_min"] == ratio.min() and m["ratio_max"] == ratio.max()
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    assert "kl" not in grpo_loss(logp, old_logp=old, ref_logp=None, advantages=adv, mask=mask, obj=Objective(beta=0))[1]


def test_kl_max_metric_and_default_estimator():
    # x = ref - logp on valid tokens: 0.5, -1, 2 | 25; k3 = 0.1487, 0.3679, 4.3891 | ~7.2e10
    logp = torch.tensor([[-1.0, -1, -1], [-1, -1, -1]], **F64)
    ref = logp + torch.tensor([[0.5, -1, 2], [25, 99, 99]], **F64)  # x = 99 is padding
    mask = torch.tensor([[True, True, True], [True, False, False]])
    k3 = [math.exp(0.5) - 1.5, math.exp(-1), math.exp(2) - 3, math.exp(25) - 26]
    _, m = grpo_loss(
        logp,
        old_logp=None,
        ref_logp=ref,
        advantages=torch.zeros(2, **F64),
        mask=mask,
        obj=Objective(beta=0.1, kl_estimator="k3"),
    )
    assert m["kl_max"].item() == pytest.approx(k3[3]) and m["kl"].item() == pytest.approx(sum(k3) / 4)
    # the default (k3_clamped) caps x = 25 at 10, so the max is 10 and the mean (k3[:3] + 10) / 4
    _, m = grpo_loss(
        logp, old_logp=None, ref_logp=ref, advantages=torch.zeros(2, **F64), mask=mask, obj=Objective(beta=0.1)
    )
    assert m["kl_max"].item() == 10 and m["kl"].item() == pytest.approx((sum(k3[:3]) + 10) / 4)
    _, m = grpo_loss(
        logp,
        old_logp=None,
        ref_logp=ref,
        advantages=torch.zeros(2, **F64),
        mask=torch.zeros_like(mask),
        obj=Objective(beta=0.1),
    )
    assert m["kl_max"].item() == 0 and m["kl"].item() == 0


def test_full_kl_in_loss_matches_naive_formula():
    torch.manual_seed(0)
    N, T, V = 4, 5, 7
    logits0, ref_logits = torch.randn(N, T, V, **F64), torch.randn(N, T, V, **F64)
    tokens = torch.randint(V, (N, T))
    mask = torch.arange(T)[None] < torch.tensor([[5], [2], [4], [1]])
    old = torch.randn(N, T, **F64).mul(0.3) + logits0.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    adv = torch.randn(N, **F64)

    logits = logits0.clone().requires_grad_()
    logp = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]  # (N, T)
    kl = full_kl(logits, ref_logits)  # (N, T)
    loss, m = grpo_loss(
        logp,
        old_logp=old,
        ref_logp=None,
        advantages=adv,
        mask=mask,
        obj=Objective(beta=0.2, kl_estimator="full"),
        kl=kl,
    )
    (grad,) = torch.autograd.grad(loss, logits)

    # naive: everything on the full (N, T, V) tensor, sequence-mean then batch-mean ("grpo")
    naive = logits0.clone().requires_grad_()
    lq, lq_ref = naive.log_softmax(-1), ref_logits.log_softmax(-1)  # (N, T, V)
    kl_n = (lq.exp() * (lq - lq_ref)).sum(-1)  # (N, T)
    r = (lq.gather(-1, tokens[..., None])[..., 0] - old).exp()  # (N, T)
    a = adv[:, None]
    per_token = -torch.minimum(r * a, r.clamp(0.8, 1.2) * a) + 0.2 * kl_n
    want = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, torch.autograd.grad(want, naive)[0])
    torch.testing.assert_close(m["kl"], kl_n[mask].mean())
    torch.testing.assert_close(m["kl_max"], kl_n[mask].max())


def test_padding_garbage_in_full_kl_and_the_sampler_logp_is_ignored():
    """Fails if a NaN / inf at padding in a full KL or the sampler's log-probs reaches the loss, a gradient or a
    metric (a where that multiplies instead of selecting)."""
    logp, old, _, adv, mask, _ = _batch()
    kl = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2), **F64)
    sample = logp - 0.5 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), **F64)

    def run(kl, sample):
        lp, kl = logp.clone().requires_grad_(), kl.clone().requires_grad_()
        obj = Objective(beta=0.1, kl_estimator="full")
        loss, m = grpo_loss(
            lp, old_logp=old, ref_logp=None, advantages=adv, mask=mask, obj=obj, kl=kl, sample_logp=sample
        )
        return loss, torch.autograd.grad(loss, (lp, kl)), m

    loss, grads, m = run(kl, sample)
    loss2, grads2, m2 = run(torch.where(mask, kl, math.nan), torch.where(mask, sample, -math.inf))
    torch.testing.assert_close(loss2, loss)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g2, g)
    for k in m:
        torch.testing.assert_close(m2[k], m[k])


def test_top_entropy_quantile_applies_to_policy_term_only():
    logp, old, ref, adv, mask, ent = _batch()
    logp.requires_grad_()
    loss, _ = grpo_loss(
        logp,
        old_logp=old,
        ref_logp=ref,
        advantages=adv,
        mask=mask,
        obj=Objective(beta=0.1, top_entropy_quantile=0.3),
        entropy=ent,
    )
    keep = top_entropy_mask(ent, mask, 0.3)
    per_token = -clipped_surrogate((logp - old).exp(), adv[:, None], eps=0.2) * keep + 0.1 * kl_estimate(logp, ref)
    torch.testing.assert_close(loss, aggregate(per_token, mask, "grpo"))
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad[mask & ~keep] != 0).all()  # the KL term still reaches dropped tokens


def test_bf16_inputs_are_upcast():
    logp, old, ref, adv, mask, _ = _batch()
    loss, m = grpo_loss(
        logp.bfloat16(),
        old_logp=old.bfloat16(),
        ref_logp=ref.bfloat16(),
        advantages=adv.bfloat16(),
        mask=mask,
        obj=Objective(),
    )
    assert loss.dtype == torch.float32 and m["ratio_mean"].dtype == torch.float32
    lp, o, r, a = (x.bfloat16().double() for x in (logp, old, ref, adv))
    want, _ = grpo_loss(lp, old_logp=o, ref_logp=r, advantages=a, mask=mask, obj=Objective())
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-4)


# -----------------------------------------------------------------------------
# Objective: the options in one place


def test_objective_resolves_eps_high_once_and_is_frozen():
    assert Objective().eps_high == 0.2 and Objective(eps=0.3).eps_high == 0.3
    assert Objective(eps_high=0.28).eps_high == 0.28
    assert dataclasses.replace(Objective(eps_high=0.28), eps=0.25).eps_high == 0.28
    with pytest.raises(dataclasses.FrozenInstanceError):
        Objective().eps = 0.5  # a change after validation would skip it


@pytest.mark.parametrize("loss_type,divisor", [("grpo", None), ("dapo", 3), ("dr_grpo", 2 * 4)])
def test_grpo_loss_with_an_objective_equals_the_hand_computed_loss(loss_type, divisor):
    # row 0 (A = +1): ratios 1.5, 0.9, x = ref - logp = 0, ln 2; row 1 (A = -1): ratio 0.5, x = 0, one pad token.
    # eps 0.2, eps_high 0.28, beta 0.1, k3 = e^x - x - 1:
    #   l00 = -min(1.5, 1.28) = -1.28 (clipped high)      l01 = -min(0.9, 0.9) + 0.1 (2 - ln 2 - 1)
    #   l10 = -min(-0.5, -0.8) = 0.8 (clipped low)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], **F64)
    logp = (old + torch.tensor([[1.5, 0.9], [0.5, 1.0]], **F64).log()).requires_grad_()
    ref = logp.detach() + torch.tensor([[0.0, math.log(2)], [0.0, 50.0]], **F64)  # 50: padding garbage
    mask = torch.tensor([[True, True], [True, False]])
    obj = Objective(beta=0.1, kl_estimator="k3", loss_type=loss_type, eps_high=0.28, max_new_tokens=4)
    loss, m = grpo_loss(
        logp, old_logp=old, ref_logp=ref, advantages=torch.tensor([1.0, -1.0], **F64), mask=mask, obj=obj
    )
    k = 1 - math.log(2)
    l00, l01, l10 = -1.28, -0.9 + 0.1 * k, 0.8
    want = ((l00 + l01) / 2 + l10) / 2 if divisor is None else (l00 + l01 + l10) / divisor
    assert loss.item() == pytest.approx(want, rel=1e-12)
    # only token 01 is unclipped: d/dlogp of -r A + 0.1 k3 is -0.9 - 0.1 (e^x - 1) = -1, times its weight
    weight = 1 / 4 if divisor is None else 1 / divisor
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -weight], [0.0, 0.0]], **F64), rtol=0, atol=1e-12)
    # the clip fractions are counts in fp32 (one rounding: relative error <= 2^-24), the rest fp64
    f32, f64 = 2**-24, 1e-12
    want_m = {
        "clip_low": (1 / 3, f32),
        "clip_high": (1 / 3, f32),
        "clip": (2 / 3, f32),
        "kl": (k / 3, f64),
        "kl_max": (k, f64),
        "ratio_mean": (2.9 / 3, f64),
        "ratio_min": (0.5, f64),
        "ratio_max": (1.5, f64),
    }
    assert {key: pytest.approx(v, rel=r) for key, (v, r) in want_m.items()} == {key: v.item() for key, v in m.items()}


def test_docstring_examples():
    result = doctest.testmod(grpo, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


# -----------------------------------------------------------------------------
# bad input

_x, _m, _adv = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)
_NO_KL = Objective(beta=0)
BAD = [  # the facts each message must carry: the argument or flag, the value where there is one
    (lambda: group_advantages(torch.zeros(7), 4), r"group_size.*\(7\).*got 4"),
    (lambda: group_advantages(torch.zeros(4), 1), "group_size must be an int >= 2"),
    (lambda: group_advantages(torch.zeros(4), 2.0), "group_size must be an int >= 2"),
    (lambda: group_advantages(torch.zeros(4, 1), 2), "rewards must have shape"),
    (lambda: group_advantages(torch.zeros(4), 2, scale="no-such-scale"), "--scale-rewards 'no-such-scale'.*group"),
    (
        lambda: process_advantages(
            torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2).bool(), 2, 4
        ),
        r"group_size\b.*\b2\b.*\b3\b",  # its value and the rows it must divide
    ),
    (
        lambda: process_advantages(torch.zeros(2, 2), torch.tensor([[0, 4], [0, 1]]), _m[:, :2], 2, 4),
        r"step_ends must lie in \[0, seq_len=4\)",
    ),
    (lambda: kl_estimate(_x, _x, "no-such-kl"), "--kl-estimator 'no-such-kl'.*k3"),
    (lambda: aggregate(_x, _m, "no-such-aggregation"), "aggregation 'no-such-aggregation'.*grpo"),
    (lambda: aggregate(_x, _m, "dr_grpo", max_new_tokens=2), "max_new_tokens"),
    (lambda: aggregate(_x, _m[:, :2], "grpo"), "mask must have shape"),
    (lambda: importance_ratio(_x, _x, _m, "no-such-level"), "--importance-level 'no-such-level'.*token"),
    (lambda: clipped_surrogate(_x, _x, eps=0.2, delta=1.1), "delta must be > 1 \\+ eps_high"),
    (lambda: full_kl(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)), "ref_logits must have shape"),
    (lambda: top_entropy_mask(_x, _m, 0.0), r"top_entropy_quantile must be in \(0, 1\]"),
    (
        lambda: grpo_loss(_x, old_logp=_x[:1], ref_logp=None, advantages=_adv, mask=_m, obj=_NO_KL),
        "old_logp must have shape",
    ),
    (
        lambda: grpo_loss(_x, old_logp=None, ref_logp=None, advantages=_adv, mask=_m[:1], obj=_NO_KL),
        "mask must have shape",
    ),
    (
        lambda: grpo_loss(_x, old_logp=None, ref_logp=None, advantages=torch.zeros(3), mask=_m, obj=_NO_KL),
        "advantages must have shape",
    ),
    (
        lambda: grpo_loss(_x, old_logp=None, ref_logp=_x[:1], advantages=_adv, mask=_m, obj=Objective()),
        "ref_logp must have shape",
    ),
    (
        lambda: grpo_loss(_x, old_logp=None, ref_logp=None, advantages=_adv, mask=_m, obj=Objective()),
        "ref_logp is required when beta > 0",
    ),
    (
        lambda: grpo_loss(
            _x, old_logp=None, ref_logp=None, advantages=_adv, mask=_m, obj=Objective(beta=0, entropy_coef=0.1)
        ),
        "entropy is required",
    ),
    (
        lambda: grpo_loss(
            _x, old_logp=None, ref_logp=None, advantages=_adv, mask=_m, obj=Objective(beta=0, top_entropy_quantile=0.5)
        ),
        "entropy is required",
    ),
    (lambda: kl_estimate(_x, _x, "full"), "kl_estimator='full' needs logits"),
    (
        lambda: grpo_loss(
            _x, old_logp=None, ref_logp=None, advantages=_adv, mask=_m, obj=Objective(beta=0.1, kl_estimator="full")
        ),
        "'full' needs kl=",
    ),
    (
        lambda: grpo_loss(_x, old_logp=None, ref_logp=_x, advantages=_adv, mask=_m, obj=Objective(), kl=_x),
        "kl is read only with kl_estimator='full'",
    ),
    (
        lambda: grpo_loss(
            _x,
            old_logp=None,
            ref_logp=None,
            advantages=_adv,
            mask=_m,
            obj=Objective(beta=0, kl_estimator="full"),
            kl=_x[:1],
        ),
        "kl must have shape",
    ),
    (
        lambda: grpo_loss(
            _x, old_logp=None, ref_logp=None, advantages=_adv, mask=_m, obj=_NO_KL, sample_logp=_x[:, :2]
        ),
        "sample_logp must have shape",
    ),
    (lambda: behaviour_weights(_x, _x, _m, "no-such-mode"), "--is-mode 'no-such-mode'.*token_truncate"),
    (lambda: behaviour_weights(_x, _x[:1], _m), "sample_logp must have shape"),
    (lambda: behaviour_weights(_x, _x, _m[:1]), "mask must have shape"),
    (lambda: informative_groups(torch.zeros(5), 2), "group_size must be an int >= 2 that divides"),
    (lambda: Objective(eps_high=math.nan), "--eps-high must be a finite number, got nan"),
    (lambda: Objective(delta=math.nan), "--delta must be a finite number, got nan"),
    (lambda: informative_groups(torch.zeros(4, 1), 2), "rewards must have shape"),
    # Objective: one line naming the flag or config key, the value and what holds
    (lambda: Objective(eps_high=0.1), r"--eps-high 0.1 < --eps 0.2"),
    (lambda: Objective(delta=1.1), r"--delta 1.1 must be > 1 \+ eps_high = 1.2"),
    (lambda: Objective(eps=0.3, delta=1.25), r"--delta 1.25 must be > 1 \+ eps_high = 1.3"),  # resolved eps_high
    (lambda: Objective(loss_type="no-such-loss"), "--loss-type 'no-such-loss'.*grpo"),
    (lambda: Objective(kl_estimator="no-such-kl"), "--kl-estimator 'no-such-kl'.*full"),
    (lambda: Objective(importance_level="no-such-level"), "--importance-level 'no-such-level'.*sequence"),
    (lambda: Objective(is_mode="no-such-mode"), "--is-mode 'no-such-mode'.*none"),
    (lambda: Objective(aggregation="no-such-aggregation"), "aggregation 'no-such-aggregation'.*dapo"),
    (lambda: Objective(cispo_cap=0.5), "cispo_cap must be >= 1, got 0.5"),
    (lambda: Objective(is_cap=0.0), "is_cap must be > 0, got 0.0"),
    (lambda: Objective(sapo_temperature_neg=0.0), "sapo_temperature_neg must be > 0"),
]


@pytest.mark.parametrize("call,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_raises_value_error_naming_the_argument(call, message):
    """Fails if a bad argument is accepted (a silent wrong result) or its one-line error leaves out the argument,
    its value or the rule it breaks."""
    with pytest.raises(ValueError, match=message):
        call()


def test_beta_zero_needs_no_reference():
    logp, old, _, adv, mask, _ = _batch()
    loss, m = grpo_loss(logp, old_logp=old, ref_logp=None, advantages=adv, mask=mask, obj=Objective(beta=0.0))
    assert torch.isfinite(loss) and "kl" not in m
    # nor does the full-vocabulary estimator need its kl then
    assert torch.equal(
        grpo_loss(
            logp, old_logp=old, ref_logp=None, advantages=adv, mask=mask, obj=Objective(beta=0, kl_estimator="full")
        )[0],
        loss,
    )
