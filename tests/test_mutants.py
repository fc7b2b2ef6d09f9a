"""Tests that kill mutmut's survivors in grpo.py and rewards.py (`mutmut run --max-children 1 "grpo.*" "rewards.*"`;
BENCHMARKS.md lists the run and the equivalent mutants). Each docstring names the planted defect (the mutant) it
catches; the expected values are hand calculations or the papers' formulas, fp64 where a boundary must be hit
exactly."""

import math
import re

import pytest
import torch

from grpo import (
    LOSS_TYPES,
    Objective,
    aggregate,
    behaviour_weights,
    clipped_surrogate,
    grpo_loss,
    kl_estimate,
)
from gsm8k import extract_gold
from rewards import (
    RewardError,
    answers_match,
    check_fields,
    combine_rewards,
    correctness_reward,
    extract_boxed,
    format_reward,
    parse_weights,
)
from variants import cispo_surrogate, full_kl, overlong_reward, process_advantages, sapo_surrogate, top_entropy_mask

F64 = dict(dtype=torch.float64)
NO_KL = Objective(beta=0.0)


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def _raises(message, call, *args, **kwargs):
    """ValueError whose whole message is `message` (a substring match passes a message wrapped in junk)."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call(*args, **kwargs)


def _one_token(ratio, advantage):
    """logp (1, 1) with grad, old_logp 0, so rho = ratio; advantages (1,)."""
    logp = torch.tensor([[math.log(ratio)]], **F64, requires_grad=True)
    return logp, torch.zeros(1, 1, **F64), torch.tensor([advantage], **F64), torch.ones(1, 1, dtype=torch.bool)


# -----------------------------------------------------------------------------
# grpo.py: process supervision (DeepSeekMath §4.1.3)


def _process(rewards, ends, step_mask, group_size, seq_len):
    return process_advantages(
        torch.tensor(rewards, **F64), torch.tensor(ends), torch.tensor(step_mask), group_size, seq_len
    )


def test_process_advantages_two_valid_steps_use_the_unbiased_std():
    """Fails if the std's divisor is count - 1 clamped at 2 instead of 1: two valid steps, r = 0 and 1, have
    std = sqrt(0.5 / 1), so r~ = -+0.5 / (sqrt(0.5) + eps) on each token up to its step's end."""
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    adv = _process([[0.0], [1.0]], [[1], [1]], [[True], [True]], 2, 2)
    torch.testing.assert_close(adv, torch.tensor([[-a, -a], [a, a]], **F64))


def test_process_advantages_flat_group_is_exactly_zero():
    """Fails if a flat group is not found as flat (its first reward not gathered per group, any() over the whole batch,
    | for &, == for !=) or gets 1 instead of 0: three rewards 0.1 have a float mean 0.1 + 2e-17, so r - mean is not 0
    and only the flat test makes their advantage exactly 0."""
    assert torch.tensor([0.1] * 3, **F64).mean() != 0.1  # the rounding the flat test must not rely on
    adv = _process([[0.0], [1.0], [2.0], [0.1], [0.1], [0.1]], [[0]] * 6, [[True]] * 6, 3, 1)
    torch.testing.assert_close(adv[:3], torch.tensor([[-1.0], [0.0], [1.0]], **F64) / (1 + 1e-4))  # std 1
    assert torch.equal(adv[3:], torch.zeros(3, 1, **F64))


def test_process_advantages_masked_step_ends_are_never_read():
    """Fails if a masked step's end is replaced by 1 instead of 0 before the scatter: with seq_len 1 that index is out
    of range."""
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    adv = _process([[0.0, 9.0], [1.0, 9.0]], [[0, 5], [0, 7]], [[True, False], [True, False]], 2, 1)
    torch.testing.assert_close(adv, torch.tensor([[-a], [a]], **F64))


def test_process_advantages_checks_step_ends_and_step_mask_shapes():
    """Fails if process_advantages leaves step_ends or step_mask out of its shape check: a (2,) step_ends broadcasts
    silently, a (2, 3) step_mask fails later in a reshape."""
    r, ends, sm = torch.zeros(2, 2, **F64), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.bool)
    _raises("step_ends must have shape (2, 2), got (2,)", process_advantages, r, ends[0], sm, 2, 4)
    wide = torch.ones(2, 3, dtype=torch.bool)
    _raises("step_mask must have shape (2, 2), got (2, 3)", process_advantages, r, ends, wide, 2, 4)


