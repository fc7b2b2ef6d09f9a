"""Truncated sampling (rollout.Sampler's top_k, top_p, min_p): the kept set against a naive per-row filter written
here in fp64, the draws against the renormalised truncated distribution, the decode loops' kept sets, and the
trainer's log-probs and entropy under the SAMPLER's kept set (never one it recomputes from its own logits).

The naive filter: temperature, then the k likeliest (a tie: the lower id first), then top_p on the top_k-renormalised
probabilities q (a token is kept while the mass before it is < p: the top token always is), then min_p (q >= min_p x
the top q). fp32 against fp64 can only differ at a decision within rounding of its threshold: such rows (margin
< 1e-5, a few eps of a cumulative sum) are left out of exact comparisons, and the tests assert they are few.
Tolerances: conftest's (log-probs against the teacher-forced pass: VALUES; the decode loop's: DECODE)."""

import itertools
import math

import numpy as np
import pytest
import torch

import grpo
import rollout
from conftest import DECODE, EOS, VOCAB, assert_close_scaled, make_tokenizer, tiny
from rollout import Sampler, batch_logprobs, sample, token_logprobs
import test_decode
from test_errors import forbid_model_load, mentions
from test_tool_rollouts import REPLY, Forced, stub
from toy import TRAIN, error_of, read_metrics, run_script, train_args

from variants import pack, unpack  # the kept sets' bits

V = len(VOCAB)  # 98: not a multiple of 8, so pack pads its last byte
PROMPTS = ["w1", "w2 w3 w4 w5 w6 w7 w8 w9 w10 w11", [{"role": "user", "content": "w5 w6"}]]  # left padding
ROBUST = 1e-5  # a decision this close to its threshold may go either way in fp32


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# -----------------------------------------------------------------------------
# the naive filter, distribution and draw: one row, fp64, a token at a time


def naive_kept(z, top_k=0, top_p=1.0, min_p=None, temperature=1.0):
    """Raw logits (V,) -> (kept (V,) bool, margin: the distance of the closest decision to its threshold)."""
    z = np.asarray(z, np.float64)
    if temperature not in (0, 1):
        z = z / temperature
    order = sorted(range(len(z)), key=lambda v: (-z[v], v))  # likeliest first; a tie: the lower id first
    k = top_k or len(z)
    top = order[:k]
    margin = math.inf
    if k < len(z) and z[order[k - 1]] != z[order[k]]:  # an exact tie stays a tie in fp32; a near one may not
        margin = z[order[k - 1]] - z[order[k]]
    w = np.exp(z[top] - z[top[0]])
    q = w / w.sum()  # the top_k-renormalised probabilities
    kept, before = np.zeros(len(z), bool), 0.0
    for v, qv in zip(top, q):
        keep = True
        if top_p < 1:
            keep = keep and before < top_p
            margin = min(margin, abs(before - top_p))
        if min_p:
            keep = keep and qv >= min_p * q[0]
            if qv != q[0]:  # a token tied with the top one is exactly tied in fp32 too
                margin = min(margin, abs(qv - min_p * q[0]))
        kept[v] = keep
        before += qv
    return kept, margin


def naive_probs(z, kept, temperature=1.0):
    """The distribution renormalised over `kept`: raw logits (V,), kept (V,) bool -> probabilities (V,), fp64."""
    z = np.asarray(z, np.float64)
    if temperature not in (0, 1):
        z = z / temperature
    w = np.where(kept, np.exp(z - z[kept].max()), 0.0)
    return w / w.sum()


def naive_draw(p, u):
    """Inverse CDF: the first token whose cumulative probability exceeds u -> (token, distance of u to a step)."""
    cdf = np.cumsum(p)
    return int(np.searchsorted(cdf, u, side="right")), float(np.abs(cdf[p > 0] - u).min())


def trajectory_logits(model, r):
    """Each row alone, unpadded, through model(input_ids=prompt + trajectory): the raw logits (N, C, V) fp64 at the
    position before each completion token the row attends to (own and replies), 0 elsewhere."""
    C = r.completion_ids.size(1)
    seen = r.attention_mask[:, -C:].bool()  # (N, C)
    out = torch.zeros(*seen.shape, model.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for i in range(seen.size(0)):
            n = int(seen[i].sum())
            prompt = r.prompt_ids[i][r.prompt_mask[i].bool()]
            ids = torch.cat([prompt, r.completion_ids[i, :n]])  # the trajectory is one contiguous run
            out[i, :n] = model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1].double()
    return out


