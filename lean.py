"""
Lean passes for Llama-style causal LMs (Llama, SmolLM2, Qwen2: RMSNorm, rotary, GQA, SwiGLU).

- hidden_states(): the teacher-forced forward of the log-prob pass (rollout.token_logprobs), with
  gradients. Rows that share a prompt run it once and attend to its keys/values, gradients flowing
  back into it. Norms, linears and the MLP are autograd Functions that keep only what their
  backward needs (the residual stream, matmul inputs, the MLP's gate and up), and linears cast the
  fp32 weight to the autocast dtype again in backward instead of holding a bf16 copy.
- LeanDecoder: the decode step of rollout.sample(). Through the HF forward that is ~30 small ops
  per layer plus a KV cache that grows by torch.cat. Here the KV cache is preallocated (keys
  stored transposed, so attention is two plain batched matmuls), q/k/v and gate/up are one matmul
  each, and on CPU the bf16 weights are packed once per rollout for oneDNN instead of on every call.
The math is the HF forward's up to rounding (tests compare logits and gradients); other
architectures use the HF forward.
"""

import torch
import torch.nn.functional as F


def supports(model):
    """The HF classes whose layout this file knows (wrappers and subclasses go through the HF forward)."""
    cfg = model.config
    return (type(model).__name__ in ("LlamaForCausalLM", "Qwen2ForCausalLM") and cfg.hidden_act == "silu"
            and not getattr(cfg, "use_sliding_window", False)
            and not (model.training and cfg.attention_dropout > 0))


# -----------------------------------------------------------------------------
# the teacher-forced forward, with gradients

class _Norm(torch.autograd.Function):
    """The HF RMSNorm (weight * (x / rms(x)) in x's dtype, statistics in fp32), output cast to `dtype`.

    Saves x and 1/rms only; backward recomputes x / rms. With u = g * w and n = x / rms:
    dx = (u - n * mean(u * n)) / rms, dw = sum over tokens of g * n.
    """

    @staticmethod
    def forward(ctx, x, w, eps, dtype):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 as HF (float64 stays: gradcheck)
        r = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # (..., 1)
        ctx.save_for_backward(x, w, r)
        return (w * (xf * r).to(x.dtype)).to(dtype)

    @staticmethod
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        n, g = x.to(r.dtype) * r, g.to(r.dtype)
        u = g * w.to(r.dtype)
        gx = (u - n * (u * n).mean(-1, keepdim=True)).mul_(r)
        gw = (g * n).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        return gx.to(x.dtype), None if gw is None else gw.to(w.dtype), None, None


class _Linear(torch.autograd.Function):
    """x @ w.T + b in `dtype`; saves x and the fp32 weight, and casts it again in backward."""

    @staticmethod
    def forward(ctx, x, w, b, dtype):
        ctx.save_for_backward(x, w)
        ctx.dtype, ctx.has_bias = dtype, b is not None
        return F.linear(x, w.to(dtype), None if b is None else b.to(dtype))

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.flatten(0, -2)
        gx = g @ w.to(ctx.dtype) if ctx.needs_input_grad[0] else None
        gw = (g2.t() @ x.flatten(0, -2)).to(w.dtype) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0, dtype=torch.float32) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


class _MLP(torch.autograd.Function):
    """down(silu(gate(h)) * up(h)); saves h, gate(h) and up(h), recomputes the product in backward.

    d silu(a) / da = s * (1 + a * (1 - s)), s = sigmoid(a).
    """

    @staticmethod
    def forward(ctx, h, wg, bg, wu, bu, wd, bd, dtype):
        cast = lambda t: None if t is None else t.to(dtype)
        a, u = F.linear(h, cast(wg), cast(bg)), F.linear(h, cast(wu), cast(bu))
        ctx.save_for_backward(h, a, u, wg, wu, wd)
        ctx.dtype, ctx.bias = dtype, (bg is not None, bu is not None, bd is not None)
        return F.linear(F.silu(a) * u, cast(wd), cast(bd))

    @staticmethod
    def backward(ctx, g):
        h, a, u, wg, wu, wd = ctx.saved_tensors
        dt, g2, h2 = ctx.dtype, g.flatten(0, -2), h.flatten(0, -2)
        s = torch.sigmoid(a)
        silu = a * s
        gm = g @ wd.to(dt)  # d loss / d (silu(a) * u)
        gwd = (g2.t() @ (silu * u).flatten(0, -2)).to(wd.dtype)
        gu = gm * silu
        ga = gm * u * s * (1 + a * (1 - s))
        gh = ga @ wg.to(dt) + gu @ wu.to(dt) if ctx.needs_input_grad[0] else None
        gwg = (ga.flatten(0, -2).t() @ h2).to(wg.dtype)
        gwu = (gu.flatten(0, -2).t() @ h2).to(wu.dtype)
        bias = lambda t, on: t.flatten(0, -2).sum(0, dtype=torch.float32) if on else None
        return gh, gwg, bias(ga, ctx.bias[0]), gwu, bias(gu, ctx.bias[1]), gwd, bias(g, ctx.bias[2]), None


