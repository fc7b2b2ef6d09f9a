"""The GRPO objective as small pure tensor functions, plus Objective, the loss's options. No model calls, no I/O.
Paper: DeepSeekMath (https://arxiv.org/abs/2402.03300) §4.1; each variant cites its source where it is computed.
The README keeps the one list of where the defaults depart from the paper.
Conventions: rows are contiguous groups of G (prompt i owns rows i*G ... i*G+G-1); N rows, T completion tokens;
mask (N, T) is True on valid completion tokens. Loss = minus the objective."""

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_clamped", "full")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")
BEHAVIOUR_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_shape(name, x, shape):  # None passes: an optional input
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _check_groups(n, group_size):
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (a group of one has no baseline), got {group_size!r}")
    if n % group_size:
        raise ValueError(f"number of rows ({n}) must be divisible by group_size ({group_size})")


def _up(x):
    # exp/ratio math in at least fp32: bf16 has ~3 significant digits
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# -----------------------------------------------------------------------------
# advantages

def informative_groups(rewards, group_size):
    """DAPO dynamic sampling (https://arxiv.org/abs/2503.14476 §3.2, eq. 11): group g is informative iff some
    r_gi != r_g0; a flat group gets zero advantages, so no gradient. rewards (N,) -> bool (N/G,)"""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    _check_groups(rewards.shape[0], group_size)
    r = rewards.view(-1, group_size)  # (N/G, G)
    # exact equality, not std == 0: the float mean of equal values need not equal them
    return (r != r[:, :1]).any(1)  # (N/G,)


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """Outcome supervision (DeepSeekMath §4.1.2): A_i = (r_i - mean(group)) / (std + eps) on every token.
    scale "group": the paper; "batch": std of all N rewards (https://arxiv.org/abs/2508.08221); "none": no division
    (Dr. GRPO, https://arxiv.org/abs/2503.20783 §3.1). std is unbiased (/(G-1)), as the paper's code and TRL.
    A flat group gets exactly 0: fp32 rounding of its mean must not invent a signal.
    rewards (N,) -> (advantages (N,), fraction of flat groups 0-dim)

    >>> adv, frac = group_advantages(torch.tensor([-2., -2, -5, 0, -5, -1, -1, -3]), 4)
    >>> [round(a, 2) for a in adv.tolist()], frac.item()
    ([0.12, 0.12, -1.33, 1.09, -1.31, 0.78, 0.78, -0.26], 0.0)
    """
    flat = ~informative_groups(rewards, group_size)[:, None]  # (N/G, 1)
    _check_choice("scale", scale, SCALES)
    r = _up(rewards).view(-1, group_size)  # (N/G, G)
    adv = r - r.mean(1, keepdim=True)  # (N/G, G)
    if scale != "none":  # "group": each group's std, "batch": one std over all N rewards
        adv = adv / ((r.std(1, keepdim=True) if scale == "group" else r.std()) + eps)
    return torch.where(flat, 0.0, adv).view(-1), flat.float().mean()  # (N,), 0-dim


