"""Tests for grpo.py: each function against a hand calculation or an independent computation (CPU, fp64)."""

import doctest
import math
import statistics

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

import grpo
from grpo import (LOSS_TYPES, aggregate, clipped_surrogate, entropy_from_logits, full_kl,
                  group_advantages, grpo_loss, importance_ratio, kl_estimate, process_advantages, top_entropy_mask)

F64 = dict(dtype=torch.float64)


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
    expected = [a for i in range(4) for a in _unbiased(r.tolist()[3 * i:3 * i + 3])]
    torch.testing.assert_close(group_advantages(r, 3, scale="group")[0], torch.tensor(expected, **F64))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_zero_variance_group_is_exactly_zero(scale):
    # the float mean of three 0.1s is not 0.1, so r - mean alone would leave ~1e-17 / 1e-4 noise
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.2], **F64)  # (6,)
    adv, frac = group_advantages(r, 3, scale=scale)
    assert torch.equal(adv[:3], torch.zeros(3, **F64))
    assert adv[3:].abs().min() > 0
    assert frac.item() == 0.5


def test_process_advantages_hand_example():
    # group of 2 outputs x 2 steps, rewards 0, 4 | 4, 4: mean 3, unbiased std sqrt(12 / 3) = 2,
    # normalised -1.5, 0.5 | 0.5, 0.5. Output 0 steps end at tokens 1, 4; output 1 at tokens 2, 3.
    adv = process_advantages(torch.tensor([[0.0, 4], [4, 4]], **F64), torch.tensor([[1, 4], [2, 3]]),
                             torch.ones(2, 2, dtype=torch.bool), group_size=2, seq_len=5, eps=0.0)
    expected = [[-1.5 + 0.5, -1.5 + 0.5, 0.5, 0.5, 0.5],
                [0.5 + 0.5, 0.5 + 0.5, 0.5 + 0.5, 0.5, 0.0]]  # token 4 of output 1 is after its last step
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
    std = ((p * per_value ** 2).sum() - exact ** 2).sqrt()
    assert abs(k.mean() - exact) < 5 * std / math.sqrt(n)


def test_k1_k2_hand_values():
    logp, ref = torch.tensor([-1.0, -2.0], **F64), torch.tensor([-1.5, -1.0], **F64)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0], **F64))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5], **F64))
    torch.testing.assert_close(kl_estimate(logp, ref), torch.tensor([math.exp(-0.5) + 0.5 - 1, math.e - 2], **F64))


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_full_kl_matches_torch_distributions(chunk_size):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, **F64, requires_grad=True)
    ref = torch.randn(2, 5, 7, **F64)
    want = kl_divergence(Categorical(logits=logits), Categorical(logits=ref))  # (2, 5)
    got = full_kl(logits, ref, chunk_size=chunk_size)
    torch.testing.assert_close(got, want)
    g_got, = torch.autograd.grad(got.sum(), logits)  # through the checkpointed chunks
    g_want, = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g_got, g_want)
    mask = torch.rand(2, 5) > 0.5
    torch.testing.assert_close(full_kl(logits, ref, mask, chunk_size), torch.where(mask, want, 0.0))
    # bf16 in: the math runs in fp32 and comes back fp32
    low = full_kl(logits.detach().bfloat16(), ref.bfloat16(), chunk_size=chunk_size)
    assert low.dtype == torch.float32
    p_bf, q_bf = Categorical(logits=logits.detach().bfloat16().double()), Categorical(logits=ref.bfloat16().double())
    want_bf = kl_divergence(p_bf, q_bf)
    torch.testing.assert_close(low.double(), want_bf, atol=1e-5, rtol=1e-4)


def test_entropy_from_logits_matches_categorical():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 9, **F64)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=5), Categorical(logits=logits).entropy())
    uniform = entropy_from_logits(torch.zeros(1, 2, 9))
    torch.testing.assert_close(uniform, torch.full((1, 2), math.log(9)))


def test_top_entropy_mask_keeps_top_fraction_of_valid_tokens():
    h = torch.tensor([[0.0, 1, 2, 3, 4, 100], [5, 6, 7, 8, 9, 100]], **F64)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[:, 5] = False  # padding with huge entropy must neither be kept nor move the threshold
    keep = top_entropy_mask(h, mask, 0.3)
    assert keep.sum() == 3 and torch.equal(h[keep].sort().values, torch.tensor([7.0, 8, 9], **F64))
    assert torch.equal(top_entropy_mask(h, mask, 1.0), mask)
    assert torch.equal(top_entropy_mask(h, mask, 0.2), (h >= 8) & mask)


# -----------------------------------------------------------------------------
# policy term

