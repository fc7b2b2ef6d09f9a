"""
Sampling G completions per prompt, and per-token log-probs of sampled tokens: the plain path.

Everything here runs through the model's own modules: the decode loop calls `model(...)` with its KV
cache, the log-prob pass calls the model's decoder and its `lm_head` module. Whatever a fork changes
in them (LoRA, a hook, a swapped layer, a quantised linear) is what runs. lean.py offers faster
drop-ins for the two pluggable points, the decode step (`sample(..., decoder=)`) and `token_logprobs`,
and refuses models it cannot reproduce exactly.

Conventions used everywhere in this repo:
- rows are grouped contiguously: prompt i owns rows i*G ... i*G+G-1;
- prompts are left-padded, completions right-padded; position_ids = cumsum(attention_mask) - 1;
- completion_mask covers the completion up to AND including the first stop token, found from the
  stop position, never from pad_token_id (SmolLM2 has pad == eos: a pad-based mask would drop the
  EOS token and the model would never learn to stop).
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

import grpo


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
    prompt_cut: torch.Tensor = None  # (N,) bool: the prompt was cut from the left to max_prompt_tokens

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


def sample_from_logits(logits, u):
    """One token per row by inverse CDF, from one uniform u (N,) in [0, 1) per row.

    Cheaper than torch.multinomial, which draws a random number for every vocabulary entry.
    Removed (-inf) tokens have an empty CDF interval, so they are never drawn.
    """
    cdf = logits.softmax(-1).cumsum(-1)  # (N, V)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.size(-1) - 1).squeeze(1)


def _autocast(model, dtype):
    """Autocast to `dtype` when it is lower than the weights' (fp32 master weights, bf16 compute)."""
    p = next(model.parameters())
    on = dtype is not None and dtype != p.dtype and dtype != torch.float32
    return torch.autocast(p.device.type, dtype=dtype) if on else nullcontext()


class HFDecoder:
    """The plain decode step: the model's own forward with transformers' KV cache.

    Built once per rollout: each of the B prompts is prefilled once and its cache repeated G times.
    `logits` (N, V) predict the first completion token; step(tokens (N,), positions (N, 1)) -> (N, V)
    for the next. dtype: the compute dtype (autocast when lower than the weights').
    """

    def __init__(self, model, prompt_ids, prompt_mask, group_size, max_new_tokens, dtype=None):
        self.model, self.autocast = model, _autocast(model, dtype)
        self.cache = DynamicCache(config=model.config)
        pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        with self.autocast:
            logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos,
                           past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, V)
        self.cache.batch_repeat_interleave(group_size)
        self.logits = logits.repeat_interleave(group_size, 0)  # (N, V)
        self.mask = prompt_mask.repeat_interleave(group_size, 0)  # (N, P), grows by a column a step

    def step(self, tokens, positions):
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.size(0), 1)], 1)  # (N, P+t+1)
        with self.autocast:
            return self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=positions,
                              past_key_values=self.cache, use_cache=True).logits[:, -1]  # (N, V)


def _check_sampling(group_size, max_new_tokens, temperature, top_p, top_k):
    if group_size < 1 or max_new_tokens < 1:
        raise ValueError(f"group_size and max_new_tokens must be >= 1, got {group_size} and {max_new_tokens}")
    if not temperature >= 0:  # nan fails too
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need 0 < top_p <= 1 and top_k >= 0, got top_p={top_p}, top_k={top_k}")


