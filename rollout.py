"""Sampling G completions per prompt, and teacher-forced log-probs, through the model's own `model(...)`, KV cache,
decoder and `lm_head`: a fork's LoRA, hook or swapped layer is what runs. completion_mask runs to AND including the
first stop token, found by position, never by pad_token_id (SmolLM2's pad is its EOS: it would never learn to stop)."""

import importlib
import inspect
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Annotated, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from config import Knob, flag


ROW_FIELDS = ("num_tokens", "own_tokens", "truncated", "trajectory")  # Rollout.reward_fields beside the example's


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (N, P) left-padded prompt tokens, N = num_prompts * G
    prompt_mask: torch.Tensor  # (N, P) 1 on real prompt tokens
    completion_ids: torch.Tensor  # (N, C) the trajectory: sampled tokens (and tool replies), pad after the stop
    completion_mask: torch.Tensor  # (N, C) 1 on the model's own tokens, each turn's stop token included
    truncated: torch.Tensor  # (N,) bool: the budget ended the row (max_new_tokens), not its stop token or environment
    completions: list  # N strings: the model's own words (its sampled tokens only), turns joined by a newline
    sample_logp: torch.Tensor  # (N, C) log-probs at sampling time (temperature applied), 0 off completion_mask
    prompt_cut: torch.Tensor  # (N,) bool: the prompt was cut from the left to max_prompt_tokens
    env_mask: torch.Tensor  # (N, C) bool: an environment's reply, which the model reads but is not trained on
    trajectories: list = None  # N strings: the whole conversation after the prompt, replies included
    env_state: list = None  # N dicts: each row's environment's state() (numbers: reward fields, env/ metrics)
    examples: list = None  # N dicts: the example each row answers
    rewards: torch.Tensor = None  # (N, K) each reward fn's value for each row (train.py's collect fills it)
    reward: torch.Tensor = None  # (N,) their weighted sum, the reward that trains
    kept: torch.Tensor = None  # (N, C, V/8) uint8: the sampler's kept set at each token, a bit a vocabulary entry

    def __post_init__(self):  # without an environment the trajectory is the completion, and there is no state
        self.trajectories = self.completions if self.trajectories is None else self.trajectories
        self.env_state = [{} for _ in self.completions] if self.env_state is None else self.env_state
        self.examples = [{} for _ in self.completions] if self.examples is None else self.examples

    @property
    def input_ids(self):
        return torch.cat([self.prompt_ids, self.completion_ids], 1)  # (N, P+C)

    @property
    def attention_mask(self):  # what the model attends to: prompt, its own tokens and the tools' replies
        return torch.cat([self.prompt_mask, self.completion_mask + self.env_mask.long()], 1)  # (N, P+C)

    def reward_fields(self):
        """What reward fns may ask for by name, one value per row: the example's keys, num_tokens (the budget used:
        its own tokens and the replies it read), own_tokens, truncated (0/1), trajectory, the environment's state."""
        own = self.completion_mask.sum(1)  # (N,) its stop tokens included
        out = {k: [e[k] for e in self.examples] for k in self.examples[0]}
        out.update(num_tokens=(own + self.env_mask.sum(1)).tolist(), own_tokens=own.tolist())
        out.update(truncated=self.truncated.float().tolist(), trajectory=self.trajectories)
        return out | {k: [s[k] for s in self.env_state] for k in self.env_state[0]}

    def __getitem__(self, rows):  # the rows `rows` (a LongTensor) of every field
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return Rollout(**{k: [v[i] for i in rows.tolist()] if isinstance(v, list) else v[rows] for k, v in out.items()})


def encode_prompts(tokenizer, prompts, env=None):
    """Prompts (messages or strings) -> token-id lists (no chat template: joined by newlines); env (envs.EnvDriver): its
    tools as the template shows them. A control token's string in a message is tokenized as text."""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    out = []
    for p in prompts:
        messages, tools = ([{"role": "user", "content": p}] if isinstance(p, str) else p), {}
        if not tokenizer.chat_template:
            out.append(tokenizer("\n".join(m["content"] for m in messages), split_special_tokens=True)["input_ids"])
            continue
        if env is not None:
            messages, tools = env.render(messages)
        if any(s in str(m.get("content")) for m in messages for s in specials):
            import chat  # imported only for such a message

            out.append(chat.template_ids(tokenizer, messages, tools, specials))
            continue
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **tools)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template has its own BOS
    return out