def test_clip_gradient_zero_exactly_where_the_clipped_branch_is_active():
    # (A, rho): eps_low=0.2, eps_high=0.28 (clip-higher)
    cases = [(1, 1.5), (1, 1.25), (1, 0.5), (1, 1.0), (-1, 0.5), (-1, 0.75), (-1, 0.9), (-1, 1.5)]
    A = torch.tensor([[a for a, _ in cases]], **F64)  # (1, 8)
    old = torch.full((1, 8), -1.0, **F64)
    logp = (old + torch.tensor([[r for _, r in cases]], **F64).log()).requires_grad_()
    mask = torch.ones(1, 8, dtype=torch.bool)
    loss, m = grpo_loss(logp, old, None, A, mask, eps_low=0.2, eps_high=0.28)
    grad, = torch.autograd.grad(loss, logp)
    clipped = torch.tensor([[True, False, False, False, True, True, False, False]])
    assert torch.equal(grad[clipped], torch.zeros(3, **F64))
    assert (grad[~clipped] != 0).all()
    want = [min(r * a, min(max(r, 0.8), 1.28) * a) for a, r in cases]
    torch.testing.assert_close(loss, -torch.tensor(want, **F64).mean())
    assert (m["clip_high"].item(), m["clip_low"].item(), m["clip"].item()) == (1 / 8, 2 / 8, 3 / 8)
    # without clip-higher, rho=1.25 with A>0 is clipped too
    grad_sym, = torch.autograd.grad(grpo_loss(logp, old, None, A, mask, eps_low=0.2)[0], logp)
    assert grad_sym[0, 1] == 0 and grad[0, 1] != 0


def test_delta_caps_ratio_for_negative_advantages():
    ratio = torch.tensor([[10.0, 3.0, 10.0]], **F64, requires_grad=True)
    A = torch.tensor([[-1.0, -1.0, 1.0]], **F64)
    capped = clipped_surrogate(ratio, A, 0.2, delta=4.0)
    torch.testing.assert_close(capped, torch.tensor([[-4.0, -3.0, 1.2]], **F64))
    torch.testing.assert_close(clipped_surrogate(ratio, A, 0.2), torch.tensor([[-10.0, -3.0, 1.2]], **F64))
    grad, = torch.autograd.grad(capped.sum(), ratio)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0, 0.0]], **F64))  # no gradient above delta


def test_gspo_sequence_ratio_is_exp_of_masked_mean_log_ratio():
    logp, old, _, _, mask, _ = _batch()
    ratio = importance_ratio(logp, old, mask, "sequence")
    for i in range(logp.shape[0]):
        L = int(mask[i].sum())
        s = math.exp(sum((logp[i, t] - old[i, t]).item() for t in range(L)) / L)
        torch.testing.assert_close(ratio[i], torch.full_like(ratio[i], s))
    torch.testing.assert_close(importance_ratio(logp, old, mask), torch.where(mask, (logp - old).exp(), 1.0))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_mu1_value_is_advantage_and_gradient_is_minus_A_times_weight(loss_type, level):
    logp, _, _, adv, mask, _ = _batch()
    logp.requires_grad_()
    N, T = logp.shape
    loss, m = grpo_loss(logp, None, None, adv, mask, loss_type=loss_type, importance_level=level, max_len=10)
    lens = mask.sum(1, keepdim=True).double()  # (N, 1)
    n = mask.sum()
    weight = {"grpo": 1 / (lens * N), "bnpo": 1 / n, "dr_grpo": 1 / (N * 10), "dapo": 1 / n}[loss_type]
    grad, = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.where(mask, -adv[:, None] * weight, 0.0))
    torch.testing.assert_close(loss, -(torch.where(mask, adv[:, None] * weight, 0.0)).sum())
    assert m["ratio_min"] == m["ratio_max"] == 1


# -----------------------------------------------------------------------------
# masks and aggregation

