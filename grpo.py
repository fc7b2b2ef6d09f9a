"""The GRPO objective (DeepSeekMath, arXiv 2402.03300 §4.1) as pure tensor functions, loss = -objective, and Objective,
its options. A flag's choices are a dict of name -> small function: a fork adds an entry; README lists the departures. N
rows, contiguous groups of G (prompt i owns rows i*G ... i*G+G-1), T completion tokens; mask (N, T) True if valid."""

import importlib
from dataclasses import dataclass
from typing import Annotated

import torch

from config import Knob, declared, flag, problem, where


def _variant(name):  # variants.py's `name`, imported at its first call: a run that names no variant never reads it
    return lambda *args, **kwargs: getattr(importlib.import_module("variants"), name)(*args, **kwargs)


def _check(ok, message):
    if not ok:
        raise ValueError(message)


def _check_choice(name, value, choices):
    _check(value in choices, f"{name} {value!r}: choose from {', '.join(choices)}")


def _check_shape(shape, **tensors):  # None passes: an optional input
    for name, x in tensors.items():
        if x is not None:
            _check(tuple(x.shape) == tuple(shape), f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _check_groups(n, group_size):  # a group of one has no baseline
    ok = isinstance(group_size, int) and group_size >= 2 and n % group_size == 0
    _check(ok, f"group_size must be an int >= 2 that divides the number of rows ({n}), got {group_size!r}")


def _up(x):  # exp/ratio math in at least fp32: bf16 has ~3 significant digits
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _mean(x, mask):  # over valid entries, 0-dim, no host sync; 0 for an all-masked call, not NaN
    return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)


def _max(x, mask):  # as _mean; the min is -_max(-x, mask)
    return torch.where(mask.any(), torch.where(mask, x, -torch.inf).amax(), 0.0)


