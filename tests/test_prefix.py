"""Prompt sharing in rollout.token_logprobs / completion_hidden (share=True) against the full rows.

The reference is independent of rollout.py: the whole rows through `model(...)` with position ids
cumsum(mask) - 1, log_softmax in fp32, position t predicting token t+1 (tiny models, CPU, fp32).

Tolerance: fp32 throughout, and sharing only splits the same sums differently (the prompt's keys and values
come from a separate, smaller forward; batch shapes differ), so only the summation order changes: 6e-8
relative per rounding, through 2 layers of width 32-64 and a 98-way softmax, stays near 1e-6 of log-probs of
order 1-10 (measured <= 1e-6). A gradient sums N*C per-token terms of size up to ~10, so its rounding is absolute
across the tensor, a few 1e-6 (measured <= 5e-6). Both are bounded relative to the tensor's largest value
(conftest.assert_close_scaled: 64 and 256 eps32, 7.6e-6 and 3.1e-5 of it). A completion placed at the wrong
position moves log-probs by 0.2 here (test_the_data_sees_a_wrong_position), 10^4 times the tolerance.
"""

import copy

import pytest
import torch

import rollout
from conftest import EOS, GRADS, VOCAB, assert_close_scaled, tiny

V = len(VOCAB)
KINDS = ["llama", "qwen2", "llama_bias"]


def rows(G=4, C=6, prompts=None, seed=1):
    """Prompts (default: random, of lengths 7, 3, 5, 2), left-padded, each repeated G times (contiguous rows),
    then C completion tokens; every other row stops early: its stop token, then EOS padding with mask 0.
    -> input_ids, attention_mask (N, P+C)."""
    g = torch.Generator().manual_seed(seed)
    prompts = prompts or [torch.randint(5, V, (n,), generator=g).tolist() for n in (7, 3, 5, 2)]
    ids, mask = rollout.left_pad(prompts, pad_id=EOS)
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)  # (N, P)
    N = ids.size(0)
    stop = torch.randint(0, C - 1, (N,), generator=g)
    stop[::2] = C  # no stop: runs to the end
    comp = torch.randint(5, V, (N, C), generator=g)
    cmask = (torch.arange(C)[None] <= stop[:, None]).long()  # (N, C) up to and including the stop
    comp = comp.masked_fill(torch.arange(C)[None] >= stop[:, None], EOS)  # the stop token, then padding
    return torch.cat([ids, comp], 1), torch.cat([mask, cmask], 1)


def trim(ids, mask):
    """Drop the leading all-padding columns, as micro_batches does (cumsum positions do not change)."""
    lo = mask.any(0).nonzero().min().item()
    return ids[:, lo:], mask[:, lo:]


