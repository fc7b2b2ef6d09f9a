"""Multi-turn tool rollouts: rollout.sample with an environment, the loss and log-probs on trajectories that hold
tools' replies, train.py and evaluate() on a task with tools. CPU, fp32, tiny models built in process; a stub tool on
word tokens (tests/toy.py's WordTools: a row's own w5 is a call, w7 a call answered with an error, the reply the word
"w1" in the chat template's frame: `<|im_end|> <|im_start|> user w1 <|im_end|> <|im_start|> assistant`, 7 tokens) and
the real ToolEnv on the offline SmolLM2 (`real_model`).

Tolerances (conftest): the log-prob pass against the model's own forward, one row at a time, computes the same fp32
sums in another order, within 64 eps32 of the largest |log-prob| compared (measured <= 13); the decode loop against
the teacher-forced pass adds the KV cache's batch shapes, 128 eps32 (measured <= 27). A reply missing from the
context, or a position off by one, moves log-probs by > 1e-2 here (init_std 0.3): ~1000x the bound. Masked positions
are compared bit for bit: torch.where picks, it does not round."""

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import threading
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import grpo
import toy
from conftest import DECODE, ENDOFTEXT, EOS, VOCAB, assert_close_scaled, make_tokenizer, tiny
from rollout import RefStates, Sampler, batch_logprobs, completion_hidden, sample, token_logprobs
from eval import evaluate
from tasks import TASKS
from toy import REPO, TIMING, TRAIN, WordTools, read_metrics, run_script, subprocess_env, train_args


def state(r, key):
    """(N,) one environment-state value of each row of a Rollout."""
    return torch.tensor([s[key] for s in r.env_state])


_ = -1  # a step the script leaves to the model (a reply's step: the environment replaces the token)
W = VOCAB  # conftest's word ids: W["w5"]
REPLY = [EOS, W["<|im_start|>"], W["user"], W["w1"], EOS, W["<|im_start|>"], W["assistant"]]  # the stub's, framed
L = len(REPLY)
PROMPTS = [
    "w1 w2",
    "w3 w4 w6 w8 w9 w10 w11 w12",  # very different lengths: left padding is real
    [{"role": "system", "content": "w13"}, {"role": "user", "content": "w14 w15 w16"}],
]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


class Forced(torch.nn.Module):
    """A model for sample(): step t of row r takes script[r][t] where that is >= 0 (its logit 0, every other -1e4:
    probability 1 at any temperature, greedy too), else the model's own choice. Each prefill (the call with
    logits_to_keep) starts the next batch's script in `scripts`; the prefill's rows are the prompts, each its group's
    first row (a group's rows must agree on step 0)."""

    def __init__(self, model, *scripts):
        super().__init__()
        self.model, self.config, self.scripts, self.batch, self.t = model, model.config, scripts, -1, 0

    def get_decoder(self):  # sample() names the cache argument as the decoder's forward does
        return self.model.get_decoder()

    def forward(self, **kw):
        logits = self.model(**kw).logits[:, -1:].clone()  # (n, 1, V)
        if "logits_to_keep" in kw:  # the prefill: a new batch, step 0
            self.batch, self.t = self.batch + 1, 0
            self.fed = torch.zeros(len(self.scripts[self.batch]), dtype=torch.long)  # (N,) a row's tokens fed
        else:  # a row's step counts its fed tokens: a hole (a row waiting on its environment) is no step
            self.fed += kw["attention_mask"][:, -1].cpu()
        script = self.scripts[self.batch]
        G = len(script) // logits.size(0)
        if self.t == 0:
            assert all(len({s[0] for s in script[b * G : (b + 1) * G]}) == 1 for b in range(logits.size(0))), (
                "a group's rows share their prefill: the script must give them one step 0"
            )
        for r in range(logits.size(0)):
            steps, t = script[r * G if self.t == 0 else r], int(self.fed[r]) if self.t else 0
            if t < len(steps) and steps[t] >= 0:
                logits[r] = -1e4
                logits[r, 0, steps[t]] = 0.0
        self.t += 1
        return SimpleNamespace(logits=logits)


# -----------------------------------------------------------------------------
# 3. masks by hand: rows ending at different turns, the call limit, a reply cut by the budget


B = 28  # scripted_rollout's budget: room for three calls (3 x 8 tokens) and an answer
LONG = [EOS, W["<|im_start|>"], W["user"], W["w1"], W["w2"], W["w3"], EOS, W["<|im_start|>"], W["assistant"]]


def stub(tok, max_calls=2, calls=("w5",), replies=None):
    import envs

    return envs.EnvDriver(WordTools(max_calls, calls=calls, errors=("w7",), reply="w1", replies=replies), tok)


def scripted_rollout(model, tok):
    """Six rows (one prompt each, G=1), B = 28 new tokens, stop ids [<|endoftext|>, <|im_end|>] (pad:
    <|endoftext|>), at most 2 calls; w6 is a call whose reply is 9 tokens (LONG). A turn runs only where more than the
    shortest reply (7 tokens: REPLY's length) is left after it. Rows: 0 calls; 1 call then a stop; 2 calls (the second
    an error) then a stop; a call at every turn (the third, past the limit, gets an error reply) then an answer; a w6
    call on step 20 (own token 19, 28 - 20 = 8 tokens left: it runs) whose reply the budget cuts after 8 tokens; calls
    on steps 21, 27 and 28 (7, 1 and 0 tokens left: none runs or counts)."""
    w = [W[f"w{i}"] for i in range(41)]
    words = [w[i] for i in range(13, 41)]  # 28 words without a call (w5, w6, w7) among them
    script = [
        [w[10], w[11], EOS],
        [w[5], *[_] * L, w[12], EOS],
        [w[5], *[_] * L, W["w7"], *[_] * L, EOS],
        [w[5], *[_] * L, w[5], *[_] * L, w[5], *[_] * L, w[12], EOS],
        [*words[:19], w[6], *[_] * 8],
        [*words[:20], w[5], *words[21:26], w[5], w[5]],
    ]
    prompts = [PROMPTS[i % 3] for i in range(6)]
    return sample(
        Forced(model, script),
        tok,
        prompts,
        1,
        max_new_tokens=B,
        stop_ids=[ENDOFTEXT, EOS],
        generator=gen(),
        env=stub(tok, replies={"w6": "w1 w2 w3"}),
    )


