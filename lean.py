"""
Lean passes for Llama-style causal LMs (Llama, SmolLM2, Qwen2): an accelerator behind `--lean`.

rollout.py is the plain path, through the model's own modules. This file reads the weights directly
instead, which is faster on CPU but sees nothing a fork changed in the modules; so every entry point
first runs check(model), which passes only for modules exactly as transformers defines them, and
refuses anything else with the reason. Drop-ins, with rollout.py's signatures:
- token_logprobs / completion_hidden: the teacher-forced forward (hidden_states) with gradients.
  Rows that share a prompt run it once and attend to its keys/values. Each layer is two autograd
  Functions (norm + q/k/v; residual + norm + MLP) plus o_proj, which keep only what their backward
  cannot cheaply recompute, and cast the fp32 weights to the autocast dtype again in backward instead
  of holding a bf16 copy. The LM head is one Function with a hand-written backward (_HeadLogprobs).
  Padding after a row's stop token is left out; widths are rounded so matmul shapes recur.
- LeanDecoder: the decode step of rollout.sample. A preallocated KV cache, q/k/v and gate/up as one
  matmul each, and on CPU the bf16 weights packed once per rollout for oneDNN.
The tests compare values and gradients with the model's own forward.
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import rollout

# -----------------------------------------------------------------------------
# check: lean computes exactly what the model's own forward computes, or says why not

def _known():
    from transformers.activations import SiLUActivation
    from transformers.models.llama import modeling_llama as L
    from transformers.models.qwen2 import modeling_qwen2 as Q
    classes = {torch.nn.Linear, torch.nn.Embedding, torch.nn.ModuleList, SiLUActivation}
    for m, p in ((L, "Llama"), (Q, "Qwen2")):
        classes |= {getattr(m, p + s) for s in ("ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RMSNorm",
                                                "RotaryEmbedding")}
    # the methods as the library defines them, to see a class-level replacement later
    return {c: (c.forward, c.__call__) for c in classes}


KNOWN = _known()
ROOTS = {c for c in KNOWN if c.__name__ in ("LlamaForCausalLM", "Qwen2ForCausalLM")}
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# gradient checkpointing puts this hook on the input embeddings; it only marks their output as needing
# grad, and lean calls that module itself (hidden_states, LeanDecoder.step), so the hook runs there too
REQUIRE_GRADS = ("transformers.modeling_utils",
                 "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads")


def _hooked(m):
    """Any hook on m but that one."""
    return any((getattr(f, "__module__", None), getattr(f, "__qualname__", None)) != REQUIRE_GRADS
               for h in HOOKS for f in (getattr(m, h, None) or {}).values())


def check(model):
    """(ok, reason): ok only when lean's passes compute exactly what the model's forward computes.

    Every module's class must be one lean knows (Llama / Qwen2 layers, plain nn.Linear / nn.Embedding),
    with its forward as the library wrote it, no hook on any module, plain floating-point parameters,
    full attention in every layer, no attention dropout while training, SDPA or eager attention.
    Anything else (LoRA, a hook, a swapped activation, a Linear subclass, quantised weights, ...) makes
    the caller use the plain path in rollout.py. Cheap: one walk over the modules and parameters.
    """
    if type(model) not in ROOTS:
        return False, f"{type(model).__name__} is not a plain LlamaForCausalLM / Qwen2ForCausalLM"
    cfg = model.config
    if cfg.hidden_act != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return False, f"hidden_act={cfg.hidden_act!r}, pretraining_tp={getattr(cfg, 'pretraining_tp', 1)}"
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_scaling", 1.0) != 1.0:
        return False, "logit softcapping / scaling"
    if cfg._attn_implementation not in ("sdpa", "eager"):
        return False, f"attention implementation {cfg._attn_implementation!r} (lean reproduces sdpa / eager)"
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False, "sliding-window attention"
    if any(getattr(torch.nn.modules.module, "_global" + h) for h in HOOKS):  # backward ones change gradients
        return False, "a global module hook is registered"
    for name, m in model.named_modules():
        name = name or type(m).__name__
        cls = type(m)
        if cls not in KNOWN:
            return False, f"{name} is a {cls.__module__}.{cls.__name__}"
        if (cls.forward, cls.__call__) != KNOWN[cls] or "forward" in vars(m) or "__call__" in vars(m):
            return False, f"{name}: forward replaced"
        if _hooked(m):
            return False, f"{name} has a hook"
        if getattr(m, "sliding_window", None) is not None:
            return False, f"{name} uses sliding-window attention"
        if m.training and getattr(m, "attention_dropout", 0) > 0:
            return False, f"{name}: attention dropout {m.attention_dropout} in train mode"
    for name, p in model.named_parameters():
        if type(p) is not torch.nn.Parameter or type(p.data) is not torch.Tensor or not p.is_floating_point():
            return False, f"parameter {name} is a {type(p.data).__name__} of {p.dtype}"
    return True, "Llama / Qwen2 modules as the library defines them"


def select(mode, model, device):
    """--lean {auto,on,off} -> (use lean?, the line to print). auto: on where the check passes and the device
    is a CPU, the only place it has been measured. on with a failing check raises ValueError(the reason)."""
    if mode == "off":
        return False, "lean: off (--lean off)"
    ok, why = check(model)
    if ok and mode == "auto" and device.type != "cpu":
        ok, why = False, f"auto uses it on CPU, where it is measured; --lean on to use it on {device.type}"
    if mode == "on" and not ok:
        raise ValueError(f"--lean on: lean cannot reproduce this model ({why}); use --lean auto or off")
    return ok, "lean: on" if ok else f"lean: off ({why})"


def _guard(model):
    ok, why = check(model)
    if not ok:
        raise ValueError(f"lean cannot reproduce this model ({why}); use the plain path in rollout.py")

# -----------------------------------------------------------------------------
# drop-ins for rollout.py: the same signatures


def shared_prompt_rows(group_size, micro_batch):
    """Rows per prompt inside each micro-batch of G-row groups, for group_size= below: G when
    micro-batches hold whole groups, the micro-batch when it lies inside one group, else 1."""
    G, mb = group_size, micro_batch
    return G if mb % G == 0 else mb if G % mb == 0 else 1


def _round_shapes(input_ids, attention_mask, num_completion):
    """Prompt and completion widths padded (masked) to multiples of 16, so matmul shapes recur between
    steps: on CPU every new shape makes oneDNN build and cache new kernels."""
    C = num_completion + -num_completion % 16
    left = -(input_ids.size(1) - num_completion) % 16
    pad = lambda t: F.pad(t, (left, C - num_completion))
    return pad(input_ids), pad(attention_mask), C


def completion_hidden(model, input_ids, attention_mask, num_completion, group_size=1):
    """rollout.completion_hidden through hidden_states (each shared prompt run once)."""
    _guard(model)
    device = next(model.parameters()).device
    ids, mask, C = _round_shapes(input_ids.to(device), attention_mask.to(device), num_completion)
    return hidden_states(model, ids, mask, C, group_size)[:, :num_completion]  # (N, C, H)


def token_logprobs(model, input_ids, attention_mask, num_completion, temperature=1.0, with_entropy=False,
                   chunk_size=None, out_device=None, group_size=1, ref=None):
    """rollout.token_logprobs through hidden_states and the fused head (_HeadLogprobs); with ref (the exact
    KL) the head is rollout.head_logprobs, whose chunks autograd differentiates."""
    _guard(model)
    device = next(model.parameters()).device
    out_device = out_device or input_ids.device
    n_out = num_completion
    ids, mask, C = _round_shapes(input_ids.to(device), attention_mask.to(device), n_out)
    hidden = hidden_states(model, ids, mask, C, group_size)  # (N, C, H)
    real = mask[:, -C:].bool()  # (N, C)
    keep = token_index(real)  # (n,) real targets, topped up to a multiple of 32 (recurring shapes)
    N, _, H = hidden.shape
    hidden, targets = hidden.reshape(N * C, H).index_select(0, keep), ids[:, -C:].reshape(N * C)[keep]
    head = model.get_output_embeddings()
    if ref is not None:
        ref_h = F.pad(ref[1], (0, 0, 0, C - n_out)).reshape(N * C, H).index_select(0, keep)
        logp, ent, kl = rollout.head_logprobs(head, hidden, targets, temperature, with_entropy, chunk_size,
                                              (ref[0], ref_h))
    else:
        if chunk_size is None:  # a chunk's fp32 logits under 24 MiB on CPU: glibc reuses such blocks
            chunk_size = max(16, (24 << 20) // (4 * head.weight.size(0))) if device.type == "cpu" else 1024
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else head.weight.dtype
        logp, ent = _HeadLogprobs.apply(hidden, head.weight, head.bias, targets, temperature, with_entropy,
                                        chunk_size, dtype)
        kl = None
    at = lambda t: None if t is None else t.new_zeros(N * C).index_copy(0, keep, t).view(N, C).masked_fill(~real, 0)
    return tuple(None if t is None else at(t)[:, :n_out].to(out_device) for t in (logp, ent, kl))  # (N, C) each


# -----------------------------------------------------------------------------
# the teacher-forced forward, with gradients

def _norm_fwd(x, w, eps, dtype):
    """The HF RMSNorm (weight * (x / rms(x)) in x's dtype, statistics in fp32), cast to `dtype` -> (out, 1/rms)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 as HF (float64 stays: gradcheck)
    r = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # (..., 1)
    return _norm_apply(x, w, r, dtype), r


def _norm_apply(x, w, r, dtype):
    """The norm's output from 1/rms: in the forward, and again in backward (the same ops, the same bits)."""
    return (w * (x.to(r.dtype) * r).to(x.dtype)).to(dtype)


def _norm_bwd(x, w, r, g):
    """With u = g * w and n = x / rms: dx = (u - n * mean(u * n)) / rms, dw = sum over tokens of g * n."""
    n, g = x.to(r.dtype) * r, g.to(r.dtype)
    u = g * w.to(r.dtype)
    gx = (u - n * (u * n).mean(-1, keepdim=True)).mul_(r)
    return gx.to(x.dtype), (g * n).flatten(0, -2).sum(0).to(w.dtype)


def _linear_bwd(g, x, w, has_bias, dtype):
    """Gradients of x @ w.T + b for output gradient g -> (gx in g's dtype, gw in w's dtype, gb fp32 or None)."""
    g2 = g.flatten(0, -2)
    gw = (g2.t() @ x.flatten(0, -2)).to(w.dtype)
    return g @ w.to(dtype), gw, g2.sum(0, dtype=torch.float32) if has_bias else None


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


class _Norm(torch.autograd.Function):
    """RMSNorm (_norm_fwd); saves x and 1/rms, recomputes x / rms in backward."""

    @staticmethod
    def forward(ctx, x, w, eps, dtype):
        out, r = _norm_fwd(x, w, eps, dtype)
        ctx.save_for_backward(x, w, r)
        return out

    @staticmethod
    def backward(ctx, g):
        return *_norm_bwd(*ctx.saved_tensors, g), None, None


class _Linear(torch.autograd.Function):
    """x @ w.T + b in `dtype`; saves x and the fp32 weight, and casts it again in backward."""

    @staticmethod
    def forward(ctx, x, w, b, dtype):
        ctx.save_for_backward(x, w)
        ctx.dtype, ctx.has_bias = dtype, b is not None
        return F.linear(x, w.to(dtype), _cast(b, dtype))

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return *_linear_bwd(g, x, w, ctx.has_bias, ctx.dtype), None


class _NormLinears(torch.autograd.Function):
    """RMSNorm of x, then linears of it (the attention's q, k, v): (x, norm w, eps, dtype, w1, b1, w2,
    b2, ...) -> outputs. Saves x and 1/rms and recomputes the norm's output in backward, instead of
    keeping it: x is the layer input, which the layer's _AddNormMLP keeps anyway."""

    @staticmethod
    def forward(ctx, x, nw, eps, dtype, *wb):
        h, r = _norm_fwd(x, nw, eps, dtype)
        ctx.save_for_backward(x, nw, r, *wb[0::2])
        ctx.dtype, ctx.has_bias = dtype, [b is not None for b in wb[1::2]]
        return tuple(F.linear(h, w.to(dtype), _cast(b, dtype)) for w, b in zip(wb[0::2], wb[1::2]))

    @staticmethod
    def backward(ctx, *gs):
        x, nw, r, *ws = ctx.saved_tensors
        h, gh, grads = _norm_apply(x, nw, r, ctx.dtype), 0, []
        for g, w, has_bias in zip(gs, ws, ctx.has_bias):
            gx, gw, gb = _linear_bwd(g, h, w, has_bias, ctx.dtype)
            gh, grads = gh + gx, grads + [gw, gb]
        return *_norm_bwd(x, nw, r, gh), None, None, *grads


class _AddNormMLP(torch.autograd.Function):
    """The second half of a layer: xm = x + a (the attention output), out = xm + mlp(norm(xm)), with
    mlp(h) = down(silu(gate(h)) * up(h)). Saves x, a, 1/rms, gate(h) and up(h): the fp32 xm and the
    norm's output are recomputed (the same ops, the same bits), silu(gate) * up too.

    d silu(s) / ds = sig * (1 + s * (1 - sig)), sig = sigmoid(s).
    """

    @staticmethod
    def forward(ctx, x, a, nw, eps, wg, bg, wu, bu, wd, bd, dtype):
        xm = x + a
        h, r = _norm_fwd(xm, nw, eps, dtype)
        gate, up = F.linear(h, wg.to(dtype), _cast(bg, dtype)), F.linear(h, wu.to(dtype), _cast(bu, dtype))
        ctx.save_for_backward(x, a, nw, r, gate, up, wg, wu, wd)
        ctx.dtype, ctx.bias = dtype, (bg is not None, bu is not None, bd is not None)
        return xm + F.linear(F.silu(gate) * up, wd.to(dtype), _cast(bd, dtype))

    @staticmethod
    def backward(ctx, g):
        x, a, nw, r, gate, up, wg, wu, wd = ctx.saved_tensors
        dt = ctx.dtype
        xm = x + a
        h = _norm_apply(xm, nw, r, dt)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        gm, gwd, gbd = _linear_bwd(g.to(dt), silu * up, wd, ctx.bias[2], dt)  # gm: d loss / d (silu * up)
        gu = gm * silu
        ga = gm * up * sig * (1 + gate * (1 - sig))
        gh_g, gwg, gbg = _linear_bwd(ga, h, wg, ctx.bias[0], dt)
        gh_u, gwu, gbu = _linear_bwd(gu, h, wu, ctx.bias[1], dt)
        gxm, gnw = _norm_bwd(xm, nw, r, gh_g + gh_u)
        gxm = gxm + g  # the residual
        return gxm.to(x.dtype), gxm.to(a.dtype), gnw, None, gwg, gbg, gwu, gbu, gwd, gbd, None


def _lin(x, mod, dtype):
    return _Linear.apply(x, mod.weight, mod.bias, dtype)


def _rotate(t, cos, sin):
    """Rotary embedding of t (..., heads, D) with cos/sin (..., 1, D), as HF's apply_rotary_pos_emb."""
    D = t.size(-1)
    return t * cos + torch.cat((-t[..., D // 2:], t[..., :D // 2]), -1) * sin


def _layer(layer, x, cos, sin, masks, B, P, G, idx, dtype):
    """One decoder layer on the flat token batch x: B*P prompt tokens, then the completion tokens
    that `idx` picks from the (N, C1) grid (see token_index); attention runs on that grid."""
    a, cfg = layer.self_attn, layer.self_attn.config
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, a.head_dim
    norm1 = layer.input_layernorm
    q, k, v = _NormLinears.apply(x, norm1.weight, norm1.variance_epsilon, dtype, a.q_proj.weight, a.q_proj.bias,
                                 a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias)  # (T, heads D)
    T = x.size(0)
    # rotated in cos/sin's dtype (the residual stream's, as HF), then rounded once to the matmul dtype
    q, k = (_rotate(t.view(T, -1, D), cos, sin).to(dtype) for t in (q, k))  # (T, heads, D) each
    v = v.view(T, KV, D)
    heads = lambda t, rows: t.view(rows, -1, *t.shape[1:]).transpose(1, 2)  # (rows, heads, len, D)
    n = B * P
    # q's prompt rows as a copy: SDPA keeps its inputs, and a view would keep all of q (grid(q) is another)
    qp, kp, vp = heads(q[:n].clone() if T > n else q, B), heads(k[:n], B), heads(v[:n], B)
    out = [F.scaled_dot_product_attention(qp, kp, vp, attn_mask=masks[0], scale=a.scaling, enable_gqa=True)]
    if T > n:  # completions attend to their group's prompt and to their own earlier tokens
        N, C1 = B * G, masks[1].size(-2)
        grid = lambda t: heads(t.new_zeros(N * C1, *t.shape[1:]).index_copy(0, idx, t[n:]), N)  # (N, heads, C1, D)
        kc = torch.cat([kp.repeat_interleave(G, 0), grid(k)], 2)
        vc = torch.cat([vp.repeat_interleave(G, 0), grid(v)], 2)
        out.append(F.scaled_dot_product_attention(grid(q), kc, vc, attn_mask=masks[1], scale=a.scaling,
                                                  enable_gqa=True))
    # o_proj per part: SDPA's output, which it keeps for backward, is then o_proj's saved input too
    o = [_lin(o.transpose(1, 2).reshape(-1, H * D), a.o_proj, dtype) for o in out]
    o = torch.cat([o[0], o[1].index_select(0, idx)]) if T > n else o[0]  # (T, E)
    m, norm2 = layer.mlp, layer.post_attention_layernorm
    return _AddNormMLP.apply(x, o, norm2.weight, norm2.variance_epsilon, m.gate_proj.weight, m.gate_proj.bias,
                             m.up_proj.weight, m.up_proj.bias, m.down_proj.weight, m.down_proj.bias, dtype)


def token_index(real, multiple=32):
    """(N, C) bool, True where a completion position's target is a real token -> flat indices of the
    positions to compute: those, topped up with the last padding ones to a multiple of 32, so that
    matmul shapes recur (see rollout.token_logprobs). Padding comes after a row's stop token: it is
    not scored, and nothing that is scored attends to it (causal)."""
    run = real.reshape(-1).clone()
    pad = (~run).nonzero().squeeze(1)
    run[pad[len(pad) - -int(run.sum()) % multiple:]] = True  # the last ones: ends of rows
    return run.nonzero().squeeze(1)


def hidden_states(model, ids, mask, num_completion, group_size=1):
    """Final-norm hidden states (N, C, E) at the positions that predict the last C tokens of each row.

    ids, mask (N, P+C), prompts left-padded. group_size=G > 1: rows come in groups of G with the same
    prompt (the first P columns), which is run once. Matmuls run in the autocast dtype if autocast
    is on, else in the weights' dtype; the residual stream stays in the weights' dtype, as in HF.
    Layers are recomputed in backward when the model has gradient checkpointing on and is training.
    Hidden states whose target is padding (mask 0: after a row's stop token) are not computed: 0.
    """
    dec, C, G = model.model, num_completion, group_size
    N, L = ids.shape
    dev = ids.device
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else dec.norm.weight.dtype
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # the positions sample() used
    P = L - C if G > 1 else L - 1  # G = 1: every row is its own "prompt" up to the last token
    B, C1 = N // G, L - 1 - P  # C1 completion tokens per row run as queries (the last one predicts nothing)
    valid = mask.bool()
    causal = lambda q, k: torch.ones(q, k, dtype=torch.bool, device=dev).tril(k - q)
    eye = torch.eye(P, dtype=torch.bool, device=dev)  # a padding query sees itself: no all-masked rows
    masks = [(valid[::G, None, None, :P] & causal(P, P)) | eye]  # (B, 1, P, P)
    flat_ids, flat_pos, idx = ids[::G, :P].reshape(-1), pos[::G, :P].reshape(-1), None
    if C1 > 0:
        prompt_keys = valid[:, None, None, :P].expand(N, 1, C1, P)
        own = valid[:, None, None, P:-1] & causal(C1, C1)  # (N, 1, C1, C1)
        masks.append(torch.cat([prompt_keys, own], -1))  # (N, 1, C1, P+C1)
        idx = token_index(valid[:, P + 1:])  # completion tokens whose next token is real (see token_index)
        flat_ids = torch.cat([flat_ids, ids[:, P:-1].reshape(-1)[idx]])  # (B P + len(idx),)
        flat_pos = torch.cat([flat_pos, pos[:, P:-1].reshape(-1)[idx]])
    x = dec.embed_tokens(flat_ids)  # (T, E)
    cos, sin = (t[0, :, None] for t in dec.rotary_emb(x, flat_pos[None]))  # (T, 1, D) each, in x's dtype
    recompute = model.training and getattr(model, "is_activation_checkpointing", False) and torch.is_grad_enabled()
    for layer in dec.layers:
        args = (layer, x, cos, sin, masks, B, P, G, idx, dtype)
        x = torch.utils.checkpoint.checkpoint(_layer, *args, use_reentrant=False) if recompute else _layer(*args)
    last = x[:B * P].view(B, P, -1)[:, -1:].repeat_interleave(G, 0)  # (N, 1, E) predicts the first completion token
    if G == 1:
        x = x.view(B, P, -1)[:, -C:]
    elif C1 == 0:
        x = last
    else:
        x = torch.cat([last, x.new_zeros(N * C1, x.size(-1)).index_copy(0, idx, x[B * P:]).view(N, C1, -1)], 1)
    norm = dec.norm
    return _Norm.apply(x, norm.weight, norm.variance_epsilon, x.dtype)


# -----------------------------------------------------------------------------
# the LM head


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


# -----------------------------------------------------------------------------
# the decode step


def _pack(w, rows):
    """Weight (out, in) -> what _linear takes: pre-packed for oneDNN on CPU in bf16, else w itself."""
    if w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        try:
            return torch.ops.mkldnn._reorder_linear_weight(w, rows), True
        except (RuntimeError, AttributeError):  # a CPU / build without it: plain matmuls
            pass
    return w, False


def _linear(x, w, b=None):
    """x @ w.T + b, w from _pack."""
    w, packed = w
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def _fuse(dtype, *ts):
    """Weights or biases of several linears as one, in `dtype` (None when the linears have no bias)."""
    return None if ts[0] is None else torch.cat([t.to(dtype) for t in ts])


class LeanDecoder:
    """rollout.HFDecoder's drop-in: KV cache and fused weights for one rollout of N = B * G rows.

    The B prompts (B, P), left-padded to a multiple of 16, are prefilled once through the model's
    forward; the cache is then copied G times into a preallocated one of P + max_new_tokens columns
    (rounded up to 64). `logits` (N, V) predict the first completion token; step() gives the next.
    dtype: the compute dtype, as for HFDecoder (autocast when lower than the weights'); the matmul
    weights are cast to it once here.

    step() rounds where the model's forward under autocast rounds, so that sampling and the training
    pass see the same policy: the residual stream, the norms and the rotary embedding stay in the
    weights' dtype; each matmul's output is rounded to the compute dtype once; attention scores and
    softmax are fp32, as in SDPA (the keys are kept in fp32 for that: twice the memory of bf16 keys).
    """

    def __init__(self, model, prompt_ids, prompt_mask, group_size, max_new_tokens, dtype=None):
        _guard(model)
        cfg, dec = model.config, model.model
        res = dec.embed_tokens.weight.dtype  # the residual stream's dtype, as in HF
        dt = dtype if dtype not in (None, torch.float32) else res  # as rollout._autocast: fp32 never autocasts
        left = -prompt_ids.size(1) % 16  # recurring prefill shapes (see _round_shapes)
        prompt_ids, prompt_mask = F.pad(prompt_ids, (left, 0)), F.pad(prompt_mask, (left, 0))
        cache = DynamicCache(config=cfg)
        pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        with rollout._autocast(model, dt):
            logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, past_key_values=cache,
                           use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, V)
        self.logits = logits.repeat_interleave(group_size, 0)  # (N, V)
        prompt_mask = prompt_mask.repeat_interleave(group_size, 0)  # (N, P)
        N, P = prompt_mask.shape
        self.model, self.N, self.col, self.dtype = model, N, P, dt
        self.layers = []
        for layer in dec.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                qkv=_pack(_fuse(dt, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), N),
                qkv_b=_fuse(dt, a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                o=_pack(a.o_proj.weight.to(dt), N), o_b=_fuse(dt, a.o_proj.bias),
                gate_up=_pack(_fuse(dt, m.gate_proj.weight, m.up_proj.weight), N),
                gate_up_b=_fuse(dt, m.gate_proj.bias, m.up_proj.bias),
                down=_pack(m.down_proj.weight.to(dt), N), down_b=_fuse(dt, m.down_proj.bias),
                norm1=layer.input_layernorm, norm2=layer.post_attention_layernorm, scale=a.scaling))
        head = model.get_output_embeddings()
        self.head, self.head_b = _pack(head.weight.to(dt), N), _fuse(dt, head.bias)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # attention always spans the whole cache (unwritten columns masked): one matmul shape per rollout
        L, D, KV, dev = -(-(P + max_new_tokens) // 64) * 64, self.head_dim, self.kv_heads, head.weight.device
        # keys as SDPA sees them (rounded to dt once) but stored in fp32, so q.k is summed and kept in fp32
        sd = torch.promote_types(dt, torch.float32)
        self.k = torch.zeros(len(self.layers), N * KV, L, D, dtype=sd, device=dev)
        self.v = torch.zeros(len(self.layers), N * KV, L, D, dtype=dt, device=dev)
        for i, layer in enumerate(cache.layers):  # (B, KV, P, D) each
            self.k[i, :, :P] = layer.keys.to(dt).repeat_interleave(group_size, 0).flatten(0, 1)
            self.v[i, :, :P] = layer.values.to(dt).repeat_interleave(group_size, 0).flatten(0, 1)
        # added to the scores: 0 where attendable, -inf elsewhere
        self.bias = torch.full((N, KV, 1, L), float("-inf"), dtype=sd, device=dev)
        self.bias[..., :P].masked_fill_(prompt_mask.bool()[:, None, None], 0.0)
        self.bias = self.bias.view(N * KV, 1, L)

    @torch.no_grad()
    def step(self, tokens, positions):
        """tokens (N,) at positions (N, 1) -> logits (N, V) for the token after them."""
        N, H, KV, D, c, dt = self.N, self.heads, self.kv_heads, self.head_dim, self.col, self.dtype
        dec = self.model.model
        x = dec.embed_tokens(tokens)  # (N, E) the residual stream
        cos, sin = dec.rotary_emb(x, positions)  # (N, 1, D) in its dtype, as HF
        # HF's rotate_half(t) * sin is roll(t, D/2) * (sin with its first half negated): the same products
        sin = torch.cat([-sin[..., :D // 2], sin[..., D // 2:]], -1)
        self.bias[..., c] = 0.0
        for i, lw in enumerate(self.layers):
            qkv = _linear(self._norm(x, lw["norm1"], dt), lw["qkv"], lw["qkv_b"])  # (N, (H + 2 KV) D)
            qk = qkv[:, :(H + KV) * D].view(N, H + KV, D)  # q and k heads, rotated in one pass
            qk = (qk * cos + qk.roll(D // 2, -1) * sin).to(dt).to(self.k.dtype)  # rounded once, as SDPA's input
            self.k[i, :, c], self.v[i, :, c] = qk[:, H:].flatten(0, 1), qkv[:, (H + KV) * D:].reshape(N * KV, D)
            # attention as SDPA computes it: q.k summed, scaled (alpha), masked and softmaxed in fp32; only the
            # probabilities and the output are rounded to dt. Each row's heads grouped by kv head, as HF does.
            q = qk[:, :H].reshape(N * KV, H // KV, D)
            scores = torch.baddbmm(self.bias, q, self.k[i].transpose(1, 2), alpha=lw["scale"])  # (N KV, H/KV, L)
            attn = torch.bmm(scores.softmax(-1).to(dt), self.v[i])  # (N KV, H/KV, D)
            x = x + _linear(attn.view(N, H * D), lw["o"], lw["o_b"])  # (N, E)
            gate, up = _linear(self._norm(x, lw["norm2"], dt), lw["gate_up"], lw["gate_up_b"]).chunk(2, -1)
            x = x + _linear(F.silu(gate) * up, lw["down"], lw["down_b"])
        self.col += 1
        return _linear(self._norm(x, dec.norm, dt), self.head, self.head_b)

    @staticmethod
    def _norm(x, norm, dtype):
        """The HF RMSNorm (fp32 statistics, weight applied in x's dtype), cast to the matmul's dtype."""
        return (norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype)).to(dtype)