@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padding_changes_neither_loss_nor_gradient(loss_type, level):
    logp, old, ref, adv, mask, ent = _batch()
    adv_t = adv[:, None] * torch.linspace(0.5, 1.5, 7, **F64)  # (N, T) process-style advantages

    def run(logp, old, ref, adv_t, ent):
        logp, ent = logp.clone().requires_grad_(), ent.clone().requires_grad_()
        loss, metrics = grpo_loss(logp, old, ref, adv_t, mask, beta=0.04, delta=4.0, loss_type=loss_type,
                                  importance_level=level, entropy=ent, entropy_coef=0.01, top_entropy_quantile=0.5)
        return loss, torch.autograd.grad(loss, (logp, ent)), metrics

    loss, grads, metrics = run(logp, old, ref, adv_t, ent)
    pad = ~mask
    bad = lambda x, v: torch.where(pad, torch.full_like(x, v), x)
    loss2, grads2, metrics2 = run(bad(logp, -math.inf), bad(old, math.nan), bad(ref, 1e4), bad(adv_t, math.nan),
                                  bad(ent, 1e6))
    torch.testing.assert_close(loss2, loss)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g2, g)
        assert torch.equal(g2[pad], torch.zeros_like(g2[pad]))
    for k in metrics:
        torch.testing.assert_close(metrics2[k], metrics[k])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_row_and_all_masked_call_are_finite(loss_type):
    logp, old, ref, adv, mask, ent = _batch()
    mask[2] = False
    logp.requires_grad_()
    loss, m = grpo_loss(logp, old, ref, adv, mask, beta=0.1, loss_type=loss_type, entropy=ent)
    assert torch.isfinite(loss) and torch.isfinite(torch.autograd.grad(loss, logp)[0]).all()
    loss, m = grpo_loss(logp, old, ref, adv, torch.zeros_like(mask), beta=0.1, loss_type=loss_type, entropy=ent)
    assert loss.item() == 0 and all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_formulas_on_ragged_lengths(loss_type):
    torch.manual_seed(0)
    lens = [5, 2, 4]
    x = torch.randn(3, 6, **F64)  # (N, T)
    mask = torch.arange(6)[None] < torch.tensor(lens)[:, None]
    x = torch.where(mask, x, 1e6)  # padding garbage
    rows = [x[i, :L] for i, L in enumerate(lens)]
    want = {"grpo": sum(r.mean() for r in rows) / 3,
            "bnpo": sum(r.sum() for r in rows) / 11,
            "dr_grpo": sum(r.sum() for r in rows) / (3 * 8),
            "dapo": sum(r.sum() for r in rows) / 20}[loss_type]
    got = aggregate(x, mask, loss_type, max_len=8, num_tokens=20 if loss_type == "dapo" else None)
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
    kw = dict(beta=0.04, eps_high=0.28, loss_type=loss_type)
    full = logp.clone().requires_grad_()
    loss, _ = grpo_loss(full, old, ref, adv, mask, **kw)
    loss.backward()
    acc = logp.clone().requires_grad_()
    total = 0
    for s in (slice(0, 2), slice(2, 6)):  # unequal micro-batches
        part, _ = grpo_loss(acc[s], old[s], ref[s], adv[s], mask[s], num_sequences=6, num_tokens=mask.sum(),
                            max_len=7, **kw)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, loss.detach())
    torch.testing.assert_close(acc.grad, full.grad)