# -----------------------------------------------------------------------------
# grpo.py: kl_estimate, behaviour_weights, top_entropy_mask, aggregate


def test_kl_estimate_full_message_whole():
    """Fails if kl_estimate's message for "full" is changed (e.g. wrapped as "XX...XX")."""
    x = torch.zeros(1, 1, **F64)
    message = "kl_estimator='full' needs logits: pass kl=full_kl(logits, ref_logits) to grpo_loss"
    _raises(message, kl_estimate, x, x, "full")


def test_behaviour_weights_defaults_truncate_at_two():
    """Fails if behaviour_weights' default cap is not TIS's 2 (e.g. 3.0): rho = 3 becomes min(3, 2) = 2."""
    w, _ = behaviour_weights(torch.tensor([[math.log(3.0)]], **F64), torch.zeros(1, 1, **F64), torch.ones(1, 1).bool())
    assert w.item() == 2.0


def test_behaviour_weights_ratio_on_the_cap_is_kept():
    """Fails if "mask" mode drops rho >= cap: rho exactly 2 = cap is not above it, so it keeps w = 2."""
    train = torch.tensor([[math.log(2.0)]], **F64)
    assert train.exp().item() == 2.0  # exact in fp64
    w, m = behaviour_weights(train, torch.zeros(1, 1, **F64), torch.ones(1, 1).bool(), "token_mask")
    assert w.item() == 2.0 and m["is_capped"].item() == 0


def test_behaviour_weights_metrics_of_one_valid_token():
    """Fails if the metrics' token count is clamped at 2 instead of 1: one valid token with d = log 3 (> log 2, capped)
    has is_capped 1 and dlogp_mean log 3."""
    train = torch.tensor([[math.log(3.0), 7.0]], **F64)  # the second token is padding
    _, m = behaviour_weights(train, torch.zeros(1, 2, **F64), torch.tensor([[True, False]]))
    assert m["is_capped"].item() == 1
    assert m["dlogp_mean"].item() == m["dlogp_max"].item() == pytest.approx(math.log(3.0), rel=1e-12)


def test_top_entropy_mask_checks():
    """Fails if top_entropy_mask accepts a quantile above 1 (e.g. <= 2) or leaves mask out of its shape check (a
    (2, 4) mask then fails later with a broadcast RuntimeError)."""
    e, m = torch.ones(2, 3, **F64), torch.ones(2, 3, dtype=torch.bool)
    _raises("top_entropy_quantile must be in (0, 1], got 1.5", top_entropy_mask, e, m, 1.5)
    _raises("mask must have shape (2, 3), got (2, 4)", top_entropy_mask, e, torch.ones(2, 4, dtype=torch.bool), 0.5)


def test_top_entropy_quantile_one_keeps_every_valid_token():
    """Fails if quantile 1 goes through the quantile (e.g. the shortcut tests quantile == 2): the threshold is then
    nanquantile's minimum, which skips a NaN entropy, so that token would be dropped; quantile 1 is the mask itself."""
    e = torch.tensor([[0.5, math.nan, 2.0]], **F64)
    m = torch.tensor([[True, True, False]])
    assert torch.equal(top_entropy_mask(e, m, 1.0), m)


def test_aggregate_default_is_grpo():
    """Fails if aggregate's default loss_type is not "grpo" (e.g. "XXgrpoXX", "GRPO": a ValueError): the mean over
    each row's valid tokens, averaged over rows: (1.5 + 4) / 2."""
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], **F64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert aggregate(per_token, mask).item() == 2.75


def test_bnpo_one_valid_token():
    """Fails if bnpo's token count is clamped at 2 instead of 1: one valid token of loss 3 averages to 3."""
    assert aggregate(torch.tensor([[3.0, 9.0]], **F64), torch.tensor([[True, False]]), "bnpo").item() == 3.0


# -----------------------------------------------------------------------------
# grpo.py: surrogates' defaults and their arguments as grpo_loss passes them


