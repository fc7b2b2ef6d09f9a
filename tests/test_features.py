"""The loop's features through the real entry point (train.py on tests/toy.py's task and tiny Llama):
dynamic sampling, the overlong penalty, the exact full-vocabulary KL, process supervision, tracker
logging, the metrics file, the sampler/trainer correction and per-prompt generators.

Each test watches what reaches the loss (a spy wrapped around grpo.grpo_loss or a reward fn, which
train.py looks up at call time) and compares it with a computation written out here.
"""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy  # noqa: E402
from conftest import GRADS, assert_close_scaled, make_model  # noqa: E402
from toy import TIMING, TRAIN, read_metrics, run_script, train_args  # noqa: E402

import grpo  # noqa: E402
import rollout  # noqa: E402
import extra_tasks  # noqa: E402
import tasks  # noqa: E402
import variants  # noqa: E402
from run import MetricsLog, reduce, reduce_op  # noqa: E402

G, PROMPTS, MICRO = 4, 2, 4  # train_args: 2 prompts x 4 completions, micro-batches of one group


def spy(monkeypatch, module, name, record):
    """Wrap module.name so every call's (args, kwargs, result) is passed to record first."""
    real = getattr(module, name)

    def wrapper(*a, **k):
        out = real(*a, **k)
        record(a, k, out)
        return out

    monkeypatch.setattr(module, name, wrapper)
    return real


def register(monkeypatch, name, reward_fns):
    """The toy task with other reward fns (weight 1 each), under tasks.TASKS[name] for this test."""
    monkeypatch.setitem(
        tasks.TASKS, name, toy.TASK._replace(reward_fns=reward_fns, reward_weights={k: 1.0 for k in reward_fns})
    )


def same_metrics(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in TIMING} == {k: v for k, v in y.items() if k not in TIMING}


# -----------------------------------------------------------------------------
# dynamic sampling (DAPO §3.2)


def mostly_flat(completions, question, **_):
    """0.5 for every completion of a question whose first word is w0..w32 (a flat group, no gradient);
    toy.frac_even elsewhere. 13 of the 16 toy questions are flat: steps resample, and some fall short."""
    even = toy.frac_even(completions)
    return [0.5 if toy._index(q.split()[0]) < 33 else e for q, e in zip(question, even)]


def informative(values):
    """Which groups of G have any spread, written out without grpo.informative_groups."""
    return [len(set(values[i : i + G])) > 1 for i in range(0, len(values), G)]


class DynamicSpy:
    """What each step sampled (one reward list per rollout) and what reached the loss."""

    def __init__(self, monkeypatch, reward_fn):
        self.steps = []

        def rewarded(completions, **fields):
            values = reward_fn(completions, **fields)
            if not self.steps or "batch" in self.steps[-1]:  # the previous step reached its advantages
                self.steps.append({"rollouts": [], "losses": []})
            self.steps[-1]["rollouts"].append(list(values))
            return values

        register(monkeypatch, "toy_dyn", {"r": rewarded})
        spy(monkeypatch, grpo, "group_advantages", lambda a, k, out: self.steps[-1].update(batch=a[0].tolist()))
        spy(
            monkeypatch,
            grpo,
            "grpo_loss",
            lambda a, k, out: self.steps[-1]["losses"].append(
                (k["advantages"].clone(), k["mask"].clone(), float(k["num_sequences"]))
            ),
        )


def dyn_args(model_dir, out, *extra, steps=4):
    argv = train_args(model_dir, out, "--dynamic-sampling", *extra, steps=steps)
    argv[argv.index("toy")] = "toy_dyn"
    return argv


