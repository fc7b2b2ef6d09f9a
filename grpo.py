"""The GRPO objective (DeepSeekMath, https://arxiv.org/abs/2402.03300 §4.1) as pure tensor functions (no model calls,
no I/O; loss = -objective) plus Objective, the loss's options; each variant cites its source, README lists departures.
N rows, contiguous groups of G (prompt i owns rows i*G ... i*G+G-1), T completion tokens; mask (N, T) True if valid."""

from dataclasses import dataclass

import torch

SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_clamped", "full")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
IMPORTANCE_LEVELS = ("token", "sequence")
BEHAVIOUR_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _check(ok, message):
    if not ok:
        raise ValueError(message)


def _check_choice(name, value, choices):
    _check(value in choices, f"{name} must be one of {choices}, got {value!r}")


def _check_shape(shape, **tensors):  # None passes: an optional input
    for name, x in tensors.items():
        if x is not None:
            _check(tuple(x.shape) == tuple(shape), f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _check_groups(n, group_size):  # a group of one has no baseline
    _check(
        isinstance(group_size, int) and group_size >= 2 and n % group_size == 0,
        f"group_size must be an int >= 2 that divides the number of rows ({n}), got {group_size!r}",
    )


def _up(x):  # exp/ratio math in at least fp32: bf16 has ~3 significant digits
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _mean(x, mask):  # over valid entries, 0-dim, no host sync; 0 for an all-masked call, not NaN
    return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)


def _max(x, mask):  # as _mean; the min is -_max(-x, mask)
    return torch.where(mask.any(), torch.where(mask, x, -torch.inf).amax(), 0.0)


