"""The decode loop over a static KV cache, and on CUDA the whole decode step (the model's forward on one token a row,
the draw from the pre-drawn uniforms, the rows' bookkeeping) captured once as a CUDA graph and replayed per token, as
gpt-fast does, through the model's own modules: the sampler and the trainer run one network, one set of weights.

The cache is (rows, kv heads, L, head dim) a layer, L = prompt + budget + a scratch column, allocated once a call:
a row writes its k-th token at its own column P + k, so a row waiting on its environment (a hole) or a finished row
writes the scratch column, which no row attends to, and the cache never outgrows the budget. Every buffer the step
reads or writes has a fixed address; the host reads `done` every CHECK_EVERY tokens, not every token. A start-up probe
(problem()) decodes a few tokens captured and eagerly, and the sampler falls back to rollout.decode_dynamic in one
line where they differ (a fork's hook or a module whose Python runs each call, which a replay would not rerun)."""

import importlib
import itertools
import weakref
from dataclasses import dataclass
from functools import partial

import torch

import rollout

CHECK_EVERY = 8  # tokens between the host's reads of `done`: a finished row's extra steps are masked
SCRATCH = 1  # cache columns past the budget: where a row that feeds nothing this step writes
_verdicts = weakref.WeakKeyDictionary()  # model -> None or why its step is not captured (probed once)


class RowCache:
    """The keys and values of every layer, preallocated; update() writes each row's one new column at col (N,).
    The model's attention calls update(key, value, layer) and reads the whole cache, masked by the 4D mask given."""

    def __init__(self, keys, values, col):
        self.keys, self.values, self.col = keys, values, col  # [(N, kv heads, L, d)] x layers, (N,)
        self.rows = torch.arange(col.numel(), device=col.device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.col] = key_states[:, :, 0].to(keys.dtype)  # (N, kv heads, d): a row's own column
        values[self.rows, :, self.col] = value_states[:, :, 0].to(values.dtype)
        return keys, values


@dataclass
class Step:
    """The decode step's buffers: a captured step reads and writes exactly these, in place."""

    tok: torch.Tensor  # (N,) long: the token each row drew or was fed last
    fed: torch.Tensor  # (N,) bool: the row took that token (its own or an environment's)
    used: torch.Tensor  # (N,) long: budget used, own tokens and replies
    done: torch.Tensor  # (N,) bool: stopped or out of budget
    ended: torch.Tensor  # (N,) bool: its stop token or environment ended it
    logits: torch.Tensor  # (N, V): each row's last real logits (a hole draws again from its own)
    keep: torch.Tensor  # (N, L) bool: the cache columns each row attends to
    first: torch.Tensor  # (N,) long: each row's prompt length, the position of its first completion token
    u: torch.Tensor  # (N, T) a uniform per row and budget token
    out: tuple  # token, log-prob, own, reply (N, T + 1): at each row's k-th fed token, column k; T a scratch column
    cache: RowCache
    P: int  # the cache's first completion column
    kept: torch.Tensor | None  # (N, T + 1, V/8) uint8: the sampler's kept set at each output column (None: all)