def left_pad(seqs, pad_id):  # id lists -> (ids (B, P), mask (B, P)), padded on the left
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, P - len(s) :] = 1
    return ids, mask


def stop_token_ids(tokenizer, model):  # the tokenizer's eos and generation_config.eos_token_id's (Qwen lists two)
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def decode_dynamic(model, cache, logits, mask, u, *, sampler, stop, pad_id, env, dtype):
    """The rows' loop on the DynamicCache -> tokens, log-probs, own, reply (N, C) with holes dropped, ended (N,)"""
    (N, T), G = u.shape, u.size(0) // logits.size(0)
    done = torch.zeros(N, dtype=torch.bool, device=u.device)  # (N,) a row that stopped or used its budget
    ended = torch.zeros(N, dtype=torch.bool, device=u.device)  # (N,) a row its stop token or environment ended
    used = torch.zeros(N, dtype=torch.long, device=u.device)  # (N,) budget used: own tokens and replies fed
    cols, sets = [], []  # per step: token, log-prob, own, reply (N,) each; the kept set (N, V/8) if truncated
    cached = _cache_kwarg(model, cache)
    with torch.no_grad(), _autocast(model, dtype):  # one context for the loop: autocast casts each weight once
        logits = logits.repeat_interleave(G, 0)  # (N, V)
        cache.batch_repeat_interleave(G)
        pos = (mask.sum(1, keepdim=True) - 1).repeat_interleave(G, 0)  # (N, 1) each prompt's last position
        mask = mask.repeat_interleave(G, 0)  # (N, P)
        while True:
            scaled, kept = sampler.truncated(logits)  # (N, V); kept (N, V) bool or None
            ut = u.gather(1, used[:, None].clamp(max=T - 1)).squeeze(1)  # (N,) by the row's own count
            tok = sample_from_logits(scaled, ut) if sampler.temperature else scaled.argmax(-1)  # (N,)
            own, tok = ~done, tok.masked_fill(done, pad_id)  # (N,)
            reply = torch.zeros_like(done)  # (N,) a row fed an environment's reply token
            end = torch.isin(tok, stop) & own  # (N,) a row whose turn ends here
            if env is not None:  # a row in a reply takes the reply's next token; a waiting row a hole
                tok, own, reply, end = env.step(tok, done, end, T - 1 - used)
            fed = own | reply  # (N,)
            cols.append((tok, scaled.log_softmax(-1).gather(1, tok[:, None]).squeeze(1), own, reply))
            if kept is not None:  # the set the trainer scores under, with the token fed (a reply's) in it
                sets.append(importlib.import_module("variants").pack(kept.scatter(1, tok[:, None], True)))
            used += fed
            ended |= end
            done |= end | (used == T)
            if bool(done.all()):
                break
            # a stopped row keeps mask 1 (padding to the trainer): bf16 attention as in a run without environments
            seen = fed | done
            mask, pos = torch.cat([mask, seen[:, None].long()], 1), pos + seen[:, None]  # (N, P+t+1), (N, 1)
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, **cached, use_cache=True)
            logits = torch.where(fed[:, None], out.logits[:, -1], logits)  # a hole's row samples from its last token
    tokens, logps, own, reply = (torch.stack(c, 1) for c in zip(*cols))  # (N, steps) each
    keep = torch.sort((~(own | reply)).long(), dim=1, stable=True).indices[:, : int(used.max())]  # (N, C) holes dropped
    kept = torch.stack(sets, 1).gather(1, keep[..., None].expand(-1, -1, sets[0].size(1))) if sets else None
    return *(x.gather(1, keep) for x in (tokens, logps, own, reply)), ended, kept