# --- advantages
def informative_groups(rewards, group_size):
    """DAPO dynamic sampling (https://arxiv.org/abs/2503.14476 §3.2, eq. 11): group g is informative iff some
    r_gi != r_g0; a flat group gets zero advantages, so no gradient. rewards (N,) -> bool (N/G,)"""
    _check(rewards.dim() == 1, f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    _check_groups(rewards.shape[0], group_size)
    r = rewards.view(-1, group_size)  # (N/G, G)
    return (r != r[:, :1]).any(1)  # (N/G,); exact, not std == 0: the float mean of equal values need not equal them


def pick_groups(rewards, group_size, count):
    """DAPO dynamic sampling (https://arxiv.org/abs/2503.14476 §3.2): the first `count` informative groups, topped up
    with the last flat ones (the caller masks them). rewards (N,), in sampling order -> sorted group indices (count,)"""
    informative = informative_groups(rewards, group_size)  # (N/G,)
    return torch.cat([informative.nonzero(), (~informative).nonzero().flip(0)])[:count, 0].sort().values


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """Outcome supervision (DeepSeekMath §4.1.2): A_i = (r_i - mean(group)) / (std + eps), unbiased std (the paper's
    code, TRL); scale "batch": std of all N rewards (https://arxiv.org/abs/2508.08221), "none": no division (Dr. GRPO,
    https://arxiv.org/abs/2503.20783 §3.1). A flat group gets exactly 0. rewards (N,) -> (A (N,), flat fraction 0-dim)
    >>> adv, frac = group_advantages(torch.tensor([-2., -2, -5, 0, -5, -1, -1, -3]), 4)
    >>> [round(a, 2) for a in adv.tolist()], frac.item()
    ([0.12, 0.12, -1.33, 1.09, -1.31, 0.78, 0.78, -0.26], 0.0)"""
    flat = ~informative_groups(rewards, group_size)[:, None]  # (N/G, 1)
    _check_choice("scale", scale, SCALES)
    r = _up(rewards).view(-1, group_size)  # (N/G, G)
    std = {"group": r.std(1, keepdim=True) + eps, "batch": r.std() + eps, "none": 1.0}[scale]  # (N/G, 1) or 0-dim
    adv = (r - r.mean(1, keepdim=True)) / std  # (N/G, G)
    return torch.where(flat, 0.0, adv).view(-1), flat.float().mean()  # (N,), 0-dim


def process_advantages(step_rewards, step_ends, step_mask, group_size, seq_len, eps=1e-4):
    """Process supervision (DeepSeekMath §4.1.3): step j of an output ends at token step_ends[j] with reward r_j;
    r~_j = (r_j - mean) / (std + eps) over the valid steps of the group's G outputs (unbiased std), A_t = sum of r~_j
    over steps with step_ends[j] >= t. step_rewards, step_ends (long), step_mask (N, S) -> advantages (N, seq_len)"""
    _check_shape(step_rewards.shape, step_ends=step_ends, step_mask=step_mask)
    N, S = step_rewards.shape
    _check_groups(N, group_size)
    m = step_mask.bool()
    _check(not (((step_ends < 0) | (step_ends >= seq_len)) & m).any(), f"step_ends must lie in [0, seq_len={seq_len})")
    r = _up(step_rewards).reshape(-1, group_size * S)  # (N/G, G*S)
    gm = m.reshape(-1, group_size * S)  # (N/G, G*S)
    count = gm.sum(1, keepdim=True)  # (N/G, 1)
    mean = torch.where(gm, r, 0).sum(1, keepdim=True) / count.clamp(min=1)  # (N/G, 1)
    dev = torch.where(gm, r - mean, 0)  # (N/G, G*S)
    std = (dev.pow(2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (N/G, 1)
    first = r.gather(1, gm.int().argmax(1, keepdim=True))  # (N/G, 1): each group's first valid reward
    norm = torch.where(((r != first) & gm).any(1, keepdim=True), dev / (std + eps), 0.0).view(N, S)  # (N, S); flat: 0
    per_token = r.new_zeros(N, seq_len).scatter_add_(1, torch.where(m, step_ends, 0), torch.where(m, norm, 0))
    return per_token.flip(1).cumsum(1).flip(1)  # (N, T): each step's r~ on its last token, summed from t on


# --- per-token pieces
def importance_ratio(logp, old_logp, mask, level="token"):
    """ "token" (the paper): rho_t = exp(logp_t - old_logp_t); "sequence" (GSPO, arXiv 2507.18071 eq. 7):
    exp(sum_t m_t (logp_t - old_logp_t) / sum_t m_t) on the whole row. (N, T) each -> (N, T), 1 at padding (token)"""
    _check_choice("importance_level", level, IMPORTANCE_LEVELS)
    mask = mask.bool()
    log_ratio = torch.where(mask, _up(logp) - _up(old_logp), 0.0)  # (N, T); padding's -inf/garbage: NaN in backward
    if level == "sequence":
        log_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)  # (N, T)
    return log_ratio.exp()


def clipped_surrogate(ratio, advantages, eps_low=0.2, eps_high=None, delta=None):
    """DeepSeekMath eq. 3, to maximise: min(min(rho, delta) A, clip(rho, 1 - eps_low, 1 + eps_high) A); eps_high >
    eps_low: DAPO's clip-higher (https://arxiv.org/abs/2503.14476 §3.1; None: eps_low); delta: INTELLECT-2's cap on
    a huge ratio with A < 0 (https://arxiv.org/abs/2505.07291 §3.2). ratio (N, T), advantages (N, 1|T) -> (N, T)"""
    eps_high = eps_low if eps_high is None else eps_high
    _check(delta is None or delta > 1 + eps_high, f"delta must be > 1 + eps_high = {1 + eps_high}, got {delta}")
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages  # (N, T)
    ratio = ratio if delta is None else ratio.clamp(max=delta)
    return torch.minimum(ratio * advantages, clipped)


def cispo_surrogate(ratio, advantages, logp, cap=5.0):
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585 §3.1 eq. 4-5), to maximise sg(min(rho, cap)) A log pi: the
    weight is detached, a clipped token keeps its gradient; no lower bound. ratio, logp (N, T), A (N, 1|T) -> (N, T)"""
    return ratio.clamp(max=cap).detach() * advantages * logp


def sapo_surrogate(ratio, advantages, tau_pos=1.0, tau_neg=1.05):
    """SAPO (https://arxiv.org/abs/2511.20347 §3), to maximise f(rho) A, f(x) = sigmoid(tau (x - 1)) 4 / tau with
    tau = tau_pos if A > 0 else tau_neg: a soft gate for the clip, f'(1) = 1. ratio (N, T), A (N, 1|T) -> (N, T)"""
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), tau_neg)  # (N, 1|T), in ratio's dtype: 1.05 in fp64
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def kl_estimate(logp, ref_logp, estimator="k3_clamped"):
    """Per-token KL(pi || pi_ref) from tokens sampled from pi, x = ref_logp - logp (joschu.net/blog/kl-approx.html):
    k1 = -x, k2 = x^2 / 2, k3 = e^x - x - 1 (DeepSeekMath eq. 4), k3_clamped = min(k3(clamp(x, -20, 20)), 10) (verl's
    "low_var_kl", = k3 for -11 < x < 2.61): no blow-up where pi_ref >> pi. "full": full_kl. (N, T) each -> (N, T)"""
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    _check(estimator != "full", "kl_estimator='full' needs logits: pass kl=full_kl(logits, ref_logits) to grpo_loss")
    x = _up(ref_logp) - _up(logp)  # (N, T)
    if estimator in ("k1", "k2"):
        return -x if estimator == "k1" else 0.5 * x.pow(2)
    x = x.clamp(-20, 20) if estimator == "k3_clamped" else x  # bounded before exp: no overflow in value or grad
    k3 = torch.expm1(x) - x  # expm1 keeps k3 >= 0 in floating point, exp(x) - 1 can round below x
    return k3.clamp(max=10) if estimator == "k3_clamped" else k3  # verl clamps to [-10, 10]; k3 >= 0