# --- advantages
def informative_groups(rewards, group_size):
    """DAPO (arXiv 2503.14476 §3.2, eq. 11): group g is informative iff some r_gi != r_g0. (N,) -> bool (N/G,)"""
    _check(rewards.dim() == 1, f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    _check_groups(rewards.shape[0], group_size)
    r = rewards.view(-1, group_size)  # (N/G, G)
    return (r != r[:, :1]).any(1)  # (N/G,); exact, not std == 0: the float mean of equal values need not equal them


ADVANTAGES = {  # --scale-rewards: fn(a group's rewards (N/G, G), eps) -> advantages (N/G, G)
    "group": lambda r, eps: (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps),  # unbiased (§4.1.2, TRL)
    "batch": lambda r, eps: (r - r.mean(1, keepdim=True)) / (r.std() + eps),  # all N's std (Lite PPO, 2508.08221)
    "none": lambda r, eps: r - r.mean(1, keepdim=True),  # no division (Dr. GRPO, arXiv 2503.20783 §3.1)
}


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """Outcome supervision (§4.1.2): ADVANTAGES[scale], a flat group exactly 0. rewards (N,) -> (A (N,), the flat share)
    >>> adv, frac = group_advantages(torch.tensor([-2., -2, -5, 0, -5, -1, -1, -3]), 4)
    >>> [round(a, 2) for a in adv.tolist()], frac.item()
    ([0.12, 0.12, -1.33, 1.09, -1.31, 0.78, 0.78, -0.26], 0.0)"""
    flat = ~informative_groups(rewards, group_size)[:, None]  # (N/G, 1)
    _check_choice("--scale-rewards", scale, ADVANTAGES)
    adv = ADVANTAGES[scale](_up(rewards).view(-1, group_size), eps)  # (N/G, G)
    return torch.where(flat, 0.0, adv).view(-1), flat.float().mean()  # (N,), 0-dim


REWARD_AGGREGATIONS = {  # multi_objective_aggregation: fn(rewards (N, K), their sum (N,), weights (K,), G, scale)
    "sum_then_normalize": lambda rewards, total, weights, G, scale: group_advantages(total, G, scale),
    "normalize_then_sum": lambda rewards, total, weights, G, scale: _variant("normalize_then_sum")(rewards, weights, G),
}


# --- the importance ratio and the surrogates
IMPORTANCE_LEVELS = {  # --importance-level: fn(log rho (N, T), 0 at padding, mask) -> the log-ratio each token takes
    "token": lambda x, mask: x,  # rho_t = exp(logp_t - old_logp_t) (DeepSeekMath eq. 3)
    "sequence": lambda x, mask: (x.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(x),  # GSPO
}


def importance_ratio(logp, old_logp, mask, level="token"):
    """rho = exp(IMPORTANCE_LEVELS[level] of the log-ratio). (N, T) each -> (N, T), 1 at padding (token level)"""
    _check_choice("--importance-level", level, IMPORTANCE_LEVELS)
    mask = mask.bool()
    log_ratio = torch.where(mask, _up(logp) - _up(old_logp), 0.0)  # (N, T); padding's -inf/garbage: NaN in backward
    return IMPORTANCE_LEVELS[level](log_ratio, mask).exp()  # GSPO: arXiv 2507.18071 eq. 7


def clipped_surrogate(ratio, advantages, *, eps=0.2, eps_high=None, delta=None, **_):
    """DeepSeekMath eq. 3, to maximise: min(min(rho, delta) A, clip(rho, 1 - eps, 1 + eps_high) A); eps_high > eps:
    DAPO's clip-higher (https://arxiv.org/abs/2503.14476 §3.1; None: eps); delta: INTELLECT-2's cap on a huge ratio
    with A < 0 (https://arxiv.org/abs/2505.07291 §3.2). ratio (N, T), advantages (N, 1|T) -> (N, T)"""
    eps_high = eps if eps_high is None else eps_high
    _check(delta is None or delta > 1 + eps_high, f"delta must be > 1 + eps_high = {1 + eps_high}, got {delta}")
    clipped = ratio.clamp(1 - eps, 1 + eps_high) * advantages  # (N, T)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return torch.minimum(ratio * advantages, clipped)


SURROGATES = {  # fn(ratio, A, *, logp, mask, behaviour: w or None, **Objective's fields) -> (N, T), to maximise
    "clip": clipped_surrogate,
    "cispo": _variant("cispo_surrogate"),
    "sapo": _variant("sapo_surrogate"),
    "vespo": _variant("vespo_surrogate"),
}
FOLDS_BEHAVIOUR = ("vespo",)  # surrogates that take the behaviour weights into their own weight


# --- the KL to the reference, the sampler correction, entropy
def k3(x):  # e^x - x - 1 >= 0: expm1, as exp(x) - 1 can round below x
    return torch.expm1(x) - x


def from_logits(x):  # "full": exact, summed over the vocabulary by full_kl at the head; no estimate of x gives it
    raise ValueError("kl_estimator='full' needs logits: pass kl=full_kl(logits, ref_logits) to grpo_loss")


# --kl-estimator: fn(x = ref_logp - logp, tokens from pi) -> per-token KL(pi || pi_ref) (joschu.net/blog/kl-approx.html)
KL_ESTIMATORS = {
    "k1": lambda x: -x,  # unbiased, can be negative
    "k2": lambda x: 0.5 * x.pow(2),  # biased, low variance
    "k3": k3,  # unbiased, >= 0 (DeepSeekMath eq. 4)
    "k3_clamped": lambda x: k3(x.clamp(-20, 20)).clamp(max=10),  # verl's low_var_kl: k3 for -11 < x < 2.61, no overflow
    "full": from_logits,
}


def kl_estimate(logp, ref_logp, estimator="k3_clamped"):
    """Per-token KL(pi || pi_ref) by KL_ESTIMATORS[estimator] of x = ref_logp - logp. (N, T) each -> (N, T)"""
    _check_choice("--kl-estimator", estimator, KL_ESTIMATORS)
    return KL_ESTIMATORS[estimator](_up(ref_logp) - _up(logp))


BEHAVIOUR_MODES = {  # --is-mode: fn(w = pi_train / pi_sample (N, T), the token's or (sequence_*) the row's; low, cap)
    "none": lambda w, low, cap: torch.ones_like(w),
    "token_truncate": lambda w, low, cap: w.clamp(low, cap),  # TIS
    "token_mask": lambda w, low, cap: torch.where((w < low) | (w > cap), 0.0, w),
    "sequence_truncate": lambda w, low, cap: w.clamp(low, cap),  # the row's product of ratios (TRL's, not GSPO's mean)
    "sequence_mask": lambda w, low, cap: torch.where((w < low) | (w > cap), 0.0, w),
}


def behaviour_weights(train_logp, sample_logp, mask, mode="token_truncate", cap=2.0, low=0.0):
    """Sampler/trainer mismatch (TIS, https://fengyao.notion.site/off-policy-rl; TRL vllm_importance_sampling_mode): w =
    BEHAVIOUR_MODES[mode] of exp(d_t) between low (is_cap_min, TRL's clip_min; 0: none) and cap, d_t = train_logp_t -
    sample_logp_t (sequence_*: exp(sum_t m_t d_t), the row's). A
    NaN stays NaN: the sampler scores every token, so it is a bug. (N, T) each -> (w (N, T), 1 at padding; 0-dim
    metrics: is_capped, the share of valid tokens whose w is not their ratio, dlogp_mean/p99/max of |d_t|), detached"""
    _check_choice("--is-mode", mode, BEHAVIOUR_MODES)
    _check_shape(train_logp.shape, sample_logp=sample_logp, mask=mask)
    mask = mask.bool()
    with torch.no_grad():
        d = torch.where(mask, _up(train_logp) - _up(sample_logp), 0.0)  # (N, T); padding garbage out
        ratio = (d.sum(1, keepdim=True).expand_as(d) if mode.startswith("sequence") else d).exp()  # (N, T)
        w = torch.where(mask, BEHAVIOUR_MODES[mode](ratio, low, cap), 1.0)  # (N, T)
        a, n = d.abs(), mask.sum().clamp(min=1)  # (N, T), 0-dim; metrics with no host sync
        p99 = torch.nanquantile(torch.where(mask, a, torch.nan).flatten(), 0.99)  # nanquantile skips padding
        return w, {
            "is_capped": ((w != ratio) & mask & (mode != "none")).sum() / n,
            "dlogp_mean": a.sum() / n,
            "dlogp_p99": torch.where(mask.any(), p99, 0.0),
            "dlogp_max": a.amax(),
        }


# --- aggregation and the loss: fn(l (N, T), 0 at padding, mask, num_sequences, num_tokens, max_new_tokens) -> 0-dim
AGGREGATIONS = {
    "grpo": lambda x, m, n_seq, n_tok, L: (x.sum(1) / m.sum(1).clamp(min=1)).sum() / n_seq,  # eq. 3: mean over o_i
    "bnpo": lambda x, m, n_seq, n_tok, L: x.sum() / m.sum().clamp(min=1) * (m.size(0) / n_seq),  # TRL's
    "dr_grpo": lambda x, m, n_seq, n_tok, L: x.sum() / (n_seq * L),  # Dr. GRPO, arXiv 2503.20783 §3.2
    "dapo": lambda x, m, n_seq, n_tok, L: x.sum() / torch.as_tensor(n_tok).clamp(min=1),  # DAPO eq. 8; CISPO eq. 4
    "luspo": lambda x, m, n_seq, n_tok, L: x.sum() / n_seq,  # a row's loss times its length (LUSPO, 2602.05261)
}
LOSS_TYPES = {  # --loss-type, TRL's names: (surrogate, aggregation); config key aggregation pairs another with it
    "grpo": ("clip", "grpo"),
    "bnpo": ("clip", "bnpo"),
    "dr_grpo": ("clip", "dr_grpo"),
    "dapo": ("clip", "dapo"),
    "cispo": ("cispo", "dapo"),
    "sapo": ("sapo", "grpo"),
    "luspo": ("clip", "luspo"),  # GSPO's ratio: --importance-level sequence
    "vespo": ("vespo", "dapo"),
}


def aggregate(per_token, mask, aggregation="grpo", *, num_sequences=None, num_tokens=None, max_new_tokens=None):
    """Per-token loss l (N, T) -> 0-dim by AGGREGATIONS[aggregation]. num_sequences, num_tokens: the whole batch's
    (default: this call's), so micro-batches sum to its loss (not bnpo's); max_new_tokens: the budget (default T)."""
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_shape(per_token.shape, mask=mask)
    N, T = per_token.shape
    mask = mask.bool()
    max_new_tokens = T if max_new_tokens is None else max_new_tokens
    _check(max_new_tokens >= T, f"max_new_tokens ({max_new_tokens}) must be >= the completion length T ({T})")
    n_seq = N if num_sequences is None else num_sequences
    n_tok = mask.sum() if num_tokens is None else num_tokens
    return AGGREGATIONS[aggregation](torch.where(mask, per_token, 0.0), mask, n_seq, n_tok, max_new_tokens)


@dataclass(frozen=True)
class Objective:
    """The GRPO objective (grpo.py): grpo_loss's options. eps_high None is eps, aggregation None the --loss-type's."""

    beta: Annotated[float, flag(">= 0", "KL coefficient; 0 = no reference model")] = 0.04
    kl_estimator: Annotated[str, flag(KL_ESTIMATORS, "full: exact, from the logits")] = "k3_clamped"
    loss_type: Annotated[str, flag(LOSS_TYPES, "the surrogate and its aggregation")] = "grpo"
    eps: Annotated[float, flag("[0, 1)", "clip epsilon (low)")] = 0.2
    eps_high: Annotated[float | None, flag(">= 0", "clip-higher (DAPO); None = --eps")] = None
    delta: Annotated[float | None, flag("> 1", "cap on the ratio (INTELLECT-2 two-sided clip)")] = None
    importance_level: Annotated[str, flag(IMPORTANCE_LEVELS, "sequence = GSPO")] = "token"
    entropy_coef: Annotated[float, flag(">= 0", "entropy bonus")] = 0.0
    top_entropy_quantile: Annotated[float, flag("(0, 1]", "train only the top-rho entropy tokens")] = 1.0
    is_mode: Annotated[str, flag(BEHAVIOUR_MODES, "pi_train / pi_sample")] = "token_truncate"
    is_cap: Annotated[float, Knob("> 0", "--is-mode's C (TIS: 2)")] = 2.0
    is_cap_min: Annotated[float | None, Knob("> 0", "--is-mode's lower bound (TRL's clip_min); None: none")] = None
    aggregation: Annotated[str | None, Knob(AGGREGATIONS, "pairs --loss-type's surrogate with another one")] = None
    cispo_cap: Annotated[float, Knob(">= 1", "CISPO's cap (TRL's docs: 5, as ScaleRL's eps_max)")] = 5.0
    sapo_temperature_pos: Annotated[float, Knob("> 0", "SAPO's tau for A > 0")] = 1.0
    sapo_temperature_neg: Annotated[float, Knob("> 0", "SAPO's tau for A < 0")] = 1.05
    vespo_k_pos: Annotated[float, Knob(">= 0", "VESPO's k for A >= 0")] = 2.0
    vespo_lambda_pos: Annotated[float, Knob("> 0", "VESPO's lambda for A >= 0")] = 3.0
    vespo_k_neg: Annotated[float, Knob(">= 0", "VESPO's k for A < 0")] = 3.0
    vespo_lambda_neg: Annotated[float, Knob("> 0", "VESPO's lambda for A < 0")] = 2.0
    off_policy_mask_threshold: Annotated[float | None, Knob(">= 0", "DeepSeek-V3.2's delta; None: off")] = None
    use_bias_correction_kl: Annotated[bool, Knob(None, "the KL term times rho (DeepSeek-V3.2)")] = False
    use_adaptive_entropy: Annotated[bool, Knob(None, "entropy_coef steered to entropy_target (Skywork-OR1)")] = False
    entropy_target: Annotated[float, Knob(">= 0", "use_adaptive_entropy's target entropy")] = 0.2
    entropy_coef_delta: Annotated[float, Knob(">= 0", "use_adaptive_entropy's step")] = 0.005
    entropy_coef_min: Annotated[float, Knob(">= 0", "use_adaptive_entropy's lowest coef")] = 0.0
    entropy_coef_max: Annotated[float, Knob(">= 0", "use_adaptive_entropy's highest coef")] = 1.0
    max_new_tokens: int | None = None  # dr_grpo's divisor: train.py's --max-new-tokens

    def __post_init__(self):
        for decl in declared(Objective).values():  # a direct caller's values meet the checks a flag's meet
            _check(not (why := problem(decl, getattr(self, decl.name), where(decl))), why)
        eh = self.eps if self.eps_high is None else self.eps_high
        object.__setattr__(self, "eps_high", eh)  # frozen: resolved once, here; the checks below fail on NaN too
        object.__setattr__(self, "aggregation", self.aggregation or LOSS_TYPES[self.loss_type][1])
        _check(eh >= self.eps, f"--eps-high {eh} < --eps {self.eps}: clip-higher needs eps_high >= eps")
        _check(self.delta is None or self.delta > 1 + eh, f"--delta {self.delta} must be > 1 + eps_high = {1 + eh}")
        _check(
            self.surrogate == "clip" or (self.delta is None and eh == self.eps),  # TRL ignores them
            f"--loss-type {self.loss_type} does not clip: drop --delta and --eps-high (cispo's bound is cispo_cap)",
        )
        level = {"luspo": "sequence", "vespo": "token"}.get(self.loss_type, self.importance_level)  # LUSPO: GSPO's
        _check(level == self.importance_level, f"--loss-type {self.loss_type} needs --importance-level {level}")
        folds = self.surrogate in FOLDS_BEHAVIOUR and self.is_mode.startswith("sequence")  # a row's w on every token
        _check(not folds, f"--loss-type {self.loss_type} folds --is-mode per token: not {self.is_mode}; token_*, none")
        _check(self.is_cap_min is None or self.is_cap_min < self.is_cap, f"is_cap_min must be < is_cap {self.is_cap}")
        _check(self.entropy_coef_min <= self.entropy_coef_max, "entropy_coef_min must be <= entropy_coef_max")

    @property
    def surrogate(self):  # the SURROGATES entry --loss-type names
        return LOSS_TYPES[self.loss_type][0]


def grpo_loss(
    logp,
    *,
    old_logp,
    ref_logp,
    advantages,
    mask,
    obj,
    entropy=None,
    kl=None,
    sample_logp=None,
    num_sequences=None,
    num_tokens=None,
):
    """DeepSeekMath eq. 3: l_t = -S_t e_t w_t o_t + beta KL_t (x rho: use_bias_correction_kl) - entropy_coef H_t
    (as TRL), by obj.aggregation: S_t = SURROGATES[obj.surrogate], e_t = top_entropy_mask, w_t = behaviour_weights
    (old_logp, sample_logp) or 1 (VESPO folds it in), o_t = off_policy_keep or 1. (N, T) each: logp, old_logp
    (None: logp.detach()), ref_logp or kl (kl_estimator="full": full_kl's, with grad), entropy, sample_logp; A (N,)
    or (N, T) -> (loss, detached 0-dim metrics: clip_low/high, clip, kl, kl_max, entropy, is_capped, ...)"""
    _check(logp.dim() == 2, f"logp must have shape (N, T), got {tuple(logp.shape)}")
    N, T = logp.shape
    _check_shape((N, T) if advantages.dim() == 2 else (N,), advantages=advantages)
    _check_shape(
        (N, T), mask=mask, old_logp=old_logp, ref_logp=ref_logp, entropy=entropy, kl=kl, sample_logp=sample_logp
    )
    full = obj.kl_estimator == "full"
    _check(kl is None or full, f"kl is read only with kl_estimator='full', got kl_estimator={obj.kl_estimator!r}")
    _check(not (obj.beta > 0 and full and kl is None), "kl_estimator='full' needs kl=full_kl(logits, ref_logits)")
    _check(not (obj.beta > 0 and not full and ref_logp is None), "ref_logp is required when beta > 0 (or set beta=0)")
    if obj.entropy_coef != 0 or obj.top_entropy_quantile < 1:
        _check(entropy is not None, "entropy is required when entropy_coef != 0 or top_entropy_quantile < 1")
    mask = mask.bool()
    logp = torch.where(mask, _up(logp), 0.0)  # padding zeroed: garbage there reaches neither value nor grad
    old_logp = logp.detach() if old_logp is None else old_logp
    adv = _up(advantages)[:, None] if advantages.dim() == 1 else torch.where(mask, _up(advantages), 0.0)  # (N, 1|T)
    ratio = importance_ratio(logp, old_logp, mask, obj.importance_level)  # (N, T)
    w = None  # the sampler's numerics differ from the trainer's: the policy term reweighted by w
    if sample_logp is not None:
        w, w_metrics = behaviour_weights(old_logp, sample_logp, mask, obj.is_mode, obj.is_cap, obj.is_cap_min or 0.0)
    per_token = -SURROGATES[obj.surrogate](ratio, adv, logp=logp, mask=mask, behaviour=w, **vars(obj))  # (N, T)
    if obj.top_entropy_quantile < 1:
        per_token = per_token * _variant("top_entropy_mask")(entropy, mask, obj.top_entropy_quantile)
    if w is not None and obj.surrogate not in FOLDS_BEHAVIOUR:
        per_token = per_token * torch.where(mask, w, 0.0)
    if obj.off_policy_mask_threshold is not None:  # the sampler's log-probs where given, else the old policy's
        on = sample_logp if sample_logp is not None else old_logp
        keep = _variant("off_policy_keep")(adv, logp, on, mask, obj.off_policy_mask_threshold)  # (N, 1|T)
        per_token = per_token * keep
    if obj.beta > 0:  # a caller's full KL may hold garbage at padding: aggregate and the metrics mask it
        kl = _up(kl) if full else kl_estimate(logp, torch.where(mask, _up(ref_logp), 0.0), obj.kl_estimator)  # (N, T)
        if obj.use_bias_correction_kl:  # rho is 1 on-policy in value, not in gradient: the reverse KL's
            kl = kl * ratio
        per_token = per_token + obj.beta * kl
    if obj.entropy_coef != 0:
        per_token = per_token - obj.entropy_coef * torch.where(mask, _up(entropy), 0.0)
    loss = aggregate(
        per_token,
        mask,
        obj.aggregation,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        max_new_tokens=obj.max_new_tokens,
    )
    with torch.no_grad():  # metrics: detached, no .item() (no device sync); an all-masked call gives 0, not NaN
        cispo = obj.surrogate == "cispo"  # one bound, no lower one
        low = (ratio < 1 - obj.eps) & (adv < 0) & (not cispo)  # (N, T)
        high = (ratio > (obj.cispo_cap if cispo else 1 + obj.eps_high)) & (adv > 0)  # (N, T)
        metrics = {k: _mean(x.float(), mask) for k, x in (("clip_low", low), ("clip_high", high), ("clip", low | high))}
        if obj.beta > 0:
            metrics["kl"], metrics["kl_max"] = _mean(kl, mask), _max(kl, mask)
        if entropy is not None:
            metrics["entropy"] = _mean(_up(entropy), mask)
        if sample_logp is not None:
            metrics["is_capped"] = w_metrics["is_capped"]
        if obj.off_policy_mask_threshold is not None:  # the share of rows with a token masked
            rows = mask.any(1)  # (N,)
            metrics["off_policy_masked"] = ((~keep & mask).any(1) & rows).sum() / rows.sum().clamp(min=1)
        metrics.update(ratio_mean=_mean(ratio, mask), ratio_max=_max(ratio, mask), ratio_min=-_max(-ratio, mask))
    return loss, metrics