def _start(cache, logits, mask, u, sampler):
    """Step buffers from a prefill: `cache` (a DynamicCache over B prompts) copied G times into a static one."""
    (B, P), (N, T), V = mask.shape, u.shape, logits.size(-1)
    G, device = N // B, u.device
    L = -(-(P + T + SCRATCH) // 16) * 16  # whole 16-column blocks: the attention kernels' alignment
    keys, values = [], []
    for layer in cache.layers:
        for src, dst in ((layer.keys, keys), (layer.values, values)):
            buf = src.new_zeros(N, src.size(1), L, src.size(3))  # (N, kv heads, L, d)
            buf[:, :, :P] = src.repeat_interleave(G, 0)
            dst.append(buf)
    col = torch.zeros(N, dtype=torch.long, device=device)
    keep = torch.zeros(N, L, dtype=torch.bool, device=device)
    keep[:, :P] = mask.repeat_interleave(G, 0).bool()
    flag = torch.zeros(N, dtype=torch.bool, device=device)
    out = tuple(
        torch.zeros(N, T + 1, dtype=d, device=device) for d in (torch.long, torch.float, torch.bool, torch.bool)
    )
    return Step(
        tok=col.clone(),
        fed=flag.clone(),
        used=col.clone(),
        done=flag.clone(),
        ended=flag.clone(),
        logits=logits.repeat_interleave(G, 0),
        keep=keep,
        first=mask.sum(1).repeat_interleave(G, 0),
        u=u,
        out=out,
        cache=RowCache(keys, values, col),
        P=P,
        kept=torch.zeros(N, T + 1, -(-V // 8), dtype=torch.uint8, device=device) if sampler.truncates else None,
    )


def feed(model, s):
    """The model's forward on each row's last token, at its own cache column and position; a row that took none
    (a hole, a finished row) writes the scratch column and keeps its logits."""
    T = s.u.size(1)
    s.cache.col.copy_(torch.where(s.fed, s.P + s.used - 1, s.keep.size(1) - 1))  # (N,)
    s.keep[:, s.P : s.P + T] = torch.arange(T, device=s.used.device) < s.used[:, None]  # (N, T) its own tokens
    mask = s.keep[:, None, None, :]  # (N, 1, 1, L): given whole, the model builds no mask (and reads no host value)
    if model.config._attn_implementation == "eager":  # eager attention adds its mask to the scores
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float).min)
    pos = (s.first + s.used - 1).clamp(min=0)[:, None]  # (N, 1)
    cached = rollout._cache_kwarg(model, s.cache)
    out = model(input_ids=s.tok[:, None], attention_mask=mask, position_ids=pos, **cached, use_cache=True)
    s.logits.copy_(torch.where(s.fed[:, None], out.logits[:, -1], s.logits))  # (N, V)


def draw(s, sampler, stop, pad_id, env=None):
    """Each row's next token from its logits and its next uniform (an environment may replace it: a reply's token,
    or a hole), written at the row's own output column; the bookkeeping of rollout.decode_dynamic, in place."""
    T = s.u.size(1)
    scaled, kept = sampler.truncated(s.logits)  # (N, V); kept (N, V) bool or None
    ut = s.u.gather(1, s.used[:, None].clamp(max=T - 1)).squeeze(1)  # (N,) by the row's own count
    tok = rollout.sample_from_logits(scaled, ut) if sampler.temperature else scaled.argmax(-1)  # (N,)
    own, tok = ~s.done, tok.masked_fill(s.done, pad_id)  # (N,)
    reply = torch.zeros_like(own)
    end = (tok[:, None] == stop).any(1) & own  # (N,)
    if env is not None:  # host code: this part of the step runs eagerly
        tok, own, reply, end = env.step(tok, s.done, end, T - 1 - s.used)
    fed = own | reply  # (N,)
    logp = scaled.log_softmax(-1).gather(1, tok[:, None]).squeeze(1)  # (N,)
    at = torch.where(fed, s.used, T)[:, None]  # (N, 1) its next output column, else the scratch one
    for buf, x in zip(s.out, (tok, logp, own, reply)):
        buf.scatter_(1, at, x[:, None])
    if kept is not None:  # the set the trainer scores under, with the token fed (a reply's) in it
        bits = importlib.import_module("variants").pack(kept.scatter(1, tok[:, None], True))  # (N, V/8)
        s.kept.scatter_(1, at[..., None].expand(-1, -1, bits.size(1)), bits[:, None])
    s.tok.copy_(tok)
    s.fed.copy_(fed)
    s.used += fed
    s.ended |= end
    s.done |= end | (s.used == T)


def step(model, s, sampler, stop, pad_id):
    """One whole decode step, no environment: what is captured (and what torch.compile(fullgraph=True) traces)."""
    feed(model, s)
    draw(s, sampler, stop, pad_id)


def _finish(s):
    C = int(s.used.max())
    return *(buf[:, :C] for buf in s.out), s.ended, None if s.kept is None else s.kept[:, :C]


def _autocast(model, dtype):  # autocast's cache of weight casts off: a captured cast reads the live weights
    p = next(model.parameters())
    return torch.autocast(
        p.device.type, dtype=dtype, enabled=dtype not in (None, p.dtype, torch.float32), cache_enabled=False
    )


def decode_static(model, cache, logits, mask, u, *, sampler, stop, pad_id, env, dtype):
    """DECODE["static"]: decode_dynamic's loop on a static cache, each step run eagerly."""
    s = _start(cache, logits, mask, u, sampler)
    with torch.no_grad(), _autocast(model, dtype):
        draw(s, sampler, stop, pad_id, env)
        while not bool(s.done.all()):
            feed(model, s)
            draw(s, sampler, stop, pad_id, env)
    return _finish(s)


def decode_graph(model, cache, logits, mask, u, *, sampler, stop, pad_id, env, dtype):
    """DECODE["graph"]: the static cache's step captured as a CUDA graph and replayed per token; with an
    environment the forward alone is captured and the draw runs eagerly around the environment's host code. Where
    problem() finds the step not capturable: rollout.decode_dynamic, said once per model."""
    if model not in _verdicts:
        _verdicts[model] = problem(model, dtype)
        print(f"decode: eager on a dynamic cache: {_verdicts[model]}" if _verdicts[model] else "decode: CUDA graph")
    fn = DECODE["dynamic"] if _verdicts[model] else _replayed
    return fn(model, cache, logits, mask, u, sampler=sampler, stop=stop, pad_id=pad_id, env=env, dtype=dtype)


def _replayed(model, cache, logits, mask, u, *, sampler, stop, pad_id, env, dtype):
    s = _start(cache, logits, mask, u, sampler)
    with torch.no_grad(), _autocast(model, dtype):
        draw(s, sampler, stop, pad_id, env)
        graph = _capture(model, s, sampler, stop, pad_id, env)  # after two real steps (the warm-up)
        for t in itertools.count():  # without an environment each step takes a token of every row left
            if (env is not None or t % CHECK_EVERY == 0) and bool(s.done.all()):
                break
            graph.replay()
            if env is not None:
                draw(s, sampler, stop, pad_id, env)
    return _finish(s)


def _capture(model, s, sampler, stop, pad_id, env):
    """Two real steps on a side stream (lazy inits, cuBLAS's workspace), then the step captured; returns the graph."""
    body = partial(feed, model, s)  # with an environment the draw runs eagerly, around its host code
    if env is None:
        body = partial(step, model, s, sampler, stop, pad_id)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
            if env is not None:
                draw(s, sampler, stop, pad_id, env)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a tool's thread may use CUDA meanwhile
        body()
    return graph


ON_CUDA = "graph"  # train.py's and eval.py's loop on a CUDA device: a key of DECODE (a benchmark or a fork sets it)
DECODE = {  # rollout.sample(loop=...): the decode loops by name
    "dynamic": rollout.decode_dynamic,  # the model's DynamicCache, a column a step (the loop on a CPU)
    "static": decode_static,  # a preallocated cache written in place, each step run eagerly
    "graph": decode_graph,  # that step captured once as a CUDA graph and replayed per token
}


def on_cuda(*args, **kwargs):  # the loop train.py and eval.py give rollout.sample on a CUDA device
    return DECODE[ON_CUDA](*args, **kwargs)


def problem(model, dtype):
    """None where the captured step computes what the eager step computes, else the one-line reason it is not used.
    A 2-prompt, 4-row probe of 12 tokens: the static cache against the model's own (fp32: the same tokens, log-probs
    within reordered sums), the replay twice against the eager static step in `dtype` (the same kernels)."""
    cfg, device = model.config, next(model.parameters()).device
    if cfg._attn_implementation not in ("sdpa", "eager"):
        return f"attention {cfg._attn_implementation!r} takes no 4D mask"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "layers other than full attention (a sliding window): the static cache holds every column"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return f"a forward hook on {name or 'the model'} runs Python each call, which a replay would not rerun"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook runs Python each call, which a replay would not rerun"
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    try:
        ref, static = (_probe(model, fn, None) for fn in (DECODE["dynamic"], decode_static))
        eager, *replays = (_probe(model, fn, dtype) for fn in (decode_static, _replayed, _replayed))
    except Exception as e:  # a module that cannot run on a static cache, or be captured
        return f"the step failed on a static cache or in capture ({type(e).__name__}: {str(e)[:80]})"
    if not _same(static, ref, 1e-4):
        return "the static cache gives other tokens or log-probs than the model's own cache"
    if not all(_same(r, eager, 1e-3) for r in replays):
        return "the captured step gives other tokens or log-probs than the eager step"
    return None


def _same(run, ref, tol):  # the same tokens, log-probs within tol of the largest
    return torch.equal(run[0], ref[0]) and (run[1] - ref[1]).abs().max() <= tol * ref[1].abs().max().clamp(min=1)


def _probe(model, fn, dtype):
    """fn (a DECODE entry) on two prompts x 2 rows, 12 tokens, no stop token -> tokens, log-probs, own, reply, ended"""
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4], [0, 5, 6, 7]], device=device) % model.config.vocab_size
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]], device=device)
    u = torch.rand(4, 12, generator=torch.Generator().manual_seed(0)).to(device)
    cache = rollout._Cache(config=model.config)
    with torch.no_grad(), rollout._autocast(model, dtype):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cached = rollout._cache_kwarg(model, cache)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cached, use_cache=True)
    stop = torch.tensor([-1], device=device)  # no stop token: every row decodes its whole budget
    return fn(
        model, cache, out.logits[:, -1], mask, u, sampler=rollout.Sampler(), stop=stop, pad_id=0, env=None, dtype=dtype
    )
