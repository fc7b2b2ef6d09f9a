"""The training path equals the straightforward one on a tiny model.

Training path (what train.py runs): micro-batches trimmed to their used columns, rollout.token_logprobs
(each distinct prompt of a micro-batch run once through the KV cache with share=True, whole rows with
share=False; the LM head only on completion positions, in chunks), grpo.grpo_loss per micro-batch,
gradients accumulated. Straightforward: one full forward, full-vocabulary log_softmax, the GRPO loss of
DeepSeekMath eq. 3 (k3 KL, eq. 4) written out here independently, one backward.

Tolerance: fp32, the same sums in another order (micro-batches, chunks, a shared prompt's smaller forward):
6e-8 relative per rounding through 2 layers, a 61-way softmax and sums over 8 rows stays near 1e-6 of a loss
of order 1 and of gradients of order 1 (measured <= 4e-6): loss to 1e-5; gradients to 256 eps32 (3.1e-5) of
each tensor's largest element, log-probs to 64 (conftest.assert_close_scaled: their rounding is the tensor's). A
completion at a wrong position or a prompt shared with the wrong row moves them by > 1e-2 (init_std 0.3).
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import grpo
import rollout
from conftest import GRADS, assert_close_scaled
from rollout import Rollout, micro_batches

V, PAD = 61, 0


def tiny_model(seed):
    """init_std 0.3, well above HF's 0.02: log-probs far from uniform, so a wrong position or mask shows."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    return LlamaForCausalLM(cfg).float()


def make_rollout(G=4, n_prompts=2, P=7, C=9):
    """Left-padded prompts of different lengths, completions stopping at different places."""
    g = torch.Generator().manual_seed(3)
    N = G * n_prompts
    prompt_len = torch.tensor([7, 7, 7, 7, 4, 4, 4, 4])  # group 2 has 3 pad columns
    comp_len = torch.tensor([9, 3, 5, 1, 2, 6, 4, 2])  # includes the stop token
    prompt_ids = torch.randint(1, V, (n_prompts, P), generator=g).repeat_interleave(G, 0)  # a group shares its prompt
    prompt_mask = (torch.arange(P)[None] >= P - prompt_len[:, None]).long()
    completion_ids = torch.randint(1, V, (N, C), generator=g)
    completion_mask = (torch.arange(C)[None] < comp_len[:, None]).long()
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, PAD)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, PAD)
    return Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        comp_len == C,
        [""] * N,
        torch.zeros(N, C),
        torch.zeros(N, dtype=torch.bool),
        torch.zeros(N, C, dtype=torch.bool),
        *torch.zeros(2, N, dtype=torch.long),
    )


def naive_loss(policy, ref, r, adv, beta, eps, temperature):
    ids, mask = r.input_ids, r.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    C = r.completion_ids.size(1)
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1 : -1] / temperature
    logp = logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1 : -1] / temperature
        ref_logp = ref_logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    surrogate = torch.min(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    per_token = -(surrogate - beta * kl)
    m = r.completion_mask.float()
    return ((per_token * m).sum(1) / m.sum(1)).mean()  # eq. 3: 1/G sum_i 1/|o_i| sum_t


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("micro", [2, 4, 8])  # half a group, a group, two groups a micro-batch
def test_training_path_matches_naive(micro, share):
    policy, ref = tiny_model(0), tiny_model(1)
    twin = copy.deepcopy(policy)
    r = make_rollout()
    adv = torch.linspace(-1.5, 1.5, r.prompt_ids.size(0))
    beta, eps, temp = 0.04, 0.2, 0.7
    obj = grpo.Objective(beta=beta, kl_estimator="k3", eps=eps, loss_type="grpo")

    naive = naive_loss(twin, ref, r, adv, beta, eps, temp)
    naive.backward()

    total, N = 0.0, r.prompt_ids.size(0)
    for rows, ids, mask, c, *_ in micro_batches(r, micro):
        with torch.no_grad():
            ref_logp = rollout.token_logprobs(
                ref, ids, mask, c, sampler=rollout.Sampler(temperature=temp), share=share
            )[0]
        logp, _, _ = rollout.token_logprobs(
            policy, ids, mask, c, sampler=rollout.Sampler(temperature=temp), share=share
        )
        loss, _ = grpo.grpo_loss(
            logp,
            old_logp=None,
            ref_logp=ref_logp,
            advantages=adv[rows],
            mask=r.completion_mask[rows, :c],
            obj=obj,
            num_sequences=N,
        )
        loss.backward()
        total += loss.item()

    assert total == pytest.approx(naive.item(), abs=1e-5)
    for (name, a), b in zip(policy.named_parameters(), twin.parameters()):
        assert_close_scaled(a.grad, b.grad, GRADS, msg=name)
    assert max(b.grad.abs().max() for b in twin.parameters()) > 1e-2  # gradients are not trivially zero


def test_micro_batches_trim_only_unused_columns():
    r = make_rollout()
    got = list(micro_batches(r, 4))
    # group 1: full prompts (7), longest completion 9 -> nothing trimmed
    assert got[0][1].shape == (4, 16) and got[0][3] == 9
    # group 2: 3 all-pad prompt columns dropped, longest completion 6
    assert got[1][1].shape == (4, 4 + 6) and got[1][3] == 6
    assert torch.equal(got[1][1], r.input_ids[4:, 3 : 7 + 6])


def test_shared_prompts_handle_a_single_completion_column():
    """C = 1: the prompt's last hidden state alone predicts the only completion token."""
    model, r = tiny_model(0), make_rollout()
    rows = slice(4, 8)
    ids = torch.cat([r.prompt_ids[rows], r.completion_ids[rows, :1]], 1)
    mask = torch.cat([r.prompt_mask[rows], r.completion_mask[rows, :1]], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        shared = rollout.token_logprobs(model, ids, mask, 1, share=True)[0]  # (4, 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -2]  # (4, V)
    want = logits.log_softmax(-1).gather(-1, ids[:, -1:])  # (4, 1)
    assert want.abs().min() > 0.1  # every row scored
    assert_close_scaled(shared, want)  # fp32, another order: ~1e-6 (docstring)


def padded_twice():
    """make_rollout's rows, then its rows again, groups swapped (rows 7 and 8 hold one prompt), from a sampling whose
    prompts were padded with another id to another width: concat re-pads with 0, so the two differ in padding alone."""
    a, b = make_rollout(), make_rollout()[torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])]
    b.prompt_ids = torch.cat([torch.full((8, 2), 0), b.prompt_ids.masked_fill(b.prompt_mask == 0, 5)], 1)
    b.prompt_mask = torch.cat([torch.zeros(8, 2, dtype=torch.long), b.prompt_mask], 1)
    return rollout.concat([a, b])