@dataclass(frozen=True)
class Sampler:  # the sampler draws from logits(z), the trainer scores under it: they agree by construction
    """Sampling (rollout.Sampler): a field with a Knob is a knob of train.py, as grpo.Objective's."""

    temperature: Annotated[float, flag("> 0", "sampling temperature (0: greedy, for eval.py)")] = 1.0
    top_k: Annotated[int, Knob(">= 0", "draw among the k likeliest tokens; 0: all")] = 0
    top_p: Annotated[float, Knob("(0, 1]", "then among the likeliest whose mass reaches p (nucleus)")] = 1.0
    min_p: Annotated[float | None, Knob("[0, 1]", "then among those with p >= min_p x the top token's")] = None

    def logits(self, z):  # raw logits (..., V) -> the temperature's, fp32 (not truncated); 0 (greedy), 1: as they are
        return z.float() / self.temperature if self.temperature not in (0, 1) else z.float()

    @property
    def truncates(self):  # whether the sampler draws from a kept set
        return bool(self.top_k or self.top_p < 1 or self.min_p)

    def truncated(self, z):
        """Raw logits (N, V) -> (the sampled distribution's: -inf off the kept set, the kept set (N, V) bool or None):
        variants.kept_set's top_k, then top_p, then min_p; the likeliest token is always kept."""
        z = self.logits(z)
        if not self.truncates:
            return z, None
        kept = importlib.import_module("variants").kept_set(z, self.top_k, self.top_p, self.min_p)  # (N, V)
        return z.masked_fill(~kept, -torch.inf), kept


def sample_from_logits(logits, u):
    """Inverse CDF: one token per row from one uniform u (N,) in [0, 1), not V as multinomial; -inf: never drawn."""
    cdf = logits.softmax(-1).cumsum(-1)  # (N, V)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.size(-1) - 1).squeeze(1)


def _cache_kwarg(module, cache):  # the KV cache argument by the name the model takes: cache, else past_key_values
    for inner in module.modules():  # a wrapper whose forward takes **kwargs (peft) names it from the model inside
        names = inspect.signature(inner.forward).parameters
        if "cache" in names:
            return {"cache": cache}
        if "past_key_values" in names:
            return {"past_key_values": cache}
    return {"past_key_values": cache}


class _Cache(DynamicCache):  # keys and values in autocast's dtype, which attention reads anyway: half the memory,
    def update(self, key_states, value_states, *args, **kwargs):  # and no fp32 copy of the cache a step (BENCHMARKS)
        on = torch.is_autocast_enabled(key_states.device.type)
        dtype = torch.get_autocast_dtype(key_states.device.type) if on else key_states.dtype
        return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)


def _autocast(model, dtype):  # to `dtype` when lower than the weights' (fp32 master weights, bf16 compute)
    p = next(model.parameters())
    return torch.autocast(p.device.type, dtype=dtype, enabled=dtype not in (None, p.dtype, torch.float32))


def cast_once(device):
    """Outermost around micro-batches, a disabled autocast keeps autocast's weight casts until it ends (a CPU's)."""
    return torch.autocast(device.type, enabled=False)