def behaviour_weights(train_logp, sample_logp, mask, mode="token_truncate", cap=2.0):
    """Sampler/trainer mismatch (TIS, https://fengyao.notion.site/off-policy-rl; TRL vllm_importance_sampling_mode): the
    policy term times w = pi_train / pi_sample = exp(d_t), d_t = train_logp_t - sample_logp_t (token modes), or
    exp(sum_t m_t d_t) on the row (sequence modes: TRL's product, not GSPO's mean); "truncate": min(w, cap) (2 as TIS),
    "mask": 0 above cap, "none": 1. A NaN stays NaN (TRL PR #6693 zeroes it): our sampler scores every token.
    train_logp, sample_logp, mask (N, T) -> (w (N, T) detached, 1 at padding; metrics, detached 0-dim: is_capped
    (fraction of valid tokens above cap), dlogp_mean, dlogp_p99, dlogp_max of |d_t|)"""
    _check_choice("behaviour_mode", mode, BEHAVIOUR_MODES)
    _check_shape(train_logp.shape, sample_logp=sample_logp, mask=mask)
    mask = mask.bool()
    with torch.no_grad():
        d = torch.where(mask, _up(train_logp) - _up(sample_logp), 0.0)  # (N, T); padding garbage out
        ratio = (d.sum(1, keepdim=True).expand_as(d) if mode.startswith("sequence") else d).exp()  # (N, T)
        out = (ratio > cap) & mask & (mode != "none")  # (N, T)
        w = ratio.clamp(max=cap) if mode.endswith("truncate") else torch.where(out, 0.0, ratio)
        w = torch.where(mask & (mode != "none"), w, 1.0)  # (N, T)
        a, n = d.abs(), mask.sum().clamp(min=1)  # (N, T), 0-dim; metrics with no host sync
        p99 = torch.nanquantile(torch.where(mask, a, torch.nan).flatten(), 0.99)  # nanquantile skips padding
        metrics = {
            "is_capped": out.sum() / n,
            "dlogp_mean": a.sum() / n,
            "dlogp_p99": torch.where(mask.any(), p99, 0.0),
            "dlogp_max": a.amax(),
        }
    return w, metrics


def full_kl(logits, ref_logits, mask=None):
    """Exact per-token KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)) in fp32; the caller bounds memory
    (rollout.head_logprobs passes a chunk of rows). logits, ref_logits (N, T, V), mask (N, T) or None -> (N, T)"""
    _check_shape(logits.shape, ref_logits=ref_logits)
    logq, logq_ref = _up(logits).log_softmax(-1), _up(ref_logits).log_softmax(-1)  # (N, T, V)
    kl = (logq.exp() * (logq - logq_ref)).sum(-1)  # (N, T)
    return kl if mask is None else torch.where(mask.bool(), kl, 0.0)


