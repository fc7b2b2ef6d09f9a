"""The training path equals the straightforward one on a tiny model.

Training path (what train.py runs): micro-batches trimmed to their used columns, the LM head run only
on completion positions in chunks, grpo.grpo_loss per micro-batch, gradients accumulated; the log-probs
from rollout.token_logprobs (the plain path) or lean.token_logprobs (--lean: each shared prompt run once,
the head's hand-written backward). Straightforward: one full forward, full-vocabulary log_softmax, the
GRPO loss of DeepSeekMath eq. 3 written out here independently, one backward.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import grpo
import lean
import rollout
from lean import shared_prompt_rows
from rollout import Rollout, micro_batches

V, PAD = 61, 0


def tiny_model(seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
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
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, comp_len == C,
                   torch.arange(N) // G, [""] * N, torch.zeros(N, C))


def naive_loss(policy, ref, r, adv, beta, eps, temperature):
    ids, mask = r.input_ids, r.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    C = r.completion_ids.size(1)
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1:-1] / temperature
    logp = logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1:-1] / temperature
        ref_logp = ref_logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    surrogate = torch.min(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    per_token = -(surrogate - beta * kl)
    m = r.completion_mask.float()
    return ((per_token * m).sum(1) / m.sum(1)).mean()  # eq. 3: 1/G sum_i 1/|o_i| sum_t


@pytest.mark.parametrize("logprobs", [rollout.token_logprobs, lean.token_logprobs], ids=["plain", "lean"])
@pytest.mark.parametrize("micro,share", [(2, False), (4, False), (8, False), (2, True), (4, True), (8, True)])
def test_training_path_matches_naive(micro, share, logprobs):
    policy, ref = tiny_model(0), tiny_model(1)
    twin = copy.deepcopy(policy)
    r = make_rollout()
    adv = torch.linspace(-1.5, 1.5, r.prompt_ids.size(0))
    beta, eps, temp = 0.04, 0.2, 0.7

    naive = naive_loss(twin, ref, r, adv, beta, eps, temp)
    naive.backward()

    total = 0.0
    N = r.prompt_ids.size(0)
    g = shared_prompt_rows(4, micro) if share else 1  # micro 2: half a group shares one prompt run
    assert g == (1 if not share else 2 if micro == 2 else 4)
    for rows, ids, mask, c in micro_batches(r, micro):
        with torch.no_grad():
            ref_logp = logprobs(ref, ids, mask, c, temp, group_size=g)[0]
        # chunks smaller than a row; share: lean runs each prompt once per micro-batch (plain: a hint it ignores)
        logp, _, _ = logprobs(policy, ids, mask, c, temp, chunk_size=5, group_size=g)
        loss, _ = grpo.grpo_loss(logp, None, ref_logp, adv[rows], r.completion_mask[rows, :c],
                                 grpo.Objective(beta=beta, eps=eps, loss_type="grpo"), num_sequences=N)
        loss.backward()
        total += loss.item()

    assert total == pytest.approx(naive.item(), abs=1e-6)
    for (name, a), b in zip(policy.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_micro_batches_trim_only_unused_columns():
    r = make_rollout()
    got = list(micro_batches(r, 4))
    # group 1: full prompts (7), longest completion 9 -> nothing trimmed
    assert got[0][1].shape == (4, 16) and got[0][3] == 9
    # group 2: 3 all-pad prompt columns dropped, longest completion 6
    assert got[1][1].shape == (4, 4 + 6) and got[1][3] == 6
    assert torch.equal(got[1][1], r.input_ids[4:, 3:7 + 6])


def test_shared_prefix_handles_a_single_completion_column():
    model, r = tiny_model(0), make_rollout()
    rows = slice(4, 8)
    ids = torch.cat([r.prompt_ids[rows], r.completion_ids[rows, :1]], 1)
    mask = torch.cat([r.prompt_mask[rows], r.completion_mask[rows, :1]], 1)
    with torch.no_grad():
        plain = rollout.token_logprobs(model, ids, mask, 1)[0]
        shared = lean.token_logprobs(model, ids, mask, 1, group_size=4)[0]
    assert plain.abs().min() > 0.1  # every row scored
    torch.testing.assert_close(shared, plain, atol=1e-6, rtol=1e-5)  # fp32, another order: ~1e-7 relative


def test_shared_prompt_rows_by_hand():
    # whole groups per micro-batch, a micro-batch inside one group, and straddling (no reuse)
    assert [shared_prompt_rows(8, mb) for mb in (16, 8, 4, 2, 1, 3, 12)] == [8, 8, 4, 2, 1, 1, 1]
