"""Sampling and training see the same policy: the log-probs rollout.sample records against the training pass's.

GRPO at mu = 1 takes the sampled tokens to come from the distribution the training pass computes. Both run
from fp32 weights with bf16 matmuls (train.py's defaults): rollout.sample(dtype=bf16) runs its whole decode
loop under one autocast context (each weight cast once), and the training pass is rollout.token_logprobs
under autocast, with each prompt run once through the KV cache (share=True) or whole rows (share=False).
They can only agree to bf16 rounding, and only if they round at the same points; these tests check that
they do, on models where rounding anywhere else shows.

The models. Trained Qwen2 models have attention logits of 1000 and more in layer 0: an offset that q
and k carry in their low-frequency rotary dimensions (their biases, massive activations), the same for
every key of a query. Softmax ignores it, but a bf16 *score* keeps 8 bits of it: spacing 8 at 1000,
16 at 2000, so rounding the scores to bf16 moves attention weights by factors up to e^4 to e^8. Here a
massive embedding channel, read by the lowest-frequency rotary pair of q and k in layer 0, puts the
logits at 1000-3000, with q/k weights scaled x30 and large v/o in layer 0, so that attention matters.
The offset part of q and k is the same for every token: rounding q and k (both passes do) keeps it.

The bound. u = 2^-8 is bf16's unit roundoff and S the largest |logit| of the fp32 pass where compared. A bf16 pass's
logits are off the fp32 ones by their own rounding (<= u S) and by one rounding's worth per layer that
the residual stream carries to them (L u S), twice that for the several roundings inside a layer
(norm, matmuls, rotary, softmax, SiLU): 2 (L + 1) u S. A log-prob is the target's logit minus the
log-sum-exp, each 1-Lipschitz in the max norm, so one pass is within K u S of fp32 with K = 4 (L + 1),
and two passes that round at the same points are within 2 K u S of each other. This holds on any CPU:
AVX512-BF16 and AMX kernels sum in different orders, which moves a value by ~2^-24 relative before it
is rounded and can tip the rounding, but the result is still a rounding of the same value, inside the
same +-u. A sampler that rounds the attention scores to bf16 lands about 100-160 u S off the training pass
on these models (the last check below): the bound tells the two apart.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import rollout
from conftest import EOS, VOCAB, make_tokenizer

V, E, H, KV, D, LAYERS = len(VOCAB), 64, 4, 2, 16, 2
U = 2.0**-8  # bf16's unit roundoff: round-to-nearest with 8 significant bits
K = 4 * (LAYERS + 1)  # one bf16 pass vs fp32, in units of u S (module docstring)
PROMPTS = ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11", "w12 w13"]  # left padding in the batch


def sink_model(kind, seed=0):
    """2 layers, head_dim 16; layer 0's attention logits reach 1000-3000 through an offset common to all keys."""
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=V,
        hidden_size=E,
        intermediate_size=2 * E,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=KV,
        max_position_embeddings=128,
        initializer_range=0.02,
    )
    model = (
        Qwen2ForCausalLM(Qwen2Config(**cfg, tie_word_embeddings=False))
        if kind == "qwen2"
        else LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=True))
    )
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms and biases random, so they matter
            if "norm" in name:
                p.normal_(1, 0.1)
            elif p.dim() == 1:
                p.normal_(0, 0.3)
        x = torch.randn(V, E)
        x[:, 0] = 0
        model.model.embed_tokens.weight.copy_(x / x.norm(dim=1, keepdim=True))  # same norm: same rms, same offset
        model.model.embed_tokens.weight[:, 0] = 8.0  # a massive channel, in every token
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            a.q_proj.weight *= 30
            a.k_proj.weight *= 30
            if i == 0:  # q and k read the massive channel in their lowest-frequency rotary pair only
                for w, b in ((a.q_proj.weight, a.q_proj.bias), (a.k_proj.weight, a.k_proj.bias)):
                    w.view(-1, D, E)[:, [D // 2 - 1, D - 1]] = 0
                    w.view(-1, D, E)[:, D // 2 - 1, 0] = 12.0  # q.k ~ (8 * 12)^2 / 4 per head, for every key
                    if b is not None:
                        b.view(-1, D)[:, [D // 2 - 1, D - 1]] = 0
                a.v_proj.weight[:, 0] = 0  # values carry the tokens, not the offset
                a.v_proj.weight *= 30
                a.o_proj.weight *= 30
        model.model.norm.weight[0] = 0.05  # the logits do not read the massive channel
        if kind == "qwen2":
            model.lm_head.weight *= 30
    return model.eval()


def gap(a, b, m, S):
    """max |a - b| over the sampled tokens m, in units of u S."""
    return ((a - b)[m].abs().max() / (U * S)).item()


def training_logprobs(model, ids, mask, C, share, dtype=torch.bfloat16):
    """The training pass as train.py runs it: token_logprobs under autocast to `dtype` -> (N, C)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        return rollout.token_logprobs(model, ids, mask, C, share=share)[0]


def fp32_logits(model, ids, mask, C):
    """The model's own fp32 forward over whole rows: logits (N, C, V) at the positions predicting the last C."""
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1 : -1]


def attend(q, k, v, attn_mask=None, scale=None, is_causal=False, round_scores=False):
    """Attention written out: scores (.., Tq, Tk) in fp32 (or rounded to bf16), the mask, softmax, values."""
    k, v = (x.repeat_interleave(q.size(1) // x.size(1), 1) for x in (k, v))  # grouped-query heads
    with torch.autocast("cpu", enabled=False):  # autocast would run these matmuls in bf16
        s = q.float() @ k.float().transpose(-1, -2) * scale  # (B, heads, Tq, Tk)
        s = s.bfloat16().float() if round_scores else s
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.size(-1) - s.size(-2))
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        return s, (s.softmax(-1).nan_to_num() @ v.float()).to(q.dtype)  # a padding query sees no key: 0, as SDPA


def largest_attention_logit(model, ids, mask, monkeypatch):
    """max |q.k * scale| over attended pairs in the model's fp32 forward over whole rows."""
    seen = [0.0]

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, is_causal=False, **kw):
        s, out = attend(q, k, v, attn_mask, scale, is_causal)
        seen[0] = max(seen[0], s[torch.isfinite(s)].abs().max().item())
        return out

    with monkeypatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", spy)
        fp32_logits(model, ids, mask, 1)
    return seen[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sampling_gives_the_training_pass_log_probs_to_bf16_rounding(kind, monkeypatch):
    model, tok = sink_model(kind), make_tokenizer()
    kw = dict(group_size=2, max_new_tokens=12, stop_ids=[EOS], dtype=torch.bfloat16)
    r = rollout.sample(model, tok, PROMPTS, generator=torch.Generator().manual_seed(0), **kw)
    ids, mask, C, m = r.input_ids, r.attention_mask, r.completion_ids.size(1), r.completion_mask.bool()
    assert (r.prompt_mask == 0).any() and m.sum() >= 24, "the test needs left padding and sampled tokens"
    assert largest_attention_logit(model, ids, mask, monkeypatch) > 1000  # the regime of the bug
    S = fp32_logits(model, ids, mask, C)[m].abs().max().item()
    exact = training_logprobs(model, ids, mask, C, True, torch.float32)
    assert gap(exact, training_logprobs(model, ids, mask, C, False, torch.float32), m, S) < 1e-3  # fp32: sums' order
    passes = {
        "sample": r.sample_logp,
        "train shared": training_logprobs(model, ids, mask, C, True),
        "train rows": training_logprobs(model, ids, mask, C, False),
    }
    for name, logp in passes.items():
        assert gap(logp, exact, m, S) <= K, f"{name}: {gap(logp, exact, m, S):.1f} u S from fp32, bound {K}"
    for name in ("train shared", "train rows"):
        g = gap(passes["sample"], passes[name], m, S)
        assert g <= 2 * K, f"sample vs {name}: {g:.1f} u S, bound {2 * K}"
    assert gap(passes["train shared"], passes["train rows"], m, S) <= 2 * K

    # the bound has teeth: a sampler whose attention rounds the scores to bf16 is far outside it, the same
    # attention written out in fp32 (the control: the swap itself changes nothing else) inside it
    for round_scores in (False, True):

        def attention(
            q, k, v, attn_mask=None, dropout_p=0.0, scale=None, is_causal=False, round_scores=round_scores, **_
        ):
            return attend(q, k, v, attn_mask, scale, is_causal, round_scores)[1]

        with monkeypatch.context() as mp:
            mp.setattr(F, "scaled_dot_product_attention", attention)
            r = rollout.sample(model, tok, PROMPTS, generator=torch.Generator().manual_seed(0), **kw)
        ids, mask, C, m = r.input_ids, r.attention_mask, r.completion_ids.size(1), r.completion_mask.bool()
        S = fp32_logits(model, ids, mask, C)[m].abs().max().item()
        g = gap(r.sample_logp, training_logprobs(model, ids, mask, C, True), m, S)
        assert (g > 2 * K) if round_scores else (g <= 2 * K), f"round_scores={round_scores}: {g:.1f} u S"