@pytest.mark.parametrize("make", [make_rollout, padded_twice])
@pytest.mark.parametrize("size", [1, 3, 4, 8])
def test_micro_batches_sizes_are_their_real_targets_and_distinct_prompts(size, make):
    """Each slice's sizes against counts made here from the Rollout: its completion tokens (own and replies) and its
    runs of equal prompts (their real tokens; a slice's first row always starts one). Fails if a count is off by one (a
    slice boundary, the first row) or another slice's, or if padding's ids make equal prompts differ (concat pads with
    0, a sampling with its own id): the passes would then index padding or drop a real target (nonzero_static)."""
    r = make()
    mask = r.completion_mask + r.env_mask.long()  # (N, C) what the model reads after its prompt
    for rows, ids, attention, c, (targets, prompts), _ in micro_batches(r, size):
        p = [tuple(x[m.bool()].tolist()) for x, m in zip(r.prompt_ids[rows], r.prompt_mask[rows])]
        assert targets == int(mask[rows].sum())
        assert prompts == 1 + sum(p[k] != p[k - 1] for k in range(1, len(p)))
        new = rollout._new_prompts(ids[:, :-c], attention[:, :-c])  # what the pass counts on its trimmed columns
        assert int(new.sum()) == prompts


@pytest.mark.parametrize("share", [True, False])
def test_the_micro_batch_loop_reads_nothing_from_the_device(share):
    """The training loop's work on a micro-batch (token_logprobs given micro_batches' sizes, with entropy and a
    reference's KL, grpo_loss, backward) runs under FakeTensorMode, which has no values: any read of one (a boolean
    mask's selection, a .item(), a count of prompts) raises there, and on a GPU each is a sync that stalls the queue.
    Fails if a read comes back into the loop, if micro_batches reads more than once for all its slices, or if the
    values and gradients differ from the pass that reads its sizes itself (which does raise there: the check works)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    policy, ref, r = tiny_model(0), tiny_model(1), padded_twice()
    slices = list(micro_batches(r, 3))
    reads = []
    with torch.no_grad(), pytest.MonkeyPatch.context() as m:  # micro_batches: one .tolist() for every slice
        m.setattr(torch.Tensor, "tolist", lambda t, real=torch.Tensor.tolist: reads.append(1) or real(t))
        list(micro_batches(r, 3))
    assert len(reads) == 1

    def step(sizes):
        out = []
        for _, ids, mask, c, s, _ in slices:
            s = s if sizes else None
            ref_hidden = rollout.completion_hidden(ref, ids, mask, c, share, s).detach()
            logp, entropy, kl = rollout.token_logprobs(
                policy,
                ids,
                mask,
                c,
                with_entropy=True,
                ref=rollout.RefStates(ref.get_output_embeddings(), ref_hidden),
                share=share,
                sizes=s,
            )
            adv, obj = torch.ones(logp.size(0)), grpo.Objective(kl_estimator="full")
            grpo.grpo_loss(
                logp, old_logp=None, ref_logp=None, advantages=adv, mask=mask[:, -c:], obj=obj, entropy=entropy, kl=kl
            )[0].backward()
            out.append(logp.detach())
        return out

    with FakeTensorMode(allow_non_fake_inputs=True):
        step(sizes=True)
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            step(sizes=False)
    policy.zero_grad()
    want = step(sizes=False)
    grads_want = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    got = step(sizes=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for p, g in zip(policy.parameters(), grads_want):
        assert_close_scaled(p.grad, g, GRADS)
