"""CISPO and SAPO (grpo.py): against the papers' equations written out here (fp64) and against TRL 1.16's own
GRPOTrainer._compute_loss on the same tensors (fp32): loss and gradients, whole batch and micro-batches."""

import collections
import math
import types

import pytest
import torch

from grpo import (
    LOSS_TYPES,
    Objective,
    aggregate,
    behaviour_weights,
    grpo_loss,
    importance_ratio,
)
from variants import cispo_surrogate, sapo_surrogate

NEW = ("cispo", "sapo")
TAU = (1.0, 1.05)  # SAPO's temperatures for A > 0 and A <= 0: the paper's and TRL's defaults


def _batch(dtype=torch.float64, lengths=(7, 3, 5, 1, 6, 2, 4, 7), T=7, seed=0):
    """A ragged batch: logp, old, ref, behaviour weights w, entropy (N, T); advantages (N,); mask (N, T) bool.
    old is spread wide (|log rho| ~ 0.6) so that cispo_cap=1.5 and SAPO's gate bind on many tokens."""
    g = torch.Generator().manual_seed(seed)
    N = len(lengths)
    logp = -3 * torch.rand(N, T, generator=g, dtype=torch.float64)  # (N, T)
    old = logp + 0.6 * torch.randn(N, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    w = 0.5 + torch.rand(N, T, generator=g, dtype=torch.float64)  # pi_train / pi_sample, as behaviour_weights gives
    ent = 2 * torch.rand(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]  # (N, T)
    return *(x.to(dtype) for x in (logp, old, ref, w, ent, adv)), mask


def _obj(loss_type, level="token", beta=0.0, **kw):  # "k3": TRL's KL (use_bias_correction_kl=False), unclamped
    return Objective(
        beta=beta,
        kl_estimator="k3",
        loss_type=loss_type,
        importance_level=level,
        cispo_cap=1.5,
        sapo_temperature_pos=TAU[0],
        sapo_temperature_neg=TAU[1],
        **kw,
    )


# -----------------------------------------------------------------------------
# (a) the papers' equations, written out token by token (fp64)


def _paper(loss_type, level, beta, logp, old, ref, adv, mask, w, cap=1.5):
    """(loss, d loss / d logp as nested lists) from the equations, with python floats:
    CISPO (MiniMax-M1 eq. 4-5): -(1 / sum_i |o_i|) sum_it [sg(min(r, cap)) A_i w_it log pi_it - beta k3_it]
    SAPO (2511.20347 §3): -(1 / N) sum_i (1 / |o_i|) sum_t [f(r) A_i w_it - beta k3_it], f(r) = sigmoid(tau (r-1)) 4/tau
    r = pi / pi_old per token, or GSPO's exp(mean_t log(pi / pi_old)) on the whole row (level "sequence");
    k3 = e^x - x - 1, x = log pi_ref - log pi (DeepSeekMath eq. 4), d k3 / d log pi = 1 - e^x."""
    N, T = logp.shape
    L = [int(m.sum()) for m in mask]
    n = sum(L)
    loss, grad = 0.0, [[0.0] * T for _ in range(N)]
    for i in range(N):
        lp, o, a = logp[i, : L[i]].tolist(), old[i, : L[i]].tolist(), adv[i].item()
        seq = math.exp(sum(p - q for p, q in zip(lp, o)) / max(L[i], 1))
        rs = [seq if level == "sequence" else math.exp(p - q) for p, q in zip(lp, o)]
        tau = TAU[0] if a > 0 else TAU[1]
        for t in range(L[i]):
            x, wt, r = ref[i, t].item() - lp[t], w[i, t].item(), rs[t]
            k3, dk3 = math.exp(x) - x - 1, 1 - math.exp(x)
            if loss_type == "cispo":
                loss += (-min(r, cap) * a * wt * lp[t] + beta * k3) / n
                grad[i][t] += (-min(r, cap) * a * wt + beta * dk3) / n  # the weight is a constant: sg(.)
                continue
            s = 1 / (1 + math.exp(-tau * (r - 1)))
            loss += (-s * 4 / tau * a * wt + beta * k3) / (N * L[i])
            dr = 4 * s * (1 - s) * -a * wt / (N * L[i])  # d/dr of -f(r) A w, f'(r) = 4 s (1 - s)
            grad[i][t] += beta * dk3 / (N * L[i])
            if level == "token":
                grad[i][t] += dr * r  # dr/dlog pi_t = r
            else:
                for u in range(L[i]):  # the row's ratio moves with every token's log pi: dr/dlog pi_u = r / L
                    grad[i][u] += dr * r / L[i]
    return loss, grad


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", NEW)
def test_cispo_and_sapo_match_the_papers_equations(loss_type, level, beta, weighted):
    """Loss and gradient to 1e-12 of the equations in fp64. The batch reaches every branch they have: advantages of
    both signs (SAPO's two temperatures) and ratios above cispo_cap (asserted). Fails if cispo drops its cap or
    its stop-gradient, or SAPO takes one temperature for both signs."""
    logp, old, ref, w, _, adv, mask = _batch()
    assert (adv > 0).any() and (adv < 0).any(), "the batch needs advantages of both signs"
    ratio = (logp - old).exp() if level == "token" else importance_ratio(logp, old, mask, "sequence")  # (N, T)
    assert (ratio[mask] > 1.5).any() and (ratio[mask] < 1.5).any(), "the batch needs ratios on both sides of the cap"
    w = w if weighted else torch.ones_like(w)
    logp.requires_grad_()
    sample = old - w.log() if weighted else None  # pi_old / pi_sample = w, below is_cap: not cut
    loss, _ = grpo_loss(
        logp,
        old_logp=old,
        ref_logp=ref,
        advantages=adv,
        mask=mask,
        obj=_obj(loss_type, level, beta),
        sample_logp=sample,
    )
    want, want_grad = _paper(loss_type, level, beta, logp.detach(), old, ref, adv, mask, w)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-10, atol=1e-14)