def test_rows_finish_at_different_turns_and_masks_are_exact_by_hand():
    """Fails if a reply's frame is not fed whole (its <|im_end|> taken for the row's stop), if the call past the limit
    ends the row instead of an error reply, if a call with 8 tokens left does not run or one with 7, 1 or 0 left
    does, if the budget's cut of a reply loses its last token or leaves the row untruncated, or if a mask, a count or
    the own text is off (completions holding a reply's words, a turn boundary lost)."""
    tok = make_tokenizer()
    r = scripted_rollout(tiny(), tok)
    w = {i: W[f"w{i}"] for i in range(41)}
    words = [w[i] for i in range(13, 41)]
    P = ENDOFTEXT  # the pad id: stop_ids[0]
    # lengths by hand: 3; 1 + 7 + 2 = 10; 1 + 7 + 1 + 7 + 1 = 17; 3 * (1 + 7) + 2 = 26; 20 + 8 = 28; 28
    rows = [
        [w[10], w[11], EOS],
        [w[5], *REPLY, w[12], EOS],  # the reply's own <|im_end|> (REPLY[0], REPLY[4]) did not stop the row
        [w[5], *REPLY, W["w7"], *REPLY, EOS],
        [w[5], *REPLY, w[5], *REPLY, w[5], *REPLY, w[12], EOS],  # the third call's reply is the limit's error
        [*words[:19], w[6], *LONG[:8]],  # cut 1 token before the reply's end
        [*words[:20], w[5], *words[21:26], w[5], w[5]],  # 7, 1, 0 tokens left after its calls: no reply
    ]
    assert r.completion_ids.tolist() == [x + [P] * (B - len(x)) for x in rows]
    own = [
        [1] * 3,
        [1] + [0] * L + [1, 1],
        [1] + [0] * L + [1] + [0] * L + [1],
        [1] + [0] * L + [1] + [0] * L + [1] + [0] * L + [1, 1],
        [1] * 20 + [0] * 8,
        [1] * 28,
    ]
    assert r.completion_mask.tolist() == [x + [0] * (B - len(x)) for x in own]
    assert r.env_mask.int().tolist() == [[1 - v for v in x] + [0] * (B - len(x)) for x in own]
    assert r.attention_mask[:, -B:].tolist() == [[1] * len(x) + [0] * (B - len(x)) for x in rows]
    assert r.truncated.tolist() == [False, False, False, False, True, True]  # the budget ended them
    assert state(r, "tool_calls").tolist() == [0, 1, 2, 3, 1, 0]
    assert state(r, "tool_errors").tolist() == [0, 0, 1, 1, 0, 0]
    assert (r.sample_logp[r.env_mask] == 0).all() and not (r.completion_mask.bool() & r.env_mask).any()
    # completions: the model's own words only, a turn a line (a stop alone is no turn); trajectories: the replies too
    text = " ".join(f"w{i}" for i in range(13, 32))
    assert r.completions == [
        "w10 w11",
        "w5\nw12",
        "w5\nw7",
        "w5\nw5\nw5\nw12",
        f"{text} w6",
        f"{text} w32 w5 w34 w35 w36 w37 w38 w5 w5",
    ]
    frame = "<|im_end|> <|im_start|> user w1 <|im_end|> <|im_start|> assistant"
    assert r.trajectories[:2] == ["w10 w11", f"w5 {frame} w12"]  # the row's own stop token left out
    assert r.trajectories[3] == f"w5 {frame} w5 {frame} w5 {frame} w12"
    # a reply's <|im_end|> is no stop: it stays, and so does the last reply token the budget let in
    assert r.trajectories[4] == f"{text} w6 <|im_end|> <|im_start|> user w1 w2 w3 <|im_end|> <|im_start|>"


class GatedTools(WordTools):
    """The stub whose first row's turns wait on `release` (up to 10 s; `entered` set when one starts); the other rows'
    answer at once."""

    def __init__(self, release, **kw):
        super().__init__(**kw)
        self.release, self.entered, self.in_time, self.made = release, threading.Event(), [], 0

    def __call__(self):
        self.made += 1
        env = toy.WordToolEnv(self)
        if self.made == 1:  # row 0's
            env.turn = partial(self.gated, env.turn)
        return env

    def gated(self, turn, text, stopped):
        self.entered.set()
        self.in_time.append(self.release.wait(10))
        return turn(text, stopped)


class Gate(Forced):
    """Forced, which also releases a GatedTools' call after `hold` decode steps where row 0 was a hole (waiting on
    it), and records each such step's fed rows (N,)."""

    def __init__(self, model, tools, hold, *scripts):
        super().__init__(model, *scripts)
        self.tools, self.hold, self.while_pending = tools, hold, []

    def forward(self, **kw):
        fed = kw["attention_mask"][:, -1]  # (N,) in a decode step
        if "logits_to_keep" not in kw and not fed[0] and not self.tools.release.is_set():
            self.while_pending.append(fed.clone())
            if len(self.while_pending) == self.hold:
                self.tools.release.set()
        return super().forward(**kw)


def test_a_slow_call_holds_only_its_row_and_changes_no_rows_tokens():
    """Row 0 calls at its step 1; its call answers only after 3 decode steps with row 0 a hole (released by the
    model's forward).
    Fails if turns run in the decode loop's thread (the call would wait its 10 s out: no step runs to release it), if
    the other rows stop while it is pending, or if a waiting row's hole takes a uniform, a position or a token of its
    own: every row's tokens must equal those of the same run with the tool instant."""
    import envs

    tok, model = make_tokenizer(), tiny()
    w10, w5 = W["w10"], W["w5"]
    script = [[w10, w5], [w10], [_], [_], [_], [_]]  # 3 prompts x G=2; only row 0's call is forced
    runs = []
    for instant in (True, False):
        release = threading.Event()
        if instant:
            release.set()
        tools = GatedTools(release, max_calls=2, calls=("w5",), errors=("w7",), reply="w1")
        model_ = Gate(model, tools, 3, script)
        env = envs.EnvDriver(tools, tok)
        r = sample(
            model_,
            tok,
            PROMPTS,
            2,
            max_new_tokens=24,
            stop_ids=[EOS],
            sampler=Sampler(temperature=1.0),
            generator=[gen(i) for i in range(3)],
            env=env,
        )
        runs.append((r, tools, model_))
    fast, (slow, tools, gate) = runs[0][0], runs[1]
    assert (
        tools.in_time[0] and state(slow, "tool_calls")[0] >= 1 and slow.env_mask[0, 2:9].all()
    )  # row 0 called, answered
    assert len(gate.while_pending) == 3 and all(m[1:].all() for m in gate.while_pending)  # the others decoded
    for k in ("completion_ids", "completion_mask", "env_mask", "truncated"):
        assert torch.equal(getattr(slow, k), getattr(fast, k)), k
    assert slow.env_state == fast.env_state
    assert slow.completions == fast.completions
    assert_close_scaled(slow.sample_logp, fast.sample_logp, DECODE)  # masked cache columns: the same sums, reordered


# -----------------------------------------------------------------------------
# 1. reply tokens: no loss, no gradient, whatever the log-probs there hold


