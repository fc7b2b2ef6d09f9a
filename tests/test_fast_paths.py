"""The training pass's shortcuts against the plain expressions they stand for.

rollout.TokenLogp: the log-prob of the sampled token and the entropy from a chunk's logits in one read, with a
hand-written backward (onehot - p; -p (z - E_p[z])) instead of log_softmax, gather and their autograd. Compared
with autograd of the plain expression in fp32 and fp64; both compute the same sums in another order, a few eps of
the tensor's largest value (conftest.assert_close_scaled), scaled to each dtype's eps.
"""

import pytest
import torch

import rollout
from conftest import GRADS, VALUES, assert_close_scaled

EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.float64: torch.finfo(torch.float64).eps}


def assert_close_eps(got, want, k, dtype):
    """Within k eps of `dtype` of the largest |want| (conftest's bound, for fp64 too)."""
    torch.testing.assert_close(got, want, rtol=0, atol=k * EPS[dtype] * want.abs().max().item())


def plain(z, t):
    """The plain expression: log-prob of t and entropy from log_softmax, (n, V), (n,) -> (n,), (n,)."""
    logq = z.log_softmax(-1)  # (n, V)
    return logq.gather(1, t[:, None]).squeeze(1), -(logq.exp() * logq).sum(-1)


def logits(dtype, n=37, V=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(n, V, generator=g, dtype=dtype)  # far from uniform: p spans ~1e-7 .. 0.9
    return z, torch.randint(0, V, (n,), generator=g), torch.randn(2, n, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logp_values_and_gradients_equal_autograd_of_the_plain_expression(dtype):
    """Fails if the forward or backward formula is off (the onehot term, the sign or the E_p[z] of the entropy's
    gradient, logZ), or if an output used for logging only (entropy with no gradient) changes the gradient."""
    z, t, w = logits(dtype)
    z = z.requires_grad_()
    logp, ent = rollout.TokenLogp.apply(z, t, True)
    want_logp, want_ent = plain(z, t)
    assert_close_eps(logp, want_logp, VALUES, dtype)
    assert_close_eps(ent, want_ent, VALUES, dtype)
    for used in [(0, 1), (0,), (1,)]:  # both outputs trained; the log-prob only (entropy logged: no grad); entropy
        got = rollout.TokenLogp.apply(z, t, True)
        (got,) = torch.autograd.grad(sum((w[i] * got[i]).sum() for i in used), z)
        want = (want_logp, want_ent)
        (want,) = torch.autograd.grad(sum((w[i] * want[i]).sum() for i in used), z, retain_graph=True)
        assert want.abs().max() > 0.1  # not trivially zero
        assert_close_eps(got, want, GRADS, dtype)
    assert rollout.TokenLogp.apply(z, t, False)[1] is None


def test_token_logp_with_top_k_masked_logits_stays_finite_and_exact():
    """A top-k transform under autograd before TokenLogp, as an additive mask (0 on the top 8, -inf elsewhere: its
    backward passes every gradient through): log-probs, entropy and gradients are those of the 8 kept logits alone,
    and finite. Fails if 0 * -inf (p = 0 at a -inf logit) makes the entropy or either gradient nan."""
    raw, _, w = logits(torch.float32)
    raw = raw.requires_grad_()
    kept = raw.topk(8, -1).indices  # (n, 8)
    z = raw + torch.full_like(raw, -torch.inf).scatter(1, kept, 0.0)  # (n, V)
    logp, ent = rollout.TokenLogp.apply(z, kept[:, 3], True)  # a sampled token is a kept one
    got, got_z = torch.autograd.grad((w[0] * logp).sum() + (w[1] * ent).sum(), [raw, z])
    want_logp, want_ent = plain(raw.gather(1, kept), torch.full_like(kept[:, 3], 3))  # the 8-way distribution
    (want,) = torch.autograd.grad((w[0] * want_logp).sum() + (w[1] * want_ent).sum(), raw)
    assert torch.isfinite(ent).all() and torch.isfinite(got_z).all()
    assert_close_scaled(logp, want_logp)
    assert_close_scaled(ent, want_ent)
    assert_close_scaled(got, want, GRADS)
    assert (got.abs() > 0).sum(1).max() <= 8 and want.abs().max() > 0.1  # masked logits: gradient 0