def sample(
    model,
    tokenizer,
    prompts,
    group_size,
    *,
    max_new_tokens,
    stop_ids,
    sampler=Sampler(),
    generator=None,
    dtype=None,
    max_prompt_tokens=None,
    env=None,
    examples=None,
    loop=decode_dynamic,  # the decode loop: on CUDA the caller may pass decode.py's captured one
):
    """`group_size` completions per prompt: a prompt prefilled once, its KV cache repeated G times, the rows decoded
    together to a stop token or max_new_tokens (max_prompt_tokens: a prompt keeps its last). generator: one, or one per
    prompt (then no neighbour matters). env (envs.EnvDriver): an environment per row; a row it answers is fed the reply
    a token a step; a waiting row is a hole (no mask, position, budget, uniform), dropped: a wait changes no token."""
    if group_size < 1 or max_new_tokens < 1 or not sampler.temperature >= 0:
        raise ValueError(
            f"need G, max_new_tokens >= 1, temperature >= 0: {group_size, max_new_tokens, sampler.temperature}"
        )
    G = group_size
    was_training = model.training
    model.eval()  # no dropout, and HF drops the KV cache in train mode under gradient checkpointing
    device = next(model.parameters()).device
    pad_id = stop_ids[0]  # any pad id works: padding is masked everywhere
    examples = examples or [{} for _ in prompts]
    if env is not None:
        prompts = env.reset(examples, prompts, G)
    seqs = encode_prompts(tokenizer, prompts, env)
    cut = torch.tensor([max_prompt_tokens is not None and len(s) > max_prompt_tokens for s in seqs])  # (B,)
    seqs = [s[-max_prompt_tokens:] for s in seqs] if max_prompt_tokens else seqs
    ids, mask = (t.to(device) for t in left_pad(seqs, pad_id))  # (B, P)
    # one uniform per row and budget token, drawn up front (per prompt when given a generator per prompt)
    gens, rows = (generator, G) if isinstance(generator, (list, tuple)) else ([generator], ids.size(0) * G)
    u = torch.cat([torch.rand(rows, max_new_tokens, generator=g, device=g and g.device) for g in gens]).to(device)
    stop = torch.as_tensor(stop_ids, device=device)
    cache = _Cache(config=model.config)
    try:
        with torch.no_grad(), _autocast(model, dtype):  # each prompt once; its G rows share its cache
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
            kv = _cache_kwarg(model, cache)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **kv, use_cache=True, logits_to_keep=1)
        tokens, logps, own, reply, ended, kept = loop(
            model, cache, out.logits[:, -1], mask, u, sampler=sampler, stop=stop, pad_id=pad_id, env=env, dtype=dtype
        )  # (N, C) each, holes dropped; ended (N,)
    finally:
        model.train(was_training)
    tokens = tokens.masked_fill(~(own | reply), pad_id)
    is_stop = torch.isin(tokens, stop) & own  # (N, C)
    words = own & ~is_stop  # (N, C) the model's own words: its tokens, each turn's stop token left out
    completions = tokenizer.batch_decode([t[w] for t, w in zip(tokens.cpu(), words.cpu())], skip_special_tokens=True)
    trajectories, states = completions, None
    if env is not None:  # its words turn by turn, the whole conversation, the environments' states
        completions, trajectories, states = env.texts(tokens, words, reply, is_stop)
    return Rollout(
        prompt_ids=ids.repeat_interleave(G, 0),
        prompt_mask=mask.repeat_interleave(G, 0),
        completion_ids=tokens,
        completion_mask=own.long(),  # the model's own tokens, its stop token included
        truncated=~ended,  # the budget ended it (in its own words or in a reply), not its stop token or environment
        completions=completions,
        sample_logp=logps.masked_fill(~own, 0.0),
        kept=kept,
        prompt_cut=cut.repeat_interleave(G, 0).to(device),
        env_mask=reply,
        trajectories=trajectories,
        env_state=states,
        examples=[e for e in examples for _ in range(G)],
    )


def concat(rollouts):  # -> one Rollout: prompts re-padded left, completions right (masked, log-prob 0)
    out = {}
    for name in [f.name for f in fields(Rollout)]:
        parts = [getattr(r, name) for r in rollouts]  # (n_i, w_i) or (n_i,) or lists
        if parts[0] is None:
            continue
        if isinstance(parts[0], list):
            out[name] = [x for p in parts for x in p]
            continue
        w = max(x.size(1) if x.dim() > 1 else 0 for x in parts)
        left = name.startswith("prompt")  # prompts are left-padded, completions right-padded
        out[name] = torch.cat([x if x.dim() == 1 else _pad_to(x, w, left) for x in parts])
    return Rollout(**out)


def _pad_to(x, width, left):  # (n, w, ...) -> (n, width, ...): zeros on the left or the right of dim 1
    extra = (width - x.size(1), 0) if left else (0, width - x.size(1))
    return F.pad(x, (0, 0) * (x.dim() - 2) + extra)


