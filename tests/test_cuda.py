"""On a CUDA GPU (skipped without one): what only a GPU's kernels can show. The CPU's results are the reference: fp32
on the GPU computes the same sums in another order, a few eps of the tensor's largest value (conftest's bounds), so a
wrong mask, position or a NaN shows as an O(1) difference or a non-finite value."""

import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import rollout
from conftest import EOS, GRADS, VALUES, assert_close_scaled, make_tokenizer, tiny
import toy
from toy import TRAIN, read_metrics, run_script, train_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BACKENDS = {
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def left_padded(lengths=(1, 4, 9, 17), C=6, seed=0):
    """Rows whose prompts differ in length by up to 16 tokens, left-padded: a short row's first queries attend to
    nothing but padding (fully masked rows of the attention), then C real completion tokens -> ids, mask (N, P+C)."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.randint(5, 98, (len(lengths), P + C), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(lengths):
        ids[i, : P - n], mask[i, : P - n] = EOS, 0
    return ids, mask, C


def logp_and_grads(device, dtype, share):
    model = tiny("llama").train().to(device)
    ids, mask, C = left_padded()
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        logp, _, _ = rollout.token_logprobs(model, ids, mask, C, share=share)
    logp.float().sum().backward()
    return logp.float().cpu(), [p.grad.float().cpu() for p in model.parameters()]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_rows_stay_finite_and_exact_under_each_attention_kernel(backend, dtype, share):
    """Fails if a kernel gives NaN for a fully masked query row (a left-padded prompt's first positions) and 0 * NaN
    reaches a log-prob or a gradient, or if the GPU's result differs from the CPU's by more than reordered sums
    (fp32) or than bf16's rounding (8 bits: a few 2^-8 of the largest value). A kernel that takes no arbitrary mask
    (flash) is skipped where torch refuses it."""
    want, want_grads = logp_and_grads("cpu", torch.float32, share)
    try:
        with sdpa_kernel(BACKENDS[backend]):
            got, grads = logp_and_grads("cuda", dtype, share)
    except RuntimeError as e:
        pytest.skip(f"{backend} does not take this mask or dtype here: {str(e)[:80]}")
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in grads)
    if dtype == torch.float32:
        assert_close_scaled(got, want, VALUES)
        for g, w in zip(grads, want_grads):
            assert_close_scaled(g, w, GRADS)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=16 * 2**-8 * want.abs().max().item())


def test_sampling_on_the_gpu_draws_what_the_cpu_draws():
    """The same uniforms (drawn on the CPU generator) through fp32 logits that agree to a few eps: the same tokens
    and log-probs within reordered sums. Fails if sample() puts a tensor on the wrong device, draws its uniforms on
    the GPU's generator (another stream of numbers), or mishandles left padding there."""
    tok = make_tokenizer()
    prompts = ["w1", "w2 w3 w4 w5 w6 w7 w8 w9 w10 w11"]  # 2 and 11 prompt tokens: padded by 9
    runs = []
    for device in ("cpu", "cuda"):
        model = tiny("llama").to(device)
        runs.append(
            rollout.sample(
                model,
                tok,
                prompts,
                4,
                max_new_tokens=12,
                stop_ids=[EOS],
                generator=torch.Generator().manual_seed(3),
            )
        )
    cpu, gpu = runs
    assert torch.equal(gpu.completion_ids.cpu(), cpu.completion_ids)
    assert torch.equal(gpu.completion_mask.cpu(), cpu.completion_mask)
    assert_close_scaled(gpu.sample_logp.cpu(), cpu.sample_logp, VALUES)
    assert gpu.completions == cpu.completions


@pytest.mark.parametrize("tools", [False, True])
def test_the_decode_loop_syncs_with_the_host_a_fixed_number_of_times_per_token(tools):
    """Counts the host-device synchronisations of sample() with torch's sync debug mode, for 4 and 64 rows, without
    and with an environment (toy word tools). Fails if the loop, the environment's step or the decoding of the
    completions reads a tensor row by row (`done[i]`, `t[w]` per row: syncs that grow with the rows)."""
    tok = toy.make_tokenizer()
    model = toy.make_model().to("cuda")
    counts = {}
    for G in (2, 32):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                r = rollout.sample(
                    model,
                    tok,
                    ["w1 w2", "w3"],
                    G,
                    max_new_tokens=16,
                    stop_ids=[toy.VOCAB["<|im_end|>"]],
                    generator=torch.Generator().manual_seed(0),
                    env=toy.word_tools(tok) if tools else None,
                )
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[G] = sum("synchroniz" in str(w.message) for w in seen), r.completion_ids.size(1)
    (few, steps_few), (many, steps_many) = counts[2], counts[32]
    per_step = 8  # the loop's own `done.all()`, transformers' mask check, the environment's three reads, some slack
    assert many <= few + per_step * abs(steps_many - steps_few) + 8, counts  # not 16 times as many for 16x the rows


@pytest.mark.parametrize("extra", [[], ["--dtype", "bfloat16"], ["--dtype", "bfloat16", "--ref-device", "cpu"]])
def test_train_py_steps_on_the_gpu_as_on_the_cpu(model_dir, tmp_path, extra):
    """train.py --device cuda against --device cpu, two steps: the same sampled tokens (rewards) and, in fp32, the
    same loss and KL within reordered sums. Fails if a tensor of the loop stays on the wrong device, the reference
    apart (--ref-device cpu) sends back its results on its own device, or bf16 autocast gives non-finite values."""
    rows = []
    for i, device in enumerate(("cpu", "cuda")):
        run_script(TRAIN, train_args(model_dir, str(tmp_path / str(i)), "--device", device, *extra, steps=2))
        rows.append(read_metrics(str(tmp_path / str(i))))
    for cpu, gpu in zip(*rows):
        assert all(torch.isfinite(torch.tensor(gpu[k])) for k in ("loss", "kl", "reward"))
        if not extra:
            assert gpu["reward"] == cpu["reward"]
            torch.testing.assert_close(gpu["loss"], cpu["loss"], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(gpu["kl"], cpu["kl"], rtol=1e-3, atol=1e-7)


def test_the_training_micro_batch_loop_syncs_only_in_the_models_mask_check():
    """The training pass on CUDA under torch's sync debug mode: micro_batches syncs once for all its slices, and a
    micro-batch's log-probs, entropy, loss and backward given its sizes sync at most once (transformers' SDPA mask
    check, on the shared prompts' pass). Fails if a read of the device comes back into the loop (a boolean-mask
    selection, a .item() of a bound, a count of prompts: each a sync a micro-batch)."""
    import grpo
    from test_equivalence import make_rollout, tiny_model

    policy, r = tiny_model(0).cuda(), make_rollout()
    r = rollout.Rollout(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(r).items()})
    counts = []
    for phase in ("slices", "passes"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                slices = list(rollout.micro_batches(r, 3))
                if phase == "passes":
                    for _, ids, mask, c, sizes, _ in slices:
                        logp, entropy, _ = rollout.token_logprobs(policy, ids, mask, c, with_entropy=True, sizes=sizes)
                        adv = torch.ones(logp.size(0), device="cuda")
                        obj = grpo.Objective(beta=0.0)
                        grpo.grpo_loss(
                            logp,
                            old_logp=None,
                            ref_logp=None,
                            advantages=adv,
                            mask=mask[:, -c:],
                            obj=obj,
                            entropy=entropy,
                        )[0].backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
    assert counts[0] <= 1 and counts[1] - counts[0] <= len(slices), (counts, len(slices))
