"""lean.py against the plain path (rollout.py) and the model's own forward (tiny models, CPU).

lean.check's refusals of forked models are in test_fork.py; here the models are unmodified.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

import lean
import lean_train
import rollout
from conftest import EOS, VOCAB, make_tokenizer, tiny
from lean import _HeadLogprobs
from rollout import HFDecoder, left_pad, sample

V = len(VOCAB)


def both_decoders(model, G=3, steps=6, dtype=None):
    """Two left-padded prompts through lean.LeanDecoder and rollout.HFDecoder, then the same tokens
    fed to both: [(lean logits, HF logits)] for the first token and each step."""
    g, V = torch.Generator().manual_seed(1), model.config.vocab_size
    ids, mask = left_pad([torch.randint(5, V, (n,), generator=g).tolist() for n in (7, 3)], pad_id=0)
    N = ids.size(0) * G
    with torch.no_grad():
        fast, hf = (d(model, ids, mask, G, steps, dtype) for d in (lean.LeanDecoder, HFDecoder))
        out = [(fast.logits, hf.logits)]
        next_pos = (mask.cumsum(-1) - 1)[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1)
        for t in range(steps - 1):
            tok = torch.randint(5, V, (N,), generator=g)
            out.append((fast.step(tok, next_pos), hf.step(tok, next_pos)))
            next_pos = next_pos + 1
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias"])
def test_lean_step_equals_the_hf_forward_fp32(kind):
    model = tiny(kind)
    assert lean.check(model)[0]
    for t, (got, want) in enumerate(both_decoders(model)):
        assert want.abs().max() > 1.0  # logits far from uniform: a wrong mask or position would show
        # fp32, the same math with fused weights and another order: ~1e-6 relative on logits of ~10
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"step {t}")


@pytest.mark.parametrize("weights,dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_lean_step_in_bf16_stays_within_bf16_rounding(weights, dtype):
    """bf16 weights, or fp32 weights decoding in bf16 (train.py: lean casts them once, HF runs under autocast)."""
    model = tiny("llama", weights)
    for t, (got, want) in enumerate(both_decoders(model, dtype=dtype)):
        assert got.dtype == torch.bfloat16
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < 0.03, f"step {t}: relative error {err}"
    # and the fp32 model under the same inputs is what both approximate
    fp32 = tiny("llama", torch.float32)
    for (got, _), (exact, _) in zip(both_decoders(model, dtype=dtype), both_decoders(fp32)):
        assert (got.float() - exact).abs().max() / exact.abs().max() < 0.03


def test_packed_linear_equals_linear():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    x = torch.randn(6, 32, generator=g).bfloat16()
    packed = lean._pack(w, 6)
    torch.testing.assert_close(lean._linear(x, packed, b).float(), F.linear(x, w, b).float(),
                               atol=0.05, rtol=0.02)
    assert lean._pack(w.float(), 6)[1] is False  # fp32 weights are never packed


def test_sample_gives_the_same_tokens_through_the_lean_and_the_hf_decoder():
    tok = make_tokenizer()
    model = tiny("llama")
    prompts = ["w1 w2", "w3 w4 w5 w6 w7 w8 w9"]
    kw = dict(group_size=3, max_new_tokens=12, stop_ids=[EOS], temperature=0.8)
    fast = sample(model, tok, prompts, generator=torch.Generator().manual_seed(4), decoder=lean.LeanDecoder, **kw)
    hf = sample(model, tok, prompts, generator=torch.Generator().manual_seed(4), decoder=HFDecoder, **kw)
    assert torch.equal(fast.completion_ids, hf.completion_ids) and fast.completions == hf.completions
    torch.testing.assert_close(fast.sample_logp, hf.sample_logp, atol=1e-5, rtol=0)  # fp32 logits agree to ~1e-6
    assert len({tuple(r) for r in fast.completion_ids.tolist()}) > 1


def test_only_known_classes_without_training_dropout_take_the_lean_path():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = tiny("llama")
    assert lean.check(model)[0] and lean.check(model.train())[0]
    for layer in model.model.layers:  # the lean passes have no dropout: fine in eval mode only
        layer.self_attn.attention_dropout = 0.1
    assert lean.check(model.eval())[0]
    ok, why = lean.check(model.train())
    assert not ok and "dropout" in why
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V)).eval()
    assert lean.check(gpt2) == (False, "GPT2LMHeadModel is not a plain LlamaForCausalLM / Qwen2ForCausalLM")

    class Subclass(LlamaForCausalLM):  # may change the forward: not ours to assume
        pass
    assert not lean.check(Subclass(model.config).eval())[0]


@pytest.mark.real_model
def test_real_model_lean_step_is_as_close_to_fp32_as_the_hf_step(real_model):
    """SmolLM2-135M, fp32 weights, bf16 compute: what train.py samples with. The lean step and the HF step
    under autocast round at the same points, so each one's distance to the fp32 step is bf16 rounding
    carried through 30 layers: the same process, whose size depends on the machine (the order its kernels
    sum in), not on the path. So both are measured here, on the same machine, instead of against a fixed
    number. The mean |error| of a log-prob over 128 scored tokens differs between two runs of that process
    by a fraction of itself (each token's error is a sum of many roundings), so the lean step's must be
    within 2x the HF step's. This catches a wrong mask, position, cache or weight on the real model;
    rounding at other points than the training pass is caught sharply in tests/test_numerics.py."""
    model, G, C = real_model[0], 4, 16
    g, V = torch.Generator().manual_seed(1), model.config.vocab_size
    ids, mask = left_pad([torch.randint(100, V, (n,), generator=g).tolist() for n in (21, 9)], pad_id=0)
    comp = torch.randint(100, V, (ids.size(0) * G, C), generator=g)  # (N, C) fed to every step

    def logprobs(decoder, dtype):
        step = decoder(model, ids, mask, G, C, dtype)
        pos = (mask.cumsum(-1) - 1)[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1)
        logits = [step.logits] + [step.step(comp[:, t], pos + t) for t in range(C - 1)]
        return torch.stack(logits, 1).float().log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1)  # (N, C)
    exact = logprobs(HFDecoder, torch.float32)
    err = {name: (logprobs(d, torch.bfloat16) - exact).abs() for name, d in (("lean", lean.LeanDecoder),
                                                                              ("hf", HFDecoder))}
    assert err["lean"].mean() <= 2 * err["hf"].mean(), {k: (v.mean().item(), v.max().item()) for k, v in err.items()}


# -----------------------------------------------------------------------------
# the teacher-forced forward with gradients (lean.hidden_states)

def rows_with_shared_prompts(V, G, C, seed=1):
    """Two left-padded prompts, each repeated G times, then C completion tokens; one row stops early."""
    g = torch.Generator().manual_seed(seed)
    prompts, pmask = left_pad([torch.randint(5, V, (n,), generator=g).tolist() for n in (7, 3)], pad_id=0)
    prompts, pmask = prompts.repeat_interleave(G, 0), pmask.repeat_interleave(G, 0)
    N = prompts.size(0)
    cmask = torch.ones(N, C, dtype=torch.long)
    cmask[0, min(3, C - 1):] = 0  # right padding after a stop
    comp = torch.randint(5, V, (N, C), generator=g).masked_fill(cmask == 0, 0)
    return torch.cat([prompts, comp], 1), torch.cat([pmask, cmask], 1), cmask


def hf_hidden(model, ids, mask, C):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, -C - 1:-1]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias"])
@pytest.mark.parametrize("G,C", [(3, 5), (1, 5), (3, 1), (3, 40)])  # 40: padding tokens are left out
def test_hidden_states_and_gradients_equal_the_hf_forward_fp32(kind, G, C):
    """Shared prompts (G=3) or none (G=1), one completion token or several: the hidden states at the
    completion positions and every parameter's gradient through them match HF's full forward."""
    model = tiny(kind).train()
    twin = copy.deepcopy(model)
    ids, mask, cmask = rows_with_shared_prompts(V, G, C)
    got, want = lean.hidden_states(model, ids, mask, C, group_size=G), hf_hidden(twin, ids, mask, C)
    keep = cmask.bool()[..., None]  # positions after a stop are never scored
    torch.testing.assert_close(got * keep, want * keep, atol=2e-5, rtol=1e-4)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    (got * w * keep).sum().backward()
    (want * w * keep).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is None:  # an untied LM head gets no gradient from hidden states
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hidden_states_under_autocast_give_sdpa_the_queries_and_keys_hf_gives_it(kind, monkeypatch):
    """Under bf16 autocast HF rotates the bf16 q and k with fp32 cos/sin and SDPA rounds them to bf16
    once; lean.hidden_states must too. Layer 0's queries and keys then hold the same bits, except where
    a matmul summing in another order (another batch shape, another CPU) tips a rounding: a few in 10^4
    per element at these widths, so 1% leaves a wide margin; rotating in bf16 changes over 10% of them."""
    model, G, C = tiny(kind), 3, 5
    ids, mask, _ = rows_with_shared_prompts(V, G, C)
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.bfloat16(), k.bfloat16()))  # what SDPA computes with under autocast
        return sdpa(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hf_hidden(model, ids, mask, C)
        (hq, hk), seen[:] = seen[0], []
        lean.hidden_states(model, ids, mask, C, group_size=G)
    q, k = seen[0]  # layer 0, the shared prompts: (B, heads, P, D)
    P, rep = q.size(2), hk.size(1) // k.size(1)  # HF repeats the kv heads for a masked SDPA
    for got, want in ((q, hq[::G, :, :P]), (k, hk[::G, ::rep, :P])):
        assert (got == want).float().mean() > 0.99


def test_token_index_leaves_out_padding_and_counts_a_multiple():
    next_valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)  # row 0 stopped
    assert lean.token_index(next_valid, multiple=3).tolist() == [0, 1, 4, 5, 6, 7]
    assert lean.token_index(next_valid, multiple=7).tolist() == [0, 1, 3, 4, 5, 6, 7]
    assert lean.token_index(next_valid, multiple=4).tolist() == list(range(8))
    # (3, 40) in the test above leaves out tokens: 5 rows of 39 and 2 of row 0 -> 224 of 234 run
    _, mask, _ = rows_with_shared_prompts(V, 3, 40)
    assert len(lean.token_index(mask.bool()[:, -39:])) == 224


def test_hidden_states_recompute_layers_under_gradient_checkpointing(monkeypatch):
    """Checkpointing keeps the shared prompt and the gradients; each layer then runs twice."""
    model, G, C = tiny("llama").train(), 3, 4
    ids, mask, _ = rows_with_shared_prompts(V, G, C)
    plain = copy.deepcopy(model)
    lean.hidden_states(plain, ids, mask, C, group_size=G).square().sum().backward()
    calls, layer = [0], lean_train._layer

    def counting(*a):
        calls[0] += 1
        return layer(*a)
    monkeypatch.setattr(lean_train, "_layer", counting)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lean.hidden_states(model, ids, mask, C, group_size=G).square().sum().backward()
    assert calls[0] == 2 * model.config.num_hidden_layers
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)


def test_lean_functions_pass_gradcheck():
    """The hand-written backwards against finite differences, in float64 (bias included)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
    x, w = r(2, 3, 6), r(6)
    assert torch.autograd.gradcheck(lambda x, w: lean_train._Norm.apply(x, w, 1e-6, torch.float64), (x, w))
    wl, b = r(4, 6), r(4)
    assert torch.autograd.gradcheck(lambda x, w, b: lean_train._Linear.apply(x, w, b, torch.float64), (x, wl, b))
    f64 = torch.float64
    wk, wv, bv = r(2, 6), r(2, 6), r(2)  # q with a bias, k without, v with
    assert torch.autograd.gradcheck(lambda x, w, *l: lean_train._NormLinears.apply(x, w, 1e-6, f64, l[0], l[1], l[2], None,
                                                                             l[3], l[4]), (x, w, wl, b, wk, wv, bv))
    o = r(2, 3, 6)
    wg, bg, wu, bu, wd, bd = r(5, 6), r(5), r(5, 6), r(5), r(6, 5), r(6)
    assert torch.autograd.gradcheck(lambda x, o, w, *m: lean_train._AddNormMLP.apply(x, o, w, 1e-6, *m, f64),
                                    (x, o, w, wg, bg, wu, bu, wd, bd))
    assert torch.autograd.gradcheck(lambda x, o, w, *m: lean_train._AddNormMLP.apply(x, o, w, 1e-6, m[0], None, m[1], None,
                                                                               m[2], None, f64), (x, o, w, wg, wu, wd))


def test_norm_matches_the_hf_rmsnorm_in_bf16_residual():
    """A bf16 residual stream (the reference model): the weight multiplies the bf16-rounded norm, as in HF."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(16, eps=1e-6).to(torch.bfloat16)
    norm.weight.data.normal_(1, 0.3)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(lean_train._Norm.apply(x, norm.weight, norm.variance_epsilon, torch.bfloat16), norm(x))


@pytest.mark.real_model
def test_real_model_logprobs_under_bf16_autocast_are_as_close_to_fp32_as_plain(real_model):
    """SmolLM2-135M, fp32 weights under bf16 autocast (train.py's policy): completion log-probs and
    their gradient from lean.token_logprobs are about as close to the fp32 ones as the plain path's are."""
    model = copy.deepcopy(real_model[0]).requires_grad_(True)  # the fixture is frozen
    V = model.config.vocab_size
    G, C = 4, 12
    ids, mask, cmask = rows_with_shared_prompts(V, G, C)
    keep = cmask.bool()

    def run(fast, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if fast:
                logp = lean.token_logprobs(model, ids, mask, C, group_size=G)[0]
            else:
                logp = rollout.token_logprobs(model, ids, mask, C)[0]
        (logp * keep).sum().backward()
        return logp.detach(), model.model.layers[3].mlp.down_proj.weight.grad.clone()
    exact_logp, exact_grad = run(False, False)
    err = {}
    for fast in (True, False):
        logp, grad = run(fast, True)
        err[fast] = (((logp - exact_logp) * keep).abs().max().item(),
                     ((grad - exact_grad).norm() / exact_grad.norm()).item())
    assert err[True][0] < 0.5 and err[True][0] < 2 * err[False][0] + 0.02, err
    assert err[True][1] < 0.1 and err[True][1] < 2 * err[False][1] + 0.01, err


# -----------------------------------------------------------------------------
# lean.token_logprobs / completion_hidden: the drop-ins for rollout.py's


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias"])
@pytest.mark.parametrize("G", [1, 3])
def test_token_logprobs_and_gradients_equal_the_plain_path_fp32(kind, G):
    """Log-probs, entropy and every parameter's gradient (the head's hand-written backward included)
    equal rollout.token_logprobs, which runs the model's own modules."""
    model = tiny(kind).train()
    C, T = 6, 0.7
    ids, mask, cmask = rows_with_shared_prompts(V, G, C)
    m = cmask.bool()
    w = torch.randn(cmask.shape, generator=torch.Generator().manual_seed(2)) * cmask  # (N, C) per-token weights
    params = list(model.parameters())
    out = {}
    for name, fn in (("lean", lean.token_logprobs), ("plain", rollout.token_logprobs)):
        logp, ent, kl = fn(model, ids, mask, C, temperature=T, with_entropy=True, chunk_size=5, group_size=G)
        assert kl is None and logp.shape == ent.shape == (ids.size(0), C)
        assert (logp[~m] == 0).all() and (ent[~m] == 0).all()  # padding after a stop: 0
        out[name] = logp, ent, torch.autograd.grad((w * logp).sum() + 0.1 * (w * ent).sum(), params)
    (logp, ent, got), (want_logp, want_ent, want) = out["lean"], out["plain"]
    # fp32, the same math in another order (shared prompt, fused backward): ~1e-6 relative
    torch.testing.assert_close(logp[m], want_logp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[m], want_ent[m], atol=1e-5, rtol=1e-5)
    for (name, _), g, n in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(g, n, atol=1e-5, rtol=1e-4, msg=name)
        assert n.abs().max() > 0, name


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_completion_hidden_and_kl_to_a_reference_equal_the_plain_path_fp32(kind):
    model, ref = tiny(kind).train(), tiny(kind, seed=1)
    G, C = 3, 5
    ids, mask, cmask = rows_with_shared_prompts(V, G, C)
    m = cmask.bool()
    with torch.no_grad():
        ref_hidden = rollout.completion_hidden(ref, ids, mask, C)  # (N, C, H)
        lean_hidden = lean.completion_hidden(ref, ids, mask, C, group_size=G)
    torch.testing.assert_close(lean_hidden[m], ref_hidden[m], atol=2e-5, rtol=1e-4)  # fp32, another order
    head = ref.get_output_embeddings()
    out = {}
    for name, fn in (("lean", lean.token_logprobs), ("plain", rollout.token_logprobs)):
        _, _, kl = fn(model, ids, mask, C, chunk_size=4, group_size=G, ref=(head, ref_hidden))
        assert (kl[~m] == 0).all() and (kl[m] > 0).all()  # a different model: KL > 0 everywhere
        out[name] = kl, torch.autograd.grad(kl.sum(), list(model.parameters()))
    torch.testing.assert_close(out["lean"][0], out["plain"][0], atol=1e-5, rtol=1e-5)
    for g, n in zip(out["lean"][1], out["plain"][1]):
        torch.testing.assert_close(g, n, atol=1e-5, rtol=1e-4)


# -----------------------------------------------------------------------------
# the LM head (_HeadLogprobs)

@pytest.mark.parametrize("autocast", [False, True])
def test_head_function_gradients_equal_autograd_with_bias_and_entropy(autocast):
    """_HeadLogprobs (chunked, hand-written backward) vs autograd through F.linear + log_softmax."""
    g = torch.Generator().manual_seed(7)
    n, H, V, T = 11, 8, 37, 0.8
    hidden = torch.randn(n, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(V, generator=g).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dtype = torch.bfloat16 if autocast else torch.float32
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

    def grads(lp, ent):
        return torch.autograd.grad((w_lp * lp).sum() + (w_ent * ent).sum(), [hidden, weight, bias],
                                   retain_graph=True)

    with ctx:
        lp, ent = _HeadLogprobs.apply(hidden, weight, bias, targets, T, True, 4, dtype)  # 4 does not divide 11
    got = grads(lp, ent)
    with ctx:
        z = F.linear(hidden, weight, bias).float() / T
    logp_all = z.log_softmax(-1)
    want_lp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    want_ent = -(logp_all.exp() * logp_all).sum(-1)
    want = grads(want_lp, want_ent)
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp, want_lp, **tol)
    torch.testing.assert_close(ent, want_ent, **tol)
    for name, a, b in zip(["hidden", "weight", "bias"], got, want):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, **tol, msg=name)
        assert b.abs().max() > 0.1, name  # not trivially zero
    # logged-only entropy (no gradient through it) gives the log-prob gradient alone
    with ctx:
        lp, ent = _HeadLogprobs.apply(hidden, weight, bias, targets, T, True, 4, dtype)
    only_lp = torch.autograd.grad((w_lp * lp).sum(), [hidden, weight, bias])
    want_only = torch.autograd.grad((w_lp * want_lp).sum(), [hidden, weight, bias])
    for a, b in zip(only_lp, want_only):
        torch.testing.assert_close(a, b, **tol)


def test_head_function_confident_token_gradient_in_bf16():
    """Under bf16 the forward keeps p in bf16 for backward; a target with p_t ~ 0.999 must still get
    1 - p_t from its fp32 log-prob (bf16 p_t rounds to 0.996 or 1.0: an error of several times 1 - p_t)."""
    g = torch.Generator().manual_seed(3)
    n, H, V = 6, 16, 50
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    w_t = weight.detach()[targets]
    hidden = (torch.randn(n, H, generator=g) * 0.1 + 20 * w_t / w_t.norm(dim=-1, keepdim=True)).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = _HeadLogprobs.apply(hidden, weight, None, targets, 1.0, False, 4, torch.bfloat16)
        z = F.linear(hidden, weight)  # the same bf16 logits, then autograd in fp32
    assert (lp.exp() > 0.999).sum() >= 4, "the test needs confident targets"
    got, = torch.autograd.grad(lp.sum(), [hidden])
    want, = torch.autograd.grad(z.float().log_softmax(-1).gather(-1, targets[:, None]).sum(), [hidden])
    err, size = (got - want).norm(dim=-1), want.norm(dim=-1)  # per row: confident rows have tiny gradients
    assert (err <= 0.03 * size).all(), (err, size)
