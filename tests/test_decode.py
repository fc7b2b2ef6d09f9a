"""The decode loops of decode.DECODE (rollout.sample's loop=) against the model's dynamic cache (the reference): the
static cache eagerly, its step captured as a CUDA graph where CUDA is, and on a CPU the captured path's own loop with
each replay run eagerly. fp32: the same tokens, masks and texts, log-probs within conftest's DECODE bound (the static
cache attends over masked extra columns: the same sums, reordered)."""

import warnings
from functools import partial

import pytest
import torch

import decode
import envs
import extra_tasks
import rollout
import toy
from conftest import DECODE, EOS, assert_close_scaled, make_tokenizer, tiny
from test_tool_rollouts import Held

CUDA = torch.cuda.is_available()
# every entry but the reference; "graph" on CPU is the captured path's loop with each replay run eagerly
MODES = [m for m in decode.DECODE if m != "dynamic"] + ["replayed"]
PROMPTS = ["w1", "w2 w3 w4 w5 w6 w7 w8 w9 w10 w11", [{"role": "user", "content": "w5 w6"}]]  # left padding


class EagerGraph:
    """What _capture returns, without CUDA: replay() runs the captured body eagerly."""

    def __init__(self, body):
        self.replay = body


def eager_capture(model, s, sampler, stop, pad_id, env):
    if env is None:
        return EagerGraph(lambda: decode.step(model, s, sampler, stop, pad_id))
    return EagerGraph(lambda: decode.feed(model, s))


@pytest.fixture
def mode(request, monkeypatch):
    """A decode mode to run here: "replayed" is decode_graph's own loop (_replayed) with an eager stand-in for the
    graph on a CPU, and the real capture on CUDA."""
    name = request.param
    if name == "graph" and not CUDA:
        pytest.skip("CUDA graphs need a CUDA GPU (the 'replayed' case runs their loop here)")
    if name == "replayed":
        if not CUDA:
            monkeypatch.setattr(decode, "_capture", eager_capture)
    return decode._replayed if name == "replayed" else decode.DECODE[name]


def device():
    return "cuda" if CUDA else "cpu"


def both(model, tok, prompts, G, mode, **kw):
    """The same sampling with decode_dynamic and with the loop `mode` -> (reference, other)."""
    sampler = rollout.Sampler(temperature=kw.pop("temperature", 1.0))
    runs = []
    for loop in (rollout.decode_dynamic, mode):
        gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        runs.append(rollout.sample(model, tok, prompts, G, sampler=sampler, generator=gens, loop=loop, **kw))
    return runs


def assert_same_rollout(got, want):
    for k in ("completion_ids", "completion_mask", "env_mask", "truncated", "prompt_ids", "prompt_mask"):
        assert torch.equal(getattr(got, k).cpu(), getattr(want, k).cpu()), k
    assert got.completions == want.completions and got.trajectories == want.trajectories
    assert got.env_state == want.env_state
    assert_close_scaled(got.sample_logp.cpu(), want.sample_logp.cpu(), DECODE)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias"])
def test_static_decode_draws_the_dynamic_caches_tokens(mode, kind):
    """Plain rollouts, three prompt lengths (left padding), G=4, a budget some rows stop within. Fails if a row writes
    or attends to a wrong cache column (another row's, a stale one, the scratch), gets a wrong position, or its
    bookkeeping differs (a finished row fed again, a uniform by the wrong count, the budget counted wrong)."""
    tok, model = make_tokenizer(), tiny(kind).to(device())
    want, got = both(model, tok, PROMPTS, 4, mode, max_new_tokens=20, stop_ids=[EOS])
    assert want.completion_mask.sum(1).min() < 20 < want.completion_ids.size(1) + 1, "some rows stop, some run out"
    assert_same_rollout(got, want)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_static_decode_is_greedy_and_tempered_alike(mode, temperature):
    """Greedy (argmax) and a temperature: fails if the static loop draws from other logits than the sampler's."""
    tok, model = make_tokenizer(), tiny().to(device())
    want, got = both(model, tok, PROMPTS, 2, mode, max_new_tokens=12, stop_ids=[EOS], temperature=temperature)
    assert_same_rollout(got, want)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("G", [2, 8])