@torch.no_grad()
def batch_logprobs(model, r, micro_batch, *, sampler=Sampler(), share=True, dtype=None, hidden=False):
    """No-grad log-probs (N, C) of a Rollout's tokens by micro-batch; hidden: final hidden states (rows, c, H) each."""
    device = r.completion_ids.device
    out = [] if hidden else torch.zeros(r.completion_ids.shape, device=device)  # (N, C)
    with _autocast(model, dtype):
        for rows, ids, mask, c, sizes, kept in micro_batches(r, micro_batch):
            if hidden:
                out.append(completion_hidden(model, ids, mask, c, share, sizes).to(device))
            else:
                out[rows, :c] = token_logprobs(
                    model, ids, mask, c, sampler=sampler, share=share, sizes=sizes, kept=kept
                )[0]
    return out


class RefStates(NamedTuple):  # the exact KL's reference: what its head makes its logits from
    head: torch.nn.Module  # its lm_head
    hidden: torch.Tensor  # its final hidden states at the rows' positions


class MicroBatch(NamedTuple):
    rows: slice  # the Rollout's rows
    ids: torch.Tensor  # (rows, w) input ids, without the columns no row of it uses
    mask: torch.Tensor  # (rows, w) their attention mask
    c: int  # the completion columns kept
    sizes: tuple  # (real targets, distinct prompts): its passes read nothing from the device
    kept: torch.Tensor | None  # (rows, c, V/8): the sampler's kept sets (None: the whole vocabulary)


def micro_batches(r, size):
    """A MicroBatch per `size` rows of a Rollout, unused columns cut (cumsum positions keep); all in one device read."""
    mask, P = r.attention_mask, r.prompt_ids.size(1)  # (N, P+C)
    new = _new_prompts(r.prompt_ids, r.prompt_mask)  # (N,)
    cols = torch.arange(mask.size(1), device=mask.device)  # (P+C,)
    per = []  # a slice's first and last used column (prompts left-padded, completions right-padded), its sizes
    for i in range(0, mask.size(0), size):
        used = mask[i : i + size].any(0)  # (P+C,)
        lo, hi = torch.where(used, cols, mask.size(1)).min(), torch.where(used, cols, -1).max() + 1
        per.append(torch.stack([lo, hi, mask[i : i + size, P:].sum(), new[i + 1 : i + size].sum() + 1]))
    for i, (lo, hi, targets, prompts) in zip(range(0, mask.size(0), size), torch.stack(per).tolist()):
        rows = slice(i, i + size)
        kept = None if r.kept is None else r.kept[rows, : hi - P]
        yield MicroBatch(rows, r.input_ids[rows, lo:hi], mask[rows, lo:hi], hi - P, (targets, prompts), kept)


# --- teacher-forced log-probs
class TokenLogp(torch.autograd.Function):
    """log p_t = z_t - logZ of targets t (n,) under fp32 logits z (n, V), temperature applied, and H = logZ - E_p[z] if
    with_entropy, else None. Backward reads z once: d log p_t / dz = onehot(t) - p, dH / dz = -p (z - E_p[z]); a None
    grad costs nothing, a -inf logit gets 0, not nan. logZ, E_p[z] stay on ctx for a checkpoint's recompute."""

    @staticmethod
    def forward(ctx, z, t, with_entropy):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(z, t)
        m = z.amax(-1, keepdim=True)  # (n, 1)
        d = z - m  # (n, V)
        e = d.exp()  # (n, V)
        s = e.sum(-1)  # (n,)
        ctx.logz, ctx.ez = m.squeeze(1) + s.log(), None  # (n,)
        if with_entropy:  # E_p[z] = m + sum_v e_v d_v / s, a -inf d (e = 0) counting 0
            ctx.ez = m.squeeze(1) + e.mul_(d.clamp_(min=torch.finfo(d.dtype).min)).sum(-1) / s
        logp = z.gather(1, t[:, None]).squeeze(1) - ctx.logz
        return logp, None if ctx.ez is None else ctx.logz - ctx.ez

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        z, t = ctx.saved_tensors
        g = torch.zeros_like(ctx.logz) if g_logp is None else g_logp  # (n,)
        p = (z - ctx.logz[:, None]).exp_()  # (n, V)
        w = -g[:, None]  # (n, 1), with the entropy (n, V): -g_logp - g_ent (z - E_p[z])
        if g_ent is not None:
            w = torch.where(p > 0, z - ctx.ez[:, None], 0.0).mul_(-g_ent[:, None]).add_(w)
        return p.mul_(w).scatter_add_(1, t[:, None], g[:, None]), None, None


