"""The README's worked forks, run as a user would make them: each block is taken from README.md, applied to its module
(a copy of the dict it extends, put back after the test) and trained for a step, so the documented forks cannot rot;
and README's lists of choices, config keys and flags held to the code, so a fork's new entry cannot be missing from
the docs unnoticed."""

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch

import envs
import extra_tasks
import grpo
import rewards
import toy
import test_choices
from toy import TRAIN, read_metrics, run_script, train_args

README = Path(__file__).resolve().parents[1] / "README.md"


def fork(title):
    """The ```python block after the README paragraph that starts with `title`."""
    lines = README.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(title))
    start = lines.index("```python", at) + 1
    return "\n".join(lines[start : lines.index("```", start)])


def test_the_rloo_fork_is_one_line_gets_the_shared_checks_and_trains(model_dir, tmp_path, monkeypatch):
    """Fails if README's advantage-baseline fork no longer applies to grpo.py as one line, if `--scale-rewards`
    does not offer the new entry, or if the step's advantages are not RLOO's r_i - mean of the group's others."""
    block = fork("**An advantage baseline**")
    assert len([line for line in block.splitlines() if line.strip()]) == 1
    monkeypatch.setattr(grpo, "ADVANTAGES", dict(grpo.ADVANTAGES))
    exec(block, vars(grpo))
    test_choices.test_advantages_zero_a_flat_group_keep_order_and_follow_the_rewards("rloo")  # the shared checks
    calls, real = [], grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", lambda *a, **k: calls.append(k["advantages"]) or real(*a, **k))
    g = run_script(TRAIN, train_args(model_dir, str(tmp_path), "--scale-rewards", "rloo", steps=1))
    r = g["r"].reward.double().view(-1, 4)  # (prompts, G): the step's weighted rewards
    want = (r - (r.sum(1, keepdim=True) - r) / 3).flatten()
    got = torch.cat([a[:, 0] for a in calls]).double()  # one micro-batch a group, in order
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.abs().max() > 0.01


def test_the_guessing_game_fork_is_a_task_with_an_option_and_trains(model_dir, tmp_path, monkeypatch, capsys):
    """Fails if README's environment fork no longer applies to extra_tasks.py in <= 15 lines, if its judge does not
    say higher / lower / right, if its max_guesses does not reach the environment as a task option (one attempt a
    row with max_guesses 1: the row's answer is judged, at its stop or where the budget cut it), or if the task does
    not train."""
    block = fork("**An environment with a knob**")
    assert len([line for line in block.splitlines() if line.strip() and not line.startswith("#")]) <= 15
    monkeypatch.setattr(extra_tasks, "EXTRA", dict(extra_tasks.EXTRA))
    exec(block, vars(extra_tasks))
    judge = extra_tasks.higher_or_lower
    assert [judge(t, {"answer": "37"}) for t in ("#### 12", "I say 40", "37", "nothing")] == [
        "Higher.",
        "Lower.",
        None,
        "Higher.",
    ]
    monkeypatch.setitem(extra_tasks.EXTRA, "guess", extra_tasks.EXTRA["guess"])
    extra = ["--config", "task_options={'max_guesses': 1}"]
    args = train_args(model_dir, str(tmp_path), *extra, steps=1)
    args[args.index("toy")] = "guess"
    run_script(TRAIN, args)
    [row] = [x for x in read_metrics(str(tmp_path)) if "loss" in x]
    assert row["env/attempts"] == 1.0 and "env/final_correct" in row and "reward/correct" in row


def test_the_tool_cost_fork_is_the_shipped_reward_and_trains(model_dir, tmp_path, monkeypatch):
    """Fails if README's reward fork is not the code rewards.py ships (the docs would show another function), or if
    `--reward-weights tool_cost=W` does not switch it on for a tool task: its logged mean must be -(tool calls) and
    the step's reward must carry W times it."""
    block = fork("**A reward switched on by a flag**")
    shipped = inspect.getsource(envs.tool_cost)
    assert textwrap.dedent(block).strip() == shipped.strip()
    from tasks import TASKS

    monkeypatch.setitem(TASKS, "toy_tool", toy.TOOL_TASK)
    args = train_args(model_dir, str(tmp_path), "--reward-weights", "tool_cost=0.5", steps=1)
    args[args.index("toy")] = "toy_tool"
    g = run_script(TRAIN, args)
    [row] = [x for x in read_metrics(str(tmp_path)) if "loss" in x]
    calls = torch.tensor([s["tool_calls"] for s in g["r"].env_state], dtype=torch.float64)
    assert calls.sum() > 0, "the step needs tool calls"
    assert row["reward/tool_cost"] == pytest.approx(-calls.mean().item(), abs=1e-6)
    others = row["reward/even"] + 0.5 * row["reward/first"]
    assert row["reward"] == pytest.approx(others - 0.5 * calls.mean().item(), abs=1e-5)


# -----------------------------------------------------------------------------
# README's lists against the code


def readme_rows(header):
    """The rows of the README table whose header line is `header`, as lists of cells."""
    lines = README.read_text().splitlines()
    at = lines.index(header)
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def ticked(text):
    return set(re.findall(r"`([^`\s]+)`", text))


def train_dict(name):
    """The keys of a dict literal train.py assigns to `name` (train.py runs as a script: read, not imported)."""
    tree = ast.parse((README.parent / "train.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == name)
    return {k.value for k in node.value.keys}


def test_the_readme_choices_are_the_dicts_keys():
    """Fails if a dict of choices (a fork's new entry, a removed one) and README's table of choices disagree."""
    dicts = {
        "grpo.ADVANTAGES": set(grpo.ADVANTAGES),
        "grpo.LOSS_TYPES": set(grpo.LOSS_TYPES),
        "grpo.AGGREGATIONS": set(grpo.AGGREGATIONS),
        "grpo.KL_ESTIMATORS": set(grpo.KL_ESTIMATORS) | {"full"},
        "grpo.IMPORTANCE_LEVELS": set(grpo.IMPORTANCE_LEVELS),
        "grpo.BEHAVIOUR_MODES": set(grpo.BEHAVIOUR_MODES),
        "LR_SCHEDULES": train_dict("LR_SCHEDULES"),
        "rewards.REWARDS": set(rewards.REWARDS) | set(envs.REWARDS),  # its row names both: a tool task's too
        "grpo.REWARD_AGGREGATIONS": set(grpo.REWARD_AGGREGATIONS),
    }
    seen = set()
    for flag, choices, where in readme_rows("| flag or config key | choices | the dict |"):
        name = next(k for k in dicts if f"`{k}`" in where)
        assert ticked(choices) == dicts[name], (flag, name)
        seen.add(name)
    assert seen == set(dicts)


def test_the_readme_config_keys_and_flags_are_train_pys(capsys):
    """Fails if a config key or a flag (a knob declared in train.py's Knobs, grpo.Objective or rollout.Sampler) is
    added or removed without README's lists following: both as `train.py --help` lists them."""
    with pytest.raises(SystemExit):
        run_script(TRAIN, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    keys = set(re.findall(r"(\w+)=", text.split("with their defaults:")[1]))
    readme = README.read_text()
    paragraph = readme[readme.index("Config keys") : readme.index("**`task_options`**")]
    assert set(re.findall(r"`([a-z_]+)`", paragraph)) == keys
    flags = set(re.findall(r"\[(--[a-z-]+)", text.split("options:")[0]))  # the usage line: [--flag ...]
    table = set().union(*(ticked(row[1]) for row in readme_rows("| declared in | flags |")))
    assert table == flags, table ^ flags