def top_entropy_mask(entropy, mask, quantile):
    """The policy term on high-entropy "forking" tokens only (https://arxiv.org/abs/2506.01939): valid tokens with
    H_t >= the (1 - quantile) quantile over them (linear, as TRL; 0.2: top 20%). entropy, mask (N, T) -> bool (N, T)"""
    _check(0 < quantile <= 1, f"top_entropy_quantile must be in (0, 1], got {quantile}")
    _check_shape(entropy.shape, mask=mask)
    mask = mask.bool()
    if quantile == 1:
        return mask
    h = torch.where(mask, _up(entropy.detach()), torch.nan)  # (N, T)
    threshold = torch.nanquantile(h.flatten(), 1 - quantile)  # nan quantile skips padding, no host sync
    return mask & (h >= threshold)


# --- aggregation and the full loss
def aggregate(per_token, mask, loss_type="grpo", num_sequences=None, num_tokens=None, max_len=None):
    """Per-token loss l (N, T) -> 0-dim, |o_i| = sum_t m_it. A call may be a micro-batch of a batch of num_sequences
    rows and num_tokens valid tokens (default: this call's); the calls sum to the batch's loss (bnpo: token means').
      "grpo", "sapo"  (DeepSeekMath eq. 3; SAPO §3): sum_i (sum_t m l / |o_i|) / num_sequences
      "bnpo"          (TRL): sum_it m l / sum_it m * N / num_sequences
      "dr_grpo"       (https://arxiv.org/abs/2503.20783 §3.2): sum_it m l / (num_sequences * max_len)
      "dapo", "cispo" (https://arxiv.org/abs/2503.14476 eq. 8; MiniMax-M1 eq. 4): sum_it m l / num_tokens"""
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_shape(per_token.shape, mask=mask)
    N, T = per_token.shape
    mask = mask.bool()
    if num_sequences is None:
        num_sequences = N
    if max_len is None:
        max_len = T
    _check(max_len >= T, f"max_len ({max_len}) must be >= the completion length T ({T})")
    masked = torch.where(mask, per_token, 0.0)  # (N, T)
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1) * (N / num_sequences)
    if loss_type == "dr_grpo":
        return masked.sum() / (num_sequences * max_len)
    num_tokens = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
    return masked.sum() / num_tokens.clamp(min=1)


