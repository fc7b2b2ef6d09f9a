"""Every flag's choices are a dict of name -> function; these tests run over each dict, so a fork's new entry gets the
shared checks with no test edited. Each property holds for any correct entry (a baseline, a surrogate, an
aggregation, a KL estimator, a sampler correction, a reward, a learning-rate schedule); where the test knows an
entry's formula it checks the value too."""

import dataclasses
import math

import pytest
import torch

import grpo
import rewards
from grpo import Objective, aggregate, behaviour_weights, grpo_loss, importance_ratio
from rollout import Sampler

F64 = dict(dtype=torch.float64)


def _ragged(seed=0, lengths=(5, 2, 4, 6), T=6):
    """logp (N, T) fp64, mask (N, T) bool, advantages (N,)."""
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(len(lengths), T, generator=g, **F64)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    return logp, mask, torch.randn(len(lengths), generator=g, **F64)


# -----------------------------------------------------------------------------
# --scale-rewards: grpo.ADVANTAGES


def _unbiased_std(r):
    return r.std(1, keepdim=True)


HAND_ADVANTAGES = {  # the formulas of the shipped entries, written from their sources
    "group": lambda r: (r - r.mean(1, keepdim=True)) / (_unbiased_std(r) + 1e-4),
    "batch": lambda r: (r - r.mean(1, keepdim=True)) / (r.flatten().std() + 1e-4),
    "none": lambda r: r - r.mean(1, keepdim=True),
}


@pytest.mark.parametrize("name", grpo.ADVANTAGES)
def test_advantages_zero_a_flat_group_keep_order_and_follow_the_rewards(name):
    """Fails if an entry gives a flat group (equal rewards: no signal) anything but exactly 0, reorders a group's
    rewards (a better completion a lower advantage), depends on the order of the rows within a group, or, for the
    shipped entries, departs from its formula."""
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5, 2.0, -1.0, 0.5], **F64)  # 3 groups of 3, the first flat
    adv, frac = grpo.group_advantages(r, 3, name)
    assert adv.shape == (9,) and torch.isfinite(adv).all() and frac.item() == pytest.approx(1 / 3)
    assert torch.equal(adv[:3], torch.zeros(3, **F64))
    for g in (1, 2):  # strictly better reward, strictly larger advantage
        a, x = adv[3 * g : 3 * g + 3], r[3 * g : 3 * g + 3]
        order = x.argsort()
        assert (a[order].diff() > 0).all(), (name, a, x)
    perm = torch.tensor([0, 1, 2, 5, 3, 4, 7, 8, 6])  # rows permuted within each group
    torch.testing.assert_close(grpo.group_advantages(r[perm], 3, name)[0], adv[perm])
    if name in HAND_ADVANTAGES:
        want = HAND_ADVANTAGES[name](r.view(3, 3)).view(-1)
        torch.testing.assert_close(adv, torch.where(torch.arange(9) < 3, 0.0, want))


# -----------------------------------------------------------------------------
# --kl-estimator: grpo.KL_ESTIMATORS


@pytest.mark.parametrize("name", [k for k in grpo.KL_ESTIMATORS if k != "full"])  # full: exact, from logits
def test_kl_estimators_are_zero_on_the_reference_nonnegative_in_expectation_and_finite(name):
    """Fails if an entry is not 0 where pi = pi_ref, if its exact expectation under pi (sum_v pi(v) k(x_v)) is
    negative for some pi != pi_ref (no KL estimate is), or if it or its gradient overflows for |x| <= 20 in fp32."""
    logp = -3 * torch.rand(50, generator=torch.Generator().manual_seed(0), **F64)
    assert torch.equal(grpo.kl_estimate(logp, logp, name), torch.zeros(50, **F64))
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        p, q = (
            torch.randn(7, generator=g, **F64).mul(2).log_softmax(0),
            torch.randn(7, generator=g, **F64).log_softmax(0),
        )
        assert (p.exp() * grpo.kl_estimate(p, q, name)).sum() >= 0
    x = torch.linspace(-20, 20, 81)
    lp = torch.zeros(81, requires_grad=True)
    k = grpo.kl_estimate(lp, x, name)
    (grad,) = torch.autograd.grad(k.sum(), lp)
    assert torch.isfinite(k).all() and torch.isfinite(grad).all()


# -----------------------------------------------------------------------------
# --loss-type: grpo.LOSS_TYPES = (SURROGATES entry, AGGREGATIONS entry); the config key aggregation pairs them


