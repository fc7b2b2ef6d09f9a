"""run.step_metrics, the step's metrics as a function of what it reads: a Rollout of hand-made rows, the batch's
rewards and the first pass's log-probs, checked against values counted by hand. A fork's new metric is a line there
and a line here."""

import math

import pytest
import torch

import run
from rollout import Rollout


def _rollout():
    """3 rows: row 0 writes 2 tokens, reads a 2-token reply, writes 1; row 1 writes 4 and is cut; row 2 writes 1."""
    own = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    reply = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    return Rollout(
        prompt_ids=torch.ones(3, 4, dtype=torch.long),
        prompt_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]),
        completion_ids=torch.ones(3, 5, dtype=torch.long),
        completion_mask=own,
        truncated=torch.tensor([False, True, False]),
        completions=["a", "b", "c"],
        sample_logp=-torch.tensor([[1.0, 2, 0, 0, 3], [1, 1, 1, 1, 0], [2, 0, 0, 0, 0]]) * own,
        prompt_cut=torch.tensor([False, False, True]),
        env_mask=reply,
        env_state=[{"tool_calls": 1}, {"tool_calls": 0}, {"tool_calls": 2}],
        reward=torch.tensor([1.0, 0.0, 0.5]),
    )


def test_step_metrics_are_the_hand_counted_values():
    """Fails if a metric reads the wrong mask (completion_len counting replies: row 0 would be 5), averages over the
    wrong rows, counts a reply's turns wrongly (row 0 has one reply, so 2 turns), drops an environment's state key,
    lets a sampler-gap key overwrite a loss metric of the same name, or reads padding into the gap (first_logp holds
    junk off the mask)."""
    r = _rollout()
    first = r.sample_logp + torch.tensor([[0.5, -0.5, 9, 9, 0.0], [0, 0, 0, 0.25, 9], [1.0, 9, 9, 9, 9]])
    every = torch.tensor([1.0, 0.0, 0.5, 2.0])  # this rank's rewards and another rank's
    got = run.step_metrics(r, every, torch.tensor(0.25), {"is_capped": 0.125}, first_logp=first, with_env=True)
    want = {
        "reward": 0.5,
        "reward_std": torch.tensor([1.0, 0.0, 0.5, 2.0]).std().item(),
        "frac_zero_std": 0.25,
        "completion_len": 8 / 3,
        "completion_len_max": 4.0,
        "truncated": 1 / 3,
        "prompt_cut": 1 / 3,
        "prompt_len": 9 / 3,
        "env/tool_calls": 1.0,
        "env_tokens": 2 / 3,
        "turns": 1 + 1 / 3,
        "is_capped": 0.125,  # the loss's, not the gap's (mode "none": 0)
        "loss": 0.0,  # no optimizer step's metrics given (a skipped step): 0, not missing
        "grad_norm": 0.0,
    }
    gaps = [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.25, 1.0]  # |first - sample| on the 8 own tokens
    want.update(dlogp_mean=sum(gaps) / 8, dlogp_max=1.0)
    assert set(want) | {"dlogp_p99"} == set(got)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    assert 0.25 < got["dlogp_p99"] <= 1.0 and all(math.isfinite(v) for v in got.values())


def test_a_run_without_environments_logs_no_env_metrics():
    """Fails if env_tokens / turns / env/ keys are logged for a run without environments (a column of zeros that reads
    as "no tool calls"), or if a step that skipped training (no first pass) logs a sampler gap."""
    got = run.step_metrics(_rollout(), torch.tensor([1.0, 0.0]), torch.tensor(0.0), {})
    assert not {k for k in got if k.startswith(("env", "turns", "dlogp"))}
    assert got["completion_len"] == pytest.approx(8 / 3)


def test_each_optimizer_steps_metrics_are_logged_as_its_own_and_reduced_over_them():
    """Two optimizer steps' metrics (mu x steps_per_generation > 1): each as update{i}/<name>, and the step's own
    reduced over them as the name says (loss, grad_norm: the mean; *_max: the max; *_min: the min); one optimizer
    step logs no update{i}/ keys. Fails if an update's metrics are dropped or numbered from 0, if the step's loss or
    grad_norm is the last update's or their sum, or if a _max / _min is averaged."""
    per_update = [
        {"loss": 1.0, "grad_norm": 2.0, "ratio_max": 1.5, "ratio_min": 0.9, "lr": 1e-3},
        {"loss": 3.0, "grad_norm": 6.0, "ratio_max": 1.2, "ratio_min": 0.5, "lr": 2e-3},
    ]
    got = run.step_metrics(_rollout(), torch.tensor([1.0, 0.0]), torch.tensor(0.0), {}, per_update)
    want = {"loss": 2.0, "grad_norm": 4.0, "ratio_max": 1.5, "ratio_min": 0.5}
    want.update({f"update{i}/{k}": v for i, u in enumerate(per_update, 1) for k, v in u.items()})
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    one = run.step_metrics(_rollout(), torch.tensor([1.0, 0.0]), torch.tensor(0.0), {}, per_update[:1])
    assert (one["loss"], one["grad_norm"]) == (1.0, 2.0) and not [k for k in one if k.startswith("update")]