def naive_sets(logits, where, sampler):
    """naive_kept at each position `where` (N, C) of logits (N, C, V) -> kept (N, C, V) bool, robust (N, C) bool."""
    f = dict(top_k=sampler.top_k, top_p=sampler.top_p, min_p=sampler.min_p, temperature=sampler.temperature)
    kept, robust = torch.zeros(logits.shape, dtype=torch.bool), torch.zeros(where.shape, dtype=torch.bool)
    for i, t in where.nonzero().tolist():
        k, margin = naive_kept(logits[i, t].numpy(), **f)
        kept[i, t], robust[i, t] = torch.from_numpy(k), bool(margin > ROBUST)
    return kept, robust


def random_logits(n, vocab, seed, ties=False):
    """(n, vocab) fp32 logits ~ N(0, 2^2); ties: rounded to halves, so many rows hold equal logits."""
    z = torch.randn(n, vocab, generator=gen(seed)) * 2
    return torch.round(z * 2) / 2 if ties else z


# -----------------------------------------------------------------------------
# 1. Sampler.truncated against the naive filter


GRID = [
    g
    for g in itertools.product([0, 1, 7, 97], [1.0, 0.5, 0.95], [None, 0.05, 0.3, 1.0])  # top_k, top_p, min_p
    if Sampler(top_k=g[0], top_p=g[1], min_p=g[2]).truncates
]


@pytest.mark.parametrize("top_k, top_p, min_p", GRID, ids=lambda x: str(x))
def test_kept_set_is_the_naive_filters(top_k, top_p, min_p):
    """Random logits (half of them with many ties), two vocabulary sizes, four temperatures (0: greedy's raw logits).
    Fails if the filters run in another order (top_p on the probabilities before top_k's cut), if top_p keeps the
    token that crosses p's neighbour (mass AFTER < p) or drops the top token, if min_p compares with > or against the
    top logit rather than probability, if a tie is broken by the higher id (an unstable sort), if the temperature is
    applied after the filter, or if the set is scattered back to the wrong ids. The returned logits are the
    temperature's on the set and -inf off it. (min_p on the probabilities before top_k's cut is the same set: a ratio
    to the top probability does not see the renormalisation.)"""
    checked = total = 0
    for vocab, temperature, ties in itertools.product([V, 13], [0, 0.6, 1.0, 1.7], [False, True]):
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        z = random_logits(64, vocab, seed=vocab + int(10 * temperature) + ties, ties=ties)
        out, kept = sampler.truncated(z)
        assert kept.dtype == torch.bool and kept.shape == z.shape
        assert kept.gather(1, z.argmax(1, keepdim=True)).all(), "the likeliest token (the lowest id of a tie) is kept"
        assert torch.equal(out[kept], sampler.logits(z)[kept]) and (out[~kept] == -torch.inf).all()
        for i in range(z.size(0)):
            want, margin = naive_kept(z[i].numpy(), top_k, top_p, min_p, temperature)
            total += 1
            if margin > ROBUST:
                checked += 1
                assert kept[i].tolist() == want.tolist(), (vocab, temperature, ties, i)
    assert checked >= 0.9 * total, f"only {checked} of {total} rows decided away from a threshold"


def test_top_k_ties_keep_the_lower_ids_and_min_p_one_keeps_the_tied_top():
    """By hand: logits [1, 3, 3, 0, 3]. top_k=2 keeps ids 1 and 2 (the stable sort's first two of the tie), not 4;
    min_p=1 keeps the whole tie at the top (1, 2, 4); top_p=0.5 keeps 1 and 2 (the mass before id 2 is ~0.31 < 0.5,
    before id 4 ~0.63). Fails on an unstable or ascending sort, or a min_p that drops tied tokens."""
    z = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert Sampler(top_k=2).truncated(z)[1].tolist() == [[False, True, True, False, False]]
    assert Sampler(min_p=1.0).truncated(z)[1].tolist() == [[False, True, True, False, True]]
    assert Sampler(top_p=0.5).truncated(z)[1].tolist() == [[False, True, True, False, False]]


