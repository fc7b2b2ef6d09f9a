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
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache


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


def left_pad(seqs, pad_id):
    """List of id lists -> (ids (B, P), mask (B, P)) with padding on the left."""
    P = max(len(s) for s in seqs)
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
           top_p=1.0, top_k=0, generator=None):
    """Sample `group_size` completions for each prompt with a KV cache; temperature 0 is greedy.

    Each prompt is prefilled once and its KV cache repeated G times (prefix reuse), then all
    rows decode together until every row has produced a stop token or max_new_tokens is reached.
    """
    was_training = model.training
    model.eval()  # no dropout, and HF drops the KV cache in train mode under gradient checkpointing
    try:
        return _sample(model, tokenizer, prompts, group_size, max_new_tokens, stop_ids, temperature, top_p, top_k,
                       generator)
    finally:
        model.train(was_training)


def _sample(model, tokenizer, prompts, group_size, max_new_tokens, stop_ids, temperature, top_p, top_k, generator):
    device = next(model.parameters()).device
    pad_id = stop_ids[0]  # any id works: padding is masked everywhere
    ids, mask = left_pad(encode_prompts(tokenizer, prompts), pad_id)  # (B, P)
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, V)
    G = group_size
    cache.batch_repeat_interleave(G)
    ids, mask, logits = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), logits.repeat_interleave(G, 0)
    next_pos = pos[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1)
    N = ids.size(0)
    stop = torch.as_tensor(stop_ids, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        logits = logits.float() / (temperature if temperature > 0 else 1.0)  # (N, V)
        logp = logits.log_softmax(-1)  # (N, V)
        if temperature > 0:
            tok = sample_from_logits(filter_logits(logits, top_k, top_p), generator)  # (N,)
        else:
            tok = logits.argmax(-1)  # (N,)
        tok = tok.masked_fill(done, pad_id)
        tokens.append(tok)
        logps.append(logp.gather(1, tok[:, None]).squeeze(1))
        done |= torch.isin(tok, stop)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        mask = torch.cat([mask, mask.new_ones(N, 1)], 1)  # (N, P+t+1)
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                       past_key_values=cache, use_cache=True).logits[:, -1]  # (N, V)
        next_pos = next_pos + 1
    completion_ids = torch.stack(tokens, 1)  # (N, C)
    completion_mask, truncated = completion_mask_from_stops(completion_ids, stop_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)
    lengths = completion_mask.sum(1) - (~truncated).long()  # (N,) tokens before the stop token
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completion_ids.tolist(), lengths.tolist())],
                                   skip_special_tokens=True)
    return Rollout(prompt_ids=ids, prompt_mask=mask[:, :ids.size(1)], completion_ids=completion_ids,
                   completion_mask=completion_mask, truncated=truncated,
                   group=torch.arange(N, device=device) // G, completions=texts,
                   sample_logp=torch.stack(logps, 1).masked_fill(completion_mask == 0, 0.0))


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


def _head_logprobs(lm_head, hidden, targets, temperature, with_entropy):
    """hidden (n, H), targets (n,) -> log-probs (n,) and entropy (n,) of the tempered head."""
    logits = lm_head(hidden).float()  # (n, V) fp32 for one chunk only
    if temperature != 1.0:  # skipping it saves a full (n, V) pass forward and backward
        logits = logits / temperature
    logz = logits.logsumexp(-1)  # (n,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz  # (n,)
    if not with_entropy:
        return logp, None
    probs = (logits - logz[:, None]).exp()  # (n, V)
    return logp, logz - (probs * logits).sum(-1)  # H = logZ - E_p[logit]


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
                   with_entropy=False, chunk_size=1024, out_device=None, group_size=1):
    """Teacher-forced log-probs of the last `num_completion` tokens of each row.

    input_ids, attention_mask (N, P+C) -> logp (N, C) [and entropy (N, C)], on out_device.
    One forward of the decoder; the LM head runs only on the C completion positions and in
    chunks of `chunk_size` tokens, so the (N, C, V) fp32 log-softmax never exists at once. With
    grad enabled each chunk is checkpointed: backward recomputes its logits instead of storing them.
    group_size=G > 1: rows come in groups of G that share their prompt (as sample() makes them);
    each prompt is run once and its KV cache repeated G times, gradients flowing through it.
    Runs on the model's own device (a reference model may live on CPU); grad follows torch's mode.
    """
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_scaling", 1.0) != 1.0:
        raise NotImplementedError(f"{cfg.model_type}: logit softcapping/scaling is not applied in token_logprobs")
    device = next(model.parameters()).device
    out_device = out_device or input_ids.device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P+C) same positions as during sampling
    C = num_completion
    if group_size > 1:
        hidden = _shared_prefix_hidden(model.get_decoder(), ids, mask, pos, C, group_size)  # (N, C, H)
    else:
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        hidden = hidden[:, -C - 1:-1]  # (N, C, H) position t predicts token t+1
    targets = ids[:, -C:]  # (N, C)
    N, _, H = hidden.shape
    hidden, targets = hidden.reshape(N * C, H), targets.reshape(N * C)
    lm_head = model.get_output_embeddings()
    logps, ents = [], []
    for i in range(0, N * C, chunk_size):
        args = (lm_head, hidden[i:i + chunk_size], targets[i:i + chunk_size], temperature, with_entropy)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(*args)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps).view(N, C).to(out_device)  # (N, C)
    entropy = torch.cat(ents).view(N, C).to(out_device) if with_entropy else None
    return logp, entropy