@pytest.mark.parametrize("name", grpo.LOSS_TYPES)
def test_each_loss_type_names_a_surrogate_and_an_aggregation(name):
    """Fails if a --loss-type entry names a surrogate or an aggregation that does not exist (the flag would offer a
    choice that crashes at the first step)."""
    surrogate, aggregation = grpo.LOSS_TYPES[name]
    assert surrogate in grpo.SURROGATES and aggregation in grpo.AGGREGATIONS
    obj = Objective(loss_type=name, importance_level="sequence" if name == "luspo" else "token")  # LUSPO's is GSPO's
    assert (obj.surrogate, obj.aggregation) == (surrogate, aggregation)


def _policy_gradient(surrogate, aggregation):
    """d loss / d logp at mu = 1 (ratio 1) for a surrogate paired with an aggregation, and that aggregation's weight
    of each token (d aggregate / d l), on a ragged batch."""
    logp, mask, adv = _ragged()
    loss_type = next(k for k, (s, _) in grpo.LOSS_TYPES.items() if s == surrogate)
    obj = Objective(beta=0, loss_type=loss_type, aggregation=aggregation, max_new_tokens=8)
    lp = logp.clone().requires_grad_()
    loss, _ = grpo_loss(lp, old_logp=None, ref_logp=None, advantages=adv, mask=mask, obj=obj)
    (grad,) = torch.autograd.grad(loss, lp)
    x = torch.zeros_like(logp, requires_grad=True)
    (weight,) = torch.autograd.grad(aggregate(x, mask, aggregation, max_new_tokens=8), x)
    return grad, weight, adv, mask


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
@pytest.mark.parametrize("surrogate", grpo.SURROGATES)
def test_on_policy_every_surrogate_is_the_policy_gradient_under_every_aggregation(surrogate, aggregation):
    """At mu = 1 (ratio 1) a GRPO surrogate's gradient is the policy gradient: -A times the aggregation's weight of
    the token, 0 at padding. Fails if an entry's gradient on-policy is not A (a wrong clip at ratio 1, a missing
    4 / tau, a ratio left undetached), or if an aggregation weights a token differently in the loss than it says."""
    grad, weight, adv, mask = _policy_gradient(surrogate, aggregation)
    torch.testing.assert_close(grad, torch.where(mask, -adv[:, None] * weight, 0.0))
    assert (weight[mask] > 0).all()


@pytest.mark.parametrize("surrogate", grpo.SURROGATES)
def test_a_surrogate_gives_no_gradient_without_advantage(surrogate):
    """Fails if an entry moves the policy where the advantage is 0 (a flat group must not train), at any ratio."""
    g = torch.Generator().manual_seed(4)
    logp = (-3 * torch.rand(3, 5, generator=g, **F64)).requires_grad_()
    ratio = (logp - logp.detach() + 0.5 * torch.randn(3, 5, generator=g, **F64)).exp()
    mask = torch.ones(3, 5, dtype=torch.bool)
    s = grpo.SURROGATES[surrogate](ratio, torch.zeros(3, 1, **F64), logp=logp, mask=mask, **vars(Objective()))
    (grad,) = torch.autograd.grad(s.sum(), logp)
    assert s.shape == (3, 5) and torch.equal(grad, torch.zeros_like(grad))


NOT_ADDITIVE = {"bnpo": "a token mean of each micro-batch, as TRL's bnpo"}


@pytest.mark.parametrize("name", grpo.AGGREGATIONS)
def test_aggregations_ignore_padding_and_micro_batches_sum_to_the_batch(name):
    """Fails if padding values reach the loss, if the loss is not linear in the per-token losses, or if micro-batches
    given the batch's num_sequences and num_tokens do not add up to the whole batch's loss (gradient accumulation
    would then train another objective), except for entries that say they are per micro-batch (NOT_ADDITIVE)."""
    x, mask, _ = _ragged(seed=3)
    y = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), **F64)

    def agg(v, rows=slice(None), **kw):
        return aggregate(v[rows], mask[rows], name, max_new_tokens=8, **kw)

    garbage = torch.where(mask, x, 1e9)
    torch.testing.assert_close(agg(garbage), agg(x))
    torch.testing.assert_close(agg(2 * x - 3 * y), 2 * agg(x) - 3 * agg(y))
    if name in NOT_ADDITIVE:
        return
    whole = {"num_sequences": 4, "num_tokens": mask.sum()}
    parts = agg(x, slice(0, 1), **whole) + agg(x, slice(1, 4), **whole)
    torch.testing.assert_close(parts, agg(x))