def test_an_untruncated_sampler_keeps_no_set():
    """top_k 0, top_p 1, min_p None or 0: truncates is False and truncated(z) is (the temperature's logits, None).
    Fails if the default sampler starts storing sets (memory) or masking (a different distribution)."""
    z = random_logits(8, V, seed=1)
    for sampler in (Sampler(0.7), Sampler(0.7, top_k=0, top_p=1.0, min_p=None), Sampler(0.7, min_p=0.0)):
        out, kept = sampler.truncated(z)
        assert not sampler.truncates and kept is None and torch.equal(out, z / 0.7)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 13, V, 100])
def test_pack_unpack_round_trip(vocab):
    """A bit per vocabulary entry, (..., V) bool -> uint8 (..., ceil(V/8)) -> the same bools, for V not a multiple of
    8 too and with leading dims. Fails if a bit is dropped or shifted (the padding byte), or bytes are wider."""
    x = torch.rand(2, 3, vocab, generator=gen(vocab)) < 0.5
    bits = pack(x)
    assert bits.dtype == torch.uint8 and bits.shape == (2, 3, -(-vocab // 8))
    assert torch.equal(unpack(bits, vocab), x)
    one = torch.eye(vocab, dtype=torch.bool)  # each entry alone
    assert torch.equal(unpack(pack(one), vocab), one)


# -----------------------------------------------------------------------------
# 2. no truncation, and truncation that keeps everything, are today's sampler


def test_untruncated_sampling_is_the_inverse_cdf_of_the_full_distribution():
    """top_p = 1.0 (top_k 0, min_p None or 0): the same tokens and sample_logp as Sampler(T) and no kept sets; and
    each own token is the inverse CDF of softmax(z / T) of the teacher-forced logits at its row's uniform, its
    sample_logp that distribution's log-prob. Fails if an off switch still truncates (top_p = 1 losing a tail token
    to a cumulative sum that rounds to 1 early) or the untruncated path changed."""
    tok, model, T, B = make_tokenizer(), tiny(), 0.8, 12
    runs = [
        sample(model, tok, PROMPTS, 3, max_new_tokens=B, stop_ids=[EOS], sampler=s, generator=gen(0))
        for s in (Sampler(T), Sampler(T, top_p=1.0, top_k=0, min_p=None), Sampler(T, min_p=0.0))
    ]
    for r in runs:
        assert r.kept is None
        assert torch.equal(r.completion_ids, runs[0].completion_ids)
        assert torch.equal(r.sample_logp, runs[0].sample_logp)
    r = runs[0]
    u = torch.rand(r.completion_ids.size(0), B, generator=gen(0)).double()  # (N, B): sample's, drawn the same way
    logits, own = trajectory_logits(model, r), r.completion_mask.bool()
    logp = torch.zeros(own.shape, dtype=torch.float64)
    drawn = 0
    for i, t in own.nonzero().tolist():
        p = naive_probs(logits[i, t].numpy(), np.ones(V, bool), T)
        token, margin = naive_draw(p, u[i, t].item())
        logp[i, t] = math.log(p[r.completion_ids[i, t]])
        if margin > ROBUST:
            drawn += 1
            assert token == r.completion_ids[i, t], (i, t)
    assert drawn >= 0.95 * own.sum()
    assert_close_scaled(r.sample_logp.double(), logp, DECODE)


def test_top_k_of_the_whole_vocabulary_is_the_untruncated_sampler():
    """top_k = V: the truncation path with nothing cut. The same tokens and bit-identical sample_logp as the
    untruncated sampler (an all-True mask changes no logit), kept all ones at every token the row took. Fails if the
    truncation path draws or scores differently (another softmax, another uniform) or stores a partial set."""
    tok, model, T = make_tokenizer(), tiny(), 0.8
    plain, full = (
        sample(model, tok, PROMPTS, 3, max_new_tokens=12, stop_ids=[EOS], sampler=s, generator=gen(0))
        for s in (Sampler(T), Sampler(T, top_k=V))
    )
    assert Sampler(T, top_k=V).truncates and full.kept is not None
    for k in ("completion_ids", "completion_mask", "sample_logp", "truncated"):
        assert torch.equal(getattr(full, k), getattr(plain, k)), k
    assert full.kept.shape == (*full.completion_ids.shape, -(-V // 8))
    assert unpack(full.kept, V)[full.completion_mask.bool()].all()


# -----------------------------------------------------------------------------
# 3. draws lie in the naive set, with the renormalised truncated distribution


TRUNCATING = Sampler(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05)


def test_every_token_is_the_inverse_cdf_of_the_truncated_distribution():
    """Each own token of a rollout: in the naive set of the teacher-forced logits at its position, the stored kept set
    is that naive set, and the token is the inverse CDF of the renormalised truncated distribution at its row's
    uniform. Fails if a token is drawn from the untruncated distribution (or the truncated one not renormalised), if
    the stored set is another position's or row's, or is the set of the raw logits (the temperature left out)."""
    tok, model, B = make_tokenizer(), tiny(), 16
    r = sample(model, tok, PROMPTS, 4, max_new_tokens=B, stop_ids=[EOS], sampler=TRUNCATING, generator=gen(1))
    own = r.completion_mask.bool()
    logits = trajectory_logits(model, r)
    want, robust = naive_sets(logits, own, TRUNCATING)
    stored = unpack(r.kept, V)  # (N, C, V)
    assert robust[own].float().mean() >= 0.9
    at = own & robust
    assert want[at].gather(1, r.completion_ids[at][:, None]).all(), "a token outside the naive set"
    assert torch.equal(stored[at], want[at])
    assert (want[own].sum(1) > 1).float().mean() > 0.5 and (want[own].sum(1) < V).all(), "sets of a few tokens"
    u = torch.rand(r.completion_ids.size(0), B, generator=gen(1)).double()
    drawn = 0
    for i, t in own.nonzero().tolist():
        p = naive_probs(logits[i, t].numpy(), want[i, t].numpy(), TRUNCATING.temperature)
        token, margin = naive_draw(p, u[i, t].item())
        if robust[i, t] and margin > ROBUST:
            drawn += 1
            assert token == r.completion_ids[i, t], (i, t)
    assert drawn >= 0.9 * own.sum()


def test_many_draws_at_one_position_follow_the_truncated_distribution():
    """16384 rows of one prompt, one token each: every draw lies in the naive set (top_k and top_p both cut here),
    and the counts fit the renormalised truncated distribution by Pearson's chi-square, below df + 8 sqrt(2 df) (a
    false alarm ~5e-6 at df 7; the seeds are fixed). Fails if tokens outside the set are drawn (top_p's threshold
    on the untruncated probabilities keeps all 10), or if the set's mass is renormalised wrongly (the temperature
    left out of the draw adds ~130 to the statistic here)."""
    tok, model, n = make_tokenizer(), tiny(), 16384
    sampler = Sampler(temperature=1.5, top_k=10, top_p=0.8, min_p=0.02)
    r = sample(model, tok, ["w3 w4"], n, max_new_tokens=1, stop_ids=[EOS], sampler=sampler, generator=gen(2))
    ids = torch.tensor(rollout.encode_prompts(tok, ["w3 w4"])[0])
    with torch.no_grad():
        z = model(input_ids=ids[None]).logits[0, -1].double().numpy()  # (V,) the position every row draws at
    kept, margin = naive_kept(z, sampler.top_k, sampler.top_p, sampler.min_p, sampler.temperature)
    p = naive_probs(z, kept, sampler.temperature)
    assert margin > ROBUST and 3 <= kept.sum() < sampler.top_k, "the test needs top_p to cut, decided clearly"
    drawn = np.bincount(r.completion_ids[:, 0].numpy(), minlength=V)
    assert drawn[~kept].sum() == 0, "a token outside the kept set was drawn"
    assert torch.equal(unpack(r.kept[:, 0], V), torch.from_numpy(kept).expand(n, -1))
    expected = p[kept] * n
    assert expected.min() >= 5, "chi-square needs >= 5 expected draws per token"
    chi2, df = ((drawn[kept] - expected) ** 2 / expected).sum(), kept.sum() - 1
    assert chi2 < df + 8 * math.sqrt(2 * df), (chi2, df, drawn[kept], expected.round())


# -----------------------------------------------------------------------------
# 4. the static decode loop stores the dynamic loop's kept sets


mode = test_decode.mode  # the decode loops' fixture: "replayed" runs the captured loop eagerly on a CPU


@pytest.mark.parametrize("mode", test_decode.MODES, indirect=True)
@pytest.mark.parametrize("tools", [False, True])
def test_static_decode_keeps_the_dynamic_loops_sets(mode, tools):
    """decode.DECODE's loops (static, and the captured loop's own with an eager stand-in for the graph on a CPU)
    against rollout.decode_dynamic with a truncating sampler, with and without tool replies: the same tokens, masks
    and kept sets at every token a row took (own and replies: past a row's end the static loop leaves zeros, which
    no pass reads), log-probs within DECODE. Fails if the static loop stores a set at the wrong output column (a
    finished row's step, the scratch column), leaves the fed token out of it, or draws from the untruncated logits."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok, model = make_tokenizer(), tiny().to(dev)
    kw = dict(max_new_tokens=24, stop_ids=[EOS, VOCAB["w33"]], sampler=TRUNCATING)  # w33: a second stop, drawn often
    runs = []
    for loop in (rollout.decode_dynamic, mode):
        env = stub(tok, max_calls=2, calls=tuple(f"w{i}" for i in range(0, 90, 15))) if tools else None
        gens = [gen(i) for i in range(len(PROMPTS))]
        runs.append(sample(model, tok, PROMPTS, 4, generator=gens, env=env, loop=loop, **kw))
    want, got = runs
    assert want.env_mask.any() == tools and want.completion_mask.sum(1).min() < 24, "replies; rows that stop"
    for k in ("completion_ids", "completion_mask", "env_mask", "truncated"):
        assert torch.equal(getattr(got, k).cpu(), getattr(want, k).cpu()), k
    assert_close_scaled(got.sample_logp.cpu(), want.sample_logp.cpu(), DECODE)
    fed = (want.completion_mask.bool() | want.env_mask).cpu()
    assert got.kept.shape == want.kept.shape
    assert torch.equal(got.kept.cpu()[fed], want.kept.cpu()[fed])
    assert unpack(want.kept.cpu()[fed], V).sum(1).float().mean() < 6, "sets of a few tokens, not all ones"


# -----------------------------------------------------------------------------
# 5, 6. the trainer scores under the sampler's kept set


def naive_scores(logits, kept, targets, where, T):
    """Log-prob of targets (N, C) and entropy (N, C) under logits (N, C, V) / T renormalised over kept (N, C, V),
    fp64, at `where`; 0 elsewhere."""
    logp, ent = torch.zeros(where.shape, dtype=torch.float64), torch.zeros(where.shape, dtype=torch.float64)
    for i, t in where.nonzero().tolist():
        p = naive_probs(logits[i, t].numpy(), kept[i, t].numpy(), T)
        logp[i, t] = math.log(p[targets[i, t]])
        ent[i, t] = -sum(x * math.log(x) for x in p if x > 0)
    return logp, ent


def test_trainer_logprobs_and_entropy_are_the_truncated_distributions():
    """With the sampler's weights and the rollout's kept sets, token_logprobs and batch_logprobs equal sample_logp
    (DECODE) and the naive log-probs under the stored set (VALUES); the entropy is the truncated distribution's. The
    untruncated pass differs by > 0.01 (teeth). Fails if the trainer ignores r.kept (scores the full distribution: a
    ratio pi_train / pi_sample < 1 on every token), if micro_batches hands a micro-batch another slice of the sets,
    or if the entropy is the full distribution's."""
    tok, model = make_tokenizer(), tiny()
    r = sample(model, tok, PROMPTS, 3, max_new_tokens=16, stop_ids=[EOS], sampler=TRUNCATING, generator=gen(3))
    own, C = r.completion_mask.bool(), r.completion_ids.size(1)
    ids, mask = r.input_ids, r.attention_mask
    with torch.no_grad():
        logp, ent, _ = token_logprobs(model, ids, mask, C, sampler=TRUNCATING, with_entropy=True, kept=r.kept)
        full, full_ent, _ = token_logprobs(model, ids, mask, C, sampler=TRUNCATING, with_entropy=True)
    assert_close_scaled(logp[own], r.sample_logp[own], DECODE)
    for micro in (1, 2, 5):
        assert_close_scaled(batch_logprobs(model, r, micro, sampler=TRUNCATING)[own], r.sample_logp[own], DECODE)
    want_logp, want_ent = naive_scores(
        trajectory_logits(model, r), unpack(r.kept, V), r.completion_ids, own, TRUNCATING.temperature
    )
    assert_close_scaled(logp[own].double(), want_logp[own])
    assert_close_scaled(ent[own].double(), want_ent[own])
    assert (full[own] - r.sample_logp[own]).abs().max() > 1e-2 and (full[own] <= logp[own] + 1e-6).all()
    assert (full_ent[own] - ent[own]).abs().max() > 1e-2


def test_trainer_never_recomputes_the_set_from_its_own_logits():
    """The sampled tokens scored by models that rank many of them outside their own top_k: the policy with its
    lm_head perturbed after sampling, and another model as the reference. Their log-probs and entropy with the
    rollout's kept sets are finite, equal the naive ones under the SAMPLER's set, the ratio to sample_logp and the
    reference's k3 KL are finite, and the gradients too. Fails if head_logprobs recomputes top_k from the scoring
    model's logits (-inf log-probs, a NaN ratio, KL or gradient) or renormalises over its own top_k."""
    import copy

    tok, policy, T = make_tokenizer(), tiny("qwen2"), 1.0
    sampler = Sampler(temperature=T, top_k=3)
    r = sample(policy, tok, PROMPTS, 3, max_new_tokens=16, stop_ids=[EOS], sampler=sampler, generator=gen(4))
    own, C, kept = r.completion_mask.bool(), r.completion_ids.size(1), unpack(r.kept, V)
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        moved.lm_head.weight.add_(torch.randn(moved.lm_head.weight.shape, generator=gen(5)))
    ref = tiny("qwen2", seed=1)
    scored = {}
    for name, model in (("moved", moved), ("ref", ref)):
        logits = trajectory_logits(model, r)
        ranks_out = ~naive_sets(logits, own, sampler)[0].gather(2, r.completion_ids[..., None]).squeeze(2)
        assert (ranks_out & own).sum() >= 10, f"the {name} model must rank sampled tokens outside its own top_k"
        logp, ent, _ = token_logprobs(
            model, r.input_ids, r.attention_mask, C, sampler=sampler, with_entropy=True, kept=r.kept
        )
        assert logp[own].isfinite().all() and ent[own].isfinite().all(), name
        want_logp, want_ent = naive_scores(logits, kept, r.completion_ids, own, T)
        assert_close_scaled(logp[own].double(), want_logp[own], msg=name)
        assert_close_scaled(ent[own].double(), want_ent[own], msg=name)
        (logp[own].sum() + ent[own].sum()).backward()
        assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None), name
        scored[name] = logp.detach()
        assert batch_logprobs(model, r, 2, sampler=sampler)[own].isfinite().all(), name
    ratio = (scored["moved"] - r.sample_logp).exp()[own]
    kl = grpo.kl_estimate(scored["moved"], scored["ref"], "k3")[own]
    assert ratio.isfinite().all() and kl.isfinite().all() and kl.max() > 0


# -----------------------------------------------------------------------------
# 7. concat, Rollout[rows], micro_batches carry the sets with their rows and columns


def test_concat_index_and_micro_batches_keep_each_rows_sets():
    """Two truncated rollouts of different widths: concat pads each row's sets with zeros past its width and keeps
    them whole; Rollout[rows] takes row i's sets to where row i goes; each micro-batch's sets are its rows' first c
    columns, column j the set its token at ids[:, -c + j] was drawn from (the token in it), and batch_logprobs on the
    concat equals sample_logp. Fails if concat pads the wrong dim (the vocabulary bytes) or on the left, if indexing
    leaves the sets behind, or if micro_batches slices them by another row range or column offset."""
    tok, model = make_tokenizer(), tiny()
    kw = dict(stop_ids=[EOS], sampler=TRUNCATING)
    a = sample(model, tok, PROMPTS[:2], 2, max_new_tokens=5, generator=gen(6), **kw)
    b = sample(model, tok, PROMPTS[1:], 3, max_new_tokens=11, generator=gen(7), **kw)
    (na, ca), (nb, cb) = a.completion_ids.shape, b.completion_ids.shape
    assert ca < cb, "the test needs two widths"
    r = rollout.concat([a, b])
    assert r.kept.shape == (na + nb, cb, -(-V // 8))
    assert torch.equal(r.kept[:na, :ca], a.kept) and not r.kept[:na, ca:].any()
    assert torch.equal(r.kept[na:], b.kept)
    rows = torch.randperm(na + nb, generator=gen(8))
    assert torch.equal(r[rows].kept, torch.stack([r.kept[i] for i in rows.tolist()]))
    own = r.completion_mask.bool()
    for size in (1, 3, 4):
        for mb in rollout.micro_batches(r, size):
            c = mb.c
            assert torch.equal(mb.kept, r.kept[mb.rows, :c])
            assert torch.equal(mb.ids[:, -c:], r.completion_ids[mb.rows, :c])
            fed = mb.mask[:, -c:].bool()  # (rows, c)
            held = unpack(mb.kept, V).gather(2, mb.ids[:, -c:, None]).squeeze(2)  # (rows, c) each token in its set
            assert held[fed].all()
    assert_close_scaled(batch_logprobs(model, r, 3, sampler=TRUNCATING)[own], r.sample_logp[own], DECODE)


# -----------------------------------------------------------------------------
# 8. an environment's reply tokens are in the stored sets


def test_reply_tokens_are_in_their_kept_sets_and_masks_are_unchanged():
    """Tool rollouts with top_k = 1. Scripted (tests/test_tool_rollouts.py's Forced: each own token has probability
    1): the same trajectory, masks and sample_logp as the untruncated sampler; every reply token (not sampled, the
    environment's) is in the stored set at its position, which is the model's top token plus it: so the trainer's
    log-prob there is finite. Fails if the fed token is not OR-ed into the set (a reply token's log-prob -inf, a NaN
    loss through it), if the set is the reply's next position's, or if truncation changes a mask."""
    tok, model, T = make_tokenizer(), tiny(), 0.8
    w, _ = {i: VOCAB[f"w{i}"] for i in range(20)}, -1
    L = len(REPLY)
    script = [[w[5], *[_] * L, w[12], EOS], [w[10], w[11], EOS], [w[5], *[_] * L, w[5], *[_] * L, w[13], EOS]]
    runs = []
    for sampler in (Sampler(T), Sampler(T, top_k=1)):
        env = stub(tok)
        runs.append(
            sample(Forced(model, script), tok, PROMPTS, 1, max_new_tokens=24, stop_ids=[EOS], sampler=sampler, env=env)
        )
    plain, r = runs
    for k in ("completion_ids", "completion_mask", "env_mask", "truncated", "sample_logp"):
        assert torch.equal(getattr(r, k), getattr(plain, k)), k
    assert r.completions == plain.completions and r.trajectories == plain.trajectories
    reply, own, C = r.env_mask, r.completion_mask.bool(), r.completion_ids.size(1)
    assert reply.sum() == 3 * L
    kept = unpack(r.kept, V)  # (N, C, V)
    held = kept.gather(2, r.completion_ids[..., None]).squeeze(2)  # (N, C)
    assert held[reply | own].all()
    top = trajectory_logits(model, r).argmax(2)  # (N, C) the model's own top token at each position
    one_hot = torch.nn.functional.one_hot
    assert torch.equal(kept[reply], (one_hot(top[reply], V) | one_hot(r.completion_ids[reply], V)).bool())
    assert (top[reply] != r.completion_ids[reply]).sum() >= L, "reply tokens the sampler's own set leaves out"
    logp = token_logprobs(model, r.input_ids, r.attention_mask, C, sampler=Sampler(T, top_k=1), kept=r.kept)[0]
    assert logp[reply | own].isfinite().all()


def test_sampled_tool_rollout_scores_its_replies_and_own_tokens_under_the_sets():
    """Sampled (not scripted) tool rollouts with a truncating sampler: every reply token is in its stored set, every
    own token in the naive set of its teacher-forced logits, and batch_logprobs equals sample_logp on own tokens.
    Fails if a reply shifts the sets by a column (the sets of a row's own tokens after a reply would be wrong), or
    if a reply token is left out of its set."""
    tok, model = make_tokenizer(), tiny()
    env = stub(tok, max_calls=2, calls=tuple(f"w{i}" for i in range(0, 90, 15)))
    r = sample(model, tok, PROMPTS, 3, max_new_tokens=24, stop_ids=[EOS], sampler=TRUNCATING, generator=gen(9), env=env)
    own, reply = r.completion_mask.bool(), r.env_mask
    after = own & (reply.long().cumsum(1) > 0)
    assert reply.sum() >= 7 and after.sum() >= 5, "the test needs replies, and own tokens after them"
    kept = unpack(r.kept, V)
    assert kept.gather(2, r.completion_ids[..., None]).squeeze(2)[reply].all()
    want, robust = naive_sets(trajectory_logits(model, r), own, TRUNCATING)
    assert robust[after].float().mean() >= 0.9
    assert torch.equal(kept[after & robust], want[after & robust])
    assert_close_scaled(batch_logprobs(model, r, 2, sampler=TRUNCATING)[own], r.sample_logp[own], DECODE)


# -----------------------------------------------------------------------------
# 9. train.py: refusals, and a truncated run's trainer matching its sampler


@pytest.fixture
def no_model_load(monkeypatch):
    forbid_model_load(monkeypatch)


@pytest.mark.parametrize("key", ["top_k=5", "top_p=0.9", "min_p=0.1"])
def test_full_kl_with_truncation_is_refused(model_dir, tmp_path, capsys, no_model_load, key):
    """--kl-estimator full sums KL over the whole vocabulary, which a truncated sampler's distribution does not
    cover: refused in one line (exit 2) naming --kl-estimator full and the truncation knob given, before the model
    loads. Fails if the run starts (a KL of another distribution), or the line names neither or another knob."""
    argv = train_args(model_dir, str(tmp_path / "out"), "--kl-estimator", "full", "--config", key)
    code, line = error_of(TRAIN, argv, capsys)
    assert code == 2 and "error:" in line, (code, line)
    assert "kl-estimator" in line and "full" in line and key.split("=")[0] in line, line


@pytest.mark.parametrize("key, value", [("top_p", "0"), ("top_p", "1.5"), ("top_k", "-1"), ("min_p", "1.5")])
def test_bad_truncation_values_are_refused(model_dir, tmp_path, capsys, no_model_load, key, value):
    """Out of range: top_p outside (0, 1], a negative top_k, min_p > 1. One line, exit 2, naming the key and the
    value, before the model loads. Fails if a value reaches the sampler (top_p 0 would keep the top token alone)."""
    code, line = error_of(TRAIN, train_args(model_dir, str(tmp_path / "out"), "--config", f"{key}={value}"), capsys)
    assert code == 2 and "error:" in line, (code, line)
    assert key.replace("_", "-") in line or key in line, line
    assert mentions(line, value, tmp_path), line


def test_a_truncated_run_trains_on_the_samplers_log_probs(model_dir, tmp_path):
    """train.py with top_k, top_p and min_p set: the first pass's log-probs equal the sampler's (dlogp_max within
    the decode loop's rounding: measured 7e-7), the logged entropy is at most log 6 (a distribution over <= 6
    tokens; the full one's is 3.76 here), the loss and KL finite. Fails if train.py does not hand the rollout's kept
    sets to the policy's pass (dlogp_max would be log 1/mass, > 0.01) or the reference's (a NaN or huge KL)."""
    out = str(tmp_path / "out")
    extra = ["--config", "top_k=6", "--config", "top_p=0.9", "--config", "min_p=0.02", "--temperature", 1.2]
    run_script(TRAIN, train_args(model_dir, out, *extra, steps=2))
    rows = [m for m in read_metrics(out) if "loss" in m]
    assert len(rows) == 2
    for m in rows:
        assert math.isfinite(m["loss"]) and math.isfinite(m["kl"]) and m["kl"] < 1, m
        assert m["dlogp_max"] < 1e-4 and m["entropy"] <= math.log(6) + 1e-6, m
