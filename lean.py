"""
Lean passes for Llama-style causal LMs (Llama, SmolLM2, Qwen2): an accelerator behind `--lean`.

rollout.py is the plain path, through the model's own modules. This file reads the weights directly
instead, which is faster on CPU but sees nothing a fork changed in the modules; so every entry point
first runs check(model), which passes only for modules exactly as transformers defines them, and
refuses anything else with the reason. Drop-ins, with rollout.py's signatures:
- token_logprobs / completion_hidden: the teacher-forced forward with gradients (lean_train.py): each
  shared prompt run once, small saved activations, a fused LM head with a hand-written backward;
  padding after a row's stop token is left out and widths are rounded so matmul shapes recur.
- LeanDecoder: the decode step of rollout.sample. A preallocated KV cache, q/k/v and gate/up as one
  matmul each, and on CPU the bf16 weights packed once per rollout for oneDNN.
The tests compare values and gradients with the model's own forward.
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import rollout
from lean_train import _HeadLogprobs, hidden_states, token_index

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