def test_dynamic_sampling_keeps_only_groups_with_a_spread(model_dir, tmp_path, monkeypatch):
    watch = DynamicSpy(monkeypatch, mostly_flat)
    run_script(TRAIN, dyn_args(model_dir, str(tmp_path), "--config", "max_resample=3"))
    rows = read_metrics(str(tmp_path))
    assert len(watch.steps) == len(rows) == 4
    seen_extra = seen_filler = False
    for step, row in zip(watch.steps, rows):
        counts = [sum(informative(values)) for values in step["rollouts"]]
        # sampling stops once PROMPTS informative groups are in hand, or after the 3 extra rollouts
        done = [sum(counts[: k + 1]) >= PROMPTS for k in range(len(counts))]
        assert not any(done[:-1]) and (done[-1] or len(counts) == 4), counts
        groups = [tuple(values[i : i + G]) for values in step["rollouts"] for i in range(0, len(values), G)]
        flags = [f for values in step["rollouts"] for f in informative(values)]
        kept = min(PROMPTS, sum(flags))
        # the batch: the first informative groups, topped up with the last flat ones, in sampling order
        good, flat = [i for i, f in enumerate(flags) if f], [i for i, f in enumerate(flags) if not f]
        chosen = sorted(good[:kept] + flat[::-1][: PROMPTS - kept])
        assert step["batch"] == torch.tensor([v for i in chosen for v in groups[i]]).tolist()  # as fp32
        assert (row["extra_rollouts"], row["kept_groups"]) == (len(counts) - 1, kept)
        every = [v for values in step["rollouts"] for v in values]  # all that was sampled, kept or not
        assert row["reward_sampled"] == pytest.approx(sum(every) / len(every), abs=1e-6)
        # the loss: a flat group's rows have no valid token; a kept group's advantages are its own rewards',
        # (r - mean) / (std + 1e-4) with the unbiased std, per row or on each token; the normaliser counts the
        # kept rows
        assert len(step["losses"]) == PROMPTS * G // MICRO
        for j, (adv, mask, num_sequences) in enumerate(step["losses"]):
            r = torch.tensor(step["batch"][j * G : (j + 1) * G], dtype=torch.float64)
            if len(set(r.tolist())) == 1:
                assert mask.sum() == 0 and (adv == 0).all()
            else:
                assert mask.sum(1).gt(0).all()
                # float32 against float64 on O(1) values: ~1e-7 apart
                want = ((r - r.mean()) / (r.std() + 1e-4)).view(G, *[1] * (adv.dim() - 1))  # (G,) or (G, 1)
                torch.testing.assert_close(adv.double(), want.expand_as(adv), atol=1e-5, rtol=0)
            assert num_sequences == kept * G
        seen_extra |= row["extra_rollouts"] > 0
        seen_filler |= kept < PROMPTS
    assert seen_extra and seen_filler  # the run resampled, and once fell short: both paths were checked


def test_dynamic_sampling_is_deterministic_and_resumes_exactly(model_dir, tmp_path, monkeypatch):
    register(monkeypatch, "toy_dyn", {"r": mostly_flat})
    a, b, c = (str(tmp_path / x) for x in "abc")
    for out in (a, b):
        run_script(TRAIN, dyn_args(model_dir, out, "--config", "max_resample=3"))
    same_metrics(read_metrics(a), read_metrics(b))
    run_script(TRAIN, dyn_args(model_dir, c, "--config", "max_resample=3", steps=2))
    run_script(TRAIN, ["--resume", c, "--steps", 4])  # the extra rollouts' prompts depend on (seed, step)
    same_metrics(read_metrics(c), read_metrics(a))
    assert max(r["extra_rollouts"] for r in read_metrics(a)[2:]) > 0  # resampling happened after the resume


def test_dynamic_sampling_skips_a_step_with_no_spread(model_dir, tmp_path, monkeypatch, capsys):
    watch = DynamicSpy(monkeypatch, lambda completions, **_: [0.5] * len(completions))
    g = run_script(TRAIN, dyn_args(model_dir, str(tmp_path), "--config", "max_resample=0", steps=2))
    rows = read_metrics(str(tmp_path))
    assert [(r["skipped"], r["kept_groups"], r["extra_rollouts"]) for r in rows] == [(1.0, 0.0, 0.0)] * 2
    assert len(watch.steps) == 2 and all(not s["losses"] for s in watch.steps)  # the loss never ran
    init = LlamaForCausalLM.from_pretrained(model_dir).state_dict()
    for k, v in g["policy"].state_dict().items():
        assert torch.equal(v, init[k]), k  # no optimizer step (AdamW would move every weight)
    assert capsys.readouterr().out.count("skipped, no group with a reward spread after 0 resamples") == 2