@dataclass(frozen=True)
class Objective:
    """grpo_loss's options, each train.py's flag or config key of the same name (max_len: --max-new-tokens, dr_grpo's
    divisor). eps_high=None becomes eps. Choices and cross-field checks here, each value's range in train.py's check."""

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
    cispo_cap: float = 5.0  # TRL reads epsilon_high (default eps) for it; 5: its docs' advice (ScaleRL's eps_max)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    def __post_init__(self):
        _check_choice("--kl-estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("--loss-type", self.loss_type, LOSS_TYPES)
        _check_choice("--importance-level", self.importance_level, IMPORTANCE_LEVELS)
        eh = self.eps if self.eps_high is None else self.eps_high
        object.__setattr__(self, "eps_high", eh)  # frozen: resolved once, here; the checks below fail on NaN too
        _check(eh >= self.eps, f"--eps-high {eh} < --eps {self.eps}: clip-higher needs eps_high >= eps")
        _check(self.delta is None or self.delta > 1 + eh, f"--delta {self.delta} must be > 1 + eps_high = {1 + eh}")
        _check(
            self.loss_type not in ("cispo", "sapo") or (self.delta is None and eh == self.eps),  # TRL ignores them
            f"--loss-type {self.loss_type} does not clip: drop --delta and --eps-high (cispo's bound is cispo_cap)",
        )


def grpo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    obj,
    *,
    entropy=None,
    kl=None,
    behaviour_weights=None,
    num_sequences=None,
    num_tokens=None,
):
    """DeepSeekMath eq. 3 with obj's variants, per token, then aggregate(l, mask, obj.loss_type, ...):
        l_t = -S_t e_t w_t + beta KL_t - entropy_coef H_t, S_t = min(min(rho, delta) A, clip(rho, 1-eps, 1+eps_high) A)
    or cispo_/sapo_surrogate's; e_t (top_entropy_mask) and w_t (behaviour_weights, detached) scale the policy term
    only, as TRL. (N, T) each: logp, old_logp (None: logp.detach(), mu=1), ref_logp, or kl (full_kl's, with grad) if
    kl_estimator="full", entropy; advantages (N,) or (N, T) -> (loss, metrics: detached 0-dim, over valid tokens:
    clip_low, clip_high, clip (cispo: rho > cispo_cap with A > 0, as TRL), kl, kl_max, entropy, ratio_mean/min/max)"""
    _check(logp.dim() == 2, f"logp must have shape (N, T), got {tuple(logp.shape)}")
    N, T = logp.shape
    _check_shape((N, T) if advantages.dim() == 2 else (N,), advantages=advantages)
    _check_shape(
        (N, T),
        mask=mask,
        old_logp=old_logp,
        ref_logp=ref_logp,
        entropy=entropy,
        kl=kl,
        behaviour_weights=behaviour_weights,
    )
    beta, est = obj.beta, obj.kl_estimator
    full = est == "full"
    _check(kl is None or full, f"kl is read only with kl_estimator='full', got kl_estimator={est!r}")
    _check(not (beta > 0 and full and kl is None), "kl_estimator='full' needs kl=full_kl(logits, ref_logits)")
    _check(not (beta > 0 and not full and ref_logp is None), "ref_logp is required when beta > 0 (or set beta=0)")
    _check(
        entropy is not None or not (obj.entropy_coef != 0 or obj.top_entropy_quantile < 1),
        "entropy is required when entropy_coef != 0 or top_entropy_quantile < 1",
    )
    mask = mask.bool()
    logp = torch.where(mask, _up(logp), 0.0)  # padding zeroed: garbage there reaches neither value nor grad
    old_logp = logp.detach() if old_logp is None else old_logp
    adv = _up(advantages)[:, None] if advantages.dim() == 1 else torch.where(mask, _up(advantages), 0.0)  # (N, 1|T)
    ratio = importance_ratio(logp, old_logp, mask, obj.importance_level)  # (N, T)
    if obj.loss_type == "cispo":
        per_token = -cispo_surrogate(ratio, adv, logp, obj.cispo_cap)  # (N, T)
    elif obj.loss_type == "sapo":
        per_token = -sapo_surrogate(ratio, adv, obj.sapo_temperature_pos, obj.sapo_temperature_neg)  # (N, T)
    else:  # the clip of eq. 3
        per_token = -clipped_surrogate(ratio, adv, obj.eps, obj.eps_high, obj.delta)  # (N, T)
    if obj.top_entropy_quantile < 1:
        per_token = per_token * top_entropy_mask(entropy, mask, obj.top_entropy_quantile)
    if behaviour_weights is not None:
        per_token = per_token * torch.where(mask, _up(behaviour_weights.detach()), 0.0)
    if beta > 0:  # a caller's full KL may hold garbage at padding: aggregate and the metrics mask it
        kl = _up(kl) if full else kl_estimate(logp, torch.where(mask, _up(ref_logp), 0.0), obj.kl_estimator)  # (N, T)
        per_token = per_token + beta * kl
    if obj.entropy_coef != 0:
        per_token = per_token - obj.entropy_coef * torch.where(mask, _up(entropy), 0.0)
    loss = aggregate(per_token, mask, obj.loss_type, num_sequences, num_tokens, obj.max_len)
    with torch.no_grad():  # metrics: detached, no .item() (no device sync); an all-masked call gives 0, not NaN
        cispo = obj.loss_type == "cispo"  # one bound, no lower one
        low = (ratio < 1 - obj.eps) & (adv < 0) & (not cispo)  # (N, T)
        high = (ratio > (obj.cispo_cap if cispo else 1 + obj.eps_high)) & (adv > 0)  # (N, T)
        metrics = {k: _mean(x.float(), mask) for k, x in (("clip_low", low), ("clip_high", high), ("clip", low | high))}
        if beta > 0:
            metrics["kl"], metrics["kl_max"] = _mean(kl, mask), _max(kl, mask)
        if entropy is not None:
            metrics["entropy"] = _mean(_up(entropy), mask)
        metrics.update(ratio_mean=_mean(ratio, mask), ratio_max=_max(ratio, mask), ratio_min=-_max(-ratio, mask))
    return loss, metrics
