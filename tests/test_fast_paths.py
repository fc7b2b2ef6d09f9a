"""The training pass's two shortcuts against the plain expressions they stand for.

rollout.TokenLogp: the log-prob of the sampled token and the entropy from a chunk's logits in one read, with a
hand-written backward (onehot - p; -p (z - E_p[z])) instead of log_softmax, gather and their autograd. Compared
with autograd of the plain expression in fp32 and fp64; both compute the same sums in another order, a few eps of
the tensor's largest value (conftest.assert_close_scaled), scaled to each dtype's eps.

rollout.cast_once: around the micro-batches of an optimizer step, autocast casts each weight once, not once per
micro-batch and again in each checkpointed recompute. The casts are the same roundings of the same fp32 weights, and
each backward still runs through one cast per weight, so values and gradients equal autocast per micro-batch's; the
sums of a tied weight's gradients (embedding and head) may come in another order: a few eps (conftest's GRADS).
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import rollout
from conftest import DEVICES, GRADS, VALUES, assert_close_scaled, tiny

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logp_values_and_gradients_equal_autograd_of_the_plain_expression(dtype, device):
    """Fails if the forward or backward formula is off (the onehot term, the sign or the E_p[z] of the entropy's
    gradient, logZ), or if an output used for logging only (entropy with no gradient) changes the gradient."""
    z, t, w = (x.to(device) for x in logits(dtype))
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


def test_token_logp_shifts_each_row_by_its_own_max():
    """Rows of one chunk whose logits lie 1000 apart (softmax is shift-invariant: the same log-probs and entropy).
    Fails if logZ is shifted by the chunk's max instead of each row's (amax over all dims): the far row's exp
    underflows to 0, its logZ to -inf and its log-prob to +inf."""
    z, t, _ = logits(torch.float32, n=2)
    z = torch.stack([z[0], z[0] - 1000])  # (2, V): the same distribution twice
    t = t[:1].expand(2)
    logp, ent = rollout.TokenLogp.apply(z, t, True)
    want_logp, want_ent = plain(z[:1], t[:1])  # the near row's, by log_softmax
    # z_t - logZ and logZ - E_p[z] each cancel two numbers of size |z| (~1000): a few eps of |z|, not of the result
    atol = VALUES * EPS[torch.float32] * z.abs().max().item()
    torch.testing.assert_close(logp, want_logp.expand(2), rtol=0, atol=atol)
    torch.testing.assert_close(ent, want_ent.expand(2), rtol=0, atol=atol)


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


# -----------------------------------------------------------------------------
# cast_once


def lora_model():
    import scale

    model = scale.add_lora(tiny("llama").train(), 4)
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0, where the adapter adds nothing
            p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def fp32_mlp(model):
    """A fork's edit: layer 1's MLP computes in fp32 with autocast off (as some routers do), its down_proj too."""
    mlp = model.model.layers[1].mlp

    def forward(x):
        with torch.autocast(x.device.type, enabled=False):
            x = x.float()
            return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    mlp.forward = forward
    return model


MODELS = {
    "llama": lambda: tiny("llama").train(),  # tied head: the embedding's weight also feeds the head's matmul
    "qwen2": lambda: tiny("qwen2").train(),  # q/k/v biases, untied head
    "lora": lora_model,  # fp32 adapters beside the frozen fp32 base
    "fp32_mlp": lambda: fp32_mlp(tiny("llama").train()),
}
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft: pip install peft")


def batches(seed=0, N=6, P=5, C=7, micro=2):
    """Micro-batches (ids, mask (micro, P+C)) of random rows, completions of random lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 98, (N, P + C), generator=g)
    mask = (torch.arange(P + C) < P + torch.randint(1, C + 1, (N, 1), generator=g)).long()  # (N, P+C)
    return [(ids[i : i + micro], mask[i : i + micro]) for i in range(0, N, micro)], C


def train_pass(model, once, steps=2, device="cpu"):
    """train.py's loop in bf16, mu = `steps`: each micro-batch's log-probs under autocast, its backward, then an SGD
    step; once: the micro-batches in rollout.cast_once -> log-probs, gradients, the graph's cast nodes per weight."""
    mbs, C = batches()
    model, mbs = model.to(device), [(ids.to(device), mask.to(device)) for ids, mask in mbs]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    out, casts = [], []
    for _ in range(steps):
        with rollout.cast_once(torch.device(device)) if once else torch.enable_grad():
            for ids, mask in mbs:
                with torch.autocast(device, dtype=torch.bfloat16):
                    logp, ent, _ = rollout.token_logprobs(
                        model, ids, mask, C, sampler=rollout.Sampler(0.7), with_entropy=True, share=True
                    )
                casts.append(cast_nodes(logp.grad_fn, params))
                ((logp * torch.linspace(-1, 1, C, device=device)).sum() + 0.1 * ent.sum()).backward()
                out.append(logp.detach())
        out += [p.grad.clone() for p in params]
        opt.step()  # the weights move: the next block's casts must be new
        opt.zero_grad()
    return out, casts


def cast_nodes(fn, params):
    """{parameter index: the graph's nodes that cast it (autocast's ToCopyBackward into its AccumulateGrad)}"""
    index, seen, out, todo = {id(p): i for i, p in enumerate(params)}, set(), {}, [fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        for g, _ in f.next_functions:
            if type(f).__name__.startswith("ToCopy") and id(getattr(g, "variable", None)) in index:
                out.setdefault(index[id(g.variable)], set()).add(f)
            todo.append(g)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=[needs_peft] if k == "lora" else []) for k in MODELS])
def test_cast_once_gives_the_values_and_gradients_of_autocast_per_micro_batch(kind, device):
    """Fails if the block changes what a micro-batch computes: weights cast to bf16 where autocast leaves them fp32
    (a norm, the embedding, a fork's fp32 region: other roundings), a backward run under autocast (the fp32 MLP's
    backward matmuls then run in bf16), or casts kept past the block (the second step on the first step's weights)."""
    want, _ = train_pass(MODELS[kind](), once=False, device=device)
    got, casts = train_pass(MODELS[kind](), once=True, device=device)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_close_scaled(a, b, GRADS)
    assert min(g.abs().max() for g in want if g.dim() > 1) > 0  # every gradient reached its weight


def test_cast_once_casts_each_weight_once_per_block():
    """Within a block every micro-batch's graph casts each weight through the same node (one cast), and the next
    block through a new one (the weights moved). Fails if the block lets autocast's cache end with each micro-batch.
    A CPU's only: on CUDA autograd runs the head's checkpointed recompute in its device thread, whose autocast exit
    clears the process-wide cache each micro-batch (seen on an H200, BENCHMARKS.md); values and gradients hold."""
    _, casts = train_pass(MODELS["qwen2"](), once=True)  # 3 micro-batches a block, 2 blocks
    _, each = train_pass(MODELS["qwen2"](), once=False)
    assert len(casts[0]) == len(each[0]) > 10 and all(len(c) == 1 for c in casts[0].values())  # every matmul weight
    assert casts[0] == casts[1] == casts[2] and not set.union(*casts[0].values()) & set.union(*casts[3].values())
    assert each[0] != each[1]  # autocast per micro-batch alone casts them anew