def loss_inputs(r, model, ref):
    """The per-token inputs of grpo_loss on rollout r, as train.py makes them (fp32, no grad): logp, entropy and the
    exact KL from the policy's pass, old and reference log-probs and the sampler's a little off the policy's."""
    C, g = r.completion_ids.size(1), gen(3)
    with torch.no_grad():
        ref_hidden = completion_hidden(ref, r.input_ids, r.attention_mask, C)  # (N, C, H)
        logp, entropy, kl = token_logprobs(
            model,
            r.input_ids,
            r.attention_mask,
            C,
            with_entropy=True,
            ref=RefStates(ref.get_output_embeddings(), ref_hidden),
        )
    noise = torch.randn(3, *logp.shape, generator=g)
    return {
        "logp": logp,
        "entropy": entropy,
        "kl": kl,
        "old": logp + 0.3 * noise[0],
        "ref": logp + noise[1],
        "sample": logp + 0.05 * noise[2],
    }


ADV = [1.0, -0.5, 0.8, -1.2, 0.4, 0.9]  # one advantage per scripted row


def loss_and_grads(v, mask, obj, is_mode):
    """grpo_loss as train.py calls it with --mu > 1 -> (loss, {input: d loss / d input}, metrics)."""
    leaves = {k: v[k].clone().requires_grad_() for k in ("logp", "entropy", "kl")}
    obj = dataclasses.replace(obj, is_mode=is_mode)
    full = obj.kl_estimator == "full"
    adv = torch.tensor(ADV)  # (N,)
    loss, metrics = grpo.grpo_loss(
        leaves["logp"],
        old_logp=v["old"],
        ref_logp=None if full else v["ref"],
        advantages=adv,
        mask=mask,
        obj=obj,
        entropy=leaves["entropy"],
        kl=leaves["kl"] if full else None,
        sample_logp=v["sample"],
        num_sequences=torch.tensor(6.0),
        num_tokens=mask.sum().float(),
    )
    grads = torch.autograd.grad(
        loss, [leaves["logp"], leaves["entropy"]] + ([leaves["kl"]] if full else []), allow_unused=True
    )
    return loss, dict(zip(["logp", "entropy", "kl"], grads)), metrics


@pytest.fixture(scope="module")
def rollout_with_replies():
    tok, model = make_tokenizer(), tiny()
    return scripted_rollout(model, tok), model, tiny(seed=1)


@pytest.mark.parametrize("variant", ["token", "sequence+entropy"])
@pytest.mark.parametrize("kl_estimator", ["k3_clamped", "k3", "full"])  # k3: no clamp to hide a NaN
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_reply_tokens_get_exactly_zero_loss_and_gradient(rollout_with_replies, loss_type, kl_estimator, variant):
    """Fails if the loss reads a reply position (env_mask folded into the loss mask, a product with the mask instead of
    a torch.where that lets a NaN through), or if the loss differs from the same terms with the replies deleted."""
    r, model, ref = rollout_with_replies
    own, reply = r.completion_mask.bool(), r.env_mask  # (N, C) each
    assert reply.sum() == 50 and own.sum() == 62  # by hand: 7 + 14 + 21 + 8 replies; 3 + 3 + 3 + 5 + 20 + 28 own
    extra = {} if variant == "token" else dict(importance_level="sequence", entropy_coef=0.01, top_entropy_quantile=0.5)
    if (loss_type, extra.get("importance_level", "token")) in {("luspo", "token"), ("vespo", "sequence")}:
        pytest.skip(f"--loss-type {loss_type} takes the other importance level (Objective refuses this one)")
    obj = grpo.Objective(beta=0.04, kl_estimator=kl_estimator, loss_type=loss_type, max_new_tokens=B, **extra)
    is_mode = "token_truncate" if variant == "token" else "sequence_truncate"
    clean = loss_inputs(r, model, ref)
    assert all(x[reply].abs().min() > 1e-3 for k, x in clean.items() if k != "kl")  # real values, not zeros
    loss, grads, metrics = loss_and_grads(clean, r.completion_mask, obj, is_mode)
    assert torch.isfinite(loss) and loss != 0
    for k, g in grads.items():
        if g is not None:
            assert (g[reply] == 0).all() and (g[~own] == 0).all(), k  # exactly: torch.where routes no gradient
    assert grads["logp"][own].abs().max() > 1e-4  # the model's own tokens do get one
    # garbage at the reply positions of every input changes nothing, bit for bit
    for junk in (math.nan, math.inf, -math.inf, 1e30, -1e30):
        dirty = {k: x.masked_fill(reply, junk) for k, x in clean.items()}
        loss2, grads2, metrics2 = loss_and_grads(dirty, r.completion_mask, obj, is_mode)
        assert torch.equal(loss2, loss), junk
        for k in grads:
            assert (grads[k] is None and grads2[k] is None) or torch.equal(grads2[k], grads[k]), (junk, k)
        for k in metrics:
            assert torch.equal(metrics2[k], metrics[k]), (junk, k)
    # an independent computation: the reply columns deleted, each row's own tokens packed to the left
    n = own.sum(1)  # (N,)
    packed_mask = (torch.arange(int(n.max()))[None] < n[:, None]).long()  # (N, C')

    def pack(x):
        out = torch.zeros(packed_mask.shape, dtype=x.dtype)
        out[packed_mask.bool()] = x[own]
        return out

    packed, _, _ = loss_and_grads({k: pack(x) for k, x in clean.items()}, packed_mask, obj, is_mode)
    assert_close_scaled(packed, loss)  # the same terms; dr_grpo's divisor is max_len in both
    # the test has teeth: the same garbage on one own token moves the loss
    bad = {**clean, "old": clean["old"].masked_fill(own & (torch.arange(B) == 4), 5.0)}
    assert not torch.equal(loss_and_grads(bad, r.completion_mask, obj, is_mode)[0], loss)


