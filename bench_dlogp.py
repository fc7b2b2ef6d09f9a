"""
How far the sampling pass is from the training pass, on a model's own samples: |delta log-prob| per token.

    python bench_dlogp.py                        # SmolLM2-135M as shipped
    python bench_dlogp.py --ckpt out/run         # a train.py run (its ckpt.pt)

GRPO at mu = 1 takes the sampled tokens to come from the distribution the training pass computes. As in
train.py: fp32 weights, bf16 compute, temperature 1; --prompts task prompts x --group-size completions
are sampled with one decode step (--sampler). The same tokens are then fed, one step at a time, to each
decode step (lean.LeanDecoder; rollout.HFDecoder, the model's forward under autocast), teacher-forced
through each training pass (lean.token_logprobs; rollout.token_logprobs under autocast) and through the
fp32 forward. The table gives max, p99 and mean of |log p - log p'| over the valid completion tokens.
"""

import argparse
import datetime
import hashlib
import os
import platform

import torch
import transformers

import lean
import rollout
from eval import load_checkpoint_model
from models import load_model, load_tokenizer, stop_token_ids
from tasks import TASKS

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
src = p.add_mutually_exclusive_group()
src.add_argument("--model", default="smollm2-135m", help="alias, HF folder or hub id")
src.add_argument("--ckpt", default=None, help="train.py out dir or ckpt.pt (fp32 weights)")
p.add_argument("--task", default="arith", choices=sorted(TASKS))
p.add_argument("--split", default="test", choices=["train", "test"])
p.add_argument("--data-dir", default=None)
p.add_argument("--prompts", type=int, default=8)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=48)
p.add_argument("--sampler", default="lean", choices=["lean", "hf"], help="the decode step that samples")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 keeps torch's default")
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)
CPU, BF16 = torch.device("cpu"), torch.bfloat16

# -----------------------------------------------------------------------------
# model and samples
if args.ckpt:
    model, tok, _ = load_checkpoint_model(args.ckpt, CPU, torch.float32)
else:
    model, tok = load_model(args.model, CPU, torch.float32, trainable=False), load_tokenizer(args.model)
model.eval().requires_grad_(False)
task = TASKS[args.task]
prompts = [task.prompt(ex) for ex in task.load(args.split, data_dir=args.data_dir)[:args.prompts]]
G, decoders = args.group_size, {"lean": lean.LeanDecoder, "hf": rollout.HFDecoder}
r = rollout.sample(model, tok, prompts, G, args.max_new_tokens, stop_token_ids(tok, model),
                   generator=torch.Generator().manual_seed(args.seed), dtype=BF16, decoder=decoders[args.sampler])
ids, mask, C = r.input_ids, r.attention_mask, r.completion_ids.size(1)
valid = r.completion_mask.bool()  # (N, C)


@torch.no_grad()
def decode_logprobs(decoder):
    """The sampled tokens fed to `decoder` one step at a time, as rollout.sample feeds them -> (N, C)."""
    step = decoder(model, r.prompt_ids[::G], r.prompt_mask[::G], G, C, BF16)
    pos = (r.prompt_mask.cumsum(-1) - 1)[:, -1:] + 1  # (N, 1)
    logits = [step.logits] + [step.step(r.completion_ids[:, t], pos + t) for t in range(C - 1)]
    return torch.stack(logits, 1).float().log_softmax(-1).gather(-1, r.completion_ids[..., None]).squeeze(-1)


@torch.no_grad()
def training_logprobs(fast, dtype=BF16):
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        if fast:
            return lean.token_logprobs(model, ids, mask, C, group_size=G)[0]  # (N, C)
        return rollout.token_logprobs(model, ids, mask, C)[0]


STEPS = {"lean": "lean decode step", "hf": "HF decode step (autocast)"}
logp = {STEPS["lean"]: decode_logprobs(lean.LeanDecoder), STEPS["hf"]: decode_logprobs(rollout.HFDecoder),
        "lean training pass": training_logprobs(True), "HF training pass (autocast)": training_logprobs(False),
        "fp32 forward": training_logprobs(False, torch.float32)}
assert torch.equal(logp[STEPS[args.sampler]].masked_fill(~valid, 0), r.sample_logp), \
    "feeding the samples back does not reproduce the sampler's own log-probs"

# -----------------------------------------------------------------------------
# the table
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
           platform.processor())
code = hashlib.sha1(open(lean.__file__, "rb").read()).hexdigest()[:10]
print(f"\n{datetime.date.today()} | {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads | torch "
      f"{torch.__version__}, transformers {transformers.__version__} | lean.py sha1 {code}")
print(f"{args.ckpt or args.model}: {args.prompts} {args.task}/{args.split} prompts x {G}, sampled by the "
      f"{args.sampler} step; {int(valid.sum())} valid tokens, mean sampled log-prob "
      f"{r.sample_logp[valid].mean():.3f}\n")
print("| sampling pass | vs | max \\|Δ log p\\| | p99 | mean |")
print("|---|---|---:|---:|---:|")
pairs = [(s, t) for s in STEPS.values() for t in ("lean training pass", "HF training pass (autocast)")]
pairs += [("lean training pass", "HF training pass (autocast)")] + \
    [(s, "fp32 forward") for s in (*STEPS.values(), "HF training pass (autocast)")]
for a, b in pairs:
    d = (logp[a] - logp[b]).abs()[valid]
    print(f"| {a} | {b} | {d.max():.4f} | {d.quantile(0.99):.4f} | {d.mean():.4f} |")
