"""lean.LeanDecoder against the HF forward with a DynamicCache, step by step (tiny models, CPU)."""

import copy
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import lean
from conftest import EOS, make_tokenizer
from rollout import HFDecoder, left_pad, sample

V = 98


def tiny(kind, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
    if kind == "qwen2":  # q/k/v biases, untied head
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif kind == "llama_bias":  # attention and MLP biases, rope scaling
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    for p in model.parameters():  # HF inits biases to 0 and norms to 1: randomise both so they matter
        if p.dim() == 1:
            p.data.normal_(0, 0.3)
    return model.to(dtype).eval()


def both_decoders(model, G=3, steps=6, dtype=None):
    """Two left-padded prompts, then the same tokens fed to the lean and the HF decode step -> [(lean, hf)]."""
    g, V = torch.Generator().manual_seed(1), model.config.vocab_size
    ids, mask = left_pad([torch.randint(5, V, (n,), generator=g).tolist() for n in (7, 3)], pad_id=0)
    dec, hf = (cls(model, ids, mask, G, steps, dtype) for cls in (lean.LeanDecoder, HFDecoder))
    pos = (mask.cumsum(-1) - 1)[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1)
    out = [(dec.logits, hf.logits)]
    for t in range(steps - 1):
        tok = torch.randint(5, V, (pos.size(0),), generator=g)
        out.append((dec.step(tok, pos + t), hf.step(tok, pos + t)))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias"])
def test_lean_step_equals_the_hf_forward_fp32(kind):
    model = tiny(kind)
    assert lean.check(model)[0]
    for t, (got, want) in enumerate(both_decoders(model)):
        assert want.abs().max() > 1.0  # logits far from uniform: a wrong mask or position would show
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"step {t}")


def test_lean_step_in_bf16_stays_within_bf16_rounding():
    model = tiny("llama", torch.bfloat16)
    for t, (got, want) in enumerate(both_decoders(model)):
        assert got.dtype == torch.bfloat16
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < 0.03, f"step {t}: relative error {err}"
    # and the fp32 model under the same inputs is what both approximate
    fp32 = tiny("llama", torch.float32)
    for (got, _), (exact, _) in zip(both_decoders(model), both_decoders(fp32)):
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


def test_sample_gives_the_same_tokens_through_the_lean_and_the_hf_path():
    tok = make_tokenizer()
    model = tiny("llama")
    model.config.eos_token_id = EOS
    prompts = ["w1 w2", "w3 w4 w5 w6 w7 w8 w9"]
    kw = dict(group_size=3, max_new_tokens=12, stop_ids=[EOS], temperature=0.8)
    fast = sample(model, tok, prompts, generator=torch.Generator().manual_seed(4), decoder=lean.LeanDecoder, **kw)
    hf = sample(model, tok, prompts, generator=torch.Generator().manual_seed(4), **kw)
    assert torch.equal(fast.completion_ids, hf.completion_ids) and fast.completions == hf.completions
    torch.testing.assert_close(fast.sample_logp, hf.sample_logp, atol=1e-5, rtol=0)
    assert len({tuple(r) for r in fast.completion_ids.tolist()}) > 1


def test_only_known_classes_without_training_dropout_take_the_lean_path():
    from transformers import GPT2Config, GPT2LMHeadModel
    supports = lambda m: lean.check(m)[0]
    model = tiny("llama")
    assert supports(model) and supports(model.train())
    for layer in model.model.layers:  # the lean passes have no dropout: fine in eval mode only
        layer.self_attn.attention_dropout = 0.1
    assert supports(model.eval()) and not supports(model.train())
    assert not supports(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V)).eval())

    class Subclass(LlamaForCausalLM):  # may change the forward: not ours to assume
        pass
    assert not supports(Subclass(model.config).eval())


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
    calls, layer = [0], lean._layer

    def counting(*a):
        calls[0] += 1
        return layer(*a)
    monkeypatch.setattr(lean, "_layer", counting)
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
    assert torch.autograd.gradcheck(lambda x, w: lean._Norm.apply(x, w, 1e-6, torch.float64), (x, w))
    wl, b = r(4, 6), r(4)
    assert torch.autograd.gradcheck(lambda x, w, b: lean._Linear.apply(x, w, b, torch.float64), (x, wl, b))
    f64 = torch.float64
    wk, wv, bv = r(2, 6), r(2, 6), r(2)  # q with a bias, k without, v with
    assert torch.autograd.gradcheck(lambda x, w, *l: lean._NormLinears.apply(x, w, 1e-6, f64, l[0], l[1], l[2], None,
                                                                             l[3], l[4]), (x, w, wl, b, wk, wv, bv))
    o = r(2, 3, 6)
    wg, bg, wu, bu, wd, bd = r(5, 6), r(5), r(5, 6), r(5), r(6, 5), r(6)
    assert torch.autograd.gradcheck(lambda x, o, w, *m: lean._AddNormMLP.apply(x, o, w, 1e-6, *m, f64),
                                    (x, o, w, wg, bg, wu, bu, wd, bd))
    assert torch.autograd.gradcheck(lambda x, o, w, *m: lean._AddNormMLP.apply(x, o, w, 1e-6, m[0], None, m[1], None,
                                                                               m[2], None, f64), (x, o, w, wg, wu, wd))


def test_norm_matches_the_hf_rmsnorm_in_bf16_residual():
    """A bf16 residual stream (the reference model): the weight multiplies the bf16-rounded norm, as in HF."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(16, eps=1e-6).to(torch.bfloat16)
    norm.weight.data.normal_(1, 0.3)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(lean._Norm.apply(x, norm.weight, norm.variance_epsilon, torch.bfloat16), norm(x))


@pytest.mark.real_model
def test_real_model_logprobs_under_bf16_autocast_are_as_close_to_fp32_as_hf(real_model):
    """SmolLM2-135M, fp32 weights under bf16 autocast (train.py's policy): completion log-probs and
    their gradient from the lean forward are about as close to the fp32 ones as HF's forward is."""
    from rollout import token_logprobs
    model = copy.deepcopy(real_model[0]).requires_grad_(True)  # the fixture is frozen
    V = model.config.vocab_size
    G, C = 4, 12
    ids, mask, cmask = rows_with_shared_prompts(V, G, C)
    keep = cmask.bool()

    def run(fast, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp = (lean.token_logprobs if fast else token_logprobs)(model, ids, mask, C, group_size=G)[0]
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