# -----------------------------------------------------------------------------
# the overlong penalty (DAPO eq. 13)


def dapo_overlong(n, max_len=12, buffer=4):
    if n <= max_len - buffer:
        return 0.0
    return (max_len - buffer - n) / buffer if n <= max_len else -1.0


def test_overlong_reward_is_the_formula_over_the_sampled_lengths(model_dir, tmp_path, monkeypatch):
    lengths, scored = [], []
    spy(monkeypatch, rollout, "sample", lambda a, k, r: lengths.append(r.completion_mask.sum(1).tolist()))
    real = variants.overlong_reward  # train.py imports variants when --overlong-buffer is given

    def recorded(max_len, buffer):
        fn = real(max_len, buffer)
        return lambda completions, **fields: scored.append(fn(completions, **fields)) or scored[-1]

    monkeypatch.setattr(variants, "overlong_reward", recorded)
    run_script(
        TRAIN, train_args(model_dir, str(tmp_path), "--overlong-buffer", 4, "--reward-weights", "overlong=0.5", steps=3)
    )
    rows = read_metrics(str(tmp_path))
    want = [[dapo_overlong(n) for n in step] for step in lengths]
    assert scored == want
    for row, w in zip(rows, want):
        assert row["reward/overlong"] == pytest.approx(sum(w) / len(w), abs=1e-6)  # fp32 mean of 8 values
        assert row["reward"] == pytest.approx(
            row["reward/even"] + 0.5 * row["reward/first"] + 0.5 * row["reward/overlong"], abs=1e-5
        )
    assert len({v for w in want for v in w}) >= 3  # the lengths reach 0, the ramp and its end


# -----------------------------------------------------------------------------
# the exact full-vocabulary KL


