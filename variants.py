"""The published departures from GRPO that a run names (grpo.py's dicts point here, imported at first use, so a run
that names none reads none of it): surrogates, advantages, masks and controllers, pure tensor functions. Each
docstring gives its source; README lists them by flag. Shapes as grpo.py's: N rows in groups of G, T tokens."""

import math
from dataclasses import dataclass

import torch


def _check(ok, message):
    if not ok:
        raise ValueError(message)


def _up(x):  # exp/ratio math in at least fp32, as grpo.py's
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# --- advantages
def normalize_then_sum(rewards, weights, group_size, eps=1e-4):
    """GDPO (arXiv 2601.05242; TRL's multi_objective_aggregation="normalize_then_sum"): each reward fn's rewards
    normalised in their group (unbiased std; a group where the fn is flat: 0), weighted, summed, then normalised over
    the batch (unbiased std, as TRL); a group flat in every weighted fn exactly 0. rewards (N, K), weights (K,) -> (A
    (N,), the share of such groups)"""
    r = _up(rewards).unflatten(0, (-1, group_size))  # (N/G, G, K)
    flat = (r == r[:, :1]).all(1)  # (N/G, K): exact, as grpo.informative_groups
    per_fn = torch.where(flat[:, None], 0.0, (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps))
    total = (per_fn * weights.to(per_fn)).sum(-1).flatten()  # (N,)
    flat = (flat | (weights == 0)).all(1)  # (N/G,)
    adv = (total - total.mean()) / (total.std() + eps)  # (N,)
    return torch.where(flat.repeat_interleave(group_size), 0.0, adv), flat.float().mean()