def test_bnpo_micro_batches_average_their_token_means():
    logp, old, _, adv, mask, _ = _batch()
    parts = [grpo_loss(logp[s], old[s], None, adv[s], mask[s], loss_type="bnpo", num_sequences=6)[0]
             for s in (slice(0, 3), slice(3, 6))]
    alone = [grpo_loss(logp[s], old[s], None, adv[s], mask[s], loss_type="bnpo")[0] for s in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close(sum(parts), sum(alone) / 2)
    # with equal token counts per micro-batch that is the full-batch token mean
    even = torch.arange(7)[None] < torch.tensor([[4], [2], [3], [3], [2], [4]])  # 9 tokens in each half
    parts = [grpo_loss(logp[s], old[s], None, adv[s], even[s], loss_type="bnpo", num_sequences=6)[0]
             for s in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close(sum(parts), grpo_loss(logp, old, None, adv, even, loss_type="bnpo")[0])


# -----------------------------------------------------------------------------
# the combined loss: KL, entropy, metrics, dtypes

def test_kl_entropy_terms_and_metrics():
    logp, old, ref, adv, mask, ent = _batch()
    logp.requires_grad_()
    base, _ = grpo_loss(logp, old, None, adv, mask)
    loss, m = grpo_loss(logp, old, ref, adv, mask, beta=0.1, entropy=ent, entropy_coef=0.01)
    k3 = kl_estimate(logp, ref)
    lens = mask.sum(1).double()
    seq_mean = lambda x: (torch.where(mask, x, 0.0).sum(1) / lens).mean()
    torch.testing.assert_close(loss, base + 0.1 * seq_mean(k3) - 0.01 * seq_mean(ent))
    torch.testing.assert_close(m["kl"], k3.detach()[mask].mean())
    torch.testing.assert_close(m["entropy"], ent[mask].mean())
    ratio = (logp - old).detach().exp()[mask]
    torch.testing.assert_close(m["ratio_mean"], ratio.mean())
    assert m["ratio_min"] == ratio.min() and m["ratio_max"] == ratio.max()
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    assert "kl" not in grpo_loss(logp, old, None, adv, mask)[1]


def test_top_entropy_quantile_applies_to_policy_term_only():
    logp, old, ref, adv, mask, ent = _batch()
    logp.requires_grad_()
    loss, _ = grpo_loss(logp, old, ref, adv, mask, beta=0.1, entropy=ent, top_entropy_quantile=0.3)
    keep = top_entropy_mask(ent, mask, 0.3)
    per_token = -clipped_surrogate((logp - old).exp(), adv[:, None]) * keep + 0.1 * kl_estimate(logp, ref)
    torch.testing.assert_close(loss, aggregate(per_token, mask, "grpo"))
    grad, = torch.autograd.grad(loss, logp)
    assert (grad[mask & ~keep] != 0).all()  # the KL term still reaches dropped tokens


def test_bf16_inputs_are_upcast():
    logp, old, ref, adv, mask, _ = _batch()
    loss, m = grpo_loss(logp.bfloat16(), old.bfloat16(), ref.bfloat16(), adv.bfloat16(), mask, beta=0.04)
    assert loss.dtype == torch.float32 and m["ratio_mean"].dtype == torch.float32
    want, _ = grpo_loss(*(x.bfloat16().double() for x in (logp, old, ref, adv)), mask, beta=0.04)
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-4)


def test_docstring_examples():
    result = doctest.testmod(grpo, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


# -----------------------------------------------------------------------------
# bad input

_x, _m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
BAD = [
    (lambda: group_advantages(torch.zeros(7), 4), "divisible by group_size"),
    (lambda: group_advantages(torch.zeros(4), 1), "group_size must be an int >= 2"),
    (lambda: group_advantages(torch.zeros(4, 1), 2), "rewards must have shape"),
    (lambda: group_advantages(torch.zeros(4), 2, scale="std"), r"scale must be one of \('group', 'batch', 'none'\)"),
    (lambda: process_advantages(torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2).bool(), 2, 4),
     "divisible by group_size"),
    (lambda: process_advantages(torch.zeros(2, 2), torch.tensor([[0, 4], [0, 1]]), _m[:, :2], 2, 4), "step_ends"),
    (lambda: kl_estimate(_x, _x, "k4"), r"kl_estimator must be one of \('k1', 'k2', 'k3'\)"),
    (lambda: aggregate(_x, _m, "sum"), r"loss_type must be one of \('grpo', 'bnpo', 'dr_grpo', 'dapo'\)"),
    (lambda: aggregate(_x, _m, "dr_grpo", max_len=2), "max_len"),
    (lambda: aggregate(_x, _m[:, :2], "grpo"), "mask must have shape"),
    (lambda: importance_ratio(_x, _x, _m, "seq"), r"importance_level must be one of \('token', 'sequence'\)"),
    (lambda: clipped_surrogate(_x, _x, 0.2, delta=1.1), "delta must be > 1 \\+ eps_high"),
    (lambda: full_kl(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)), "ref_logits must have shape"),
    (lambda: top_entropy_mask(_x, _m, 0.0), r"top_entropy_quantile must be in \(0, 1\]"),
    (lambda: grpo_loss(_x, _x[:1], None, torch.zeros(2), _m), "old_logp must have shape"),
    (lambda: grpo_loss(_x, None, None, torch.zeros(2), _m[:1]), "mask must have shape"),
    (lambda: grpo_loss(_x, None, None, torch.zeros(3), _m), "advantages must have shape"),
    (lambda: grpo_loss(_x, None, _x[:1], torch.zeros(2), _m, beta=0.1), "ref_logp must have shape"),
    (lambda: grpo_loss(_x, None, None, torch.zeros(2), _m, beta=0.1), "ref_logp is required when beta > 0"),
    (lambda: grpo_loss(_x, None, None, torch.zeros(2), _m, loss_type="mean"), r"loss_type must be one of \("),
    (lambda: grpo_loss(_x, None, None, torch.zeros(2), _m, kl_estimator="k5"), r"kl_estimator must be one of \("),
    (lambda: grpo_loss(_x, None, None, torch.zeros(2), _m, importance_level="x"), r"importance_level must be one of"),
    (lambda: grpo_loss(_x, None, None, torch.zeros(2), _m, entropy_coef=0.1), "entropy is required"),
    (lambda: grpo_loss(_x, None, None, torch.zeros(2), _m, top_entropy_quantile=0.5), "entropy is required"),
]


@pytest.mark.parametrize("call,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_raises_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_beta_zero_needs_no_reference():
    logp, old, _, adv, mask, _ = _batch()
    loss, m = grpo_loss(logp, old, None, adv, mask, beta=0.0)
    assert torch.isfinite(loss) and "kl" not in m
