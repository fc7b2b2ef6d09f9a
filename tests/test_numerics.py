"""Sampling and training see the same policy: the decode step's log-probs against the training pass's.

GRPO at mu = 1 takes the sampled tokens to come from the distribution the training pass computes.
Both run from fp32 weights with bf16 matmuls (train.py's defaults): the decode step (lean.LeanDecoder,
or rollout.HFDecoder under autocast) and the teacher-forced pass (lean.token_logprobs or
rollout.token_logprobs under autocast). They can only agree to bf16 rounding, and only if they round
at the same points; these tests check that they do, on models where rounding anywhere else shows.

The models. Trained Qwen2 models have attention logits of 1000 and more in layer 0: an offset that q
and k carry in their low-frequency rotary dimensions (their biases, massive activations), the same for
every key of a query. Softmax ignores it, but a bf16 *score* keeps 8 bits of it: spacing 8 at 1000,
16 at 2000, so rounding the scores to bf16 moves attention weights by factors up to e^4 to e^8. Here a
massive embedding channel, read by the lowest-frequency rotary pair of q and k in layer 0, puts the
logits at 1000-3000, with q/k weights scaled x30 and large v/o in layer 0, so that attention matters.
The offset part of q and k is the same for every token: rounding q and k (both passes do) keeps it.

The bound. u = 2^-8 is bf16's unit roundoff and S the largest |logit| of the fp32 pass. A bf16 pass's
logits are off the fp32 ones by their own rounding (<= u S) and by one rounding's worth per layer that
the residual stream carries to them (L u S), twice that for the several roundings inside a layer
(norm, matmuls, rotary, softmax, SiLU): 2 (L + 1) u S. A log-prob is the target's logit minus the
log-sum-exp, each 1-Lipschitz in the max norm, so one pass is within K u S of fp32 with K = 4 (L + 1),
and two passes that round at the same points are within 2 K u S of each other. This holds on any CPU:
AVX512-BF16 and AMX kernels sum in different orders, which moves a value by ~2^-24 relative before it
is rounded and can tip the rounding, but the result is still a rounding of the same value, inside the
same +-u. A step that rounds the scores to bf16 is 50-150 u S off the training pass on these models.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import lean
import rollout
from rollout import left_pad

V, E, H, KV, D, LAYERS = 98, 64, 4, 2, 16, 2
U = 2.0 ** -8  # bf16's unit roundoff: round-to-nearest with 8 significant bits
K = 4 * (LAYERS + 1)  # one bf16 pass vs fp32, in units of u S (module docstring)


def sink_model(kind, seed=0):
    """2 layers, head_dim 16; layer 0's attention logits reach 1000-3000 through an offset common to all keys."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, hidden_size=E, intermediate_size=2 * E, num_hidden_layers=LAYERS, num_attention_heads=H,
               num_key_value_heads=KV, max_position_embeddings=128, initializer_range=0.02)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg, tie_word_embeddings=False)) if kind == "qwen2" else \
        LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms and biases random, so they matter
            p.normal_(1, 0.1) if "norm" in name else p.normal_(0, 0.3) if p.dim() == 1 else None
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


def rows(G=2, C=12, seed=1):
    """Two left-padded prompts (B, P) and C continuation tokens for each of their G rows (B G, C)."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = left_pad([torch.randint(5, V, (n,), generator=g).tolist() for n in (11, 4)], pad_id=0)
    return ids, mask, torch.randint(5, V, (ids.size(0) * G, C), generator=g)


def decode_logprobs(model, decoder, ids, mask, comp, G):
    """Log-probs of comp (N, C) fed token by token to decoder(..., dtype=bf16), as rollout.sample does."""
    step = decoder(model, ids, mask, G, comp.size(1), torch.bfloat16)
    pos = (mask.cumsum(-1) - 1)[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1)
    logits = [step.logits.float()]
    for t in range(comp.size(1) - 1):
        logits.append(step.step(comp[:, t], pos + t).float())
    return torch.stack(logits, 1).log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1)  # (N, C)


def full_rows(ids, mask, comp, G):
    return (torch.cat([ids.repeat_interleave(G, 0), comp], 1),
            torch.cat([mask.repeat_interleave(G, 0), torch.ones_like(comp)], 1))  # (N, P + C) each


def training_logprobs(model, fast, ids, mask, comp, G, dtype=torch.bfloat16):
    full, full_mask = full_rows(ids, mask, comp, G)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        if fast:
            return lean.token_logprobs(model, full, full_mask, comp.size(1), group_size=G)[0]
        return rollout.token_logprobs(model, full, full_mask, comp.size(1))[0]  # (N, C)


def largest_attention_logit(model, ids, mask, comp, G, monkeypatch):
    """max |q.k * scale| over attended pairs in the model's fp32 forward."""
    seen, sdpa = [0.0], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, scale=None, **kw):
        s = q @ k.repeat_interleave(q.size(1) // k.size(1), 1).transpose(-1, -2) * scale  # (N, H, T, T)
        keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        seen[0] = max(seen[0], s.masked_fill(~keep, 0).abs().max().item())
        return sdpa(q, k, v, attn_mask=attn_mask, scale=scale, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    full, full_mask = full_rows(ids, mask, comp, G)
    with torch.no_grad():
        model(input_ids=full, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))
    monkeypatch.undo()
    return seen[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decode_steps_give_the_training_pass_log_probs_to_bf16_rounding(kind, monkeypatch):
    model, G = sink_model(kind), 2
    ids, mask, comp = rows(G)
    assert largest_attention_logit(model, ids, mask, comp, G, monkeypatch) > 1000  # the regime of the bug
    full, full_mask = full_rows(ids, mask, comp, G)
    with torch.no_grad():
        pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
        S = model(input_ids=full, attention_mask=full_mask, position_ids=pos).logits.abs().max().item()
    exact = training_logprobs(model, False, ids, mask, comp, G, torch.float32)
    train = {"lean": training_logprobs(model, True, ids, mask, comp, G),
             "hf": training_logprobs(model, False, ids, mask, comp, G)}
    decode = {"lean": decode_logprobs(model, lean.LeanDecoder, ids, mask, comp, G),
              "hf": decode_logprobs(model, rollout.HFDecoder, ids, mask, comp, G)}
    gap = lambda a, b: ((a - b).abs().max() / (U * S)).item()  # in units of u S
    passes = {**{"train " + k: v for k, v in train.items()}, **{"decode " + k: v for k, v in decode.items()}}
    for name, logp in passes.items():
        assert gap(logp, exact) <= K, f"{name}: {gap(logp, exact):.1f} u S from fp32, bound {K}"
    for d, logp in decode.items():
        for t, want in train.items():
            assert gap(logp, want) <= 2 * K, f"decode {d} vs train {t}: {gap(logp, want):.1f} u S, bound {2 * K}"
    assert gap(train["lean"], train["hf"]) <= 2 * K