def reference(model, ids, mask, C, T=1.0, pos=None):
    """Full rows through model(...) -> fp32 log-softmax (N, C, V) at the positions predicting the last C tokens."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0) if pos is None else pos  # (N, P+C)
    z = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits  # (N, P+C, V)
    return (z[:, -C - 1 : -1].float() / T).log_softmax(-1)  # (N, C, V)


def picked(logq, ids, mask, C):
    """log-softmax (N, C, V) -> log-prob of each completion token (N, C), 0 where the mask is 0."""
    return logq.gather(-1, ids[:, -C:, None]).squeeze(-1) * mask[:, -C:]


def grads(out, weights, params):
    return torch.autograd.grad((out * weights).sum(), params)


CASES = {  # name: (G, rows of the call, trim the leading all-padding columns, prompts)
    "groups": (4, slice(None), False, None),  # 4 groups of 4, prompts of 4 lengths
    "G1": (1, slice(None), False, None),  # every row its own prompt
    "part_of_a_group": (4, slice(5, 7), False, None),  # a micro-batch inside a group, all-padding columns kept
    "two_groups": (4, slice(8, 16), True, None),
    # two prompts whose padded ids are equal (the first starts with the pad id), their masks not: two prompts
    "same_ids_other_mask": (2, slice(None), False, [[EOS, 9, 10, 11], [9, 10, 11]]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES)
def test_logprobs_entropy_and_gradients_equal_the_full_rows(kind, case):
    G, sel, trimmed, prompts = CASES[case]
    C, T = 6, 0.7
    model = tiny(kind).train()  # tiny models have no dropout: train mode is deterministic
    ids, mask = rows(G, C, prompts)
    ids, mask = ids[sel], mask[sel]
    ids, mask = trim(ids, mask) if trimmed else (ids, mask)
    for train in (False, True):  # the probe answers in both modes, leaves the mode and no gradients behind
        assert rollout.sharing_problem(model.train(train)) is None and model.training == train
    assert all(p.grad is None for p in model.parameters())
    m = mask[:, -C:].bool()  # (N, C)
    assert (~m).any() and m.any(), "the call must hold rows that stop early"
    params = list(model.parameters())
    w = torch.randn(m.shape, generator=torch.Generator().manual_seed(2)) * m  # (N, C) fixed weights, valid tokens
    logp, ent, kl = rollout.token_logprobs(
        model, ids, mask, C, sampler=rollout.Sampler(temperature=T), with_entropy=True, share=True
    )
    assert kl is None and logp.shape == ent.shape == m.shape
    assert (logp[~m] == 0).all() and (ent[~m] == 0).all(), "padding after a stop must be 0"
    logq = reference(model, ids, mask, C, T)  # (N, C, V)
    want = picked(logq, ids, mask, C)
    assert_close_scaled(logp, want, msg=lambda s: f"logp: {s}")
    want_ent = -(logq.exp() * logq).sum(-1) * m  # (N, C)
    assert_close_scaled(ent, want_ent, msg=lambda s: f"entropy: {s}")
    got_g, want_g = grads(logp, w, params), grads(want, w, params)
    for (name, _), a, b in zip(model.named_parameters(), got_g, want_g):
        assert_close_scaled(a, b, GRADS, msg=lambda s, name=name: f"grad {name}: {s}")
        assert b.abs().max() > 0, name


def test_the_data_sees_a_wrong_position():
    """Completion positions that continue from the padded width instead of the prompt's length (left
    padding counted) move log-probs far more than the tolerance (rope only sees relative positions)."""
    model, C = tiny("llama"), 6
    ids, mask = rows(C=C)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P+C)
    P = ids.size(1) - C
    with torch.no_grad():
        right = picked(reference(model, ids, mask, C, pos=pos), ids, mask, C)
        pos[:, P:] = torch.arange(P, P + C)  # as if the prompt had no padding
        wrong = picked(reference(model, ids, mask, C, pos=pos), ids, mask, C)
    assert (right - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_completion_hidden_equals_the_full_rows_decoder(kind):
    model, C = tiny(kind), 6
    ids, mask = rows(C=C)
    m = mask[:, -C:].bool()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = model.get_decoder()(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False
        ).last_hidden_state[:, -C - 1 : -1]  # (N, C, H)
        shared = rollout.completion_hidden(model, ids, mask, C, share=True)
        full = rollout.completion_hidden(model, ids, mask, C, share=False)
    assert shared.shape == full.shape == want.shape
    assert_close_scaled(shared[m], want[m])  # only positions whose target is a real token count
    assert_close_scaled(full[m], want[m])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_full_kl_to_a_reference_model_equals_the_full_rows(kind):
    """kl = sum_v p (log p - log q), p the policy's and q the reference model's full-row distributions."""
    model, ref, C = tiny(kind).train(), tiny(kind, seed=1), 6
    ids, mask = rows(C=C)
    m = mask[:, -C:].bool()
    with torch.no_grad():
        ref_hidden = rollout.completion_hidden(ref, ids, mask, C)  # (N, C, H)
        logq = reference(ref, ids, mask, C)
    _, _, kl = rollout.token_logprobs(
        model, ids, mask, C, ref=rollout.RefStates(ref.get_output_embeddings(), ref_hidden)
    )
    logp = reference(model, ids, mask, C)
    want = (logp.exp() * (logp - logq)).sum(-1) * m  # (N, C)
    assert (kl[~m] == 0).all() and (want[m] > 1e-3).all()  # a different model: KL well above 0 everywhere
    assert_close_scaled(kl, want)
    params = list(model.parameters())
    for a, b in zip(grads(kl, m, params), grads(want, m, params)):
        assert_close_scaled(a, b, GRADS)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft reads transformers 5's deprecated names
def test_lora_values_and_gradients_equal_the_full_rows():
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        pytest.skip("needs peft: pip install peft")
    C = 6
    model = get_peft_model(
        tiny("llama"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    ).train()
    torch.manual_seed(3)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0 (the adapter a no-op): make it matter
            p.data.normal_(0, 0.3)
    ids, mask = rows(C=C)
    m = mask[:, -C:].bool()
    assert rollout.sharing_problem(model) is None
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    w = torch.randn(m.shape, generator=torch.Generator().manual_seed(2)) * m
    logp = rollout.token_logprobs(model, ids, mask, C, share=True)[0]
    want = picked(reference(model, ids, mask, C), ids, mask, C)
    assert_close_scaled(logp, want)
    with torch.no_grad(), model.disable_adapter():
        base = picked(reference(model, ids, mask, C), ids, mask, C)
    assert (want - base).abs().max() > 1e-2, "the adapters must change the values"
    for a, b in zip(grads(logp, w, params), grads(want, w, params)):
        assert_close_scaled(a, b, GRADS)
        assert b.abs().max() > 0


def test_a_forward_hook_on_a_decoder_layer_runs_on_the_shared_path():
    model, C = tiny("llama").train(), 6
    ids, mask = rows(C=C)
    with torch.no_grad():
        plain = picked(reference(model, ids, mask, C), ids, mask, C)
    # nonlinear, so the norms after it cannot undo it; on layer 0, so it must reach the cached prompt keys
    handle = model.model.layers[0].register_forward_hook(lambda mod, args, out: out + 0.3 * torch.tanh(out))
    try:
        assert rollout.sharing_problem(model) is None  # the hook runs on both paths: nothing to refuse
        params, w = list(model.parameters()), mask[:, -C:].float()
        logp = rollout.token_logprobs(model, ids, mask, C, share=True)[0]
        want = picked(reference(model, ids, mask, C), ids, mask, C)
        assert_close_scaled(logp, want)
        assert (want - plain).abs().max() > 1e-2, "the hook must change the values"
        for a, b in zip(grads(logp, w, params), grads(want, w, params)):
            assert_close_scaled(a, b, GRADS)
    finally:
        handle.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_* is transformers 5's deprecated name
@pytest.mark.parametrize("api", ["gradient", "activation"])  # train.py calls activation_checkpointing_enable
def test_gradient_checkpointing_is_a_sharing_problem_and_full_rows_still_match(api):
    """HF drops the KV cache in train mode under gradient checkpointing: the probe must say so, and the
    full-row path (share=False) must still give the reference values and gradients."""
    model, C = tiny("llama").train(), 6
    twin = copy.deepcopy(model)  # the reference, without checkpointing
    getattr(model, f"{api}_checkpointing_enable")(**{f"{api}_checkpointing_kwargs": {"use_reentrant": False}})
    reason = rollout.sharing_problem(model)
    assert isinstance(reason, str) and "checkpoint" in reason.lower() and "\n" not in reason, reason
    ids, mask = rows(C=C)
    m = mask[:, -C:].bool()
    w = torch.randn(m.shape, generator=torch.Generator().manual_seed(2)) * m
    logp = rollout.token_logprobs(model, ids, mask, C, share=False)[0]
    want = picked(reference(twin, ids, mask, C), ids, mask, C)
    assert_close_scaled(logp, want)
    for a, b in zip(grads(logp, w, list(model.parameters())), grads(want, w, list(twin.parameters()))):
        assert_close_scaled(a, b, GRADS)
    getattr(model, f"{api}_checkpointing_disable")()
    assert rollout.sharing_problem(model) is None


@pytest.mark.parametrize("silent", [False, True])
def test_an_attention_that_ignores_the_cache_is_a_sharing_problem(monkeypatch, silent):
    """A swapped attention that never reads past keys (a fork's layer written without cache support): full
    rows are unaffected, shared prompts lose the prompt in that layer. It fails on the mask's width, or,
    silent, cuts the mask to its own keys and computes other numbers without a word."""
    model = tiny("llama").train()
    attn = model.model.layers[1].self_attn
    forward = attn.forward

    def no_cache(hidden_states, *args, **kwargs):
        kwargs.update(dict.fromkeys(("cache", "past_key_values") & kwargs.keys()))  # the name per transformers version
        mask = kwargs.get("attention_mask")
        if silent and mask is not None:
            kwargs["attention_mask"] = mask[..., -hidden_states.size(1) :]  # (N, 1, q, q)
        return forward(hidden_states, *args, **kwargs)

    monkeypatch.setattr(attn, "forward", no_cache)
    reason = rollout.sharing_problem(model)
    assert isinstance(reason, str) and reason and "\n" not in reason, reason