@pytest.mark.parametrize("kl_estimator", ["k3_clamped", "full"])
def test_reply_positions_send_no_gradient_to_the_weights(rollout_with_replies, kl_estimator):
    """The whole path, as train.py's step runs it: token_logprobs with grad (entropy, the exact KL against the
    reference's head), behaviour weights, grpo_loss, backward. Garbage in the old, reference and sampler log-probs
    at the reply positions leaves the loss and every weight's gradient bit for bit. Fails if any of them reaches the
    loss or a gradient."""
    r, model, ref = rollout_with_replies
    C, reply = r.completion_ids.size(1), r.env_mask
    full = kl_estimator == "full"
    obj = grpo.Objective(beta=0.04, kl_estimator=kl_estimator, max_new_tokens=C, entropy_coef=0.01)
    with torch.no_grad():
        ref_hidden = completion_hidden(ref, r.input_ids, r.attention_mask, C)  # (N, C, H)
        base = token_logprobs(model, r.input_ids, r.attention_mask, C)[0]  # (N, C)
    noise = torch.randn(2, *base.shape, generator=gen(4))
    clean = {"old": base + 0.3 * noise[0], "ref": base + noise[1], "sample": base}

    def weight_grads(v):
        model.zero_grad(set_to_none=True)
        logp, entropy, kl = token_logprobs(
            model,
            r.input_ids,
            r.attention_mask,
            C,
            with_entropy=True,
            ref=RefStates(ref.get_output_embeddings(), ref_hidden) if full else None,
        )
        loss, _ = grpo.grpo_loss(
            logp,
            old_logp=v["old"],
            ref_logp=None if full else v["ref"],
            advantages=torch.tensor(ADV),
            mask=r.completion_mask,
            obj=obj,
            entropy=entropy,
            kl=kl,
            sample_logp=v["sample"],
        )
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    loss, grads = weight_grads(clean)
    assert max(g.abs().max() for g in grads.values()) > 1e-4
    for junk in (math.nan, math.inf, -1e30):
        loss2, grads2 = weight_grads({k: x.masked_fill(reply, junk) for k, x in clean.items()})
        assert torch.equal(loss2, loss) and all(torch.equal(grads2[k], g) for k, g in grads.items()), junk


# -----------------------------------------------------------------------------
# 2. training log-probs: the model's own forward on the trajectory, replies in its context


def naive_logprobs(model, r, T, drop_replies=False):
    """Each row alone, unpadded, through model(input_ids=prompt + trajectory): its real prompt tokens, then its
    completion up to its last attended token (own and reply tokens; without the replies if drop_replies), fp32
    log_softmax of logits / T at the position before each token -> (N, C), 0 where not computed."""
    C = r.completion_ids.size(1)
    seen = r.attention_mask[:, -C:].bool()  # (N, C)
    out = torch.zeros(seen.shape)
    with torch.no_grad():
        for i in range(seen.size(0)):
            keep = seen[i] & ~r.env_mask[i] if drop_replies else seen[i]
            prompt, cols = r.prompt_ids[i][r.prompt_mask[i].bool()], keep.nonzero().squeeze(1)
            ids = torch.cat([prompt, r.completion_ids[i, cols]])  # (P_i + n_i,)
            lsm = (model(input_ids=ids[None]).logits[0].float() / T).log_softmax(-1)  # (P_i + n_i, V)
            at = torch.arange(len(cols)) + len(prompt)
            out[i, cols] = lsm[at - 1, ids[at]]
    return out


@pytest.mark.parametrize("share", [True, False])
def test_training_logprobs_are_the_models_forward_on_the_trajectory_and_match_sampling(share):
    """Fails if the log-prob pass or the decode loop leaves a reply out of the context, shifts a position after one
    (a reply's tokens given no position, or a hole one), or scores a token the row did not take."""
    tok, model, T = make_tokenizer(), tiny(), 0.8
    env = stub(tok, max_calls=2, calls=tuple(f"w{i}" for i in range(0, 90, 15)))  # 6 call words: calls are common
    r = sample(
        model,
        tok,
        PROMPTS,
        3,
        max_new_tokens=24,
        stop_ids=[EOS],
        sampler=Sampler(temperature=T),
        generator=gen(0),
        env=env,
    )  # 24: room for 2 calls
    C, own, reply = r.completion_ids.size(1), r.completion_mask.bool(), r.env_mask
    seen = r.attention_mask[:, -C:].bool()
    after = own & (reply.long().cumsum(1) > 0)  # own tokens with a reply before them
    assert (r.prompt_mask == 0).any() and after.sum() >= 5 and set(state(r, "tool_calls").tolist()) >= {0, 1, 2}, (
        "the test needs left padding, own tokens after replies, rows with 0, 1 and 2 calls"
    )
    assert (seen == (torch.arange(C)[None] < seen.sum(1, keepdim=True))).all()  # a trajectory is one contiguous run
    naive = naive_logprobs(model, r, T)
    sampler = Sampler(temperature=T)
    logp = token_logprobs(model, r.input_ids, r.attention_mask, C, sampler=sampler, share=share)[0]  # (N, C)
    assert_close_scaled(logp[seen], naive[seen])  # own tokens and the replies' (teacher-forced, never trained on)
    assert (logp[~seen] == 0).all()
    micro = batch_logprobs(model, r, 2, sampler=sampler, share=share)  # train.py's: micro-batches cut to their columns
    assert_close_scaled(micro[seen], naive[seen])
    # the decode loop fed the replies into its KV cache: its log-probs are the trajectory's, own tokens only
    assert_close_scaled(r.sample_logp[own], logp[own], DECODE)
    assert (r.sample_logp[~own] == 0).all()
    # teeth: without the replies in the context, the own tokens after them get other log-probs
    blind = naive_logprobs(model, r, T, drop_replies=True)
    assert (blind[after] - r.sample_logp[after]).abs().max() > 1e-2


def test_each_token_is_drawn_with_its_rows_uniform_at_its_own_count():
    """sample draws one uniform per row and budget token up front (torch.rand(N, max_new_tokens) from the generator);
    the token at a row's trajectory position t (its own tokens and the replies it read before it: t of them) takes
    u[row, t], by inverse CDF of the model's distribution there (the teacher-forced forward on the trajectory). Checked
    on every own token, those on the budget's last position included. Fails if a token takes another row's or another
    step's uniform (replies left out of the count, the last token's clamped to the one before)."""
    from rollout import sample_from_logits

    tok, model, T, B = make_tokenizer(), tiny(), 0.8, 24
    env = stub(tok, max_calls=2, calls=tuple(f"w{i}" for i in range(0, 90, 15)))
    sampler = Sampler(temperature=T)
    r = sample(model, tok, PROMPTS, 3, max_new_tokens=B, stop_ids=[EOS], sampler=sampler, generator=gen(0), env=env)
    u = torch.rand(r.completion_ids.size(0), B, generator=gen(0))  # (N, B): sample's, drawn the same way
    own = r.completion_mask.bool()  # (N, C)
    assert own[:, B - 1].any() and (own & (r.env_mask.long().cumsum(1) > 0)).any(), "the test needs both"
    with torch.no_grad():
        for i in range(own.size(0)):
            prompt, n = r.prompt_ids[i][r.prompt_mask[i].bool()], int((own[i] | r.env_mask[i]).sum())
            ids = torch.cat([prompt, r.completion_ids[i, :n]])  # the trajectory, unpadded
            z = sampler.logits(model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1])  # (n, V): token t's
            for t in own[i].nonzero().squeeze(1).tolist():
                assert sample_from_logits(z[t : t + 1], u[i, t : t + 1]).item() == r.completion_ids[i, t], (i, t)