def head_logprobs(lm_head, hidden, targets, *, sampler=Sampler(), with_entropy=False, ref=None, kept=None):
    """hidden (n, H), targets (n,) -> logp, entropy or None, kl or None (n,) under sampler.logits of `lm_head`, in
    checkpointed chunks of (chunk, V) logits: no (n, V) tensor. ref: a RefStates (hidden (n, H)) for variants.full_kl;
    kept (n, V/8): the sampler's kept sets, the distribution renormalised over each (the entropy too)."""
    budget = 64 << 20 if hidden.device.type == "cpu" else 1 << 30  # a chunk's fp32 logits: a CPU's cache, few calls
    size = max(16, budget // (4 * lm_head.weight.size(0)))

    def chunk(h, t, h_ref, k):
        z = sampler.logits(lm_head(h))  # (n_c, V)
        if k is not None:  # the sampler's set, never the trainer's own: a token it ranks lower is not -inf
            z = z.masked_fill(~importlib.import_module("variants").unpack(k, z.size(-1)), -torch.inf)
        logp, ent = TokenLogp.apply(z, t, with_entropy)  # (n_c,) each
        if h_ref is None:
            return logp, ent, None
        with torch.no_grad():
            z_ref = sampler.logits(ref.head(h_ref))  # (n_c, V)
        return logp, ent, importlib.import_module("variants").full_kl(z, z_ref)

    out, grad = [], torch.is_grad_enabled() and hidden.requires_grad
    for i in range(0, hidden.size(0), size):
        a = (hidden[i : i + size], targets[i : i + size], None if ref is None else ref.hidden[i : i + size])
        a += (None if kept is None else kept[i : i + size],)
        if grad:  # backward reruns the chunk instead of keeping its logits
            out.append(checkpoint(chunk, *a, use_reentrant=False))
        else:
            out.append(chunk(*a))
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*out))


def _check_outer(model):  # refuse what only model(...) would run, rather than compute something else without it
    name = type(model).__name__
    cfg = getattr(model, "active_peft_config", None)
    c = model.config
    where = "which the log-prob pass does not run (it calls model.get_decoder() and the lm_head module)"
    if (model._forward_hooks or model._forward_pre_hooks) and not hasattr(model, "unshard"):  # FSDP2's own
        raise ValueError(f"{name} has a forward hook on the whole model, {where}: register it on those")
    if not type(model).forward.__module__.startswith(("transformers.", "peft.", "torch.distributed.")):
        raise ValueError(f"{name} overrides forward(), {where}: make the change in the decoder or the lm_head")
    if cfg is not None and cfg.is_prompt_learning:
        raise ValueError(f"prompt / prefix tuning adds virtual tokens in {name}.forward, {where}")
    if getattr(c, "final_logit_softcapping", None) or getattr(c, "logits_scaling", 1.0) != 1.0:
        raise ValueError(f"{c.model_type}: logit softcapping/scaling is not applied by the log-prob pass")


def _root_gathered(model):  # FSDP2's root (embeddings, norm, head) gathered by scale.py; else there is nothing to do
    return importlib.import_module("scale").root_gathered(model) if hasattr(model, "unshard") else nullcontext()


def _new_prompts(prompt_ids, prompt_mask):  # (N,) True where the prompt (ids, mask) is not the previous row's
    ids = prompt_ids * prompt_mask  # (N, P) padding as 0, whatever id padded it (concat's and sample()'s differ)
    same = ((ids[1:] == ids[:-1]) & (prompt_mask[1:] == prompt_mask[:-1])).all(1)  # (N-1,)
    return torch.cat([same.new_ones(1), ~same])