def test_static_decode_with_tool_replies(mode, G):
    """The toy word tools answer calls: replies fed one token a step, each taking a budget token. Fails if a reply's
    token is not written at the row's own column (the model would not read it), is recorded as the model's own, or
    if the environment's host code is skipped by the captured path."""
    tok, model = toy.make_tokenizer(), toy.make_model().to(device())
    kw = dict(max_new_tokens=24, stop_ids=[toy.VOCAB["<|im_end|>"]])
    want, got = both(model, tok, ["w1 w2", "w3"], G, mode, env=toy.word_tools(tok), **kw)
    assert want.env_mask.any(), "the test needs replies"
    assert_same_rollout(got, want)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_static_decode_with_feedback_turns(mode):
    """arith_retry's environment (FeedbackEnv): a row that stops is told it is wrong and answers again. Fails if a
    row the environment reopens stays finished, or its new turn is written over its old one."""
    tok, model = make_tokenizer(), tiny().to(device())
    env = partial(envs.EnvDriver, partial(envs.FeedbackEnv, extra_tasks.retry_check, 3), tok)
    examples = [{"answer": "36"}] * 3
    runs = []
    for loop in (rollout.decode_dynamic, mode):
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        r = rollout.sample(
            model,
            tok,
            PROMPTS,
            4,
            max_new_tokens=40,
            stop_ids=[EOS],
            generator=gens,
            env=env(),
            examples=examples,
            loop=loop,
        )
        runs.append(r)
    want, got = runs
    assert want.env_mask.any(), "the test needs a feedback turn"
    assert_same_rollout(got, want)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_static_decode_with_holes_matches_the_trainer(mode):
    """Tools that answer only 3 decode steps after the call: the calling rows are holes meanwhile. Fails if a hole
    takes a cache column, a position, a uniform or an output column (its tokens would differ from the dynamic
    cache's, and its log-probs from the teacher-forced pass's on the trajectory)."""
    tok, model = make_tokenizer(), tiny().to(device())
    runs, waited = [], []
    for loop in (rollout.decode_dynamic, mode):
        tools = Held(3, max_calls=2, calls=tuple(f"w{i}" for i in range(0, 90, 15)), errors=("w7",), reply="w1")
        env = envs.EnvDriver(tools, tok)
        holes = tools.drive(env)
        sampler = rollout.Sampler(temperature=0.8)
        gen = torch.Generator().manual_seed(0)
        runs.append(
            rollout.sample(
                model,
                tok,
                PROMPTS,
                3,
                max_new_tokens=24,
                stop_ids=[EOS],
                sampler=sampler,
                generator=gen,
                env=env,
                loop=loop,
            )
        )
        waited.append(int(torch.stack(holes).sum()))
    want, got = runs
    assert min(waited) >= 4, "both loops must see holes (how many: the tools threads timing)"
    assert_same_rollout(got, want)
    own, C = got.completion_mask.bool(), got.completion_ids.size(1)
    logp = rollout.token_logprobs(model, got.input_ids, got.attention_mask, C, sampler=rollout.Sampler(0.8))[0]
    assert_close_scaled(got.sample_logp[own].cpu(), logp[own].cpu(), DECODE)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_step_traces_whole_under_torch_compile(kind):
    """torch.compile(decode.step, fullgraph=True) traces the whole step (the model's forward on the static cache,
    the draw, the bookkeeping) without a graph break, and its steps equal the eager steps'. Fails if the step reads
    a host value (a `.item()`, a Python branch on a tensor), builds the model's mask from a 2D one (its padding
    check), or changes a buffer's address."""
    import copy

    model = tiny(kind)
    ids, mask = torch.tensor([[1, 2, 3, 4], [0, 5, 6, 7]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    u = torch.rand(4, 12, generator=torch.Generator().manual_seed(0))
    cache = rollout._Cache(config=model.config)
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        kv = rollout._cache_kwarg(model, cache)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **kv).logits[:, -1]
        eager = decode._start(cache, logits, mask, u, rollout.Sampler())
        args = (rollout.Sampler(), torch.tensor([-1]), 0)  # no stop token: every row decodes
        decode.draw(eager, *args)
        traced = copy.deepcopy(eager)
        torch._dynamo.reset()
        step = torch.compile(decode.step, fullgraph=True, backend="aot_eager")
        addresses = [t.data_ptr() for t in (traced.tok, traced.logits, traced.cache.keys[0], *traced.out)]
        for _ in range(4):
            decode.step(model, eager, *args)
            step(model, traced, *args)
    assert addresses == [t.data_ptr() for t in (traced.tok, traced.logits, traced.cache.keys[0], *traced.out)]
    for a, b in zip(eager.out, traced.out):
        torch.testing.assert_close(a, b, rtol=0, atol=DECODE * torch.finfo(torch.float32).eps * 10)
    assert torch.equal(eager.used, traced.used) and (eager.used == 5).all()


def test_the_probe_refuses_a_hook_and_the_graph_falls_back(capsys):
    """A fork's forward hook with a Python side effect (it counts calls) on one layer: fails if problem() does not
    name it, or if the graph loop then runs anything but the dynamic cache's loop (the hook must run every step)."""
    tok, model = make_tokenizer(), tiny()
    calls = []
    model.model.layers[1].mlp.register_forward_hook(lambda *a: calls.append(1))
    assert "model.layers.1.mlp" in decode.problem(model, None)
    r = rollout.sample(model, tok, PROMPTS[:1], 2, max_new_tokens=6, stop_ids=[EOS], loop=decode.DECODE["graph"])
    assert len(calls) == r.completion_ids.size(1)  # the prefill, then one call a step after the first draw
    assert "decode: eager on a dynamic cache" in capsys.readouterr().out


@pytest.mark.skipif(CUDA, reason="the CPU's answer")
def test_graph_on_a_cpu_says_it_decodes_eagerly(capsys):
    """The loop train.py and eval.py pass on CUDA, here without CUDA: one line, then the dynamic loop's rollout. Fails
    on a traceback (a missing entry point, a CUDA call) or silence."""
    tok, model = make_tokenizer(), tiny()
    a, b = both(model, tok, PROMPTS, 2, decode.on_cuda, max_new_tokens=6, stop_ids=[EOS])  # train.py's on CUDA
    assert "CUDA" in capsys.readouterr().out
    assert torch.equal(a.completion_ids, b.completion_ids)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_module_with_python_state_is_found_by_the_probe():
    """A swapped MLP whose output depends on a Python counter (each call scales it anew): a replay would repeat the
    captured call's scale. Fails if the probe lets the captured step run for it."""
    model = tiny().cuda()
    mlp = model.model.layers[0].mlp

    class Drifting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.calls = mlp, 0

        def forward(self, x):
            self.calls += 1
            return self.mlp(x) * (1 + 0.1 * self.calls)

    model.model.layers[0].mlp = Drifting()
    assert "other tokens or log-probs" in decode.problem(model, None)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_captured_loop_reads_the_host_every_few_tokens():
    """The host syncs of a 64-token captured sampling (16 rows): fails if the loop reads `done` every token (64+
    syncs) rather than every CHECK_EVERY tokens, or if the step itself syncs (capture would fail)."""
    tok, model = make_tokenizer(), tiny().cuda()
    rollout.sample(model, tok, PROMPTS, 2, max_new_tokens=8, stop_ids=[EOS], loop=decode.on_cuda)  # the probe
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = rollout.sample(model, tok, PROMPTS[:2], 8, max_new_tokens=64, stop_ids=[EOS], loop=decode.on_cuda)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs, steps = sum("synchroniz" in str(w.message) for w in seen), r.completion_ids.size(1)
    assert steps >= 32 and syncs <= steps // decode.CHECK_EVERY + 24, (syncs, steps)