class Held(WordTools):
    """The stub, slow: each turn waits until the test releases it (`hold` decode steps after it was submitted, or at
    once when every row left waits on one, as the real step would block), so its row is a hole meanwhile."""

    def __init__(self, hold, **kw):
        super().__init__(**kw)
        self.hold, self.gates = hold, []

    def __call__(self):
        env, gate = toy.WordToolEnv(self), threading.Event()
        self.gates.append(gate)
        env.turn = partial(self.held, gate, env.turn)
        return env

    def held(self, gate, turn, text, stopped):
        assert gate.wait(10), "the test never released the turn"
        gate.clear()
        return turn(text, stopped)

    def drive(self, driver):
        """Wrap driver.step: before each step, release each turn pending `hold` steps, or every one where all the
        rows left wait; after it, count the holes (rows neither fed their own token nor a reply's) -> the counts."""
        real, age, holes = driver.step, {}, []

        def step(tok, done, stopped, left):
            pending = {i: p[0] for i, p in enumerate(driver._pending) if p is not None and not done[i]}
            for future in pending.values():
                age[future] = age.get(future, 0) + 1
            everyone = len(pending) == int((~done).sum())
            for i, future in pending.items():
                if age[future] == self.hold or (everyone and age[future] < self.hold):
                    age[future] = self.hold + 1  # released once
                    self.gates[i].set()
            out = real(tok, done, stopped, left)
            holes.append(~done & ~out[1] & ~out[2])  # (N,)
            return out

        driver.step = step
        return holes


def test_training_logprobs_match_sampling_on_rows_that_waited():
    """Rows whose tool answers only 3 decode steps after their call: they are holes meanwhile (no token, no position,
    no uniform; a masked cache column), while the other rows decode on. Fails if a hole leaves a trace in the row's
    context (its column attended, a position counted): the decode loop's log-probs of the own tokens after it would
    no longer be the teacher-forced pass's on the trajectory (within conftest's DECODE bound)."""
    import envs

    tok, model, T = make_tokenizer(), tiny(), 0.8
    tools = Held(3, max_calls=2, calls=tuple(f"w{i}" for i in range(0, 90, 15)), errors=("w7",), reply="w1")
    env = envs.EnvDriver(tools, tok)
    holes = tools.drive(env)
    r = sample(
        model,
        tok,
        PROMPTS,
        3,
        max_new_tokens=24,
        stop_ids=[EOS],
        sampler=Sampler(temperature=T),
        generator=gen(0),
        env=env,
    )
    C, own, reply = r.completion_ids.size(1), r.completion_mask.bool(), r.env_mask
    waited = torch.stack(holes, 1).any(1)  # (N,) rows that were a hole at some step
    after = own & (reply.long().cumsum(1) > 0) & waited[:, None]  # own tokens after a reply, in rows that waited
    assert waited.sum() >= 2 and after.sum() >= 5, "the test needs rows that waited and went on after the reply"
    assert torch.stack(holes).sum() >= 2 * int(waited.sum())  # each waited 2 steps or more
    logp = token_logprobs(model, r.input_ids, r.attention_mask, C, sampler=Sampler(temperature=T))[0]  # (N, C)
    assert_close_scaled(r.sample_logp[own], logp[own], DECODE)
    assert (r.sample_logp[~own] == 0).all()


# -----------------------------------------------------------------------------
# 4. the real ToolEnv on SmolLM2: errors are replies and the row goes on


def boom(text: str) -> str:
    """Always fail."""
    raise RuntimeError("boom went the tool")


def slow(text: str) -> str:
    """Answer too late."""
    import time

    time.sleep(3)
    return text


def real_rollout(model, tok, env, calls, results):
    """Row i opens with the forced call calls[i] (then greedy), the arith_tool task's prompt, a budget of 4 own tokens
    past the longest call + reply (results[i] = (name, result)) -> (Rollout, each row's call ids, reply ids)."""
    from extra_tasks import tool_prompt

    script = [tok(c, add_special_tokens=False)["input_ids"] for c in calls]
    replies = [tok(env.reply(name, result), add_special_tokens=False)["input_ids"] for name, result in results]
    budget = max(len(c) + len(x) for c, x in zip(script, replies)) + 4
    prompt = tool_prompt({"question": "What is 482 * 937?"})
    r = sample(
        Forced(model, script),
        tok,
        [prompt] * len(calls),
        1,
        max_new_tokens=budget,
        stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")],
        sampler=Sampler(temperature=0.0),
        env=env,
    )
    return r, script, replies


def check_rows(r, script, replies):
    """Each row: its forced call, then exactly the template's reply to it (fed as is: its <|im_end|> no stop), then
    the model's own tokens again; and one call counted per reply in the trajectory."""
    for i, (call, reply) in enumerate(zip(script, replies)):
        row, env, own = r.completion_ids[i], r.env_mask[i], r.completion_mask[i].bool()
        n, m = len(call), len(call) + len(reply)
        assert row[:n].tolist() == call and own[:n].all() and not env[:n].any()
        assert row[n:m].tolist() == reply and env[n:m].all()
        assert own[m], f"row {i} ended at its tool's reply: decoding must go on"
        spans = int((env[1:] & ~env[:-1]).sum())  # replies in the trajectory (none starts at step 0)
        assert state(r, "tool_calls")[i] == spans, i
    assert not (r.completion_mask.bool() & r.env_mask).any() and (r.sample_logp[r.env_mask] == 0).all()


@pytest.mark.real_model
def test_real_tool_errors_are_replies_and_decoding_goes_on(real_model):
    """A raising call (the calculator's refusal, a tool's exception) and a slow tool, beside a good call, on SmolLM2
    with its own template ("tags" format: an unregistered <foo> is text, no call; tests/test_tools.py). Fails if an
    error ends the row or is no reply, if the reply is not the template's frame around the text, or if a reply's
    words reach the completions (the model's own)."""
    import envs

    model, tok = real_model
    env = envs.ToolEnv([envs.calculator, boom, slow], tok, max_calls=2, timeout=0.3)
    assert env.format == "tags"
    calls = [
        "<calculator>1234 * 56</calculator>",
        "<calculator>12 +</calculator>",
        "<boom>x</boom>",
        "<slow>x</slow>",
    ]
    results = [
        ("calculator", "69104"),
        ("calculator", "error: not an arithmetic expression"),
        ("boom", "error: boom went the tool"),
        ("slow", "error: slow timed out after 0.3 s"),
    ]
    r, script, replies = real_rollout(model, tok, env, calls, results)
    check_rows(r, script, replies)
    for i, (_, result) in enumerate(results):
        assert (
            f"{calls[i]}<|im_end|>\n<|im_start|>user\nResult: {result}<|im_end|>\n<|im_start|>assistant\n"
            in r.trajectories[i]
        )  # the text as the template writes a conversation
        assert r.completions[i].startswith(calls[i] + "\n") and "Result:" not in r.completions[i]  # own words only
    assert (
        state(r, "tool_errors")[0] <= state(r, "tool_calls")[0] - 1 and (state(r, "tool_errors")[1:] >= 1).all()
    )  # row 0's first call: no error