def test_cispo_default_cap_is_five():
    """Fails if cispo_surrogate's default cap is not 5 (TRL's docs, ScaleRL's eps_max), e.g. cap=6.0."""
    ratio = torch.tensor([[4.0, 5.5, 7.0]], **F64)
    out = cispo_surrogate(ratio, torch.ones(1, 1, **F64), logp=torch.ones(1, 3, **F64))
    torch.testing.assert_close(out, torch.tensor([[4.0, 5.0, 5.0]], **F64))  # min(rho, 5) * A * logp


def test_sapo_default_temperatures_are_the_papers():
    """Fails if sapo_surrogate's defaults are not SAPO's tau_pos = 1.0, tau_neg = 1.05 (e.g. 2.0 or 2.05)."""
    ratio = torch.tensor([[1.5, 1.5]], **F64)
    A = torch.tensor([[1.0, -1.0]], **F64)
    f = [_sigmoid(tau * 0.5) * 4 / tau for tau in (1.0, 1.05)]  # f(1.5) = sigmoid(tau (1.5 - 1)) 4 / tau
    torch.testing.assert_close(sapo_surrogate(ratio, A), torch.tensor([[f[0], -f[1]]], **F64))


def test_grpo_loss_passes_sapo_negative_temperature():
    """Fails if grpo_loss drops obj.sapo_temperature_neg (sapo_surrogate then uses its default 1.05)."""
    logp, old, adv, mask = _one_token(1.5, -1.0)
    obj = Objective(beta=0, loss_type="sapo", sapo_temperature_neg=2.0)
    loss, _ = grpo_loss(logp, old_logp=old, ref_logp=None, advantages=adv, mask=mask, obj=obj)
    assert loss.item() == pytest.approx(_sigmoid(2.0 * 0.5) * 4 / 2.0, rel=1e-12)  # -f(1.5) A, A = -1, tau = 2


def test_grpo_loss_passes_delta():
    """Fails if grpo_loss drops obj.delta (INTELLECT-2's cap): rho = 10, A = -1 gives min(min(10, 4) A, 1.2 A) = -4,
    not -10."""
    logp, old, adv, mask = _one_token(10.0, -1.0)
    loss, _ = grpo_loss(logp, old_logp=old, ref_logp=None, advantages=adv, mask=mask, obj=Objective(beta=0, delta=4.0))
    assert loss.item() == pytest.approx(4.0, rel=1e-12)


def test_clipped_surrogate_default_eps_is_the_papers():
    """Fails if clipped_surrogate's default eps is not 0.2 (DeepSeekMath eq. 3; e.g. 1.2): rho = 0.5 with A = -1 is
    clipped to 1 - 0.2 = 0.8, min(0.5 A, 0.8 A) = -0.8; rho = 1.5 with A = 1 to 1.2."""
    out = clipped_surrogate(torch.tensor([[0.5, 1.5]], **F64), torch.tensor([[-1.0, 1.0]], **F64))
    torch.testing.assert_close(out, torch.tensor([[-0.8, 1.2]], **F64))


def test_grpo_loss_passes_is_cap_and_reports_is_capped():
    """Fails if grpo_loss drops obj.is_cap (behaviour_weights then caps at its default 2) or logs the capped fraction
    under another key than "is_capped": with rho = 1, A = 1 and pi_train / pi_sample = 2.5 and 4 under is_cap = 3 the
    weights are 2.5 and 3, the loss -(2.5 + 3) / 2 = -2.75 (not -2), one token of two capped."""
    logp = torch.zeros(1, 2, **F64, requires_grad=True)
    sample_logp = torch.tensor([[-math.log(2.5), -math.log(4.0)]], **F64)  # old_logp - sample_logp = log 2.5, log 4
    mask = torch.ones(1, 2, dtype=torch.bool)
    obj = Objective(beta=0, is_cap=3.0)
    loss, metrics = grpo_loss(
        logp,
        old_logp=torch.zeros(1, 2, **F64),
        ref_logp=None,
        advantages=torch.ones(1, **F64),
        mask=mask,
        obj=obj,
        sample_logp=sample_logp,
    )
    assert loss.item() == pytest.approx(-2.75, rel=1e-12)
    assert metrics["is_capped"].item() == 0.5