def naive_kl(model, ref, ids, mask, C):
    """sum_v softmax(z) (log_softmax(z) - log_softmax(z_ref)) on both models' own full (N, C, V) logits."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1 : -1]  # (N, C, V)
    with torch.no_grad():
        z_ref = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1 : -1]  # (N, C, V)
    kl = (z.softmax(-1) * (z.log_softmax(-1) - z_ref.log_softmax(-1))).sum(-1)  # (N, C)
    return kl * mask[:, -C:]


def kl_batch():
    """3 rows: left-padded prompts of 4 (rows 0 and 1 the same one of 2 tokens, as a group's rows),
    completions of 6 right-padded after their stop."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 98, (3, 10), generator=g)
    ids[1, :4] = ids[0, :4]
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[:2, :2] = 0  # a shorter prompt
    mask[1, 7:] = 0  # a completion that stopped after 3 tokens
    return ids, mask, 6


@pytest.mark.parametrize("share", [True, False], ids=["prompts-shared", "whole-rows"])
def test_full_kl_value_and_gradient_equal_autograd_of_the_naive_formula(share):
    """The rows' prompts repeat (rows 0, 1 share one, row 2 has its own), so share=True runs 2 prompts."""
    policy, ref = make_model(seed=0), make_model(seed=1).requires_grad_(False)
    ids, mask, C = kl_batch()
    w = torch.rand(3, C, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_h = rollout.completion_hidden(ref, ids, mask, C, share)  # (N, C, H): what train.py keeps, not logits
    assert ref_h.shape == (3, C, ref.config.hidden_size)
    _, _, kl = rollout.token_logprobs(
        policy, ids, mask, C, ref=rollout.RefStates(ref.get_output_embeddings(), ref_h), share=share
    )
    grads = torch.autograd.grad((w * kl).sum(), list(policy.parameters()))
    want = naive_kl(policy, ref, ids, mask, C)
    want_grads = torch.autograd.grad((w * want).sum(), list(policy.parameters()))
    # both sides in fp32 on the same machine, differing only in summation order (chunked head, the prompt
    # run apart): a few ulps of the largest terms. KL values reach ~4; a gradient entry is a sum of terms as
    # large as its tensor's largest entry, so its bound scales with that. Another CPU changes the order of
    # the sums, not their precision (conftest.assert_close_scaled: 64 and 256 eps32 of the tensor's largest entry).
    assert_close_scaled(kl, want)
    assert want.abs().max() > 0.1  # two different models: a real KL to compare
    for (name, _), a, b in zip(policy.named_parameters(), grads, want_grads):
        assert_close_scaled(a, b, GRADS, msg=name)


def test_full_kl_in_the_loop_keeps_hidden_states_not_logits(model_dir, tmp_path, monkeypatch):
    stored = []
    spy(
        monkeypatch,
        rollout,
        "completion_hidden",
        lambda a, k, out: stored.append((a[0], tuple(out.shape), a[4] if len(a) > 4 else k.get("share", True))),
    )
    g = run_script(TRAIN, train_args(model_dir, str(tmp_path), "--kl-estimator", "full", steps=2))
    rows = read_metrics(str(tmp_path))
    H, V = g["ref"].config.hidden_size, g["ref"].config.vocab_size
    # the loop's calls (the start-up sharing probe runs 2 rows, not a micro-batch of MICRO)
    ref_calls = [(shape, share) for model, shape, share in stored if model is g["ref"] and shape[0] == MICRO]
    # one (micro-batch, c, H) tensor per micro-batch per step: N*C*H floats, V/H times fewer than logits;
    # each micro-batch is one group, so its prompt runs once (prompt sharing is on for this model)
    assert len(ref_calls) == 2 * PROMPTS * G // MICRO and g["passes"]["share"]
    assert all(s[2] == H != V and share for s, share in ref_calls)
    assert [tuple(h.shape) for h in g["ref_hidden"]] == [s for s, _ in ref_calls[-2:]]  # hidden states, no log-probs
    # the reference == the policy before the first update: the same fp32 numbers, a KL of exactly 0
    assert rows[0]["kl"] == 0.0 < rows[1]["kl"] and rows[1]["kl_max"] >= rows[1]["kl"]


# -----------------------------------------------------------------------------
# process supervision (DeepSeekMath §4.1.3) with the real SmolLM2 tokenizer


def steps_of(gold, group):
    """The scripted completions of a group: (lines, their step rewards under extra_tasks.arith_step_rewards)."""
    first = [("4 * 2 = 8", 1.0), ("3 + 8 = 11", 1.0)]
    if group == 0:  # a longer first row: the two micro-batches are trimmed to different widths
        first += [("1 + 1 = 3", 0.0), ("10 - 4 = 6", 1.0)]
    rows = [
        first + [(f"#### {gold}", 1.0)],
        [("4 * 2 = 9", 0.0), (f"#### {int(gold) + 1}", 0.0)],
        [("I think", 0.0), ("5 - 2 = 3", 1.0)],
        [(f"#### {gold}", 1.0)],
    ]
    return [([line for line, _ in row], [v for _, v in row]) for row in rows]


def scripted_sampler(tok, real_sample, record):
    """rollout.sample with the completions written here: the prompts as sampled, then the scripted lines
    tokenized piece by piece, so each line's last token index is known without tasks.step_positions."""

    def sample(model, tokenizer, prompts, group_size, *, max_new_tokens, stop_ids, **k):
        base = real_sample(model, tokenizer, prompts, group_size, max_new_tokens=1, stop_ids=stop_ids, **k)
        rows, ends, golds = [], [], []
        for p, messages in enumerate(prompts):
            gold = str(eval(messages[-1]["content"][len("What is ") : -1]))  # Python's precedence is the task's
            for lines, _ in steps_of(gold, p):
                ids, row_ends = [], []
                for i, line in enumerate(lines):
                    ids += tok(("\n" if i else "") + line, add_special_tokens=False)["input_ids"]
                    row_ends.append(len(ids) - 1)
                rows.append(ids + [stop_ids[0]])
                ends.append(row_ends)
                golds.append(gold)
        C = max(map(len, rows))
        completion_ids = torch.tensor([x + [stop_ids[0]] * (C - len(x)) for x in rows])  # (N, C)
        completion_mask = (torch.arange(C)[None] < torch.tensor(list(map(len, rows)))[:, None]).long()  # to the stop
        truncated = torch.zeros(len(rows), dtype=torch.bool)  # every row ends in its stop token
        texts = tokenizer.batch_decode([x[:-1] for x in rows], skip_special_tokens=True)  # as sample() decodes
        r = rollout.Rollout(
            base.prompt_ids,
            base.prompt_mask,
            completion_ids,
            completion_mask,
            truncated,
            texts,
            torch.zeros(len(rows), C),
            base.prompt_cut,
            torch.zeros(len(rows), C, dtype=torch.bool),
            examples=base.examples,
        )
        with torch.no_grad():  # the sampling log-probs are the policy's own: no behaviour correction
            r.sample_logp = rollout.token_logprobs(model, r.input_ids, r.attention_mask, C)[0]
        record.append((r, ends, golds))
        return r

    return sample


def hand_advantages(ends, step_rewards, C, eps=1e-4):
    """DeepSeekMath §4.1.3 for one group, by hand: normalise all its step rewards together (unbiased std),
    then A_t = the sum of the normalised rewards of the steps that end at or after token t."""
    flat = [v for row in step_rewards for v in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1))
    out = []
    for row_ends, row_rewards in zip(ends, step_rewards):
        norm = [(v - mean) / (std + eps) for v in row_rewards]
        out.append([sum(n for e, n in zip(row_ends, norm) if e >= t) for t in range(C)])
    return torch.tensor(out)


@pytest.mark.real_model
def test_process_supervision_advantages_are_the_hand_calculation(smol_tok, tmp_path, monkeypatch):
    """--task arith_steps --supervision process through train.py: a tiny Llama with SmolLM2's tokenizer
    (digits and `=` need a real vocabulary), completions scripted so that each group has spread."""
    folder = tmp_path / "tiny_smol"
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(smol_tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=smol_tok.bos_token_id,
        eos_token_id=smol_tok.eos_token_id,
        pad_token_id=smol_tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    smol_tok.save_pretrained(folder)
    sampled, losses = [], []
    monkeypatch.setattr(rollout, "sample", scripted_sampler(smol_tok, rollout.sample, sampled))
    spy(monkeypatch, grpo, "grpo_loss", lambda a, k, out: losses.append(k["advantages"].clone()))
    argv = train_args(str(folder), str(tmp_path / "out"), "--supervision", "process", "--beta", 0, steps=1)
    argv[argv.index("toy")], argv[argv.index("--max-new-tokens") + 1] = "arith_steps", 48
    run_script(TRAIN, argv)
    [(r, ends, golds)] = sampled
    for i, text in enumerate(r.completions):  # the scripted rewards are the task's own
        lines, step_rewards = steps_of(golds[i], i // G)[i % G]
        assert text == "\n".join(lines)
        assert [v for _, v in extra_tasks.arith_step_rewards(text, {"answer": golds[i]})] == step_rewards
    assert len(losses) == PROMPTS * G // MICRO
    for j, adv in enumerate(losses):
        rows = slice(j * G, (j + 1) * G)
        want = hand_advantages(ends[rows], [rw for _, rw in steps_of(golds[j * G], j)], adv.size(1))
        # float32 against Python's float64 sums of a few O(1) terms: ~1e-7 apart
        torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)
        assert adv[:, 0].abs().min() > 0.1  # every row's first token carries its steps' rewards
    every_step = [v for i in range(len(r.completions)) for v in steps_of(golds[i], i // G)[i % G][1]]
    [row] = read_metrics(str(tmp_path / "out"))  # logged as reward/step: the mean over all steps of the batch
    assert row["reward/step"] == pytest.approx(sum(every_step) / len(every_step), abs=1e-6)


# -----------------------------------------------------------------------------
# tracker logging and the metrics file


def test_tensorboard_holds_the_values_of_metrics_jsonl(model_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install -r requirements-extra.txt")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--config", "log_to=tensorboard", steps=2))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rows = read_metrics(str(tmp_path))
    for key in ("reward", "loss", "kl", "lr", "reward/even", "completion_len"):
        got = {e.step: e.value for e in events.Scalars(key)}
        # TensorBoard stores float32; metrics.jsonl the float64 the loop logged
        assert got == {r["step"]: pytest.approx(r[key], rel=1e-6, abs=1e-12) for r in rows}, key


def test_metrics_file_is_json_even_with_non_finite_values(tmp_path):
    log = MetricsLog(str(tmp_path))
    log.write({"step": 1, "loss": math.nan, "kl": math.inf, "grad_norm": -math.inf, "reward": 0.25, "n": 3})
    log.write({"step": 2, "loss": 0.5})
    log.close()

    def no_constants(name):
        raise AssertionError(f"bare {name} in metrics.jsonl: not JSON")

    lines = open(tmp_path / "metrics.jsonl").read().splitlines()
    rows = [json.loads(x, parse_constant=no_constants) for x in lines]
    assert rows == [
        {"step": 1, "loss": None, "kl": None, "grad_norm": None, "reward": 0.25, "n": 3},
        {"step": 2, "loss": 0.5},
    ]
    resumed = MetricsLog(str(tmp_path), resume_step=1)  # a resume from step 1 drops the later lines
    resumed.close()
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1]


def test_metrics_combine_over_micro_batches_by_their_names_ending():
    """A step's metric from its micro-batches (run.reduce; run.reduce_op also picks all_reduce's op across
    processes): a name ending _max takes the max, _min the min, anything else the mean, max/min elsewhere in the
    name included. Fails if every metric is averaged (a kl_max that is no maximum), _max and _min are swapped, or
    the rule matches "max"/"min" anywhere in the name."""
    stats = {
        "kl_max": [0.5, 3.0, 1.0],
        "ratio_min": [0.75, 0.25, 1.5],
        "loss": [1.0, 2.0, 6.0],
        "max_tokens": [2.0, 4.0, 0.0],
        "min_reward_p99": [0.5, 1.5],
    }
    by_hand = {"kl_max": 3.0, "ratio_min": 0.25, "loss": 3.0, "max_tokens": 2.0, "min_reward_p99": 1.0}
    assert {k: reduce(k, v) for k, v in stats.items()} == by_hand
    ops = {"kl_max": "max", "ratio_min": "min", "loss": "mean", "max_tokens": "mean", "min_reward_p99": "mean"}
    assert {k: reduce_op(k) for k in stats} == ops  # the keys run.all_reduce takes


# -----------------------------------------------------------------------------
# the sampler/trainer correction (truncated importance sampling)


def test_bfloat16_gap_metrics_and_weights_are_the_recomputed_ones(model_dir, tmp_path, monkeypatch):
    """--dtype bfloat16 samples in bf16 and trains in autocast: the two log-probs differ a little.
    is_cap=1 truncates every token the trainer likes more than the sampler did."""
    sampled, losses = [], []
    spy(monkeypatch, rollout, "sample", lambda a, k, r: sampled.append(r))
    spy(
        monkeypatch,
        grpo,
        "grpo_loss",
        lambda a, k, out: losses.append((a[0].detach().clone(), k["mask"].clone(), k["sample_logp"].clone(), out[1])),
    )
    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--dtype", "bfloat16", "--config", "is_cap=1.0", steps=2))
    rows = read_metrics(str(tmp_path))
    per_step = PROMPTS * G // MICRO
    for s, (row, r) in enumerate(zip(rows, sampled)):
        calls = losses[s * per_step : (s + 1) * per_step]
        d, capped = [], []
        for j, (logp, mask, given, metrics) in enumerate(calls):
            c = logp.size(1)
            sample_logp = r.sample_logp[j * MICRO : (j + 1) * MICRO, :c]
            assert torch.equal(given, sample_logp)  # the loss reweights against this micro-batch's sampled log-probs
            ratio, m = (logp - sample_logp).exp(), mask.bool()  # fp32 as the loop: exp(1e-9) is 1, not > 1
            assert metrics["is_capped"].item() == pytest.approx((ratio[m] > 1.0).double().mean().item(), abs=1e-6)
            d += (logp.double() - sample_logp.double()).abs()[m].tolist()
            capped.append((ratio[m] > 1.0).double().mean().item())
        d = np.array(d)
        # float32 metrics against float64 numpy (the same linear-interpolation percentile): ~1e-7 relative
        assert row["dlogp_mean"] == pytest.approx(d.mean(), rel=1e-5, abs=1e-7)
        assert row["dlogp_p99"] == pytest.approx(np.percentile(d, 99), rel=1e-5, abs=1e-7)
        assert row["dlogp_max"] == pytest.approx(d.max(), rel=1e-5, abs=1e-7)
        assert row["is_capped"] == pytest.approx(np.mean(capped), abs=1e-6)
        assert row["dlogp_p99"] <= row["dlogp_max"] and row["dlogp_mean"] <= row["dlogp_max"]
        assert 0 < row["is_capped"] < 1 and row["dlogp_max"] > 0  # bf16 sampling is not the fp32 trainer


def test_is_mode_none_trains_with_weights_one(model_dir, tmp_path, monkeypatch):
    calls = []

    def check(a, k, out):
        assert k["obj"].is_mode == "none" and k["sample_logp"] is not None
        again, _ = real(*a, **{**k, "sample_logp": None})
        assert torch.equal(out[0], again)  # the loss of plain GRPO, no reweighting
        calls.append(1)

    real = spy(monkeypatch, grpo, "grpo_loss", check)
    none, cap = str(tmp_path / "none"), str(tmp_path / "cap")
    run_script(TRAIN, train_args(model_dir, none, "--dtype", "bfloat16", "--is-mode", "none", steps=1))
    assert len(calls) == PROMPTS * G // MICRO
    monkeypatch.undo()
    run_script(TRAIN, train_args(model_dir, cap, "--dtype", "bfloat16", "--config", "is_cap=1.0", steps=1))
    # the same rollouts and passes (same seed), so only the weights can move the loss: they reach it
    [a], [b] = read_metrics(none), read_metrics(cap)
    assert a["reward"] == b["reward"] and a["dlogp_max"] == b["dlogp_max"] > 0
    assert a["is_capped"] == 0 < b["is_capped"] and a["loss"] != b["loss"]


# -----------------------------------------------------------------------------
# per-prompt generators: a prompt's completions do not depend on the number of processes


@pytest.mark.slow
def test_two_processes_sample_what_one_process_samples(model_dir, tmp_path):
    from test_train import torchrun

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run_script(TRAIN, train_args(model_dir, one, steps=1))
    proc = torchrun(train_args(model_dir, two, steps=1), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [a], [b] = read_metrics(one), read_metrics(two)
    # step 1 is measured before any update; two ranks' means of 4 completions each vs one mean of 8 in fp32
    for k in ("reward", "reward/even", "reward/first", "reward_std", "completion_len", "truncated", "frac_zero_std"):
        assert b[k] == pytest.approx(a[k], abs=1e-6), k
    assert b["completion_len_max"] == a["completion_len_max"]