@pytest.mark.parametrize("name", grpo.IMPORTANCE_LEVELS)
def test_importance_levels_are_one_on_policy_and_ignore_padding(name):
    """Fails if an entry's ratio is not exactly 1 where the policy has not moved (mu = 1 would clip or reweight),
    or if a padding value changes a valid token's ratio."""
    logp, mask, _ = _ragged()
    assert torch.equal(importance_ratio(logp, logp, mask, name)[mask], torch.ones(int(mask.sum()), **F64))
    old = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(6), **F64)
    got = importance_ratio(logp, torch.where(mask, old, torch.nan), mask, name)
    torch.testing.assert_close(got[mask], importance_ratio(logp, old, mask, name)[mask])


@pytest.mark.parametrize("name", grpo.BEHAVIOUR_MODES)
def test_behaviour_modes_weigh_one_where_sampler_and_trainer_agree(name):
    """Fails if an entry does not give weight 1 to a token the sampler scored as the trainer does, gives a negative
    or non-finite weight, lets a gradient through, or weighs padding other than 1."""
    logp, mask, _ = _ragged()
    logp.requires_grad_()
    w, _ = behaviour_weights(logp, logp.detach(), mask, name, cap=2.0)
    assert torch.equal(w, torch.ones_like(w)) and not w.requires_grad
    sample = logp.detach() + torch.randn(logp.shape, generator=torch.Generator().manual_seed(7), **F64)
    w, m = behaviour_weights(logp, torch.where(mask, sample, torch.nan), mask, name, cap=2.0)
    assert torch.isfinite(w).all() and (w >= 0).all() and torch.equal(w[~mask], torch.ones(int((~mask).sum()), **F64))
    assert 0 <= m["is_capped"].item() <= 1


# -----------------------------------------------------------------------------
# the sampler's transform, shared by sampling and training (rollout.Sampler)


OTHER_VALUE = {"temperature": 2.0, "top_k": 2, "top_p": 0.5, "min_p": 0.1}  # a value other than the default


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Sampler)])
def test_sampler_transform_gives_log_probs_that_sum_to_one(field):
    """Fails if a Sampler field's setting makes logits whose softmax is no distribution (NaN where a token is cut,
    mass that does not sum to 1) for the sampler to draw from and the trainer to score under."""
    z = torch.randn(4, 11, generator=torch.Generator().manual_seed(8)).bfloat16()
    default = getattr(Sampler(), field)
    for value in {default, OTHER_VALUE[field]}:
        logits = Sampler(**{field: value}).truncated(z)[0]  # -inf off a truncated sampler's kept set
        assert logits.dtype == torch.float32 and not logits.isnan().any()
        torch.testing.assert_close(logits.softmax(-1).sum(-1), torch.ones(4))


# -----------------------------------------------------------------------------
# rewards.REWARDS: any task may switch any of them on


def _fields(n=4):
    """The fields a rollout gives every reward fn (rollout.ROW_FIELDS, an example's answer, a tool environment's
    state), one value per completion."""
    return {
        "answer": ["7", "12", "3", "40"][:n],
        "num_tokens": [5, 9, 12, 3][:n],
        "own_tokens": [5, 7, 12, 3][:n],
        "truncated": [0.0, 0.0, 1.0, 0.0][:n],
        "trajectory": ["a", "b", "c", "d"][:n],
        "tool_calls": [0, 2, 1, 0][:n],
        "tool_errors": [0, 1, 0, 0][:n],
        "called": [0.0, 1.0, 1.0, 0.0][:n],
    }


@pytest.mark.parametrize("name", rewards.REWARDS)
def test_every_reward_gives_one_finite_number_per_completion(name):
    """Fails if an entry of REWARDS asks for a field no rollout gives, raises, or returns anything but one finite
    number per completion (combine_rewards' contract)."""
    completions = ["3 + 4 = 7\n#### 7", "no answer", "#### 3", "<calculator>1+1</calculator> #### 40"]
    rewards.check_fields({name: rewards.REWARDS[name]}, _fields())
    total, per_fn = rewards.combine_rewards({name: rewards.REWARDS[name]}, {name: 1.0}, completions, **_fields())
    assert len(per_fn[name]) == 4 and all(math.isfinite(v) for v in per_fn[name])