def test_objective_bounds_accept_their_edge_and_name_the_choices():
    """Fails if Objective rejects cispo_cap = 1 (> 1 for >= 1) or is_cap = 0.5 (> 1 for > 0), if the sapo
    temperatures' message is changed (e.g. wrapped as "XX...XX"), or if a bad choice's message does not list the
    choices joined by ", " (_check_choice)."""
    assert Objective(loss_type="cispo", cispo_cap=1.0).cispo_cap == 1.0  # weight min(rho, 1): a valid, tight cap
    assert Objective(is_cap=0.5).is_cap == 0.5  # TIS with a cap below 1 is a valid choice
    _raises("config key cispo_cap must be >= 1, got 0.5", Objective, cispo_cap=0.5)
    _raises("config key is_cap must be > 0, got 0.0", Objective, is_cap=0.0)
    _raises(
        "config key sapo_temperature_neg must be > 0, got 0.0", Objective, loss_type="sapo", sapo_temperature_neg=0.0
    )
    with pytest.raises(ValueError) as e:
        Objective(loss_type="ppo")
    assert f"--loss-type 'ppo': choose from {', '.join(LOSS_TYPES)}" in str(e.value)


def test_entropy_coef_bounds_message_whole():
    """Fails if Objective's entropy_coef_min <= entropy_coef_max message is changed (e.g. wrapped as "XX...XX")."""
    _raises("entropy_coef_min must be <= entropy_coef_max", Objective, entropy_coef_min=0.5, entropy_coef_max=0.25)


def test_delta_just_above_one_plus_eps_high_is_accepted():
    """Fails if clipped_surrogate's check is delta > 2 + eps_high: delta = 2 > 1.2 is valid and caps rho at 2."""
    ratio = torch.tensor([[3.0, 1.5]], **F64)
    A = torch.tensor([[-1.0, -1.0]], **F64)
    out = clipped_surrogate(ratio, A, eps=0.2, delta=2.0)
    torch.testing.assert_close(out, torch.tensor([[-2.0, -1.5]], **F64))  # min(min(rho, 2) A, clip(rho) A)


def test_delta_equal_to_one_plus_eps_high_is_rejected():
    """Fails if delta = 1 + eps_high passes (>= for >), or the message gives another bound (1 - eps_high, 2 +
    eps_high), in clipped_surrogate or Objective; Objective(delta=2) is valid (fails if the check is > 2 + eps_high)."""
    assert 1 + 0.2 == 1.2  # the bound is hit exactly
    x = torch.ones(1, 1, **F64)
    _raises("delta must be > 1 + eps_high = 1.2, got 1.2", clipped_surrogate, x, x, eps=0.2, delta=1.2)
    _raises("--delta 1.2 must be > 1 + eps_high = 1.2", Objective, delta=1.2)
    assert Objective(delta=2.0).delta == 2.0


def test_full_kl_token_with_probability_zero_adds_zero():
    """Fails if full_kl keeps a token pi gives probability 0 (a -inf logit, e.g. top-k's cut): 0 * (-inf - x) is NaN
    (`logq >= -inf`), or the masked term is 1 instead of 0. pi = (1, 0), pi_ref = (1/2, 1/2): KL = log 2; a token
    both cut (-inf against -inf) adds 0 too: pi = pi_ref = (1, 0), KL = 0."""
    inf = math.inf
    logits = torch.tensor([[[0.0, -inf], [0.0, -inf]]], **F64)  # (1, 2, V=2)
    ref = torch.tensor([[[0.0, 0.0], [0.0, -inf]]], **F64)
    torch.testing.assert_close(full_kl(logits, ref), torch.tensor([[math.log(2), 0.0]], **F64))


# -----------------------------------------------------------------------------
# grpo.py: the checks' messages (a substring match passes the "XX...XX"-wrapped mutants)


X, ADV, MASK = torch.zeros(2, 3, **F64), torch.zeros(2, **F64), torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    "obj, message",
    [
        (Objective(kl_estimator="full"), "kl_estimator='full' needs kl=full_kl(logits, ref_logits)"),
        (Objective(), "ref_logp is required when beta > 0 (or set beta=0)"),
        (Objective(beta=0, entropy_coef=0.1), "entropy is required when entropy_coef != 0 or top_entropy_quantile < 1"),
    ],
)
def test_grpo_loss_missing_input_messages_whole(obj, message):
    """Fails if a grpo_loss check's message is changed (e.g. wrapped as "XX...XX")."""
    _raises(message, grpo_loss, X, old_logp=None, ref_logp=None, advantages=ADV, mask=MASK, obj=obj)