@torch.no_grad()
def sample(model, tokenizer, prompts, group_size, max_new_tokens, stop_ids, temperature=1.0, top_p=1.0, top_k=0,
           generator=None, dtype=None, decoder=HFDecoder, max_prompt_tokens=None):
    """Sample `group_size` completions for each prompt; temperature 0 is greedy.

    All rows decode together until every row has produced a stop token or max_new_tokens is reached.
    generator: a torch.Generator, or a list of one per prompt: then each prompt's completions depend only
    on its own generator, not on which prompts share the batch (or the process). dtype: the compute
    dtype (default: the weights'). decoder: the decode step (HFDecoder, or a drop-in such as
    lean.LeanDecoder). max_prompt_tokens: longer prompts keep their last tokens (cut from the left).
    """
    _check_sampling(group_size, max_new_tokens, temperature, top_p, top_k)
    was_training = model.training
    model.eval()  # no dropout, and HF drops the KV cache in train mode under gradient checkpointing
    try:
        return _sample(model, tokenizer, prompts, group_size, max_new_tokens, stop_ids, temperature, top_p, top_k,
                       generator, dtype, decoder, max_prompt_tokens)
    finally:
        model.train(was_training)


def _sample(model, tokenizer, prompts, G, max_new_tokens, stop_ids, temperature, top_p, top_k, generator, dtype,
            decoder, max_prompt_tokens):
    device = next(model.parameters()).device
    pad_id = stop_ids[0]  # any id works: padding is masked everywhere
    seqs = encode_prompts(tokenizer, prompts)
    cut = torch.tensor([max_prompt_tokens is not None and len(s) > max_prompt_tokens for s in seqs])  # (B,)
    if max_prompt_tokens is not None:
        seqs = [s[-max_prompt_tokens:] for s in seqs]
    ids, mask = (t.to(device) for t in left_pad(seqs, pad_id))  # (B, P)
    N = ids.size(0) * G
    # one uniform per row and token, drawn up front (per prompt when given a generator per prompt)
    gens = generator if isinstance(generator, (list, tuple)) else None
    u = torch.cat([torch.rand(G, max_new_tokens, generator=g, device=g.device) for g in gens]) if gens else \
        torch.rand(N, max_new_tokens, generator=generator, device=generator.device if generator else None)
    u = u.to(device)  # (N, max_new_tokens)
    step = decoder(model, ids, mask, G, max_new_tokens, dtype)
    logits = step.logits  # (N, V)
    next_pos = (mask.cumsum(-1) - 1)[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1)
    stop = torch.as_tensor(stop_ids, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(N, max_new_tokens, device=device)
    for t in range(max_new_tokens):
        logits = logits.float()  # (N, V)
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        logp = logits.log_softmax(-1)  # (N, V)
        tok = sample_from_logits(filter_logits(logits, top_k, top_p), u[:, t]) if temperature > 0 else \
            logits.argmax(-1)  # (N,)
        tok = tok.masked_fill(done, pad_id)
        tokens[:, t] = tok
        logps[:, t] = logp.gather(1, tok[:, None]).squeeze(1)
        done |= torch.isin(tok, stop)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        logits = step.step(tok, next_pos)  # (N, V)
        next_pos += 1
    completion_ids, logps = tokens[:, :t + 1], logps[:, :t + 1]  # (N, C)
    completion_mask, truncated = completion_mask_from_stops(completion_ids, stop_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)
    lengths = completion_mask.sum(1) - (~truncated).long()  # (N,) tokens before the stop token
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completion_ids.tolist(), lengths.tolist())],
                                   skip_special_tokens=True)
    return Rollout(prompt_ids=ids.repeat_interleave(G, 0), prompt_mask=mask.repeat_interleave(G, 0),
                   completion_ids=completion_ids, completion_mask=completion_mask, truncated=truncated,
                   group=torch.arange(N, device=device) // G, completions=texts,
                   sample_logp=logps.masked_fill(completion_mask == 0, 0.0),
                   prompt_cut=cut.repeat_interleave(G, 0).to(device))