def _hidden(model, ids, mask, C, share, sizes=None):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P+C) the positions sample() used
    decoder = model.get_decoder()
    if not share or _checkpointing(model):  # one forward over whole rows; position t predicts token t+1
        return decoder(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, -C - 1 : -1]
    # each distinct prompt once, into the model's own KV cache (with grad), then every completion on top of it
    new = _new_prompts(ids[:, :-C], mask[:, :-C])  # (N,)
    first = torch.nonzero_static(new, size=sizes[1] if sizes else int(new.sum())).squeeze(1)  # (B,)
    which = new.long().cumsum(0) - 1  # (N,)
    cache = DynamicCache(config=model.config)
    cached = _cache_kwarg(decoder, cache)
    h_prompt = decoder(
        input_ids=ids[first, :-C],
        attention_mask=mask[first, :-C],
        position_ids=pos[first, :-C],
        **cached,
        use_cache=True,
    ).last_hidden_state[:, -1:]  # (B, 1, H)
    cache.batch_select_indices(which)  # (N, heads, P, d) per layer
    h = decoder(
        input_ids=ids[:, -C:], attention_mask=mask, position_ids=pos[:, -C:], **cached, use_cache=True
    ).last_hidden_state  # (N, C, H)
    return torch.cat([h_prompt[which], h[:, :-1]], 1)  # (N, C, H): the prompt's last state predicts token 0


def completion_hidden(model, input_ids, attention_mask, num_completion, share=True, sizes=None):
    """Final hidden states (N, C, H) at the positions that predict the last C = num_completion tokens."""
    _check_outer(model)
    device = next(model.parameters()).device
    with _root_gathered(model):
        return _hidden(model, input_ids.to(device), attention_mask.to(device), num_completion, share, sizes)


def token_logprobs(
    model, ids, mask, C, *, sampler=Sampler(), with_entropy=False, ref=None, share=True, sizes=None, kept=None
):
    """Teacher-forced log-probs of each row's last C tokens: ids, mask (N, P+C) -> logp, entropy or None, kl or None,
    (N, C) each, 0 where mask is 0. The decoder runs once (share: a distinct prompt once), the lm_head in chunks. ref: a
    RefStates (hidden (N, C, H)) for the exact KL; sizes: micro_batches', then no device read; kept (N, C, V/8)."""
    _check_outer(model)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    with _root_gathered(model):
        hidden = _hidden(model, ids, mask, C, share, sizes).flatten(0, 1)  # (N*C, H)
        real = mask[:, -C:].flatten().bool()  # (N*C,) positions whose target is a real token
        at = torch.nonzero_static(real, size=sizes[0] if sizes else int(real.sum())).squeeze(1)  # (n,)
        ref = None if ref is None else ref._replace(hidden=ref.hidden.flatten(0, 1)[at])  # (n, H)
        head, targets = model.get_output_embeddings(), ids[:, -C:].flatten()[at]  # (n,)
        kept = None if kept is None else kept.to(device).flatten(0, 1)[at]  # (n, V/8)
        out = head_logprobs(head, hidden[at], targets, sampler=sampler, with_entropy=with_entropy, ref=ref, kept=kept)
    return tuple(None if v is None else v.new_zeros(mask.size(0) * C).index_copy(0, at, v).view(-1, C) for v in out)


def _checkpointing(model):  # transformers drops the KV cache in training under gradient checkpointing
    return model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def sharing_problem(model, dtype=None):
    """None if a prompt run once into the KV cache gives what whole rows give (on a 2-row probe), else why not."""
    _check_outer(model)  # its own one-line refusals first
    if _checkpointing(model):
        return "gradient checkpointing: transformers drops the KV cache in training"
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]], device=device) % model.config.vocab_size
    mask = torch.ones_like(ids)
    was_training = model.training
    try:
        with torch.no_grad(), _autocast(model, dtype):
            model.eval()
            a, b = (completion_hidden(model, ids, mask, 2, share=s).float() for s in (True, False))  # (2, 2, H)
    except Exception as e:  # a module that cannot take a cache
        return f"the model's forward with a KV cache failed ({type(e).__name__}: {str(e)[:80]})"
    finally:
        model.train(was_training)
    tol = 1e-4 if dtype in (None, torch.float32) else 3e-2  # fp32 reassociation / bf16's 8-bit mantissa
    if not (a - b).abs().max() <= tol * b.abs().max().clamp(min=1):
        return "the model gives other hidden states when its prompt comes from its KV cache"
    return None
