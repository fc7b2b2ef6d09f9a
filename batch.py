"""
What a training step learns from: which prompts, the random numbers that sample them, their rewards,
DAPO's dynamic sampling (which groups fill the batch), and per-token advantages from step rewards.

Every choice here is a function of (seed, step, slot), never of process count or history, so a resumed
run and a run split over more processes sample the same completions for the same prompts.
"""

import hashlib

import torch

import grpo
from rollout import concat, token_ends


def seed_of(*parts):
    """A 64-bit seed from any labels (the seed, the step, a slot)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def prompt_indices(n_examples, prompts_per_step, step, seed, first, count, attempt=0):
    """Indices of `count` examples starting at position `first` of the step's batch, and their slot names.

    attempt 0: a fixed shuffle per epoch, walked batch by batch; attempt k > 0 (dynamic sampling's extra
    rollouts): a shuffle of its own per (step, k)."""
    epoch, k = divmod(step, n_examples // prompts_per_step)
    s = seed + epoch if attempt == 0 else seed_of(seed, step, "extra", attempt)
    order = torch.randperm(n_examples, generator=torch.Generator().manual_seed(s))
    start = (0 if attempt else k * prompts_per_step) + first
    return order[start:start + count].tolist(), [f"{attempt}/{i}" for i in range(start, start + count)]


def generators(seed, step, slots):
    """One CPU generator per prompt slot: a prompt's completions do not depend on its neighbours."""
    return [torch.Generator().manual_seed(seed_of(seed, step, s)) for s in slots]


def pick_groups(rewards, group_size, count):
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2): groups with a reward spread fill the batch.

    rewards: one (n_i * G,) tensor per rollout -> `count` (rollout, group, informative) triples in
    sampling order: the first informative groups, topped up (when there are too few) with the last
    uninformative ones, which the caller masks out of the loss."""
    groups = [(i, j, bool(f)) for i, r in enumerate(rewards) for j, f in enumerate(grpo.informative_groups(r, group_size))]
    informative = [x for x in groups if x[2]]
    return sorted((informative + [x for x in groups if not x[2]][::-1])[:count])


def process_advantages(step_rewards, tokenizer, r, examples, group_size):
    """Process supervision (DeepSeekMath §4.1.3) of a Rollout: task.step_rewards gives each completion's
    (char_end, reward) steps; each step ends on the token its last character falls in; then
    grpo.process_advantages -> ((N, C) per-token advantages, the mean step reward: the loop logs it as
    reward/step, since the outcome rewards it logs as reward do not drive a process-supervised run)."""
    lengths = (r.completion_mask.sum(1) - (~r.truncated).long()).tolist()  # tokens before the stop token
    steps = [step_rewards(text, examples[i // group_size]) for i, text in enumerate(r.completions)]
    N, S = len(steps), max(len(s) for s in steps)
    ends, values, mask = torch.zeros(N, S, dtype=torch.long), torch.zeros(N, S), torch.zeros(N, S, dtype=torch.bool)
    for i, s in enumerate(steps):
        ends[i, :len(s)] = torch.tensor(token_ends(tokenizer, r.completion_ids[i], lengths[i], [e for e, _ in s]))
        values[i, :len(s)], mask[i, :len(s)] = torch.tensor([v for _, v in s]), True
    adv = grpo.process_advantages(values, ends, mask, group_size, r.completion_ids.size(1))  # (N, C)
    return adv, values[mask].mean()


def collect(step, examples, sample_fn, score_fn, args, first, count):
    """This rank's batch at `step`: sample and score `count` prompts from position `first` of the step ->
    (Rollout, its examples, rewards (N,), keep (N,) bool, stats). sample_fn(examples, generators) -> Rollout,
    score_fn(rollout, examples, step) -> (rewards, {reward fn: values}).

    args.dynamic_sampling (DAPO §3.2): a group whose rewards are all equal carries no gradient, so more
    prompts are sampled (at most args.max_resample extra rollouts) until `count` informative groups are in
    hand; a shortfall is filled with uninformative groups that keep=False takes out of the loss, so every
    rank trains on the same shapes. stats: the mean of every reward fn over all completions sampled."""
    G, parts = args.group_size, []
    for attempt in range(1 + (args.max_resample if args.dynamic_sampling else 0)):
        idx, slots = prompt_indices(len(examples), args.prompts_per_step, step, args.seed, first, count, attempt)
        exs = [examples[i] for i in idx]
        r = sample_fn(exs, generators(args.seed, step, slots))
        total, per_fn = score_fn(r, exs, step)
        parts.append((r, exs, torch.tensor(total), per_fn))
        if not args.dynamic_sampling or sum(int(grpo.informative_groups(t, G).sum()) for *_, t, _ in parts) >= count:
            break
    stats = {f"reward/{k}": torch.tensor([v for *_, f in parts for v in f[k]]).mean() for k in per_fn}
    if not args.dynamic_sampling:
        return r, exs, parts[0][2], torch.ones(len(total), dtype=torch.bool), stats
    chosen = pick_groups([t for *_, t, _ in parts], G, count)
    rows = [torch.tensor([j * G + g for i2, j, _ in chosen if i2 == i for g in range(G)], dtype=torch.long)
            for i in range(len(parts))]
    keep = torch.tensor([f for *_, f in chosen]).repeat_interleave(G)  # (N,)
    stats.update(reward_sampled=torch.cat([t for *_, t, _ in parts]).mean(), kept_groups=keep.sum() / G,
                 groups_dropped=torch.tensor(sum(len(t) for *_, t, _ in parts) // G) - keep.sum() // G,
                 extra_rollouts=torch.tensor(len(parts) - 1))
    return (concat([x[0] for x in parts], rows), [parts[i][1][j] for i, j, _ in chosen],
            torch.cat([t[i] for (*_, t, _), i in zip(parts, rows)]), keep, stats)