def _lin(x, mod, dtype):
    return _Linear.apply(x, mod.weight, mod.bias, dtype)


def _rotate(t, cos, sin):
    """Rotary embedding of t (..., heads, D) with cos/sin (..., 1, D), as HF's apply_rotary_pos_emb."""
    D = t.size(-1)
    return t * cos + torch.cat((-t[..., D // 2:], t[..., :D // 2]), -1) * sin


def _layer(layer, x, cos, sin, masks, B, P, G, dtype):
    """One decoder layer on the flat token batch x (B*P prompt tokens, then N*C1 completion tokens)."""
    a, cfg = layer.self_attn, layer.self_attn.config
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, a.head_dim
    norm1 = layer.input_layernorm
    h = _Norm.apply(x, norm1.weight, norm1.variance_epsilon, dtype)  # (T, E)
    T = h.size(0)
    q = _rotate(_lin(h, a.q_proj, dtype).view(T, H, D), cos, sin)
    k = _rotate(_lin(h, a.k_proj, dtype).view(T, KV, D), cos, sin)
    v = _lin(h, a.v_proj, dtype).view(T, KV, D)
    heads = lambda t, rows: t.view(rows, -1, *t.shape[1:]).transpose(1, 2)  # (rows, heads, len, D)
    n = B * P
    qp, kp, vp = heads(q[:n], B), heads(k[:n], B), heads(v[:n], B)
    out = [F.scaled_dot_product_attention(qp, kp, vp, attn_mask=masks[0], scale=a.scaling, enable_gqa=True)]
    if T > n:  # completions attend to their group's prompt and to their own earlier tokens
        N = B * G
        kc = torch.cat([kp.repeat_interleave(G, 0), heads(k[n:], N)], 2)
        vc = torch.cat([vp.repeat_interleave(G, 0), heads(v[n:], N)], 2)
        out.append(F.scaled_dot_product_attention(heads(q[n:], N), kc, vc, attn_mask=masks[1], scale=a.scaling,
                                                  enable_gqa=True))
    # o_proj per part: SDPA's output, which it keeps for backward, is then o_proj's saved input too
    x = x + torch.cat([_lin(o.transpose(1, 2).reshape(-1, H * D), a.o_proj, dtype) for o in out])  # (T, E)
    m, norm2 = layer.mlp, layer.post_attention_layernorm
    h = _Norm.apply(x, norm2.weight, norm2.variance_epsilon, dtype)
    return x + _MLP.apply(h, m.gate_proj.weight, m.gate_proj.bias, m.up_proj.weight, m.up_proj.bias,
                          m.down_proj.weight, m.down_proj.bias, dtype)


def hidden_states(model, ids, mask, num_completion, group_size=1):
    """Final-norm hidden states (N, C, E) at the positions that predict the last C tokens of each row.

    ids, mask (N, P+C), prompts left-padded. group_size=G > 1: rows come in groups of G with the same
    prompt (the first P columns), which is run once. Matmuls run in the autocast dtype if autocast
    is on, else in the weights' dtype; the residual stream stays in the weights' dtype, as in HF.
    Layers are recomputed in backward when the model has gradient checkpointing on and is training.
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
    flat_ids, flat_pos = ids[::G, :P].reshape(-1), pos[::G, :P].reshape(-1)
    if C1 > 0:
        prompt_keys = valid[:, None, None, :P].expand(N, 1, C1, P)
        own = valid[:, None, None, P:-1] & causal(C1, C1)  # (N, 1, C1, C1)
        masks.append(torch.cat([prompt_keys, own], -1))  # (N, 1, C1, P+C1)
        flat_ids = torch.cat([flat_ids, ids[:, P:-1].reshape(-1)])  # (B P + N C1,)
        flat_pos = torch.cat([flat_pos, pos[:, P:-1].reshape(-1)])
    x = dec.embed_tokens(flat_ids)  # (T, E)
    cos, sin = (t[0, :, None].to(dtype) for t in dec.rotary_emb(x, flat_pos[None]))  # (T, 1, D) each
    recompute = model.training and getattr(model, "is_activation_checkpointing", False) and torch.is_grad_enabled()
    for layer in dec.layers:
        args = (layer, x, cos, sin, masks, B, P, G, dtype)
        x = torch.utils.checkpoint.checkpoint(_layer, *args, use_reentrant=False) if recompute else _layer(*args)
    last = x[:B * P].view(B, P, -1)[:, -1:].repeat_interleave(G, 0)  # (N, 1, E) predicts the first completion token
    x = torch.cat([last, x[B * P:].view(N, C1, x.size(-1))], 1) if G > 1 else x.view(B, P, -1)[:, -C:]
    norm = dec.norm
    return _Norm.apply(x, norm.weight, norm.variance_epsilon, x.dtype)


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
    w, packed = w
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") if packed else F.linear(x, w, b)


def _fuse(dtype, *ts):
    """Weights or biases of several linears as one, in `dtype` (None when the linears have no bias)."""
    return None if ts[0] is None else torch.cat([t.to(dtype) for t in ts])


class LeanDecoder:
    """KV cache and fused weights for one rollout of N rows; step() gives the next-token logits.

    cache: the HF DynamicCache of a prefill of the B = N / G prompts, repeated G times here;
    prompt_mask (N, P) 1 on real prompt tokens; max_new_tokens bounds the preallocated cache;
    dtype: the weights are cast to it once here (default: their own dtype).
    """

    def __init__(self, model, cache, group_size, prompt_mask, max_new_tokens, dtype=None):
        cfg, dec = model.config, model.model
        dt = dtype or dec.norm.weight.dtype
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
                norm1=self._norm_weights(layer.input_layernorm),
                norm2=self._norm_weights(layer.post_attention_layernorm),
                scaling=a.scaling))
        head = model.get_output_embeddings()
        self.head, self.head_b = _pack(head.weight.to(dt), N), _fuse(dt, head.bias)
        self.final_norm = self._norm_weights(dec.norm)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        L, D, dev = P + max_new_tokens, self.head_dim, head.weight.device
        self.k = torch.zeros(len(self.layers), N, self.kv_heads, D, L, dtype=dt, device=dev)  # keys transposed
        self.v = torch.zeros(len(self.layers), N, self.kv_heads, L, D, dtype=dt, device=dev)
        for i, layer in enumerate(cache.layers):
            self.k[i, ..., :P] = layer.keys.repeat_interleave(group_size, 0).transpose(-1, -2)
            self.v[i, :, :, :P] = layer.values.repeat_interleave(group_size, 0)
        self.valid = torch.zeros(N, 1, 1, L, dtype=torch.bool, device=dev)  # (N, 1, 1, L) attendable
        self.valid[..., :P] = prompt_mask.bool()[:, None, None]

    def _norm_weights(self, norm):
        return norm.weight.to(self.dtype), norm.variance_epsilon

    @torch.no_grad()
    def step(self, tokens, positions):
        """tokens (N,) at positions (N, 1) -> logits (N, V) for the token after them."""
        N, H, KV, D, c = self.N, self.heads, self.kv_heads, self.head_dim, self.col
        dec = self.model.model
        x = dec.embed_tokens(tokens).to(self.dtype)  # (N, E)
        cos, sin = dec.rotary_emb(x, positions)  # (N, 1, D)
        self.valid[..., c] = True
        valid = self.valid[..., :c + 1]  # (N, 1, 1, c+1)
        for i, lw in enumerate(self.layers):
            qkv = _linear(self._norm(x, lw["norm1"]), lw["qkv"], lw["qkv_b"])  # (N, (H + 2 KV) D)
            qk = _rotate(qkv[:, :(H + KV) * D].view(N, H + KV, D), cos, sin)  # q and k heads in one pass
            q, self.k[i, ..., c] = qk[:, :H] * lw["scaling"], qk[:, H:]
            self.v[i, :, :, c] = qkv[:, (H + KV) * D:].view(N, KV, D)
            scores = q.view(N, KV, H // KV, D) @ self.k[i, ..., :c + 1]  # (N, KV, H/KV, c+1)
            probs = scores.masked_fill(~valid, float("-inf")).softmax(-1, dtype=torch.float32).to(x.dtype)
            attn = (probs @ self.v[i, :, :, :c + 1]).view(N, H * D)  # (N, H D)
            x = x + _linear(attn, lw["o"], lw["o_b"])
            gate, up = _linear(self._norm(x, lw["norm2"]), lw["gate_up"], lw["gate_up_b"]).chunk(2, -1)
            x = x + _linear(F.silu(gate) * up, lw["down"], lw["down_b"])
        self.col += 1
        return _linear(self._norm(x, self.final_norm), self.head, self.head_b)

    @staticmethod
    def _norm(x, norm):
        """The HF RMSNorm (fp32 statistics, weight applied in x's dtype) in one fused kernel."""
        weight, eps = norm
        return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