# -----------------------------------------------------------------------------
# (b) TRL 1.16's GRPOTrainer._compute_loss on the same tensors (fp32)


class _OneProcess:  # the accelerate calls _compute_loss makes, for one process
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trl_trainer(loss_type, level, beta, quantile, accumulation, sampler):
    """A GRPOTrainer with only what _compute_loss reads (read from trl/trainer/grpo_trainer.py, 1.16.0): training
    mode, `accumulation` micro-batches per optimizer step and per generation, TRL's epsilon_high is cispo's cap."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args = types.SimpleNamespace(
        use_bias_correction_kl=False,
        delta=None,
        sapo_temperature_pos=TAU[0],
        sapo_temperature_neg=TAU[1],
        steps_per_generation=accumulation,
    )
    t.loss_type, t.importance_sampling_level, t.beta, t.epsilon_low, t.epsilon_high = loss_type, level, beta, 0.2, 1.5
    t.top_entropy_quantile, t.off_policy_mask_threshold = quantile, None
    t.current_gradient_accumulation_steps = accumulation
    t.use_vllm = t.vllm_importance_sampling_correction = sampler  # the sampler weights multiply the policy term
    t.model, t.accelerator = types.SimpleNamespace(training=True), _OneProcess()
    t._entropy_bonus_enabled, t.aux_loss_enabled = False, False
    t._metrics = {"train": collections.defaultdict(list)}
    return t


def _rel(a, b):  # normwise: max |a - b| / max |b|, blind to where an entry is near 0 by cancellation
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("entropy_mask", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", NEW)
def test_cispo_and_sapo_match_trl_compute_loss(loss_type, level, beta, weighted, entropy_mask, accumulation):
    pytest.importorskip("trl", minversion="1.16.0", reason="pip install trl==1.16.0")
    logp, old, ref, w, ent, adv, mask = _batch(torch.float32)
    N, quantile = logp.shape[0], 0.5 if entropy_mask else 1.0
    trl_logp, our_logp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    trainer = _trl_trainer(loss_type, level, beta, quantile, accumulation, weighted)
    obj = _obj(loss_type, level, beta, top_entropy_quantile=quantile)
    n_tokens = mask.sum()
    sample = old - w.log()  # the sampler's log-probs; TRL gets the weights ours computes from them
    w = behaviour_weights(old, sample, mask, obj.is_mode, obj.is_cap)[0]
    # TRL's micro-batches are equal: grpo/sapo divide each one's row mean by the accumulation steps, cispo/dapo the
    # whole batch's tokens (num_items_in_batch * accumulation / steps_per_generation); ours get the whole batch's
    # num_sequences and num_tokens, so each micro-batch's loss is comparable, and so is the accumulated gradient
    for rows in torch.arange(N).chunk(accumulation):

        def logps_and_entropies(*args, rows=rows, **kwargs):
            return trl_logp[rows], ent[rows], None

        trainer._get_per_token_logps_and_entropies = logps_and_entropies
        inputs = {
            "prompt_ids": torch.zeros(len(rows), 1, dtype=torch.long),
            "prompt_mask": torch.ones(len(rows), 1),
            "completion_ids": torch.zeros(len(rows), logp.shape[1], dtype=torch.long),
            "completion_mask": mask[rows].float(),
            "advantages": adv[rows],
            "old_per_token_logps": old[rows],
            "ref_per_token_logps": ref[rows],
            "importance_sampling_ratio": w[rows],
            "num_items_in_batch": n_tokens,
        }
        theirs = trainer._compute_loss(None, inputs)
        ours, _ = grpo_loss(
            our_logp[rows],
            old_logp=old[rows],
            ref_logp=ref[rows],
            advantages=adv[rows],
            mask=mask[rows],
            obj=obj,
            entropy=ent[rows],
            sample_logp=sample[rows] if weighted else None,
            num_sequences=N,
            num_tokens=n_tokens,
        )
        # fp32 (2^-24 ~ 6e-8 per rounding), sums in a different order: agreement to 1e-6 relative (~16 ulp)
        assert _rel(ours.detach(), theirs.detach()) <= 1e-6
        theirs.backward()
        ours.backward()
    assert our_logp.grad.abs().max() > 0
    assert _rel(our_logp.grad, trl_logp.grad) <= 1e-6


# -----------------------------------------------------------------------------
# properties the equations imply


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", NEW)
def test_mu1_gradient_is_minus_A_times_weight(loss_type, level):
    # on-policy (old_logp None): cispo's weight min(1, cap) = 1, SAPO's f'(1) = 4 sigmoid(0)^2 = 1; the value is
    # -A log pi (cispo) and -A f(1) = -2 A / tau (sapo), aggregated as dapo and as grpo
    logp, _, _, _, _, adv, mask = _batch()
    logp.requires_grad_()
    loss, m = grpo_loss(logp, old_logp=None, ref_logp=None, advantages=adv, mask=mask, obj=_obj(loss_type, level))
    N, lens, n = logp.shape[0], mask.sum(1, keepdim=True).double(), mask.sum()
    weight = 1 / n if loss_type == "cispo" else 1 / (lens * N)  # (N, 1) or 0-dim
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.where(mask, -adv[:, None] * weight, 0.0))
    tau = torch.where(adv > 0, TAU[0], TAU[1]).double()[:, None]  # (N, 1)
    value = logp.detach() if loss_type == "cispo" else 2 / tau
    torch.testing.assert_close(loss, -torch.where(mask, adv[:, None] * value * weight, 0.0).sum())
    assert m["ratio_min"] == m["ratio_max"] == 1 and m["clip"] == 0


def test_cispo_clipped_tokens_keep_their_gradient_where_grpo_drops_it():
    # rho = 2 > cap = 1.5 with A = 1: the clip of eq. 3 gives no gradient, CISPO gives -cap * A per token (/ 1 token)
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), math.log(2), dtype=torch.float64, requires_grad=True)
    mask, A = torch.ones(1, 1, dtype=torch.bool), torch.ones(1, dtype=torch.float64)
    (grad_grpo,) = torch.autograd.grad(
        grpo_loss(logp, old_logp=old, ref_logp=None, advantages=A, mask=mask, obj=Objective(beta=0))[0], logp
    )
    loss, m = grpo_loss(logp, old_logp=old, ref_logp=None, advantages=A, mask=mask, obj=_obj("cispo"))
    (grad_cispo,) = torch.autograd.grad(loss, logp)
    assert grad_grpo.item() == 0 and grad_cispo.item() == pytest.approx(-1.5, rel=1e-15)
    assert loss.item() == pytest.approx(-1.5 * math.log(2), rel=1e-15)
    assert (m["clip_high"].item(), m["clip_low"].item(), m["clip"].item()) == (1, 0, 1)  # TRL's cispo_clip_ratio
    # the weight is detached: no gradient reaches the ratio
    ratio = torch.tensor([[0.5, 2.0]], dtype=torch.float64, requires_grad=True)
    out = cispo_surrogate(
        ratio, torch.ones(1, 1, dtype=torch.float64), logp=torch.ones(1, 2, dtype=torch.float64), cispo_cap=1.5
    )
    torch.testing.assert_close(out, torch.tensor([[0.5, 1.5]], dtype=torch.float64))
    assert not out.requires_grad


def test_sapo_gate_is_one_on_policy_and_decays_faster_for_negative_advantages():
    r = torch.tensor([[1.0, 1.0, 3.0, 3.0]], dtype=torch.float64, requires_grad=True)
    A = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    f = sapo_surrogate(r, A, sapo_temperature_pos=TAU[0], sapo_temperature_neg=TAU[1])
    (g,) = torch.autograd.grad(f.sum(), r)
    torch.testing.assert_close(f.detach()[0, :2], torch.tensor([2 / TAU[0], -2 / TAU[1]], dtype=torch.float64))
    torch.testing.assert_close(g[0, :2], torch.tensor([1.0, -1.0], dtype=torch.float64))  # f'(1) A = A
    s = [1 / (1 + math.exp(-2 * t)) for t in TAU]  # sigmoid(tau (3 - 1))
    want = [4 * s[0] * (1 - s[0]), -4 * s[1] * (1 - s[1])]
    torch.testing.assert_close(g[0, 2:], torch.tensor(want, dtype=torch.float64))
    assert 0 < g[0, 2] < 1 and 0 < -g[0, 3] < g[0, 2]  # soft, and faster for A <= 0 (tau_neg > tau_pos)


@pytest.mark.parametrize("loss_type", NEW)
def test_aggregation_is_trls_and_micro_batches_sum_to_the_batch(loss_type):
    """aggregate against the formulas written out on the rows: cispo sum_it l / num_tokens (MiniMax-M1 eq. 4, TRL's
    dapo normaliser), sapo (1/N) sum_i mean_t l (SAPO §3, TRL's grpo); then unequal micro-batches given the batch's
    num_sequences and num_tokens sum to the whole batch's loss and gradient. Fails if the branch cispo shares with
    dapo is off by any factor (comparing cispo with dapo could not see it), cispo divides by this call's tokens, or
    sapo by tokens instead of each row's length."""
    logp, old, ref, w, _, adv, mask = _batch()
    x = torch.where(mask, logp, 1e6)  # padding garbage
    rows = [x[i, : int(m.sum())] for i, m in enumerate(mask)]
    want = sum(r.sum() for r in rows) / 30 if loss_type == "cispo" else sum(r.mean() for r in rows) / len(rows)
    assert mask.sum() != 30  # num_tokens is not this call's count: the formula must read it
    torch.testing.assert_close(aggregate(x, mask, LOSS_TYPES[loss_type][1], num_tokens=30), want, rtol=1e-12, atol=0)
    obj = _obj(loss_type, beta=0.04)
    full = logp.clone().requires_grad_()
    sample = old - w.log()  # pi_old / pi_sample = w
    loss, _ = grpo_loss(full, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, obj=obj, sample_logp=sample)
    loss.backward()
    acc, total = logp.clone().requires_grad_(), 0
    for s in (slice(0, 3), slice(3, 8)):  # unequal micro-batches
        part, _ = grpo_loss(
            acc[s],
            old_logp=old[s],
            ref_logp=ref[s],
            advantages=adv[s],
            mask=mask[s],
            obj=obj,
            sample_logp=sample[s],
            num_sequences=8,
            num_tokens=mask.sum(),
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, loss.detach())
    torch.testing.assert_close(acc.grad, full.grad)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", NEW)
def test_padding_changes_neither_loss_nor_gradient(loss_type, level):
    logp, old, ref, w, ent, adv, mask = _batch()
    adv_t = adv[:, None] * torch.linspace(0.5, 1.5, 7, dtype=torch.float64)  # (N, T) process-style advantages
    obj = _obj(loss_type, level, 0.04, entropy_coef=0.01, top_entropy_quantile=0.5)
    sample = old - w.log()  # from the clean old: at padding the weights then meet the garbage old

    def run(logp, old, ref, adv_t, ent):
        logp = logp.clone().requires_grad_()
        loss, metrics = grpo_loss(
            logp, old_logp=old, ref_logp=ref, advantages=adv_t, mask=mask, obj=obj, entropy=ent, sample_logp=sample
        )
        return loss, torch.autograd.grad(loss, logp)[0], metrics

    def bad(x, v):
        return torch.where(mask, x, torch.full_like(x, v))

    loss, grad, metrics = run(logp, old, ref, adv_t, ent)
    loss2, grad2, metrics2 = run(
        bad(logp, -math.inf), bad(old, math.nan), bad(ref, 1e4), bad(adv_t, math.nan), bad(ent, 1e6)
    )
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2, grad)
    assert torch.equal(grad2[~mask], torch.zeros_like(grad2[~mask]))
    assert {k: v.item() for k, v in metrics2.items()} == {k: v.item() for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type", NEW)
def test_objective_refuses_the_clip_flags_it_would_ignore(loss_type):
    # TRL reads neither delta nor (for sapo) epsilon_high there, and reads epsilon_high as cispo's cap: one line each
    for kw in (dict(delta=4.0), dict(eps_high=5.0)):
        with pytest.raises(ValueError, match=rf"^--loss-type {loss_type} does not clip: drop --delta and --eps-high "):
            Objective(loss_type=loss_type, **kw)
    assert Objective(loss_type=loss_type, eps_high=0.2).eps_high == 0.2  # a resumed run.json holds eps_high = eps
    assert (Objective().cispo_cap, Objective().sapo_temperature_pos, Objective().sapo_temperature_neg) == (5.0, *TAU)