def concat(rollouts, rows=None):
    """Rollouts (prompts and completions of different widths) -> one Rollout: prompts re-padded on the left,
    completions on the right (masked, log-prob 0). rows: for each rollout, the row indices to keep."""
    rows = rows or [torch.arange(r.prompt_ids.size(0)) for r in rollouts]
    P = max(r.prompt_ids.size(1) for r in rollouts)
    C = max(r.completion_ids.size(1) for r in rollouts)
    left = lambda t, w: F.pad(t, (w - t.size(1), 0))
    right = lambda t, w: F.pad(t, (0, w - t.size(1)))
    pick = lambda f: [f(r)[i] for r, i in zip(rollouts, rows)]
    cat = lambda f: torch.cat(pick(f))
    texts = [r.completions[j] for r, i in zip(rollouts, rows) for j in i.tolist()]
    groups = torch.cat([r.group[i] + k * len(r.completions) for k, (r, i) in enumerate(zip(rollouts, rows))])
    group = torch.unique_consecutive(groups, return_inverse=True)[1]  # (N,) renumbered 0, 0, .., 1, 1, ..
    return Rollout(prompt_ids=cat(lambda r: left(r.prompt_ids, P)), prompt_mask=cat(lambda r: left(r.prompt_mask, P)),
                   completion_ids=cat(lambda r: right(r.completion_ids, C)),
                   completion_mask=cat(lambda r: right(r.completion_mask, C)), truncated=cat(lambda r: r.truncated),
                   group=group, completions=texts, sample_logp=cat(lambda r: right(r.sample_logp, C)),
                   prompt_cut=cat(lambda r: r.prompt_cut))


def token_ends(tokenizer, completion_ids, length, char_ends):
    """Character offsets in a decoded completion -> the index of the token each one falls in.

    completion_ids (C,) of one row, length: its tokens before the stop token, char_ends: exclusive
    ends of pieces of the text (as rollout.sample decodes it) -> list of token indices in [0, length),
    the first token whose decoded prefix holds the text up to the offset. Decoding prefixes is exact
    whatever the tokenizer does to bytes and spaces; a character split over byte tokens decodes as
    U+FFFD until its last byte, so the prefix is compared with the text, not only measured.
    """
    ids = completion_ids[:length].tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    reaches = lambda k, end: tokenizer.decode(ids[:k], skip_special_tokens=True)[:end] == text[:end]
    out = []
    for end in char_ends:
        lo, hi = 1, max(length, 1)
        while lo < hi:  # smallest k whose decoded prefix holds text[:end]
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if reaches(mid, end) else (mid + 1, hi)
        out.append(max(lo - 1, 0))
    return out


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


# -----------------------------------------------------------------------------
# teacher-forced log-probs


