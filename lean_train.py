"""
lean.py's training pass for Llama / Qwen2: the teacher-forced forward and the LM head as autograd
Functions with hand-written backwards. Called only through lean.py, whose check(model) first proves
that the model's modules are the ones this file reproduces.

- hidden_states: rows that share a prompt run it once and attend to its keys/values, gradients flowing
  back into it. Each layer is two Functions (norm + q/k/v; residual + norm + MLP) plus o_proj, which keep
  only what their backward cannot cheaply recompute, and cast the fp32 weights to the autocast dtype
  again in backward instead of holding a bf16 copy. Padding after a row's stop token is left out.
- _HeadLogprobs: the log-prob (and entropy) of each target under the LM head, V-sized work in chunks.
The tests compare values and every gradient with the model's own forward and with finite differences.
"""

import torch
import torch.nn.functional as F

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