@pytest.mark.real_model
def test_real_malformed_json_call_is_a_reply_and_decoding_goes_on(real_model):
    """Fails if a malformed JSON call ends the row, gets no error reply, or is not counted as an error."""
    import copy

    import envs
    from test_tools import QWEN_TEMPLATE  # Qwen2.5's tool-use template, shortened: the "json" format

    model, tok = real_model
    tok = copy.deepcopy(tok)
    tok.chat_template = QWEN_TEMPLATE
    env = envs.ToolEnv([envs.calculator], tok, max_calls=2)
    assert env.format == "json"
    good = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 56"}}\n</tool_call>'
    calls = [good, '<tool_call>\n{"name": calculator}\n</tool_call>']
    r, script, replies = real_rollout(model, tok, env, calls, [("calculator", "69104"), (None, envs.MALFORMED)])
    check_rows(r, script, replies)
    assert state(r, "tool_errors")[0] <= state(r, "tool_calls")[0] - 1 and state(r, "tool_errors")[1] >= 1


# -----------------------------------------------------------------------------
# 5. train.py end to end on the toy task with the stub tool (TASKS["toy_tool"], tests/toy.py)

TOY_CALL, TOY_ERROR = toy.VOCAB["w5"], toy.VOCAB["w7"]
TOY_FRAME = ("<|im_end|>", "<|im_start|>", "user", "w2", "<|im_end|>", "<|im_start|>", "assistant")  # tests/toy.py's
TOY_REPLY = [toy.VOCAB[w] for w in TOY_FRAME]  # the stub's reply "w2" in the toy template's frame: 7 tokens
BUDGET = 12  # train_args' --max-new-tokens
LEAST = 7  # the shortest reply in the toy template, `<|im_end|> <|im_start|> user X <|im_end|> <|im_start|> assistant`
TOOL_KEYS = ("env/tool_calls", "env/tool_errors", "env/called", "env_tokens")


def mostly_flat(completions, question, **_):
    """0.5 for every completion of a question whose first word is w0..w32 (a flat group), toy.frac_even elsewhere:
    --dynamic-sampling resamples (as tests/test_features.py's)."""
    even = toy.frac_even(completions)
    return [0.5 if toy._index(q.split()[0]) < 33 else e for q, e in zip(question, even)]


@pytest.fixture
def tool_tasks(monkeypatch):
    monkeypatch.setitem(TASKS, "toy_tool", toy.TOOL_TASK)
    monkeypatch.setitem(
        TASKS, "toy_tool_flat", toy.TOOL_TASK._replace(reward_fns={"r": mostly_flat}, reward_weights={"r": 1.0})
    )


def replay(r, max_calls=4):
    """Walk each row's trajectory as the stub's rules say, without its code: an own w5 / w7 is a call (w7 an error),
    unless at most LEAST tokens of the budget are left after it (the model could not act on a reply: it is not run,
    not counted, and the row goes on); past max_calls a call is an error too; either way the reply's tokens follow, up
    to the budget; an own stop ends the row, which is truncated where it did not end so -> (env_mask (N, C), calls
    (N,), errors (N,), reply tokens the budget cut (N,))."""
    N, C = r.completion_ids.shape
    env, calls, errors, cut = torch.zeros(N, C, dtype=torch.bool), [0] * N, [0] * N, [0] * N
    for i in range(N):
        ids, own, n = r.completion_ids[i].tolist(), r.completion_mask[i].tolist(), int(r.attention_mask[i, -C:].sum())
        t = 0
        while t < n:
            assert own[t], (i, t)  # every token that is not a reply is the model's own
            if ids[t] == toy.EOS:
                assert t == n - 1, (i, t)  # an own stop ends the row
            if ids[t] in (TOY_CALL, TOY_ERROR) and BUDGET - 1 - t > LEAST:  # t tokens before it: BUDGET - 1 - t after
                error = ids[t] == TOY_ERROR or calls[i] >= max_calls  # the limit's reply is an error
                calls[i], errors[i] = calls[i] + 1, errors[i] + error
                k = min(len(TOY_REPLY), BUDGET - t - 1)
                assert ids[t + 1 : t + 1 + k] == TOY_REPLY[:k], (i, t)
                env[i, t + 1 : t + 1 + k], cut[i], t = True, cut[i] + len(TOY_REPLY) - k, t + 1 + k
                continue
            t += 1
        assert bool(r.truncated[i]) == (ids[n - 1] != toy.EOS or not own[n - 1]), i  # the budget ended it
    return env, torch.tensor(calls), torch.tensor(errors), torch.tensor(cut)


class Scored:
    """What the trainer scores: the ids of each rollout.token_logprobs call (the reference's, the old policy's and the
    policy's passes, micro-batch by micro-batch), and copies of the ids rollout.sample returned."""

    def __init__(self, monkeypatch):
        import rollout

        self.sampled, self.calls, real_sample, real_logprobs = [], [], rollout.sample, rollout.token_logprobs

        def sample_spy(*args, **kw):
            r = real_sample(*args, **kw)
            self.sampled.append([x.clone() for x in (r.prompt_ids, r.prompt_mask, r.completion_ids)])
            self.calls.append([])  # the calls after this rollout: its step's
            return r

        def logprobs_spy(model, ids, mask, c, *args, **kw):
            self.calls[-1].append((ids.clone(), mask.clone(), c))
            return real_logprobs(model, ids, mask, c, *args, **kw)

        monkeypatch.setattr(rollout, "sample", sample_spy)
        monkeypatch.setattr(rollout, "token_logprobs", logprobs_spy)

    def check_last_step(self, micro_batch=4):
        """Each call of the last step scored rows [k, k + micro_batch) of the last rollout (k cycling over the rows,
        pass after pass): their real prompt tokens, then exactly the sampled completion ids."""
        (prompt, prompt_mask, completion), calls = self.sampled[-1], self.calls[-1]
        assert calls, "the last step scored nothing"
        for j, (ids, mask, c) in enumerate(calls):
            rows = slice(j * micro_batch % completion.size(0), j * micro_batch % completion.size(0) + micro_batch)
            assert torch.equal(ids[:, -c:], completion[rows, :c]), j  # the same ids, reply tokens included
            for got, m, want, want_mask in zip(ids[:, :-c], mask[:, :-c], prompt[rows], prompt_mask[rows]):
                assert torch.equal(got[m.bool()], want[want_mask.bool()]), j