def test_grpo_loss_logp_shape_message():
    """Fails if the message of grpo_loss's logp check is lost (None)."""
    _raises(
        "logp must have shape (N, T), got (3,)",
        grpo_loss,
        X[0],
        old_logp=None,
        ref_logp=None,
        advantages=ADV,
        mask=MASK,
        obj=NO_KL,
    )


def test_grpo_loss_checks_mask_and_entropy_shapes():
    """Fails if grpo_loss's shape check leaves out mask or entropy: a (2, 4) mask then fails later with a broadcast
    RuntimeError, and a (1, 3) or (3,) entropy broadcasts silently into a wrong loss."""
    wide = torch.ones(2, 4, dtype=torch.bool)
    _raises(
        "mask must have shape (2, 3), got (2, 4)",
        grpo_loss,
        X,
        old_logp=None,
        ref_logp=None,
        advantages=ADV,
        mask=wide,
        obj=NO_KL,
    )
    obj = Objective(beta=0, entropy_coef=0.1)
    for entropy in (torch.ones(1, 3, **F64), torch.ones(3, **F64), torch.ones(2, 4, **F64)):
        shape = tuple(entropy.shape)
        _raises(
            f"entropy must have shape (2, 3), got {shape}",
            grpo_loss,
            X,
            old_logp=None,
            ref_logp=None,
            advantages=ADV,
            mask=MASK,
            obj=obj,
            entropy=entropy,
        )


# -----------------------------------------------------------------------------
# grpo.py: clip metrics, TRL's definition: low = rho < 1 - eps with A < 0, high = rho > 1 + eps_high with A > 0
# (cispo: rho > cispo_cap with A > 0, no low); a token on the bound keeps its gradient, so it is not clipped