def process_advantages(step_rewards, step_ends, step_mask, group_size, seq_len, eps=1e-4):
    """Process supervision (DeepSeekMath §4.1.3): step j of an output ends at token step_ends[j] with reward r_j;
    r~_j = (r_j - mean) / (std + eps) over all steps of the group's G outputs (unbiased std), and
    A_t = sum of r~_j over the steps with step_ends[j] >= t (0 after the last step).
    step_rewards, step_ends (long), step_mask (False: padding step) (N, S) -> advantages (N, seq_len)"""
    _check_shape("step_ends", step_ends, step_rewards.shape)
    _check_shape("step_mask", step_mask, step_rewards.shape)
    N, S = step_rewards.shape
    _check_groups(N, group_size)
    m = step_mask.bool()
    if (((step_ends < 0) | (step_ends >= seq_len)) & m).any():
        raise ValueError(f"step_ends of valid steps must lie in [0, seq_len={seq_len})")
    r = _up(step_rewards).reshape(-1, group_size * S)  # (N/G, G*S)
    gm = m.reshape(-1, group_size * S)  # (N/G, G*S)
    count = gm.sum(1, keepdim=True)  # (N/G, 1)
    mean = torch.where(gm, r, 0).sum(1, keepdim=True) / count.clamp(min=1)  # (N/G, 1)
    dev = torch.where(gm, r - mean, 0)  # (N/G, G*S)
    std = (dev.pow(2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (N/G, 1)
    hi = torch.where(gm, r, -torch.inf).amax(1, keepdim=True)  # (N/G, 1)
    lo = torch.where(gm, r, torch.inf).amin(1, keepdim=True)  # (N/G, 1)
    norm = torch.where(hi == lo, 0.0, dev / (std + eps)).view(N, S)  # (N, S); a flat group gets 0
    # each step's reward on its last token, then a reverse cumsum sums the steps ending at or after t
    per_token = r.new_zeros(N, seq_len).scatter_add_(1, torch.where(m, step_ends, 0), torch.where(m, norm, 0))
    return per_token.flip(1).cumsum(1).flip(1)  # (N, T)


# -----------------------------------------------------------------------------
# per-token pieces

def importance_ratio(logp, old_logp, mask, level="token"):
    """"token" (the paper): rho_t = exp(logp_t - old_logp_t); "sequence" (GSPO, https://arxiv.org/abs/2507.18071
    eq. 7): exp(sum_t m_t (logp_t - old_logp_t) / sum_t m_t) on every token of the row.
    logp, old_logp, mask (N, T) -> (N, T), 1 at padding (token level)"""
    _check_choice("importance_level", level, IMPORTANCE_LEVELS)
    mask = mask.bool()
    # mask before exp: padding may hold -inf/garbage, and 0 * inf in backward is NaN
    log_ratio = torch.where(mask, _up(logp) - _up(old_logp), 0.0)  # (N, T)
    if level == "sequence":
        seq = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (N, 1)
        log_ratio = seq.expand_as(log_ratio)  # (N, T)
    return log_ratio.exp()


def clipped_surrogate(ratio, advantages, eps_low=0.2, eps_high=None, delta=None):
    """DeepSeekMath eq. 3, to maximise: min(min(rho, delta) A, clip(rho, 1 - eps_low, 1 + eps_high) A).
    eps_high > eps_low is DAPO's clip-higher (https://arxiv.org/abs/2503.14476 §3.1; None: eps_low); delta is
    INTELLECT-2's cap (https://arxiv.org/abs/2505.07291 §3.2): a huge ratio with A < 0 cannot blow up the update.
    ratio (N, T), advantages (N, T) or (N, 1) -> (N, T)"""
    eps_high = eps_low if eps_high is None else eps_high
    if delta is not None and delta <= 1 + eps_high:
        raise ValueError(f"delta must be > 1 + eps_high = {1 + eps_high}, got {delta}")
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages  # (N, T)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return torch.minimum(ratio * advantages, clipped)


def kl_estimate(logp, ref_logp, estimator="k3_clamped"):
    """Per-token KL(pi || pi_ref) from tokens sampled from pi, x = ref_logp - logp (joschu.net/blog/kl-approx.html):
    k1 = -x, k2 = x^2 / 2, k3 = e^x - x - 1 (DeepSeekMath eq. 4), k3_clamped = min(k3(clamp(x, -20, 20)), 10)
    (verl's "low_var_kl"): one token with pi_ref >> pi cannot blow up value or gradient; equal to k3 for
    -11 < x < 2.61. "full" needs logits: full_kl. logp, ref_logp (N, T) -> (N, T)"""
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    if estimator == "full":
        raise ValueError("kl_estimator='full' needs logits: pass kl=full_kl(logits, ref_logits) to grpo_loss")
    x = _up(ref_logp) - _up(logp)  # (N, T)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x.pow(2)
    if estimator == "k3_clamped":
        x = x.clamp(-20, 20)  # bounded before exp, so neither value nor gradient can overflow
    k3 = torch.expm1(x) - x  # expm1 keeps k3 >= 0 in floating point, exp(x) - 1 can round below x
    return k3.clamp(max=10) if estimator == "k3_clamped" else k3  # verl clamps to [-10, 10]; k3 >= 0


def behaviour_weights(train_logp, sample_logp, mask, mode="token_truncate", cap=2.0):
    """Sampler/trainer mismatch (TIS, https://fengyao.notion.site/off-policy-rl; TRL vllm_importance_sampling_mode):
    the policy term is reweighted by pi_train / pi_sample. With d_t = train_logp_t - sample_logp_t, token modes
    use exp(d_t), sequence modes exp(sum_t m_t d_t) (TRL's product, not GSPO's mean) on the whole row; "truncate"
    clamps to <= cap (2 as TIS), "mask" zeroes above cap, "none" is 1 (metrics only). Padding gets 1. A NaN on a
    valid token stays NaN: TRL (PR #6693) zeroes its d_t, so weight 1 in token modes and dropped from the row's
    sum in sequence modes; our sampler scores every token, so a NaN is a bug to surface.
    train_logp, sample_logp, mask (N, T) -> (weights (N, T) detached, metrics of detached 0-dim tensors:
    is_capped (fraction of valid tokens above cap), dlogp_mean, dlogp_p99, dlogp_max of |d_t|)"""
    _check_choice("behaviour_mode", mode, BEHAVIOUR_MODES)
    _check_shape("sample_logp", sample_logp, train_logp.shape)
    _check_shape("mask", mask, train_logp.shape)
    mask = mask.bool()
    with torch.no_grad():
        d = torch.where(mask, _up(train_logp) - _up(sample_logp), 0.0)  # (N, T); padding garbage out
        log_w = d.sum(1, keepdim=True).expand_as(d) if mode.startswith("sequence") else d  # (N, T)
        ratio = log_w.exp()
        out = ratio > cap  # (N, T)
        w = ratio.clamp(max=cap) if mode.endswith("truncate") else torch.where(out, 0.0, ratio)
        if mode == "none":
            w, out = torch.ones_like(ratio), torch.zeros_like(out)
        w = torch.where(mask, w, 1.0)
        # metrics with no host sync: padding has |d| = 0, and nanquantile skips it
        a, n = d.abs(), mask.sum().clamp(min=1)  # (N, T), 0-dim
        p99 = torch.nanquantile(torch.where(mask, a, torch.nan).flatten(), 0.99)
        metrics = {"is_capped": (out & mask).sum() / n, "dlogp_mean": a.sum() / n,
                   "dlogp_p99": torch.where(mask.any(), p99, 0.0), "dlogp_max": a.amax()}
    return w, metrics


def _rowwise(fn, *logits, chunk_size):
    """fn over (chunk_size, V) row blocks of (..., V) tensors: one block upcast to fp32 at a time, and under
    autograd each block is checkpointed, so backward keeps no (N, T, V) fp32 either."""
    lead, V = logits[0].shape[:-1], logits[0].shape[-1]
    flat = [x.reshape(-1, V) for x in logits]  # (N*T, V)
    out = []
    for i in range(0, flat[0].shape[0], chunk_size):
        block = [x[i:i + chunk_size] for x in flat]  # (C, V)
        if torch.is_grad_enabled() and any(b.requires_grad for b in block):
            out.append(checkpoint(fn, *block, use_reentrant=False))  # (C,)
        else:
            out.append(fn(*block))  # (C,)
    return torch.cat(out).view(lead) if out else flat[0].new_zeros(lead, dtype=torch.float32)  # (N, T)


def _kl_rows(logits, ref_logits):
    logq, logq_ref = _up(logits).log_softmax(-1), _up(ref_logits).log_softmax(-1)  # (C, V)
    return (logq.exp() * (logq - logq_ref)).sum(-1)  # (C,)


def full_kl(logits, ref_logits, mask=None, chunk_size=512):
    """Exact per-token KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)), chunk_size rows at a time.
    logits, ref_logits (N, T, V), mask (N, T) or None -> (N, T), 0 where mask is False"""
    _check_shape("ref_logits", ref_logits, logits.shape)
    kl = _rowwise(_kl_rows, logits, ref_logits, chunk_size=chunk_size)  # (N, T)
    return kl if mask is None else torch.where(mask.bool(), kl, 0.0)


def top_entropy_mask(entropy, mask, quantile):
    """The policy term on the high-entropy "forking" tokens only (https://arxiv.org/abs/2506.01939): mask and
    H_t >= the (1 - quantile) quantile of H over valid tokens (linear, as TRL); 1 keeps all, 0.2 the top 20%.
    entropy, mask (N, T) -> bool (N, T)"""
    if not 0 < quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {quantile}")
    _check_shape("mask", mask, entropy.shape)
    mask = mask.bool()
    if quantile == 1:
        return mask
    h = torch.where(mask, _up(entropy.detach()), torch.nan)  # (N, T)
    threshold = torch.nanquantile(h.flatten(), 1 - quantile)  # nan quantile skips padding, no host sync
    return mask & (h >= threshold)


# -----------------------------------------------------------------------------
# aggregation and the full loss

def aggregate(per_token, mask, loss_type="grpo", num_sequences=None, num_tokens=None, max_len=None):
    """Per-token loss l (N, T) -> 0-dim; |o_i| = sum_t m_it. A call may be one micro-batch of a batch of
    num_sequences rows and num_tokens valid tokens (default: this call's); summing the calls gives the batch's
    loss (bnpo: the mean of the micro-batches' token means).
      "grpo"    (DeepSeekMath eq. 3): sum_i (sum_t m l / |o_i|) / num_sequences
      "bnpo"    (TRL): sum_it m l / sum_it m * N / num_sequences
      "dr_grpo" (https://arxiv.org/abs/2503.20783 §3.2): sum_it m l / (num_sequences * max_len)
      "dapo"    (https://arxiv.org/abs/2503.14476 eq. 8): sum_it m l / num_tokens"""
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_shape("mask", mask, per_token.shape)
    N, T = per_token.shape
    mask = mask.bool()
    num_sequences = N if num_sequences is None else num_sequences
    max_len = T if max_len is None else max_len
    if max_len < T:
        raise ValueError(f"max_len ({max_len}) must be >= the completion length T ({T})")
    masked = torch.where(mask, per_token, 0.0)  # (N, T)
    if loss_type == "grpo":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1) * (N / num_sequences)
    if loss_type == "dr_grpo":
        return masked.sum() / (num_sequences * max_len)
    num_tokens = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
    return masked.sum() / num_tokens.clamp(min=1)


@dataclass(frozen=True)
class Objective:
    """grpo_loss's options, each train.py's flag of the same name; eps_high=None becomes eps. A bad value is a
    one-line ValueError naming the flag. max_len: dr_grpo's divisor, the generation budget (--max-new-tokens)."""
    beta: float = 0.04
    kl_estimator: str = "k3_clamped"
    loss_type: str = "grpo"
    eps: float = 0.2
    eps_high: float | None = None
    delta: float | None = None
    importance_level: str = "token"
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    max_len: int | None = None

    def __post_init__(self):
        for flag, value, choices in (("--kl-estimator", self.kl_estimator, KL_ESTIMATORS),
                                     ("--loss-type", self.loss_type, LOSS_TYPES),
                                     ("--importance-level", self.importance_level, IMPORTANCE_LEVELS)):
            _check_choice(flag, value, choices)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", self.eps)  # frozen: resolved once, here
        eh, q, ml = self.eps_high, self.top_entropy_quantile, self.max_len
        for flag, value, ok, want in (("--beta", self.beta, self.beta >= 0, ">= 0"),
                                      ("--eps", self.eps, 0 <= self.eps < 1, "in [0, 1)"),
                                      ("--entropy-coef", self.entropy_coef, math.isfinite(self.entropy_coef), "finite"),
                                      ("--top-entropy-quantile", q, 0 < q <= 1, "in (0, 1]"),
                                      ("--max-new-tokens", ml, ml is None or ml >= 1, ">= 1")):
            if not ok:  # written so that NaN fails too
                raise ValueError(f"{flag} {value} must be {want}")
        if not eh >= self.eps:
            raise ValueError(f"--eps-high {eh} < --eps {self.eps}: clip-higher needs eps_high >= eps")
        if self.delta is not None and not self.delta > 1 + eh:
            raise ValueError(f"--delta {self.delta} must be > 1 + eps_high = {1 + eh}")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, obj, *, entropy=None, kl=None, behaviour_weights=None,
              num_sequences=None, num_tokens=None):
    """DeepSeekMath eq. 3 with obj's variants; per token, then aggregate(l, mask, obj.loss_type, ...):
        l_t = -min(min(rho, delta) A, clip(rho, 1 - eps, 1 + eps_high) A) e_t w_t + beta KL_t - entropy_coef H_t
    e_t (top_entropy_mask) and w_t (behaviour_weights, detached) scale the policy term only, as TRL.
    logp (N, T) with grad; old_logp (N, T) or None (mu=1: logp.detach(), value A, gradient A grad logp);
    ref_logp (N, T), read only if beta > 0 with a log-prob estimator; kl (N, T) (full_kl's, with grad) only with
    kl_estimator="full"; advantages (N,) or (N, T); entropy (N, T), needed if entropy_coef != 0 (then with grad)
    or top_entropy_quantile < 1. -> (loss 0-dim, metrics of detached 0-dim tensors over valid tokens: clip_low,
    clip_high, clip (token-weighted at both levels), kl and kl_max if beta > 0, entropy if given, ratio_mean/min/max)"""
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape (N, T), got {tuple(logp.shape)}")
    N, T = logp.shape
    _check_shape("mask", mask, (N, T))
    if advantages.shape not in ((N,), (N, T)):
        raise ValueError(f"advantages must have shape ({N},) or ({N}, {T}), got {tuple(advantages.shape)}")
    for name, x in (("old_logp", old_logp), ("entropy", entropy), ("kl", kl), ("behaviour_weights", behaviour_weights)):
        _check_shape(name, x, (N, T))
    full, beta = obj.kl_estimator == "full", obj.beta
    if kl is not None and not full:
        raise ValueError(f"kl is read only with kl_estimator='full', got kl_estimator={obj.kl_estimator!r}")
    if beta > 0 and full and kl is None:
        raise ValueError("kl_estimator='full' needs kl=full_kl(logits, ref_logits) from the log-prob pass")
    if beta > 0 and not full and ref_logp is None:
        raise ValueError("ref_logp is required when beta > 0 (or set beta=0 to train without a reference model)")
    if entropy is None and (obj.entropy_coef != 0 or obj.top_entropy_quantile < 1):
        raise ValueError("entropy is required when entropy_coef != 0 or top_entropy_quantile < 1")

    mask = mask.bool()
    logp = torch.where(mask, _up(logp), 0.0)  # padding zeroed: garbage there reaches neither value nor grad
    old_logp = logp.detach() if old_logp is None else old_logp
    adv = _up(advantages)
    adv = adv[:, None] if adv.dim() == 1 else torch.where(mask, adv, 0.0)  # (N, 1) or (N, T)
    ratio = importance_ratio(logp, old_logp, mask, obj.importance_level)  # (N, T)
    per_token = -clipped_surrogate(ratio, adv, obj.eps, obj.eps_high, obj.delta)  # (N, T)
    if obj.top_entropy_quantile < 1:
        per_token = per_token * top_entropy_mask(entropy, mask, obj.top_entropy_quantile)
    if behaviour_weights is not None:
        per_token = per_token * torch.where(mask, _up(behaviour_weights.detach()), 0.0)
    if beta > 0:
        if not full:
            _check_shape("ref_logp", ref_logp, (N, T))
            kl = kl_estimate(logp, torch.where(mask, _up(ref_logp), 0.0), obj.kl_estimator)  # (N, T)
        kl = torch.where(mask, _up(kl), 0.0)  # a caller's full KL may hold garbage at padding
        per_token = per_token + beta * kl
    if obj.entropy_coef != 0:
        per_token = per_token - obj.entropy_coef * torch.where(mask, _up(entropy), 0.0)
    loss = aggregate(per_token, mask, obj.loss_type, num_sequences, num_tokens, obj.max_len)

    # metrics: detached, no .item() (no device sync); an all-masked call gives 0, not NaN
    with torch.no_grad():
        n, any_valid = mask.sum().clamp(min=1), mask.any()
        mean = lambda x: torch.where(mask, x, 0).sum() / n
        vmax = lambda x: torch.where(any_valid, torch.where(mask, x, -torch.inf).amax(), 0.0)
        low = (ratio < 1 - obj.eps) & (adv < 0)  # (N, T)
        high = (ratio > 1 + obj.eps_high) & (adv > 0)  # (N, T)
        metrics = {"clip_low": mean(low.float()), "clip_high": mean(high.float()), "clip": mean((low | high).float())}
        if beta > 0:
            metrics["kl"], metrics["kl_max"] = mean(kl), vmax(kl)
        if entropy is not None:
            metrics["entropy"] = mean(_up(entropy))
        metrics.update(ratio_mean=mean(ratio), ratio_max=vmax(ratio),
                       ratio_min=torch.where(any_valid, torch.where(mask, ratio, torch.inf).amin(), 0.0))
    return loss, metrics
