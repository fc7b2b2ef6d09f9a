"""
The GRPO objective as small pure tensor functions: no model calls, no I/O, no classes.

Paper: DeepSeekMath, Shao et al. 2024, §4.1 (https://arxiv.org/abs/2402.03300). Variants, all off
by default unless said otherwise:
- Dr. GRPO (https://arxiv.org/abs/2503.20783): no std scaling (scale="none"), loss_type="dr_grpo".
- DAPO (https://arxiv.org/abs/2503.14476): clip-higher (eps_high > eps_low), loss_type="dapo".
- GSPO (https://arxiv.org/abs/2507.18071): sequence-level importance ratio (importance_level="sequence").
- INTELLECT-2 (https://arxiv.org/abs/2505.07291): two-sided clipping, ratio capped at delta.
- Beyond the 80/20 rule (https://arxiv.org/abs/2506.01939): policy term on top-entropy tokens only.
- KL estimators k1/k2/k3: http://joschu.net/blog/kl-approx.html (k3 is the paper's, eq. 4);
  k3_clamped: verl's bounded k3 ("low_var_kl"); full: the exact KL over the vocabulary, from logits.
- Lite PPO (https://arxiv.org/abs/2508.08221): group mean, batch std (scale="batch").
- loss_type="bnpo": token mean over each micro-batch, as in TRL's GRPOTrainer.
- DAPO dynamic sampling (§3.2): informative_groups says which groups have any reward spread.
- Sampler/trainer mismatch (https://fengyao.notion.site/off-policy-rl, TRL vllm_importance_sampling_*):
  behaviour_weights, truncated or masked pi_train / pi_sample, multiplied into the policy term.

Where the defaults depart from the paper:
- beta=0.0 (paper: 0.04); no reference model is needed then (Dr. GRPO, DAPO, TRL default).
- kl_estimator=KL_DEFAULT="k3_clamped" (paper: k3), read only when beta > 0: one token with
  pi_ref >> pi cannot blow up the loss.
- std is the unbiased sample std (/(G-1)) plus eps=1e-4, like the paper's reference code and TRL
  (the paper's formula does not say which; write-ups that use /G print larger advantages).
- old_logp=None means mu=1 (one optimisation step per generation batch): ratio = exp(logp - logp.detach()).

Conventions: rows are contiguous groups of G (prompt i owns rows i*G ... i*G+G-1); N rows, T
completion tokens; mask (N, T) is 1 on valid completion tokens. Loss = minus the objective.
"""

import torch
from torch.utils.checkpoint import checkpoint

SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_clamped", "full")
KL_DEFAULT = "k3_clamped"
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")
BEHAVIOUR_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_shape(name, x, shape):
    if tuple(x.shape) != tuple(shape):
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
    """
    DAPO dynamic sampling (https://arxiv.org/abs/2503.14476 §3.2, eq. 11 keeps a prompt iff
    0 < #correct < G): group g is informative iff some r_gi != r_g0 (exact equality). A flat group
    gets zero advantages (group_advantages uses this test), so it adds no gradient.

    rewards (N,) -> bool (N/G,)
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    _check_groups(rewards.shape[0], group_size)
    r = rewards.view(-1, group_size)  # (N/G, G)
    # exact equality, not std == 0: the float mean of equal values need not equal them
    return (r != r[:, :1]).any(1)  # (N/G,)


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """
    Outcome supervision (DeepSeekMath §4.1.2): A_i = (r_i - mean(group)) / (std + eps), for every token.

    scale="group": std of the group (the paper); "batch": std of all N rewards, mean still per
    group (https://arxiv.org/abs/2508.08221, TRL scale_rewards="batch"); "none": A_i = r_i - mean
    (Dr. GRPO, https://arxiv.org/abs/2503.20783 §3.1).
    std is the UNBIASED sample std, sqrt(sum (r - mean)^2 / (G - 1)) (torch.std's default), as in
    the paper's reference code and TRL. A group whose rewards are all equal gets exactly 0: it
    carries no learning signal, and fp32 rounding of its mean must not invent one. (TRL does not
    special-case it and gets tiny non-zero advantages there, up to 2.4e-3 at G=8 for rewards in [0, 2].)

    rewards (N,) -> (advantages (N,), frac_zero_std 0-dim: fraction of groups with equal rewards)

    >>> adv, frac = group_advantages(torch.tensor([-2., -2, -5, 0, -5, -1, -1, -3]), 4)
    >>> [round(a, 2) for a in adv.tolist()], frac.item()
    ([0.12, 0.12, -1.33, 1.09, -1.31, 0.78, 0.78, -0.26], 0.0)
    """
    flat = ~informative_groups(rewards, group_size)[:, None]  # (N/G, 1)
    _check_choice("scale", scale, SCALES)
    r = _up(rewards).view(-1, group_size)  # (N/G, G)
    centred = r - r.mean(1, keepdim=True)  # (N/G, G)
    if scale == "group":
        adv = centred / (r.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = centred / (r.std() + eps)
    else:
        adv = centred
    adv = torch.where(flat, 0.0, adv).view(-1)  # (N,)
    return adv, flat.float().mean()


def process_advantages(step_rewards, step_ends, step_mask, group_size, seq_len, eps=1e-4):
    """
    Process supervision (DeepSeekMath §4.1.3): each output has steps; step j ends at token
    step_ends[j] and has reward r_j. Rewards are normalised over all steps of all G outputs of the
    group, r~_j = (r_j - mean) / (std + eps) (unbiased std, as in group_advantages), and
    A_t = sum of r~_j over the steps with step_ends[j] >= t. Tokens after the last step get 0.

    step_rewards (N, S), step_ends (N, S) long token index, step_mask (N, S) bool (False = padding
    step; S is the max step count) -> advantages (N, seq_len)
    """
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
    norm = torch.where(hi == lo, 0.0, dev / (std + eps)).view(N, S)  # (N, S)
    # put each step's reward on its last token, then a reverse cumsum sums the steps ending at or after t
    per_token = r.new_zeros(N, seq_len).scatter_add_(1, torch.where(m, step_ends, 0), torch.where(m, norm, 0))
    return per_token.flip(1).cumsum(1).flip(1)  # (N, T)


# -----------------------------------------------------------------------------
# per-token pieces


def importance_ratio(logp, old_logp, mask, level="token"):
    """
    level="token" (the paper): rho_t = exp(logp_t - old_logp_t).
    level="sequence" (GSPO, https://arxiv.org/abs/2507.18071 eq. 7): s_i = exp(sum_t m_t (logp_t -
    old_logp_t) / sum_t m_t), the length-normalised sequence ratio, broadcast to every token of row i.

    logp, old_logp, mask (N, T) -> ratio (N, T); 1 at padding (token level).
    """
    _check_choice("importance_level", level, IMPORTANCE_LEVELS)
    mask = mask.bool()
    # mask before exp: padding may hold -inf/garbage, and 0 * inf in backward is NaN
    log_ratio = torch.where(mask, _up(logp) - _up(old_logp), 0.0)  # (N, T)
    if level == "sequence":
        seq = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (N, 1)
        log_ratio = seq.expand_as(log_ratio)  # (N, T)
    return log_ratio.exp()


def clipped_surrogate(ratio, advantages, eps_low=0.2, eps_high=None, delta=None):
    """
    PPO/GRPO clipped surrogate (DeepSeekMath eq. 3), the objective to MAXIMISE:
        min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    eps_high=None means eps_high = eps_low (the paper); eps_high > eps_low is DAPO's clip-higher
    (https://arxiv.org/abs/2503.14476 §3.1). delta (INTELLECT-2 two-sided clipping,
    https://arxiv.org/abs/2505.07291 §3.2) caps the unclipped branch, min(min(rho, delta) A, ...),
    so a negative-advantage token with a huge ratio cannot blow up the update. Order as in TRL.

    ratio (N, T), advantages (N, T) or broadcastable (N, 1) -> (N, T)
    """
    eps_high = eps_low if eps_high is None else eps_high
    if delta is not None and delta <= 1 + eps_high:
        raise ValueError(f"delta must be > 1 + eps_high = {1 + eps_high}, got {delta}")
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages  # (N, T)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return torch.minimum(ratio * advantages, clipped)


def kl_estimate(logp, ref_logp, estimator=KL_DEFAULT):
    """
    Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs (tokens drawn from pi),
    http://joschu.net/blog/kl-approx.html. With x = ref_logp - logp = log(pi_ref / pi):
        k1 = -x (unbiased, can be negative); k2 = x^2 / 2 (biased, >= 0);
        k3 = exp(x) - x - 1 (unbiased, >= 0; DeepSeekMath eq. 4);
        k3_clamped = min(k3(clamp(x, -20, 20)), 10) (the default): verl's "low_var_kl" (kl_penalty in
        verl/trainer/ppo/core_algos.py). With plain k3 one token whose reference log-prob is far above
        the policy's makes exp(x) explode (value and gradient exp(x) - 1; fp32 overflows past x = 88).
        It equals k3 for -11 < x < 2.61; outside, the value is 10 and the gradient 0.
    "full" (the exact KL over the vocabulary) needs logits: full_kl, passed to grpo_loss as kl=.

    logp, ref_logp (N, T) -> (N, T)
    """
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


def behaviour_weights(train_logp, sample_logp, mask, mode="token_truncate", cap=2.0, cap_min=None):
    """
    Sampler/trainer mismatch: tokens are drawn from the sampler's numerics mu (e.g. bf16 decode) but
    the loss uses the trainer's pi, so the policy term is reweighted by pi / mu, truncated or masked
    (TIS, https://fengyao.notion.site/off-policy-rl), as TRL's vllm_importance_sampling_mode. With
    d_t = train_logp_t - sample_logp_t, bounds [cap_min, cap] (cap_min=None: none, TRL's default):
      "token_truncate":    w_t = clamp(exp(d_t), cap_min, cap)
      "token_mask":        w_t = exp(d_t) if cap_min <= exp(d_t) <= cap else 0
      "sequence_truncate": w_t = clamp(exp(sum_t m_t d_t), cap_min, cap) on every token of the row
      "sequence_mask":     w_t = exp(sum_t m_t d_t) if within the bounds else 0, on the row
      "none":              w_t = 1 (metrics only)
    The sequence ratio is the product of token ratios (TRL's sum, not GSPO's length-normalised mean).
    cap=2 as TIS (TRL: 3). train_logp: the trainer's log-probs under the policy that sampled (old_logp;
    with mu=1 the current logp), detached here: the weights carry no gradient. Padding gets weight 1
    (neutral; grpo_loss masks it anyway). NaN on a valid token stays NaN (TRL maps it to weight 1;
    our sampler scores every token, so NaN is a bug to surface).

    train_logp, sample_logp, mask (N, T) -> (weights (N, T) detached, at least fp32; metrics of
    detached 0-dim tensors over valid tokens: is_capped (fraction outside the bounds, so truncated or
    zeroed; 0 for "none"), dlogp_mean, dlogp_p99, dlogp_max of |d_t|)
    """
    _check_choice("behaviour_mode", mode, BEHAVIOUR_MODES)
    _check_shape("sample_logp", sample_logp, train_logp.shape)
    _check_shape("mask", mask, train_logp.shape)
    if cap_min is not None and cap_min >= cap:
        raise ValueError(f"cap_min ({cap_min}) must be < cap ({cap})")
    mask = mask.bool()
    with torch.no_grad():
        d = torch.where(mask, _up(train_logp) - _up(sample_logp), 0.0)  # (N, T); padding garbage out
        log_w = d.sum(1, keepdim=True).expand_as(d) if mode.startswith("sequence") else d  # (N, T)
        ratio = log_w.exp()
        out = (ratio > cap) | (ratio < (-torch.inf if cap_min is None else cap_min))  # (N, T)
        w = ratio.clamp(cap_min, cap) if mode.endswith("truncate") else torch.where(out, 0.0, ratio)
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
    """Apply fn to (chunk_size, V) row blocks of (..., V) tensors, so only one block is upcast to fp32
    at a time; under autograd each block is checkpointed so backward keeps no (N, T, V) fp32 either."""
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


def _entropy_rows(logits):
    logq = _up(logits).log_softmax(-1)  # (C, V)
    return -(logq.exp() * logq).sum(-1)  # (C,)


def full_kl(logits, ref_logits, mask=None, chunk_size=512):
    """
    Exact per-token KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)) over the whole
    vocabulary, from two logit tensors, chunk_size rows of N*T at a time. 0 where mask is False.

    logits, ref_logits (N, T, V), mask (N, T) or None -> (N, T)
    """
    _check_shape("ref_logits", ref_logits, logits.shape)
    kl = _rowwise(_kl_rows, logits, ref_logits, chunk_size=chunk_size)  # (N, T)
    return kl if mask is None else torch.where(mask.bool(), kl, 0.0)


def entropy_from_logits(logits, chunk_size=512):
    """
    Per-token entropy of the policy, H_t = -sum_v pi(v) log pi(v), chunked as in full_kl.
    Differentiable, for an entropy bonus. logits (N, T, V) -> (N, T)
    """
    return _rowwise(_entropy_rows, logits, chunk_size=chunk_size)


def top_entropy_mask(entropy, mask, quantile):
    """
    Keep only the highest-entropy ("forking") tokens, https://arxiv.org/abs/2506.01939: True where
    mask and H_t >= the (1 - quantile) quantile of H over the valid tokens of this call (linear
    interpolation, as TRL). quantile=1 keeps every valid token; 0.2 keeps the top 20%.

    entropy, mask (N, T) -> bool (N, T)
    """
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
    """
    Reduce a per-token loss l (N, T) to a scalar. m = mask, |o_i| = sum_t m_it. The call may be one
    micro-batch of a generation batch of num_sequences rows and num_tokens valid tokens (defaults:
    this call's); it returns this micro-batch's contribution, so for grpo, dr_grpo and dapo summing over
    micro-batches (gradient accumulation without further scaling) gives the full-batch loss. bnpo is a
    token mean per micro-batch by definition: the sum is the mean of the micro-batches' token means,
    the full-batch token mean only when every micro-batch holds the same number of tokens.
      "grpo"    (DeepSeekMath eq. 3): sum_i (sum_t m l / |o_i|) / num_sequences
      "bnpo"    (TRL): (sum_it m l / sum_it m) * N / num_sequences, i.e. the mean over equal-size
                micro-batches of each one's token mean
      "dr_grpo" (https://arxiv.org/abs/2503.20783 §3.2): sum_it m l / (num_sequences * max_len)
      "dapo"    (https://arxiv.org/abs/2503.14476 eq. 8): sum_it m l / num_tokens

    per_token, mask (N, T) -> 0-dim
    """
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


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, *, beta=0.0, eps_low=0.2, eps_high=None, delta=None,
              kl_estimator=KL_DEFAULT, loss_type="grpo", importance_level="token", entropy=None, entropy_coef=0.0,
              top_entropy_quantile=1.0, num_sequences=None, num_tokens=None, max_len=None, kl=None,
              behaviour_weights=None):
    """
    The GRPO loss of one (micro-)batch, DeepSeekMath eq. 3 with the variants above. Per token:
        l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) * e_t * w_t + beta * KL_t - entropy_coef * H_t
    then aggregate(l, mask, loss_type, ...) (see there for num_sequences / num_tokens / max_len).
    e_t (top-entropy mask) and w_t (behaviour weights) multiply the policy term only, as TRL's
    grpo_trainer.py (per_token_loss * entropy_mask * importance_sampling_ratio + beta * per_token_kl).
    TRL's entropy bonus is a token mean over the entropy-masked tokens; here -entropy_coef * H_t is
    aggregated by loss_type over all valid tokens.

    logp (N, T) log-probs of the sampled tokens under the current policy (carries grad);
    old_logp (N, T) or None (mu=1: logp.detach(), so the value is A and the gradient A grad logp);
    ref_logp (N, T), needed only if beta > 0 with a log-prob estimator (never read otherwise);
    advantages (N,) or (N, T); mask (N, T) valid completion tokens; entropy (N, T) needed if
    entropy_coef != 0 (then it carries grad) or top_entropy_quantile < 1; kl (N, T), needed if
    kl_estimator="full" and beta > 0: exact per-token KL(pi || pi_ref), full_kl of both models'
    logits from the log-prob pass, carrying grad; behaviour_weights (N, T), used detached.
    -> (loss 0-dim to backprop, metrics dict of detached 0-dim tensors over this call's valid
    tokens: kl (mean) and kl_max (if beta > 0), clip_low, clip_high, clip, entropy (if given),
    ratio_mean/min/max; the clip fractions are token-weighted also at importance_level="sequence",
    where TRL's are row-weighted)
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape (N, T), got {tuple(logp.shape)}")
    N, T = logp.shape
    _check_shape("mask", mask, (N, T))
    if advantages.shape not in ((N,), (N, T)):
        raise ValueError(f"advantages must have shape ({N},) or ({N}, {T}), got {tuple(advantages.shape)}")
    for name, x in (("old_logp", old_logp), ("entropy", entropy), ("kl", kl), ("behaviour_weights", behaviour_weights)):
        if x is not None:
            _check_shape(name, x, (N, T))
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    full = kl_estimator == "full"
    if kl is not None and not full:
        raise ValueError(f"kl is read only with kl_estimator='full', got kl_estimator={kl_estimator!r}")
    if beta > 0 and full and kl is None:
        raise ValueError("kl_estimator='full' needs kl=full_kl(logits, ref_logits) from the log-prob pass")
    if beta > 0 and not full and ref_logp is None:
        raise ValueError("ref_logp is required when beta > 0 (or set beta=0 to train without a reference model)")
    if entropy is None and (entropy_coef != 0 or top_entropy_quantile < 1):
        raise ValueError("entropy is required when entropy_coef != 0 or top_entropy_quantile < 1")

    mask = mask.bool()
    logp = torch.where(mask, _up(logp), 0.0)  # padding zeroed: garbage there reaches neither value nor grad
    old_logp = logp.detach() if old_logp is None else old_logp
    adv = _up(advantages)
    adv = adv[:, None] if adv.dim() == 1 else torch.where(mask, adv, 0.0)  # (N, 1) or (N, T)
    ratio = importance_ratio(logp, old_logp, mask, importance_level)  # (N, T)
    per_token = -clipped_surrogate(ratio, adv, eps_low, eps_high, delta)  # (N, T)
    if top_entropy_quantile < 1:
        per_token = per_token * top_entropy_mask(entropy, mask, top_entropy_quantile)
    if behaviour_weights is not None:
        per_token = per_token * torch.where(mask, _up(behaviour_weights.detach()), 0.0)
    if beta > 0:
        if not full:
            _check_shape("ref_logp", ref_logp, (N, T))
            kl = kl_estimate(logp, torch.where(mask, _up(ref_logp), 0.0), kl_estimator)  # (N, T)
        kl = torch.where(mask, _up(kl), 0.0)  # a caller's full KL may hold garbage at padding
        per_token = per_token + beta * kl
    if entropy_coef != 0:
        per_token = per_token - entropy_coef * torch.where(mask, _up(entropy), 0.0)
    loss = aggregate(per_token, mask, loss_type, num_sequences, num_tokens, max_len)

    # metrics: detached, no .item() (no device sync); an all-masked call gives 0, not NaN
    with torch.no_grad():
        n, any_valid = mask.sum().clamp(min=1), mask.any()
        eps_high = eps_low if eps_high is None else eps_high
        mean = lambda x: torch.where(mask, x, 0).sum() / n
        vmax = lambda x: torch.where(any_valid, torch.where(mask, x, -torch.inf).amax(), 0.0)
        low = (ratio < 1 - eps_low) & (adv < 0)  # (N, T)
        high = (ratio > 1 + eps_high) & (adv > 0)  # (N, T)
        metrics = {"clip_low": mean(low.float()), "clip_high": mean(high.float()), "clip": mean((low | high).float())}
        if beta > 0:
            metrics["kl"], metrics["kl_max"] = mean(kl), vmax(kl)
        if entropy is not None:
            metrics["entropy"] = mean(_up(entropy))
        metrics.update(ratio_mean=mean(ratio), ratio_max=vmax(ratio),
                       ratio_min=torch.where(any_valid, torch.where(mask, ratio, torch.inf).amin(), 0.0))
    return loss, metrics