def pick_rows(informative, count, group_size):
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2): the first `count` informative groups, topped up with the last flat
    ones, in sampling order. informative (groups,) bool -> (their rows (count * G,), keep: False on a flat group's)"""
    groups = torch.cat([informative.nonzero(), (~informative).nonzero().flip(0)])[:count, 0].sort().values  # (count,)
    rows = (groups[:, None] * group_size + torch.arange(group_size)).flatten()  # (count * G,)
    return rows, informative[groups].repeat_interleave(group_size)


def overlong_reward(max_len, buffer):
    """DAPO's overlong penalty (arXiv 2503.14476, eq. 13): R = 0 if |y| <= L - B, (L - B - |y|) / B if |y| <= L, else -1
    >>> overlong_reward(48, 16)(["a"] * 4, num_tokens=[32, 33, 40, 49])
    [0.0, -0.0625, -0.5, -1.0]"""
    if max_len < 1 or not 0 < buffer <= max_len:
        raise ValueError(f"overlong reward needs max_len >= 1 and 0 < buffer <= max_len, got {max_len=}, {buffer=}")

    def overlong(completions, num_tokens, **_):  # L = max_len, B = buffer, |y| = num_tokens (stop token included)
        return [min(0.0, (max_len - buffer - n) / buffer) if n <= max_len else -1.0 for n in num_tokens]

    return overlong


def process_advantages(step_rewards, step_ends, step_mask, group_size, seq_len, eps=1e-4):
    """Process supervision (DeepSeekMath §4.1.3): step j of an output ends at token step_ends[j] with reward r_j;
    r~_j = (r_j - mean) / (std + eps) over the valid steps of the group's G outputs (unbiased std), A_t = sum of r~_j
    over steps with step_ends[j] >= t. step_rewards, step_ends (long), step_mask (N, S) -> advantages (N, seq_len)"""
    N, S = step_rewards.shape
    for name, x in (("step_ends", step_ends), ("step_mask", step_mask)):
        _check(x.shape == (N, S), f"{name} must have shape {(N, S)}, got {tuple(x.shape)}")
    ok = isinstance(group_size, int) and group_size >= 2 and N % group_size == 0  # a group of one has no baseline
    _check(ok, f"group_size must be an int >= 2 that divides the number of rows ({N}), got {group_size!r}")
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


# --- surrogates
def vespo_surrogate(
    ratio, advantages, *, logp, mask, behaviour=None, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, **_
):
    """VESPO (https://arxiv.org/abs/2602.10693; TRL's get_gamma_weights), to maximise sg(phi(w)) A log pi: w the row's
    prod_t rho_t (token rho; times the behaviour weights w_t: folded in, not applied after), phi(w) = e^lam w^k
    e^(-lam w), phi(1) = 1, (k, lam) = the _pos pair if A >= 0 else _neg; log w clamped to [log 1e-8, 20], each log
    rho_t to [-20, 20], as TRL. ratio, logp, mask (N, T), A (N, 1|T), behaviour (N, T) or None -> (N, T)"""
    with torch.no_grad():
        low = math.log(1e-8)
        log_w = torch.where(mask, ratio.log().clamp(-20, 20), 0.0).sum(1, keepdim=True)  # (N, 1)
        if behaviour is not None:
            log_w = log_w + torch.where(mask, behaviour.log().clamp(low, 20), 0.0).sum(1, keepdim=True)
        log_w = log_w.clamp(low, 20)
        k = torch.where(advantages >= 0, log_w.new_tensor(vespo_k_pos), vespo_k_neg)  # (N, 1|T) in log_w's dtype
        lam = torch.where(advantages >= 0, log_w.new_tensor(vespo_lambda_pos), vespo_lambda_neg).clamp(min=1e-4)
        phi = (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(0.0, 0.0, 0.0)  # (N, 1|T)
    return phi * advantages * logp


def cispo_surrogate(ratio, advantages, *, logp, cispo_cap=5.0, **_):
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585 §3.1 eq. 4-5), to maximise sg(min(rho, cap)) A log pi: the
    weight is detached, a clipped token keeps its gradient; no lower bound. ratio, logp (N, T), A (N, 1|T) -> (N, T)"""
    return ratio.clamp(max=cispo_cap).detach() * advantages * logp


def sapo_surrogate(ratio, advantages, *, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, **_):
    """SAPO (https://arxiv.org/abs/2511.20347 §3), to maximise f(rho) A, f(x) = sigmoid(tau (x - 1)) 4 / tau with
    tau = tau_pos if A > 0 else tau_neg: a soft gate for the clip, f'(1) = 1. ratio (N, T), A (N, 1|T) -> (N, T)"""
    tau = torch.where(advantages > 0, ratio.new_tensor(sapo_temperature_pos), sapo_temperature_neg)  # in ratio's dtype
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


# --- masks, the exact KL, entropy
def off_policy_keep(advantages, logp, sample_logp, mask, threshold):
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556 eq. 9; TRL's get_off_policy_mask): a row keeps its
    policy loss unless A < 0 and its mean over valid tokens of log pi_sample - log pi (detached) exceeds threshold.
    advantages (N, 1|T), logp, sample_logp, mask (N, T) -> bool (N, 1|T)"""
    d = torch.where(mask, _up(sample_logp) - logp.detach(), 0.0)  # (N, T)
    kl = d.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (N, 1)
    return (advantages >= 0) | (kl <= threshold)


def top_entropy_mask(entropy, mask, quantile):
    """The policy term on high-entropy "forking" tokens only (https://arxiv.org/abs/2506.01939): valid tokens with
    H_t >= the (1 - quantile) quantile over them (linear, as TRL; 0.2: top 20%). entropy, mask (N, T) -> bool (N, T)"""
    _check(0 < quantile <= 1, f"top_entropy_quantile must be in (0, 1], got {quantile}")
    _check(entropy.shape == mask.shape, f"mask must have shape {tuple(entropy.shape)}, got {tuple(mask.shape)}")
    mask = mask.bool()
    if quantile == 1:
        return mask
    h = torch.where(mask, _up(entropy.detach()), torch.nan)  # (N, T)
    threshold = torch.nanquantile(h.flatten(), 1 - quantile)  # nan quantile skips padding, no host sync
    return mask & (h >= threshold)


def full_kl(logits, ref_logits, mask=None):
    """Exact per-token KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)) in fp32; a token both give p = 0 adds
    0. The caller bounds memory (a chunk). logits, ref_logits (N, T, V), mask (N, T) or None -> (N, T)"""
    _check(logits.shape == ref_logits.shape, f"ref_logits must have shape {tuple(logits.shape)}")
    logq, logq_ref = _up(logits).log_softmax(-1), _up(ref_logits).log_softmax(-1)  # (N, T, V)
    kl = torch.where(logq > -torch.inf, logq.exp() * (logq - logq_ref), 0.0).sum(-1)  # (N, T)
    return kl if mask is None else torch.where(mask.bool(), kl, 0.0)


@dataclass
class EntropyControl:
    """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312 §3.2; TRL's use_adaptive_entropy): after each optimizer
    step, coef + delta if its mean entropy <= target, else coef - delta, within [low, high]; the bonus applies the coef
    only while the last entropy is <= target (none before the first measurement). A checkpoint keeps coef and last."""

    coef: float
    target: float
    delta: float
    low: float
    high: float
    last: float = math.inf  # the last optimizer step's mean entropy

    @classmethod
    def of(cls, obj):  # from a grpo.Objective's knobs, its entropy_coef the start
        return cls(
            obj.entropy_coef, obj.entropy_target, obj.entropy_coef_delta, obj.entropy_coef_min, obj.entropy_coef_max
        )

    def applied(self):  # the entropy_coef this optimizer step's loss uses
        return self.coef if self.last <= self.target else 0.0

    def update(self, entropy):
        step = self.delta if entropy <= self.target else -self.delta
        self.coef, self.last = min(self.high, max(self.low, self.coef + step)), entropy

    def state_dict(self):
        return {"coef": self.coef, "last": self.last}

    def load_state_dict(self, state):
        self.coef, self.last = state["coef"], state["last"]


# --- sampling: the kept set of top_k / top_p / min_p (rollout.Sampler's), a bit a vocabulary entry
def kept_set(z, top_k, top_p, min_p):  # rollout.Sampler's knobs
    """The tokens a truncated sampler may draw, from its logits z (N, V): the top_k likeliest (0: all), then of those,
    renormalised, the likeliest whose mass before them is < top_p (nucleus), then those with q >= min_p x the top
    q; the likeliest always kept, ties in token order. -> bool (N, V)"""
    s, order = z.sort(dim=-1, descending=True, stable=True)  # (N, V)
    kept = torch.arange(z.size(-1), device=z.device) < (top_k or z.size(-1))  # (V,)
    q = s.masked_fill(~kept, -torch.inf).softmax(-1)  # (N, V)
    kept = kept & (q >= (min_p or 0.0) * q[:, :1])  # (N, V)
    if top_p < 1:  # never tested at 1: a float sum may reach 1 before the last token
        kept = kept & (q.cumsum(-1) - q < top_p)
    return torch.zeros_like(kept).scatter(-1, order, kept)  # (N, V) in vocabulary order


def pack(kept):  # bool (..., V) -> uint8 (..., ceil(V / 8)): a bit a vocabulary entry
    kept = torch.nn.functional.pad(kept, (0, -kept.size(-1) % 8)).unflatten(-1, (-1, 8))  # (..., V/8, 8)
    return (kept * (1 << torch.arange(8, device=kept.device))).sum(-1).to(torch.uint8)


def unpack(bits, V):  # pack's inverse: uint8 (..., V/8) -> bool (..., V)
    return (bits[..., None].long() >> torch.arange(8, device=bits.device) & 1).bool().flatten(-2)[..., :V]