class LossMasks:
    """The mask each grpo_loss call of a run gets (train.py calls grpo.grpo_loss per micro-batch and mu pass)."""

    def __init__(self, monkeypatch):
        self.masks, real = [], grpo.grpo_loss

        def spy(*args, **kw):
            self.masks.append(kw["mask"].detach().clone())
            return real(*args, **kw)

        monkeypatch.setattr(grpo, "grpo_loss", spy)

    def last_step(self, N, C, mu=1, micro_batch=4):
        """The last step's loss mask (N, C), micro-batches put back together, from each of its mu passes."""
        calls = self.masks[-mu * (N // micro_batch) :]
        passes = [calls[k : k + N // micro_batch] for k in range(0, len(calls), N // micro_batch)]
        return [torch.cat([F.pad(m.long(), (0, C - m.size(1))) for m in p]) for p in passes]


def check_tool_run(out, g, losses, mu=1, max_calls=4, scored=None):
    """The metrics of every step are finite and carry the tool metrics; the last step's (g: train.py's globals, its
    last rollout r) are the trajectory's, counted by replay; the loss saw the model's own tokens of the kept rows,
    never a reply's (losses: LossMasks); the sampler's log-probs meet the trainer's on own tokens only; the trainer
    scored exactly the sampled ids (scored: Scored, for a run whose last step is one rollout)."""
    r = g["r"]
    if scored is not None:
        scored.check_last_step()
    N, C = r.completion_ids.shape
    for mask in losses.last_step(N, C, mu):
        assert torch.equal(mask, r.completion_mask * g["keep"][:, None])
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert len(rows) == 2 and all(math.isfinite(v) for row in rows for v in row.values())
    for row in rows:
        assert 0 <= row["env/tool_errors"] <= row["env/tool_calls"]
        assert row["env_tokens"] <= len(TOY_REPLY) * row["env/tool_calls"] + 1e-6
        assert row["turns"] == pytest.approx(
            1 + row["env/tool_calls"], abs=1e-6
        )  # the model's turns: one per reply + 1
        # fp32, decode loop against the training pass: within 128 eps32 of |log p| <= ~20, 3e-4; a reply token in
        # the metric's mask would show its whole log-prob there (sample_logp 0 against ~log(1/48) = -3.9)
        assert row["dlogp_max"] < 1e-3 and row["is_capped"] == 0
    assert sum(row["env/tool_calls"] for row in rows) > 0, "the test needs tool calls"
    env, calls, errors, cut = replay(r, max_calls)
    assert (
        torch.equal(env, r.env_mask)
        and torch.equal(calls, state(r, "tool_calls"))
        and torch.equal(errors, state(r, "tool_errors"))
    )
    assert (cut[r.attention_mask[:, -r.completion_ids.size(1) :].sum(1) < BUDGET] == 0).all()  # only the budget cuts
    last = rows[-1]
    assert last["env/tool_calls"] == pytest.approx(calls.float().mean().item(), abs=1e-7)
    assert last["env/tool_errors"] == pytest.approx(errors.float().mean().item(), abs=1e-7)
    # env_tokens: the reply's length times the calls, less what the budget cut, on average over the rows
    assert last["env_tokens"] == pytest.approx((len(TOY_REPLY) * calls - cut).float().mean().item(), abs=1e-7)
    return rows


def fresh_toy_state(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir).state_dict()


@pytest.mark.parametrize("extra", [("--mu", 2), ("--dynamic-sampling",)], ids=["mu2", "dynamic"])
def test_train_with_tools_end_to_end(model_dir, tmp_path, tool_tasks, monkeypatch, extra):
    """Fails if the loss mask holds a reply token, if the tool metrics disagree with the trajectory's calls (replay),
    if the trainer scores other ids than were sampled (a trajectory re-tokenized from its text, a reply's ids
    replaced), if --mu's second pass or --dynamic-sampling's concatenation loses the replies, or if nothing trains."""
    task = "toy_tool_flat" if "--dynamic-sampling" in extra else "toy_tool"
    losses, scored = LossMasks(monkeypatch), Scored(monkeypatch)
    g = run_script(TRAIN, train_args(model_dir, str(tmp_path), "--task", task, *extra, "--config", "export=none"))
    one_rollout = "--mu" in extra  # dynamic sampling concatenates rollouts: the sampled rows are re-ordered
    rows = check_tool_run(str(tmp_path), g, losses, 2 if one_rollout else 1, scored=scored if one_rollout else None)
    if "--mu" in extra:  # the second update's ratio moved off 1: the old log-probs were read
        assert max(row["ratio_max"] for row in rows) > 1 + 1e-3
    else:
        assert max(row["extra_rollouts"] for row in rows) > 0, "the test needs a resample (rollouts concatenated)"
    init, trained = fresh_toy_state(model_dir), g["policy"].state_dict()
    assert all(row["grad_norm"] > 0 for row in rows)
    assert max((trained[k] - v).abs().max() for k, v in init.items()) > 1e-4  # the run trained


def test_train_with_tools_and_lora(model_dir, tmp_path, tool_tasks, monkeypatch):
    """Fails if a LoRA run's loss mask holds a reply token, scores other ids than were sampled, or trains no
    adapter."""
    if importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft: pip install peft")
    losses, scored = LossMasks(monkeypatch), Scored(monkeypatch)
    g = run_script(
        TRAIN, train_args(model_dir, str(tmp_path), "--task", "toy_tool", "--lora-rank", 4, "--config", "export=none")
    )
    check_tool_run(str(tmp_path), g, losses, scored=scored)
    adapters = {k: v for k, v in g["policy"].named_parameters() if "lora_B" in k}  # peft starts B at 0
    assert adapters and max(v.abs().max() for v in adapters.values()) > 1e-4  # the adapters trained


def torchrun(args, **env):
    """toy.torchrun (on a timeout it ends the agent's workers too, which would otherwise hang on its pipes), then
    asserts the run succeeded."""
    proc = toy.torchrun(args, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_train_with_tools_on_two_processes_equals_one(model_dir, tmp_path, tool_tasks, monkeypatch):
    """2 gloo processes, one prompt each, against 1 process: a generator per prompt slot samples the same rollouts,
    so the tool metrics (means of small integers over 8 rows: exact in fp32) are equal, the rest to 1e-5 (the same
    fp32 sums in another order), and the weights to toy.assert_same_training's bounds. Fails if a rank's environments
    or replies depend on the other rank's rows, its rows are sampled from another generator, or its gradients are left
    out of the average."""
    one, two, dump = str(tmp_path / "one"), str(tmp_path / "two"), str(tmp_path / "params")
    losses = LossMasks(monkeypatch)
    g = run_script(TRAIN, train_args(model_dir, one, "--task", "toy_tool", "--config", "export=none"))
    torchrun(train_args(model_dir, two, "--task", "toy_tool", "--config", "export=none"), TOY_DUMP_PARAMS=dump)
    check_tool_run(one, g, losses)
    a, b = read_metrics(one), read_metrics(two)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert all(y[k] == x[k] for k in TOOL_KEYS), (x, y)
        for k in set(x) - TIMING:
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), k
    p0, p1 = torch.load(dump + ".rank0.pt"), torch.load(dump + ".rank1.pt")
    assert all(torch.equal(v, p1[k]) for k, v in p0.items())  # the ranks stay in step
    toy.assert_same_training(g["policy"].state_dict(), p0)  # all but a handful of elements to 1e-6 (its docstring)
    init = fresh_toy_state(model_dir)
    assert max((p0[k] - v).abs().max() for k, v in init.items()) > 1e-4  # the run trained


class NoteEnv(toy.WordToolEnv):
    def state(self):  # a note beside the numbers: nothing to average
        return {**super().state(), "note": "see the log"}


class NoteTools(WordTools):
    def __call__(self):
        return NoteEnv(self)


def note_tools(tokenizer):
    import envs

    return envs.EnvDriver(NoteTools(), tokenizer)


def test_a_state_value_that_is_no_number_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """Environment states are reward fields and are averaged into env/ metrics (train.py's steps, evaluate). Fails if a
    string value gets past train.py's start-up probe (a traceback mid-run, or a mean of nothing) instead of one line
    naming the key, or past the end of a rollout (rollout.sample, as evaluate runs it)."""
    import envs

    monkeypatch.setitem(TASKS, "toy_note", toy.TOOL_TASK._replace(env=note_tools))
    code, line = toy.error_of(TRAIN, train_args(model_dir, str(tmp_path / "run"), "--task", "toy_note"), capsys)
    assert code == 2 and "'note'" in line and "number" in line, (code, line)
    assert not (tmp_path / "run").exists()  # refused before the run began
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="'note'.*number"):
        sample(tiny(), tok, PROMPTS, 1, max_new_tokens=4, stop_ids=[EOS], env=envs.EnvDriver(NoteTools(), tok))


# -----------------------------------------------------------------------------
# 6. evaluate() on a task with tools: tool_calls and called per example, the summary's rates


def test_evaluate_counts_tool_calls_per_example_and_in_the_summary():
    """Fails if evaluate averages the environments' states wrongly (per example over its n samples, then over the
    examples), scores or records a reply's words as the model's (completions are its own text, the trajectory apart),
    or gives a task without tools tool fields."""
    tok, model = make_tokenizer(), tiny()
    w = {i: W[f"w{i}"] for i in range(20)}
    examples = [
        {"question": "w1 w2", "answer": "odd"},
        {"question": "w3 w4", "answer": "odd"},
        {"question": "w6 w8", "answer": "even"},
    ]
    # n=2 samples each, batch_size 4: batches [ex0, ex1], [ex2]; a group's rows share step 0 (the prefill); 26 new
    # tokens: row 2's 1 + 3 * (1 + 7) + 1 fit
    batch1 = [
        [w[10], w[5], *[_] * L, w[12], EOS],  # ex0: 1 call
        [w[10], w[12], EOS],  # ex0: none
        [w[10], w[5], *[_] * L, W["w7"], *[_] * L, w[5], *[_] * L, EOS],  # ex1: 3 calls, 2 errors (w7, the limit)
        [w[10], W["w7"], *[_] * L, EOS],  # ex1: 1 call, an error
    ]
    batch2 = [[w[10], w[14], EOS], [w[10], w[16], w[18], EOS]]  # ex2: none
    task = toy.TOOL_TASK
    summary, records = evaluate(
        Forced(model, batch1, batch2),
        tok,
        task,
        examples,
        max_new_tokens=26,
        batch_size=4,
        n=2,
        progress=False,
        env=stub(tok, max_calls=2),
    )
    # by hand, per example the mean of its 2 samples: calls (1 + 0) / 2, (3 + 1) / 2, 0; errors 0, (2 + 1) / 2, 0
    assert [(x["env"]["tool_calls"], x["env"]["tool_errors"], x["env"]["called"]) for x in records] == [
        (0.5, 0.0, 0.5),
        (2.0, 1.5, 1.0),
        (0.0, 0.0, 0.0),
    ]
    assert summary["env/tool_calls"] == pytest.approx(5 / 6) and summary["env/called"] == pytest.approx(1 / 2)
    assert records[0]["completions"] == ["w10 w5\nw12", "w10 w12"]  # own words, a turn a line
    frame = "<|im_end|> <|im_start|> user w1 <|im_end|> <|im_start|> assistant"
    assert records[0]["trajectory"] == f"w10 w5 {frame} w12"
    # greedy (n=1) with no env given: evaluate builds the task's own (the stub's defaults: max_calls 4, reply w2)
    greedy = [[w[10], w[5], *[_] * L, w[5], *[_] * L, EOS], [w[10], EOS]]
    summary, records = evaluate(
        Forced(model, greedy), tok, task, examples[:2], max_new_tokens=26, batch_size=2, progress=False
    )
    assert [(x["env"]["tool_calls"], x["env"]["called"]) for x in records] == [(2.0, 1.0), (0.0, 0.0)]
    assert records[0]["completion"] == "w10 w5\nw5"
    frame = frame.replace("user w1", "user w2")
    assert records[0]["trajectory"] == f"w10 w5 {frame} w5 {frame}"
    assert summary["env/tool_calls"] == 1.0 and summary["env/called"] == 0.5
    # a task without tools: no tool fields
    summary, records = evaluate(
        Forced(model, greedy), tok, toy.TASK, examples[:2], max_new_tokens=10, batch_size=2, progress=False
    )
    assert not any(k.startswith("env/") for k in summary) and records[0]["env"] == {}
    assert "trajectory" not in records[0]


def test_a_run_without_tools_imports_no_optional_module(model_dir, tmp_path):
    """`train.py` on a task without an environment imports none of the modules imported only when asked (envs.py,
    sandbox.py, extra_tasks.py, scale.py, eval.py, chat.py): fails if the default path imports one of them."""
    argv = [str(a) for a in train_args(model_dir, str(tmp_path), "--config", "export=none", steps=1)]
    code = (
        "import json, os, runpy, sys\n"
        f"sys.path[:0] = [{REPO!r}, os.path.join({REPO!r}, 'tests')]\n"
        "import toy\nfrom tasks import TASKS\nTASKS['toy'] = toy.TASK\n"
        f"sys.argv = ['train.py', *{argv!r}]\n"
        f"runpy.run_path({TRAIN!r}, run_name='__main__')\n"
        f"own = [m.__name__ for m in list(sys.modules.values()) if getattr(m, '__file__', None) "
        f"and os.path.abspath(m.__file__) == os.path.join({REPO!r}, m.__name__ + '.py')]\n"
        "print(json.dumps(sorted(own)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    own = json.loads(out.stdout.strip().splitlines()[-1])
    assert "grpo" in own and not set(own) & {"envs", "sandbox", "extra_tasks", "scale", "eval", "chat"}, own