def _metrics(ratios, advantages, obj):
    """grpo_loss on one row of exact fp64 ratios (old_logp 0) and per-token advantages: (metrics, d loss / d logp)."""
    logp = torch.tensor([[math.log(r) for r in ratios]], **F64, requires_grad=True)
    adv = torch.tensor([advantages], **F64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, metrics = grpo_loss(logp, old_logp=torch.zeros_like(adv), ref_logp=None, advantages=adv, mask=mask, obj=obj)
    (grad,) = torch.autograd.grad(loss, logp)
    return metrics, grad[0]


def test_clip_metrics_exclude_a_ratio_on_the_bound():
    """Fails if clip_low counts rho <= 1 - eps or clip_high counts rho >= 1 + eps_high: rho exactly 0.5 with A < 0 and
    exactly 1.5 with A > 0 (eps = 0.5) keep their gradient -A rho / T."""
    ratios, A = [0.5, 1.5], [-1.0, 1.0]
    assert (0.5, 1.5) == tuple(math.exp(math.log(r)) for r in ratios)  # exact in fp64: the bound is hit
    metrics, grad = _metrics(ratios, A, Objective(beta=0, eps=0.5))
    assert (metrics["clip_low"].item(), metrics["clip_high"].item(), metrics["clip"].item()) == (0, 0, 0)
    torch.testing.assert_close(grad, torch.tensor([0.25, -0.75], **F64))  # -A rho / 2: not clipped


def test_clip_metrics_need_the_advantage_sign():
    """Fails if clip_low counts A <= 0 or A < 1 (any A below 1), or clip_high counts A >= 0: a token with A = 0 or
    with A > 0 below the low bound is never clipped (min picks rho A there)."""
    ratios, A = [0.5, 2.0, 0.5, 0.5], [0.0, 0.0, 0.5, -1.0]
    metrics, _ = _metrics(ratios, A, Objective(beta=0))  # eps 0.2: 0.5 < 0.8, 2 > 1.2
    assert (metrics["clip_low"].item(), metrics["clip_high"].item(), metrics["clip"].item()) == (0.25, 0, 0.25)


def test_cispo_clip_metrics_use_its_cap_and_have_no_low_bound():
    """Fails if the metrics treat cispo as the clip of eq. 3 (cispo flag lost, "cispo" misspelt, or the cap branch
    dropped): rho 0.5 with A < 0 is no clip_low, rho 3 with A > 0 is under the cap 5, rho 6 is above it."""
    metrics, _ = _metrics([0.5, 3.0, 6.0], [-1.0, 1.0, 1.0], Objective(beta=0, loss_type="cispo"))
    assert metrics["clip_low"].item() == 0
    assert metrics["clip_high"].item() == metrics["clip"].item() == pytest.approx(1 / 3, rel=1e-6)


# -----------------------------------------------------------------------------
# rewards.py: extraction


def test_extract_gold_takes_the_text_after_the_last_marker():
    """Fails if extract_gold splits at the first `####` (split) or the middle one (rsplit with maxsplit 2 or none)."""
    assert extract_gold("#### 1\n#### 2\n#### 3") == "3"


def test_extract_gold_messages_whole():
    """Fails if extract_gold's message is changed or shows other than the solution's last 80 characters
    (text[+80:], text[-81:])."""
    _raises("no '#### <answer>' line in solution: 'no final line'", extract_gold, "no final line")
    _raises("nothing after '####' in solution: '2 + 2 = 4\\n#### '", extract_gold, "2 + 2 = 4\n#### ")
    long = "".join(chr(ord("a") + i % 26) for i in range(100))  # 100 characters, no marker
    _raises(f"no '#### <answer>' line in solution: {long[20:]!r}", extract_gold, long)


def test_extract_boxed_without_a_box_is_none():
    """Fails if extract_boxed scans the text when there is no `\\boxed{`: "a} 5" would give "a"."""
    assert extract_boxed("a} 5") is None


# -----------------------------------------------------------------------------
# rewards.py: answers_match


@pytest.mark.parametrize("gold", ["None", "XXXX", "0", ""])
def test_none_prediction_never_matches(gold):
    """Fails if a None prediction is read as a string: str(None) = "None", or a placeholder such as "XXXX"."""
    assert answers_match(None, gold) is False


@pytest.mark.parametrize(
    "pred, gold, same",
    [
        ("1\\!000", "1000", True),  # LaTeX negative thin space
        ("1\\,000", "1000", True),  # thin space
        ("1\\ 000", "1000", True),  # control space
        ("1000", "$1,000", True),  # the gold is cleaned too
        ("1000", "1\\,000", True),
        ("Paris.", "Paris", True),  # a trailing `.`, on either side, as a string
        ("Paris", "Paris.", True),
        (".5", "0.5", True),  # a leading `.` is kept: .5 is a number
        ("0.5", ".5", True),
        ("IX", "I", False),  # only `.` is stripped: roman numerals are strings
        ("I", "IX", False),
    ],
)
def test_answers_match_cleaning(pred, gold, same):
    """Fails if a LaTeX space (\\! \\, \\ ) is not removed, the gold is cleaned differently from the prediction, or
    the trailing-dot strip takes whitespace (rstrip()), the left end (lstrip) or more than `.` (e.g. "X")."""
    assert answers_match(pred, gold) is same


# -----------------------------------------------------------------------------
# rewards.py: overlong_reward's bounds


def test_overlong_reward_smallest_valid_arguments():
    """Fails if overlong_reward rejects max_len = 1 (max_len <= 1, < 2) or buffer = 1 (1 < buffer):
    R = 0 for |y| <= L - B, (L - B - |y|) / B up to L, -1 after (DAPO eq. 13)."""
    assert overlong_reward(1, 1)(["a"] * 3, num_tokens=[0, 1, 2]) == [0.0, -1.0, -1.0]
    assert overlong_reward(8, 1)(["a"] * 3, num_tokens=[7, 8, 9]) == [0.0, -1.0, -1.0]


# -----------------------------------------------------------------------------
# rewards.py: parse_weights (train.py's --reward-weights)

FNS = {"correct": correctness_reward, "format": format_reward}


def test_parse_weights():
    """Fails if parse_weights drops, mis-splits (at "," or the first "=") or mis-converts an item, or reads an empty
    spec as one item."""
    assert parse_weights("correct=1,format=0.1", FNS) == {"correct": 1.0, "format": 0.1}
    assert parse_weights("format=-2.5e-1", FNS) == {"format": -0.25}
    assert parse_weights("", FNS) == {} and parse_weights(None, FNS) == {}
    # the name is the text before the first "=": "a=b=1" names "a" with the number "b=1"
    with pytest.raises(ValueError, match="'a=b=1' is not name=number"):
        parse_weights("a=b=1", {"a=b": format_reward})


@pytest.mark.parametrize("item", ["corect=1", "correct=x", "correct=", "correct", "correct=nan", "format=inf"])
def test_parse_weights_names_the_bad_item(item):
    """Fails if an unknown name or a weight that is not a finite number passes, or the error is not the one-line
    ValueError naming the item and the known names (its message lost, or a TypeError from a None weight)."""
    _raises(
        f"--reward-weights: '{item}' is not name=number with name in ['correct', 'format']", parse_weights, item, FNS
    )


# -----------------------------------------------------------------------------
# rewards.py: combine_rewards' errors


def _reward_error(fns, completions, **fields):
    with pytest.raises(RewardError) as e:
        combine_rewards(fns, {name: 1.0 for name in fns}, completions, **fields)
    return str(e.value)


def test_completion_of_exactly_sixty_characters_is_shown_whole():
    """Fails if _show adds "..." to a completion of exactly `width` (60) characters, which was not cut."""
    text = "x" * 60
    msg = _reward_error({"judge": lambda c, **_: [math.nan]}, [text])
    assert (
        msg
        == f"reward 'judge' gave nan (float) for completion 0 {text!r}, not a finite number; return a list of 1 numbers"
    )


def test_blame_passes_a_scalar_field_whole():
    """Fails if _blame slices a field that is not a list (scale=2 -> 2[0:1], a TypeError on completion 0) when it
    looks for the first completion the fn raises on (completion 1: 1 / 0)."""

    def inverse(completions, answer, scale, **_):
        return [1 / (int(a) * scale) for a in answer]

    msg = _reward_error({"inverse": inverse}, ["a", "b"], answer=["1", "0"], scale=2)
    assert msg == (
        "reward 'inverse' raised ZeroDivisionError: division by zero on completion 1 'b'; "
        "fix the function or its weight"
    )


def test_one_element_tensor_is_not_a_number():
    """Fails if _number unpacks anything with .item() (ndim == 0 or has .item): a 1-element 1-D tensor per completion
    is a list of tensors, not a number, and is reported."""
    msg = _reward_error({"judge": lambda c, **_: [torch.tensor([1.0]), torch.tensor([0.0])]}, ["a", "b"])
    assert msg == (
        "reward 'judge' gave tensor([1.]) (Tensor) for completion 0 'a', not a finite number; "
        "return a list of 2 numbers"
    )


def test_raised_message_is_cut_at_200_characters():
    """Fails if a reward fn's error is cut at other than 200 characters (e.g. 201)."""

    def loud(completions, **_):
        raise ValueError("x" * 300)

    msg = _reward_error({"loud": loud}, ["a"])
    shown = ("ValueError: " + "x" * 300)[:200]
    assert msg == f"reward 'loud' raised {shown} on completion 0 'a'; fix the function or its weight"


# -----------------------------------------------------------------------------
# rewards.py: check_fields (train.py's check that the task gives each reward fn its fields)


def test_check_fields_names_the_first_missing_field_and_what_the_task_gives():
    """Fails if check_fields skips a field the fn asks for (params[2:], missing = None), asks for one with a default
    (`is not p.empty`), names other than the first missing field (missing[1]), or its message loses the field, the
    fn's name or the task's fields, sorted and joined by ", " (None, sorted(None), "XX, XX")."""

    def judge(completions, answer, num_tokens, *extra, hint=None, **_):  # answer, num_tokens: no default
        return [0.0] * len(completions)

    check_fields({"judge": judge}, {"num_tokens", "answer"})  # everything it asks for: no error
    check_fields({"judge": judge}, {"num_tokens", "answer", "hint"})
    with pytest.raises(ValueError) as e:
        check_fields({"judge": judge}, {"prompt", "b"})  # hint has a default, *extra and **_ are no fields
    message = str(e.value)
    assert "'judge'" in message and "the field 'answer'" in message  # the first of answer, num_tokens
    assert "(it gives b, prompt)" in message and "give it a default or drop the reward's weight" in message