def head_logprobs(lm_head, hidden, targets, temperature=1.0, with_entropy=False, chunk_size=None, ref=None):
    """Log-prob of each target token under the `lm_head` module, in chunks of rows.

    hidden (n, H), targets (n,) -> logp (n,), entropy (n,) or None, kl (n,) or None. Each chunk's
    (chunk, V) logits are made, used and dropped; under autograd each chunk is checkpointed, so backward
    keeps only `hidden` and calls the head again: no (n, V) fp32 tensor ever exists.
    ref = (ref_lm_head, ref_hidden (n, H)): also the exact KL(pi || pi_ref) over the whole vocabulary
    at each position (grpo.full_kl), the reference's logits made from its hidden states chunk by chunk.
    """
    if chunk_size is None:  # a chunk's fp32 logits stay under 64 MiB
        chunk_size = max(16, (64 << 20) // (4 * lm_head.weight.size(0)))

    def chunk(h, t, h_ref):
        z = lm_head(h).float() / temperature  # (n_c, V)
        logz = z.logsumexp(-1)  # (n_c,)
        logp = z.gather(-1, t[:, None]).squeeze(-1) - logz
        ent = logz - (z - logz[:, None]).exp().mul(z).sum(-1) if with_entropy else None  # H = logZ - E_p[z]
        kl = None
        if h_ref is not None:
            with torch.no_grad():
                z_ref = ref[0](h_ref).float() / temperature  # (n_c, V)
            kl = grpo.full_kl(z[None], z_ref[None], chunk_size=z.size(0))[0]
        return logp, ent, kl

    out = []
    for i in range(0, hidden.size(0), chunk_size):
        args = (hidden[i:i + chunk_size], targets[i:i + chunk_size], None if ref is None else ref[1][i:i + chunk_size])
        grad = torch.is_grad_enabled() and hidden.requires_grad
        out.append(checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
    cat = lambda k: torch.cat([o[k] for o in out]) if out and out[0][k] is not None else None
    return (cat(0) if out else hidden.new_zeros(0, dtype=torch.float32)), cat(1), cat(2)


def _check_outer(model):
    """This pass calls model.get_decoder() and the lm_head module, not model(...), which sampling runs:
    refuse what only model(...) would do, rather than compute something else."""
    name, cfg = type(model).__name__, getattr(model, "active_peft_config", None)
    where = "which the log-prob pass does not run (it calls model.get_decoder() and the lm_head module)"
    fsdp = isinstance(model, FSDPModule)  # its own hooks gather the root, which parallel.root_unsharded does here
    if (model._forward_hooks or model._forward_pre_hooks) and not fsdp:
        raise ValueError(f"{name} has a forward hook on the whole model, {where}: register it on those")
    if not type(model).forward.__module__.startswith(("transformers.", "peft.")):
        raise ValueError(f"{name} overrides forward(), {where}: make the change in the decoder or the lm_head")
    if cfg is not None and cfg.is_prompt_learning:
        raise ValueError(f"prompt / prefix tuning adds virtual tokens in {name}.forward, {where}")


def completion_hidden(model, input_ids, attention_mask, num_completion, group_size=1):
    """Final hidden states (N, C, H) at the positions that predict the last C tokens of each row.

    One forward of the model's decoder over the whole rows (position t predicts token t+1).
    group_size: rows come in groups of G that share their prompt, a hint the plain path does not need
    (lean.completion_hidden runs each shared prompt once).
    """
    C = num_completion
    _check_outer(model)
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (N, P+C) the positions sample() used
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos)
    return out.last_hidden_state[:, -C - 1:-1]  # (N, C, H)


def token_logprobs(model, input_ids, attention_mask, num_completion, temperature=1.0, with_entropy=False,
                   chunk_size=None, out_device=None, group_size=1, ref=None):
    """Teacher-forced log-probs of the last `num_completion` tokens of each row.

    input_ids, attention_mask (N, P+C) -> logp (N, C), entropy (N, C) or None, kl (N, C) or None, on
    out_device; all 0 where attention_mask is 0 (the padding after a row's stop token, which the head
    skips). The decoder runs once (completion_hidden), the lm_head module in chunks (head_logprobs).
    ref = (ref_lm_head, ref_hidden (N, C, H) from completion_hidden of the reference): the exact
    full-vocabulary KL at each position too. Runs on the model's own device; grad follows torch's mode.
    """
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_scaling", 1.0) != 1.0:
        raise NotImplementedError(f"{cfg.model_type}: logit softcapping/scaling is not applied in token_logprobs")
    device = next(model.parameters()).device
    out_device = out_device or input_ids.device
    ids, mask, C = input_ids.to(device), attention_mask.to(device), num_completion
    hidden = completion_hidden(model, ids, mask, C, group_size)  # (N, C, H)
    real = mask[:, -C:].bool()  # (N, C) positions whose target is a real token
    ref = None if ref is None else (ref[0], ref[1][real])
    logp, ent, kl = head_logprobs(model.get_output_embeddings(), hidden[real], ids[:, -C:][real], temperature,
                                  with_entropy, chunk_size, ref)  # (n,) each
    return scatter_rows(real, logp, ent, kl, out_device=out_device)


def scatter_rows(real, *values, out_device=None):
    """Values (n,) at the True positions of real (N, C) -> (N, C) tensors, 0 elsewhere (None stays None)."""
    def put(v):
        return None if v is None else v.new_zeros(real.shape).masked_scatter(real, v).to(out_device or v.device)
    return tuple(put(v) for v in values)
