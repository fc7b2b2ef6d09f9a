"""
A lean decode step for Llama-style causal LMs (Llama, SmolLM2, Qwen2: RMSNorm, rotary, GQA, SwiGLU).

rollout.sample() decodes one token for all N rows per step. Through the HF forward that is ~30
small ops per layer plus a KV cache that grows by torch.cat. Here the KV cache is preallocated
(keys stored transposed, so attention is two plain batched matmuls), q/k/v and gate/up are one
matmul each, and on CPU the bf16 weights are packed once per rollout for oneDNN instead of on every
call. The math is the HF forward's up to rounding (tests compare logits); other architectures use
the HF forward.
"""

import torch
import torch.nn.functional as F


def supports(model):
    """The HF classes whose layout step() knows (wrappers and subclasses go through the HF forward)."""
    cfg = model.config
    return (type(model).__name__ in ("LlamaForCausalLM", "Qwen2ForCausalLM") and cfg.hidden_act == "silu"
            and not getattr(cfg, "use_sliding_window", False) and not model.training)


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


def _cat(*ts):
    return None if ts[0] is None else torch.cat(ts)


class LeanDecoder:
    """KV cache and fused weights for one rollout of N rows; step() gives the next-token logits.

    cache: the HF DynamicCache of a prefill of the B = N / G prompts, repeated G times here;
    prompt_mask (N, P) 1 on real prompt tokens; max_new_tokens bounds the preallocated cache.
    """

    def __init__(self, model, cache, group_size, prompt_mask, max_new_tokens):
        cfg, dec = model.config, model.model
        N, P = prompt_mask.shape
        self.model, self.N, self.col = model, N, P
        self.layers = []
        for layer in dec.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                qkv=_pack(_cat(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), N),
                qkv_b=_cat(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                o=_pack(a.o_proj.weight, N), o_b=a.o_proj.bias,
                gate_up=_pack(_cat(m.gate_proj.weight, m.up_proj.weight), N),
                gate_up_b=_cat(m.gate_proj.bias, m.up_proj.bias),
                down=_pack(m.down_proj.weight, N), down_b=m.down_proj.bias,
                norm1=layer.input_layernorm, norm2=layer.post_attention_layernorm, scaling=a.scaling))
        head = model.get_output_embeddings()
        self.head, self.head_b = _pack(head.weight, N), head.bias
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        L, D = P + max_new_tokens, self.head_dim
        w = head.weight
        self.k = w.new_zeros(len(self.layers), N, self.kv_heads, D, L)  # keys transposed: q @ k is a plain bmm
        self.v = w.new_zeros(len(self.layers), N, self.kv_heads, L, D)
        for i, layer in enumerate(cache.layers):
            self.k[i, ..., :P] = layer.keys.repeat_interleave(group_size, 0).transpose(-1, -2)
            self.v[i, :, :, :P] = layer.values.repeat_interleave(group_size, 0)
        self.valid = torch.zeros(N, 1, 1, L, dtype=torch.bool, device=w.device)  # (N, 1, 1, L) attendable
        self.valid[..., :P] = prompt_mask.bool()[:, None, None]

    @torch.no_grad()
    def step(self, tokens, positions):
        """tokens (N,) at positions (N, 1) -> logits (N, V) for the token after them."""
        N, H, KV, D, c = self.N, self.heads, self.kv_heads, self.head_dim, self.col
        dec = self.model.model
        x = dec.embed_tokens(tokens)  # (N, E)
        cos, sin = dec.rotary_emb(x, positions)  # (N, 1, D)
        self.valid[..., c] = True
        valid = self.valid[..., :c + 1]  # (N, 1, 1, c+1)

        def rotate(t):  # t (N, heads, D): q and k heads together
            t1, t2 = t[..., :D // 2], t[..., D // 2:]
            return t * cos + torch.cat((-t2, t1), -1) * sin

        for i, lw in enumerate(self.layers):
            qkv = _linear(self._norm(x, lw["norm1"]), lw["qkv"], lw["qkv_b"])  # (N, (H + 2 KV) D)
            qk = rotate(qkv[:, :(H + KV) * D].view(N, H + KV, D))
            q, self.k[i, ..., c] = qk[:, :H] * lw["scaling"], qk[:, H:]
            self.v[i, :, :, c] = qkv[:, (H + KV) * D:].view(N, KV, D)
            scores = q.view(N, KV, H // KV, D) @ self.k[i, ..., :c + 1]  # (N, KV, H/KV, c+1)
            probs = scores.masked_fill(~valid, float("-inf")).softmax(-1, dtype=torch.float32).to(x.dtype)
            attn = (probs @ self.v[i, :, :, :c + 1]).view(N, H * D)  # (N, H D)
            x = x + _linear(attn, lw["o"], lw["o_b"])
            gate, up = _linear(self._norm(x, lw["norm2"]), lw["gate_up"], lw["gate_up_b"]).chunk(2, -1)
            x = x + _linear(F.silu(gate) * up, lw["down"], lw["down_b"])
        self.col += 1
        return _linear(self._norm(x, dec.norm), self.head, self.head_b)

    @staticmethod
    def _norm(x, norm):
        """The HF RMSNorm (fp32 statistics, weight applied in x's dtype) in one fused kernel."""
        return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype)
