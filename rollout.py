"""
Sampling G completions per prompt, and per-token log-probs of sampled tokens under any model.

Conventions used everywhere in this repo:
- rows are grouped contiguously: prompt i owns rows i*G ... i*G+G-1;
- prompts are left-padded, completions right-padded; position_ids = cumsum(attention_mask) - 1;
- completion_mask covers the completion up to AND including the first stop token, found from the
  stop position, never from pad_token_id (SmolLM2 has pad == eos: a pad-based mask would drop the
  EOS token and the model would never learn to stop).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import lean


@dataclass
class Rollout:
    prompt_ids: torch.Tensor       # (N, P) left-padded prompt tokens, N = num_prompts * G
    prompt_mask: torch.Tensor      # (N, P) 1 on real prompt tokens
    completion_ids: torch.Tensor   # (N, C) sampled tokens, pad after the first stop token
    completion_mask: torch.Tensor  # (N, C) 1 up to and including the first stop token
    truncated: torch.Tensor        # (N,) bool: hit max_new_tokens without a stop token
    group: torch.Tensor            # (N,) index of the prompt each row belongs to
    completions: list              # N decoded strings, stop token excluded
    sample_logp: torch.Tensor      # (N, C) log-probs at sampling time (temperature applied, before top-p/k)

    @property
    def input_ids(self):
        return torch.cat([self.prompt_ids, self.completion_ids], 1)  # (N, P+C)

    @property
    def attention_mask(self):
        return torch.cat([self.prompt_mask, self.completion_mask], 1)  # (N, P+C)


def encode_prompts(tokenizer, prompts):
    """Prompts (chat message lists or plain strings) -> list of token-id lists.

    With a chat template, a plain string becomes one user message; without one, strings are used
    as they are and message lists are joined by newlines.
    """
    out = []
    for p in prompts:
        if tokenizer.chat_template:
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template has its own BOS
        else:
            text = p if isinstance(p, str) else "\n".join(m["content"] for m in p)
            out.append(tokenizer(text)["input_ids"])
    return out


def left_pad(seqs, pad_id, multiple=1):
    """List of id lists -> (ids (B, P), mask (B, P)) with padding on the left, P a multiple of `multiple`."""
    P = max(len(s) for s in seqs)
    P += -P % multiple
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, P - len(s):] = 1
    return ids, mask


def completion_mask_from_stops(completion_ids, stop_ids):
    """(N, C) sampled ids -> (mask (N, C) up to and including the first stop, truncated (N,) bool)."""
    N, C = completion_ids.shape
    is_stop = torch.isin(completion_ids, torch.as_tensor(stop_ids, device=completion_ids.device))  # (N, C)
    has_stop = is_stop.any(1)  # (N,)
    first = torch.where(has_stop, is_stop.int().argmax(1), C)  # (N,) C when no stop: keep the whole row
    mask = torch.arange(C, device=completion_ids.device)[None] <= first[:, None]  # (N, C)
    return mask.long(), ~has_stop


def filter_logits(logits, top_k=0, top_p=1.0):
    """Top-k then nucleus filtering: logits (N, V) -> logits with removed tokens at -inf."""
    if top_k and top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)  # (N, V)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass strictly before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def sample_from_logits(logits, generator=None):
    """One token per row by inverse CDF: a single uniform per row.

    torch.multinomial draws an exponential for every vocabulary entry (~20 ms a step for 16 rows
    x 49k vocab on a 2-core CPU); this costs a cumsum. Removed (-inf) tokens have an empty CDF
    interval, so they are never drawn.
    """
    cdf = logits.softmax(-1).cumsum(-1)  # (N, V)
    u = torch.rand(cdf.size(0), 1, device=cdf.device, generator=generator) * cdf[:, -1:]  # (N, 1)
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.size(-1) - 1).squeeze(1)  # (N,)


@torch.no_grad()
def sample(model, tokenizer, prompts, group_size, max_new_tokens, stop_ids, temperature=1.0,
           top_p=1.0, top_k=0, generator=None, dtype=None):
    """Sample `group_size` completions for each prompt with a KV cache; temperature 0 is greedy.

    Each prompt is prefilled once and its KV cache repeated G times (prefix reuse), then all
    rows decode together until every row has produced a stop token or max_new_tokens is reached,
    through lean.LeanDecoder where it supports the model, else the model's own forward.
    dtype: the compute dtype (default: the weights'). A lower one than the weights' runs the prefill
    under autocast and the lean decode step on weights cast once per rollout (the HF forward on
    other models decodes under autocast: slower than weights stored in that dtype).
    """
    was_training = model.training
    model.eval()  # no dropout, and HF drops the KV cache in train mode under gradient checkpointing
    try:
        return _sample(model, tokenizer, prompts, group_size, max_new_tokens, stop_ids, temperature, top_p, top_k,
                       generator, dtype)
    finally:
        model.train(was_training)


def _sample(model, tokenizer, prompts, group_size, max_new_tokens, stop_ids, temperature, top_p, top_k, generator,
            dtype):
    device = next(model.parameters()).device
    pad_id = stop_ids[0]  # any id works: padding is masked everywhere
    ids, mask = left_pad(encode_prompts(tokenizer, prompts), pad_id, 16)  # (B, P) recurring shapes: see token_logprobs
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    weight_dtype = next(model.parameters()).dtype
    dtype = dtype or weight_dtype
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype not in (weight_dtype, torch.float32))
    cache = DynamicCache(config=model.config)
    with autocast:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, V)
    G = group_size
    ids, mask, logits = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), logits.repeat_interleave(G, 0)
    next_pos = pos[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1)
    decoder = lean.LeanDecoder(model, cache, G, mask, max_new_tokens, dtype) if lean.supports(model) else None
    if decoder is None:
        cache.batch_repeat_interleave(G)
    N = ids.size(0)
    stop = torch.as_tensor(stop_ids, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    # written in place: a small tensor kept per step would settle in the hole a freed (N, V) buffer
    # left, and the next step's buffers would then extend the heap (glibc), ~3 MB a step
    tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(N, max_new_tokens, device=device)
    for t in range(max_new_tokens):
        logits = logits.float()  # (N, V)
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        logp = logits.log_softmax(-1)  # (N, V)
        if temperature > 0:
            tok = sample_from_logits(filter_logits(logits, top_k, top_p), generator)  # (N,)
        else:
            tok = logits.argmax(-1)  # (N,)
        tok = tok.masked_fill(done, pad_id)
        tokens[:, t] = tok
        logps[:, t] = logp.gather(1, tok[:, None]).squeeze(1)
        done |= torch.isin(tok, stop)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        if decoder is not None:
            logits = decoder.step(tok, next_pos)  # (N, V)
        else:
            mask = torch.cat([mask, mask.new_ones(N, 1)], 1)  # (N, P+t+1)
            with autocast:
                logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                               past_key_values=cache, use_cache=True).logits[:, -1]  # (N, V)
        next_pos += 1
    completion_ids, logps = tokens[:, :t + 1], logps[:, :t + 1]  # (N, C)
    completion_mask, truncated = completion_mask_from_stops(completion_ids, stop_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)
    lengths = completion_mask.sum(1) - (~truncated).long()  # (N,) tokens before the stop token
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completion_ids.tolist(), lengths.tolist())],
                                   skip_special_tokens=True)
    return Rollout(prompt_ids=ids, prompt_mask=mask[:, :ids.size(1)], completion_ids=completion_ids,
                   completion_mask=completion_mask, truncated=truncated,
                   group=torch.arange(N, device=device) // G, completions=texts,
                   sample_logp=logps.masked_fill(completion_mask == 0, 0.0))


def shared_prompt_rows(group_size, micro_batch):
    """Rows per prompt inside each micro-batch of G-row groups, for token_logprobs(group_size=...):
    G when micro-batches hold whole groups, the micro-batch when it lies inside one group, else 1."""
    G, mb = group_size, micro_batch
    return G if mb % G == 0 else mb if G % mb == 0 else 1


def micro_batches(r, size):
    """Yield (rows, input_ids, attention_mask, c) for each slice of `size` rows of a Rollout.

    Each slice is trimmed to the columns some row in it uses: the leading all-padding prompt
    columns (dropping them leaves cumsum positions unchanged) and the completion columns after
    its longest completion; c is the number of completion columns kept.
    """
    mask = r.attention_mask  # (N, P+C)
    P = r.prompt_ids.size(1)
    for i in range(0, mask.size(0), size):
        used = mask[i:i + size].any(0).nonzero()  # prompts are left-padded, completions right-padded
        lo, hi = used.min().item(), used.max().item() + 1
        yield slice(i, i + size), r.input_ids[i:i + size, lo:hi], mask[i:i + size, lo:hi], hi - P


class _HeadLogprobs(torch.autograd.Function):
    """Log-prob of each target token (and the entropy) under the LM head, V-sized work in chunks.

    hidden (n, H), weight (V, H), bias (V,) or None, targets (n,) -> logp (n,), entropy (n,) or None.
    Backward forms the gradient of the logits directly, d logp_t / dz = onehot(t) - p and
    dH / dz = -p * (log p + H), then the two matmuls; the weight's from one (n, V) buffer in `dtype`
    (the autocast dtype, else the weight's). When that dtype is 16-bit, the forward fills this
    buffer with p, so backward does not recompute the logits; else backward recomputes each chunk's
    logits and nothing of size V is saved. The target's 1 - p_t comes from the fp32 log-prob, not
    the rounded p. Matmuls run in `dtype`, the softmax math in fp32, as autograd under autocast
    would do, with a fraction of the elementwise passes.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, chunk_size, dtype):
        ctx.set_materialize_grads(False)  # entropy that is only logged gets no gradient work
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        n = hidden.size(0)
        logp, logz = hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
        need_w = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        probs = hidden.new_empty(n, weight.size(0), dtype=dtype) if need_w and dtype.itemsize < 4 else None
        for i in range(0, n, chunk_size):  # results go into preallocated outputs (see sample())
            c = slice(i, i + chunk_size)
            z = F.linear(hidden[c].to(dtype), w, b).float()  # (n_c, V)
            if temperature != 1.0:
                z = z / temperature
            logz[c] = z.logsumexp(-1)
            logp[c] = z.gather(-1, targets[c, None]).squeeze(-1) - logz[c]
            if with_entropy or probs is not None:
                p = (z - logz[c, None]).exp_()
                if probs is not None:
                    probs[c] = p
                if with_entropy:
                    ent[c] = logz[c] - p.mul_(z).sum(-1)  # H = logZ - E_p[z]
        ctx.save_for_backward(hidden, weight, bias, targets, logz, logp, ent, probs)
        ctx.cfg = temperature, chunk_size, dtype
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, logz, logp, ent, probs = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.cfg
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        g_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        # dLoss/dz of all chunks, for one weight-gradient matmul at the end: a (V, H) product per
        # chunk would allocate (and page-fault in) the size of the weight every time
        gz_all = probs if probs is not None else \
            hidden.new_empty(hidden.size(0), weight.size(0), dtype=dtype) if need_w else None
        for i in range(0, hidden.size(0), chunk_size):
            c = slice(i, i + chunk_size)
            if probs is not None:
                p = probs[c].float()
                logp_all = p.log() if g_ent is not None else None
            else:
                z = F.linear(hidden[c].to(dtype), w, b).float()  # (n_c, V) recomputed
                if temperature != 1.0:
                    z = z / temperature
                logp_all = z.sub_(logz[c, None])  # log p, in place of z
                p = logp_all.exp()
            if g_logp is not None:  # gz = dLoss / dz
                one_minus = -torch.expm1(logp[c, None])  # 1 - p_t in fp32
                gz = (p * -g_logp[c, None]).scatter_(-1, targets[c, None], one_minus * g_logp[c, None])
            else:
                gz = torch.zeros_like(p)
            if g_ent is not None:
                gz -= p * (logp_all + ent[c, None]) * g_ent[c, None]
            if temperature != 1.0:
                gz = gz / temperature
            gz = gz.to(dtype)
            if g_hidden is not None:
                g_hidden[c] = gz @ w
            if gz_all is not None:
                gz_all[c] = gz
        g_weight = g_bias = None
        if bias is not None and ctx.needs_input_grad[2]:
            g_bias = gz_all.sum(0, dtype=torch.float32).to(bias.dtype)
        if ctx.needs_input_grad[1]:  # in blocks of vocabulary rows: no full-size low-precision copy
            g_weight, h = torch.empty_like(weight), hidden.to(dtype)
            for j in range(0, weight.size(0), 8192):
                g_weight[j:j + 8192] = gz_all[:, j:j + 8192].t() @ h
        return g_hidden, g_weight, g_bias, None, None, None, None, None


def _shared_prefix_hidden(decoder, ids, mask, pos, C, G):
    """Hidden states that predict the completion tokens, running each group's prompt once."""
    P = ids.size(1) - C
    cache = DynamicCache(config=decoder.config)
    h_prompt = decoder(input_ids=ids[::G, :P], attention_mask=mask[::G, :P], position_ids=pos[::G, :P],
                       past_key_values=cache, use_cache=True).last_hidden_state[:, -1:]  # (N/G, 1, H)
    cache.batch_repeat_interleave(G)  # differentiable: gradients reach the shared prompt
    if C == 1:
        return h_prompt.repeat_interleave(G, 0)  # (N, 1, H)
    h_comp = decoder(input_ids=ids[:, P:-1], attention_mask=mask[:, :-1], position_ids=pos[:, P:-1],
                     past_key_values=cache, use_cache=True).last_hidden_state  # (N, C-1, H)
    return torch.cat([h_prompt.repeat_interleave(G, 0), h_comp], 1)  # (N, C, H)


def token_logprobs(model, input_ids, attention_mask, num_completion, temperature=1.0,
                   with_entropy=False, chunk_size=None, out_device=None, group_size=1):
    """Teacher-forced log-probs of the last `num_completion` tokens of each row.

    input_ids, attention_mask (N, P+C) -> logp (N, C) [and entropy (N, C)], on out_device; both are
    0 where attention_mask is 0 (padding after a row's stop token), which the LM head skips.
    One forward of the decoder (lean.hidden_states where it supports the model, else HF's); the LM
    head runs only on the C completion positions and in chunks of `chunk_size` tokens, so the
    (N, C, V) fp32 log-softmax never exists at once; with gradients, one (N C, V) buffer in the
    16-bit compute dtype carries p to backward (_HeadLogprobs). The default chunk keeps a chunk's
    fp32 logits under 24 MiB on CPU: glibc then reuses freed memory, where bigger blocks are
    mapped fresh each time and page-faulted in at ~2 us per 4 KiB, more than the math on them.
    group_size=G > 1: rows come in groups of G that share their prompt (as sample() makes them);
    each prompt is run once and its keys/values repeated G times, gradients flowing through them
    (not through HF's forward under gradient checkpointing, which then drops the KV cache).
    Runs on the model's own device (a reference model may live on CPU); grad follows torch's mode.
    """
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_scaling", 1.0) != 1.0:
        raise NotImplementedError(f"{cfg.model_type}: logit softcapping/scaling is not applied in token_logprobs")
    device = next(model.parameters()).device
    out_device = out_device or input_ids.device
    # prompt and completion widths padded (masked) to multiples of 16, so the matmul shapes recur
    # from step to step: on CPU each new shape makes oneDNN build and cache (up to 1024, ~250 KB
    # each) new kernels, which grew the process by ~40 MB a step
    n_out, C = num_completion, num_completion + -num_completion % 16
    left = -(input_ids.size(1) - n_out) % 16
    ids = F.pad(input_ids, (left, C - n_out)).to(device)
    mask = F.pad(attention_mask, (left, C - n_out)).to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P+C) same positions as during sampling
    if lean.supports(model):
        hidden = lean.hidden_states(model, ids, mask, C, group_size)  # (N, C, H)
    elif group_size > 1 and not (model.training and model.is_activation_checkpointing):  # HF drops the cache then
        hidden = _shared_prefix_hidden(model.get_decoder(), ids, mask, pos, C, group_size)  # (N, C, H)
    else:
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        hidden = hidden[:, -C - 1:-1]  # (N, C, H) position t predicts token t+1
    N, _, H = hidden.shape
    # the head only where the target is a real token (after a row's stop token it is padding)
    real = mask[:, -C:].bool()  # (N, C)
    keep = lean.token_index(real)  # (n,)
    hidden, targets = hidden.reshape(N * C, H).index_select(0, keep), ids[:, -C:].reshape(N * C)[keep]
    lm_head = model.get_output_embeddings()
    if chunk_size is None:
        chunk_size = max(16, (24 << 20) // (4 * lm_head.weight.size(0))) if device.type == "cpu" else 1024
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else lm_head.weight.dtype
    logp, entropy = _HeadLogprobs.apply(hidden, lm_head.weight, lm_head.bias, targets, temperature, with_entropy,
                                        chunk_size, dtype)
    scatter = lambda t: t.new_zeros(N * C).index_copy(0, keep, t).view(N, C).masked_fill(~real, 0)[:, :n_out]
    return scatter(logp).to(out_device), scatter(entropy).to(out_device) if with_entropy else None  # (N, C)
