"""
GRPO (DeepSeekMath, arXiv 2402.03300 §4) on a Hugging Face causal LM. Reads top to bottom.

    python train.py --task gsm8k                          # defaults below
    python train.py --config configs/arith_smollm2_cpu.py  # a config file, then flags override it
    torchrun --nproc_per_node=2 train.py --config ...      # several GPUs (or CPU processes, gloo)
    python train.py --config ... --lora-rank 16            # LoRA adapters (peft) on a frozen base
    torchrun --nproc_per_node=8 train.py --config ... --fsdp  # weights, grads, Adam states sharded (FSDP2)

Each step: sample prompts -> G completions each -> rewards -> group advantages -> reference
log-probs -> mu passes of micro-batched loss, gradient accumulation, clip, optimizer step.
Sampling and log-probs run through the model's own modules (rollout.py); --lean swaps in lean.py's
faster passes where its check proves they compute the same thing, and says why when it does not.
Where the defaults depart from the paper (grpo.py's docstring lists the variants):
- the loss is aggregated per --loss-type (default: the paper's per-sequence mean);
- sampling runs in --dtype (auto: bf16 where native, else fp32) from the policy itself; max_dlogp in the
  logs measures how far the sampling pass is from the training pass;
- multi-process runs average gradients with one all-reduce per update instead of wrapping in DDP,
  because the log-prob pass calls the decoder and the LM head separately (rollout.token_logprobs);
  --fsdp shards instead, with DCP checkpoints (parallel.py says how the root is handled).
At the end the policy is written to OUT_DIR/hf, a folder transformers and vLLM load (--export).
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import batch
import checkpoint
import cli
import grpo
import lean
import parallel
import rollout
from eval import evaluate
from metrics import TRACKERS, DriftWatch, MetricsLog, check_tracker
from models import (DTYPES, LORA_TARGETS, ModelError, add_lora, check_dtype, load_model, load_tokenizer,
                    resolve_device, resolve_dtype, stop_token_ids, without_adapters)
from rewards import RewardError, combine_rewards, overlong_reward
from rollout import micro_batches, sample
from tasks import TASKS, DataError

# -----------------------------------------------------------------------------
# flags: defaults here, then --config files, then the command line (cli.py checks every value)
class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass  # keep the docstring's layout and show every default


p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
p.add_argument("--config", action="append", default=[], help="file of plain assignments (lr = 1e-6); repeatable, later wins")
# --- task and model
g = p.add_argument_group("task and model")
g.add_argument("--task", default="gsm8k", choices=sorted(TASKS))
g.add_argument("--data-dir", default=None, help="local GSM8K dir (else $GSM8K_DIR, else download once)")
g.add_argument("--model", default="smollm2-135m", help="hub id, local HF dir, .gguf file or smollm2-135m")
g.add_argument("--ref-model", default=None, help="reference model; None = same as --model")
g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:1 | mps")
g.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
               help="autocast dtype (master weights stay fp32); auto: bfloat16 where native, else float32")
g.add_argument("--ref-device", default=None, help="reference model device, e.g. cpu to offload; None = --device")
g.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
g.add_argument("--lean", default="auto", choices=["auto", "on", "off"],
               help="lean.py's faster passes for plain Llama/Qwen2 models; auto = on CPU when its check passes")
# --- rollout
g = p.add_argument_group("rollout")
g.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
g.add_argument("--prompts-per-step", type=int, default=2, help="prompts per step, over all ranks")
g.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
g.add_argument("--max-new-tokens", type=int, default=256)
g.add_argument("--max-prompt-tokens", type=int, default=None,
               help="longer prompts keep their last tokens (as TRL); None = the model's context - max-new-tokens")
g.add_argument("--temperature", type=float, default=1.0)
g.add_argument("--top-p", type=float, default=1.0)
g.add_argument("--top-k", type=int, default=0, help="0 = off")
g.add_argument("--dynamic-sampling", action="store_true",
               help="DAPO: drop groups whose rewards are all equal and sample more prompts in their place")
g.add_argument("--max-resample", type=int, default=4, help="with --dynamic-sampling: extra rollouts a step, at most")
# --- optimisation
g = p.add_argument_group("optimisation")
g.add_argument("--steps", type=int, default=100, help="generation batches")
g.add_argument("--mu", type=int, default=1, help="optimizer steps per generation batch (GRPO's mu)")
g.add_argument("--lr", type=float, default=1e-6)
g.add_argument("--warmup-steps", type=int, default=0, help="linear warmup, in optimizer steps")
g.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
               help="after warmup: constant, or cosine down to 10%% of --lr at the last update")
g.add_argument("--weight-decay", type=float, default=0.0)
g.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm; 0 = off")
# --- the GRPO objective (grpo.py)
g = p.add_argument_group("the GRPO objective (grpo.py)")
g.add_argument("--beta", type=float, default=0.04, help="KL coefficient; 0 = no reference model loaded")
g.add_argument("--kl-estimator", default=grpo.KL_DEFAULT, choices=grpo.KL_ESTIMATORS,
               help="k3_clamped: the paper's k3 with the log-ratio bounded (cannot overflow); full: exact, whole vocabulary")
g.add_argument("--loss-type", default="grpo", choices=grpo.LOSS_TYPES)
g.add_argument("--scale-rewards", default="group", choices=grpo.SCALES, help="none = Dr. GRPO")
g.add_argument("--eps", type=float, default=0.2, help="clip epsilon (low)")
g.add_argument("--eps-high", type=float, default=None, help="clip-higher (DAPO); None = --eps")
g.add_argument("--delta", type=float, default=None, help="cap on the ratio (INTELLECT-2 two-sided clip)")
g.add_argument("--importance-level", default="token", choices=grpo.IMPORTANCE_LEVELS, help="sequence = GSPO")
g.add_argument("--mask-truncated", action="store_true", help="no loss on completions cut at max-new-tokens")
g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus")
g.add_argument("--top-entropy-quantile", type=float, default=1.0, help="train only the top-rho entropy tokens")
g.add_argument("--ref-sync-every", type=int, default=0, help="every N steps mix the policy into the reference; 0 = never")
g.add_argument("--ref-sync-alpha", type=float, default=1.0, help="ref = alpha*policy + (1-alpha)*ref; 1 = reset")
g.add_argument("--is-mode", default="token_truncate", choices=grpo.BEHAVIOUR_MODES,
               help="correct for the sampler/trainer mismatch: policy term times min(pi_train / pi_sample, --is-cap)")
g.add_argument("--is-cap", type=float, default=2.0, help="cap on the importance weight pi_train / pi_sample")
g.add_argument("--supervision", default="outcome", choices=["outcome", "process"],
               help="process: per-step rewards of the task (arith_steps) -> per-token advantages (DeepSeekMath 4.1.3)")
g.add_argument("--overlong-buffer", type=int, default=0,
               help="DAPO soft overlong punishment over the last N of --max-new-tokens; 0 = off")
g.add_argument("--overlong-weight", type=float, default=1.0, help="weight of the overlong reward")
g.add_argument("--reward-weights", default=None, help="e.g. correct=1,format=0.1 (default: the task's)")
# --- run
g = p.add_argument_group("run")
g.add_argument("--seed", type=int, default=0)
g.add_argument("--out-dir", default="out/run")
g.add_argument("--overwrite", action="store_true", help="replace a finished or stopped run in --out-dir")
g.add_argument("--eval-every", type=int, default=0, help="steps between evals on the test split; 0 = only at the end")
g.add_argument("--eval-n", type=int, default=200, help="test examples per eval (the first N); 0 = no eval")
g.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (and one at the end); 0 = none")
g.add_argument("--resume", default=None, help="out dir or ckpt.pt to continue from")
g.add_argument("--log-completions", type=int, default=10, help="print a sample completion every N steps; 0 = never")
g.add_argument("--log-to", default="none", choices=TRACKERS, help="metrics.jsonl always; also this tracker")
# --- scale: LoRA adapters (peft), sharding (FSDP2), the Hugging Face export
g = p.add_argument_group("scale: LoRA (peft), FSDP2, Hugging Face export")
g.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (needs: pip install peft); 0 = full fine-tuning")
g.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale = alpha / rank; None = 2 x rank")
g.add_argument("--lora-dropout", type=float, default=0.0,
               help="dropout on the adapters' input; > 0 makes the training log-probs differ from sampling's")
g.add_argument("--lora-targets", default=LORA_TARGETS, help="comma-separated names of the modules that get adapters")
g.add_argument("--fsdp", action="store_true",
               help="under torchrun: shard weights, grads and AdamW states over the processes (FSDP2, DCP checkpoints)")
g.add_argument("--export", default="model", choices=["model", "adapter", "none"],
               help="at the end, OUT_DIR/hf: model = a HF model in --dtype (LoRA merged in); adapter = a peft folder")
# every numeric flag's valid values, checked with its type before anything loads
RANGES = {"group_size": ">= 2", "prompts_per_step": ">= 1", "micro_batch": ">= 1", "max_new_tokens": ">= 1",
          "max_prompt_tokens": ">= 1", "temperature": "> 0", "top_p": "(0, 1]", "top_k": ">= 0", "steps": ">= 1",
          "mu": ">= 1", "lr": "> 0", "warmup_steps": ">= 0", "weight_decay": ">= 0", "grad_clip": ">= 0",
          "beta": ">= 0", "eps": "[0, 1)", "eps_high": ">= 0", "delta": "> 1", "top_entropy_quantile": "(0, 1]",
          "ref_sync_every": ">= 0", "ref_sync_alpha": "(0, 1]", "seed": ">= 0", "eval_every": ">= 0",
          "eval_n": ">= 0", "save_every": ">= 0", "log_completions": ">= 0", "max_resample": ">= 0", "is_cap": "> 0",
          "overlong_buffer": ">= 0", "lora_rank": ">= 0", "lora_alpha": "> 0", "lora_dropout": "[0, 1)"}
args, ckpt_path = cli.parse(p, RANGES)
eps_high = args.eps if args.eps_high is None else args.eps_high

# -----------------------------------------------------------------------------
# setup: distributed, device, the checks that need more than one flag
ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
master = rank == 0
local_prompts = args.prompts_per_step // world
N = local_prompts * args.group_size  # completions per rank per step
cli.check_combinations(p, args, world, ddp, TASKS[args.task])
lora_ref = args.lora_rank > 0 and not args.ref_model  # the reference: the policy with its adapters disabled
task = TASKS[args.task]
reward_fns, weights = dict(task.reward_fns), dict(task.reward_weights)
if args.overlong_buffer:  # DAPO eq. 13 beside the task's rewards, with its own weight
    reward_fns["overlong"] = overlong_reward(args.max_new_tokens, args.overlong_buffer)
    weights["overlong"] = args.overlong_weight
weights.update(cli.reward_weights(p, args.reward_weights, reward_fns))
if check_tracker(args.log_to):
    p.error(check_tracker(args.log_to))
try:
    device = resolve_device(args.device)
    if ddp and device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    ref_device = resolve_device(args.ref_device) if args.ref_device else device
    dtype, dtype_note = resolve_dtype(args.dtype, device)
    args.dtype = str(dtype).removeprefix("torch.")  # config.json records what ran: a resume keeps it
    check_dtype(device, dtype)
    check_dtype(ref_device, dtype)
except ModelError as e:
    p.error(str(e))
if dtype_note and master:
    print(dtype_note)
if args.kl_estimator == "full" and args.beta > 0 and ref_device != device:
    p.error("--kl-estimator full computes the reference's logits beside the policy's: --ref-device must be --device")
problem = checkpoint.prepare_out_dir(args.out_dir, args.resume, args.overwrite, rank)  # never mix two runs' files
if problem:
    p.error(problem)
if ddp:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
torch.manual_seed(args.seed + rank)
autocast = torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)

# -----------------------------------------------------------------------------
# models and data
try:
    tokenizer = load_tokenizer(args.model)
    home = torch.device("cpu") if args.fsdp else device  # --fsdp: each rank moves only its shards to device
    # fp32 master weights; sampling reads them too. LoRA: the frozen base's matmul weights in the compute
    # dtype (under autocast the same bits as fp32 ones), the adapters fp32
    policy = load_model(args.model, home, torch.float32, matmul_dtype=dtype if args.lora_rank else None)
    if args.lora_rank:
        policy = add_lora(policy, args.lora_rank, args.lora_alpha or 2 * args.lora_rank, args.lora_dropout,
                          args.lora_targets, seed=args.seed)  # the same adapters on every rank
    # the reference in the policy's numerics: matmul weights stored as autocast would cast them (sharded:
    # all weights in dtype, as FSDP gathers the policy's), so at step 0 the two passes give the same bits
    shard_ref = args.fsdp and ref_device == device  # --ref-device elsewhere: a whole reference there
    ref = load_model(args.ref_model or args.model, home if shard_ref else ref_device,
                     dtype if shard_ref else torch.float32, trainable=False,
                     matmul_dtype=dtype) if args.beta > 0 and not lora_ref else None
    if args.fsdp:  # each decoder layer a unit, the root the rest (parallel.py)
        parallel.shard(policy, device, dtype)
        if shard_ref and ref is not None:
            parallel.shard(ref, device, dtype)
    train_set = task.load("train", data_dir=args.data_dir)
    test_set = task.load("test", data_dir=args.data_dir)[:args.eval_n] if master and args.eval_n else []
except (ModelError, DataError) as e:
    p.error(str(e))
if len(train_set) < args.prompts_per_step:
    p.error(f"the train split has {len(train_set)} examples, fewer than --prompts-per-step {args.prompts_per_step}")
context = getattr(policy.config, "max_position_embeddings", None) or 10**9
max_prompt = args.max_prompt_tokens or context - args.max_new_tokens
if max_prompt < 1 or max_prompt + args.max_new_tokens > context:
    p.error(f"--max-new-tokens {args.max_new_tokens} + prompt {max_prompt} exceed the model's context of {context} "
            "tokens: lower --max-new-tokens or --max-prompt-tokens")
stops = stop_token_ids(tokenizer, policy)
if args.gradient_checkpointing:
    policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
policy.train()
try:  # lean.py where its check proves it computes what the model's forward computes
    use_lean, line = lean.select(args.lean, policy, device)
except ValueError as e:
    p.error(str(e))
if master:
    print(line)
decoder = lean.LeanDecoder if use_lean else rollout.HFDecoder
logprobs = lean.token_logprobs if use_lean else rollout.token_logprobs
ref_lean = use_lean and ref is not None and lean.check(ref)[0]
ref_logprobs, ref_hidden = (lean.token_logprobs, lean.completion_hidden) if ref_lean else \
    (rollout.token_logprobs, rollout.completion_hidden)
if lora_ref and args.beta > 0:  # the reference pass: the policy with its adapters disabled (no second copy)
    ref, ref_logprobs, ref_hidden = policy, without_adapters(rollout.token_logprobs), \
        without_adapters(rollout.completion_hidden)
if args.fsdp:  # the log-prob pass calls the decoder and lm_head, not the root: gather the root first
    logprobs, ref_logprobs = parallel.root_unsharded(logprobs), parallel.root_unsharded(ref_logprobs)
    ref_hidden = parallel.root_unsharded(ref_hidden)
share = lean.shared_prompt_rows(args.group_size, args.micro_batch)  # rows of a micro-batch sharing a prompt


def lr_factor(update, warmup, total, schedule):
    """The learning rate of optimizer update `update` (from 0), as a fraction of --lr: linear warmup over
    `warmup` updates, then constant or a cosine from 1 to 0.1 at update total - 1."""
    warm = min(1.0, (update + 1) / (warmup + 1))
    if schedule == "constant":
        return warm
    progress = min(1.0, max(0, update - warmup) / max(1, total - 1 - warmup))
    return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


params = [q for q in policy.parameters() if q.requires_grad]
optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay,
                              fused=device.type in ("cpu", "cuda"))  # one kernel for all tensors
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.warmup_steps, args.steps * args.mu,
                                                                          args.lr_schedule))
scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 needs loss scaling
start_step = 0
if ckpt_path is not None:
    try:
        start_step = checkpoint.restore(ckpt_path, policy, optimizer, scheduler, scaler, ref, args, rank)
    except ValueError as e:
        p.error(str(e))
if master:  # resolved values here; the checkpoint keeps the flags as given, for --resume
    resolved = {**vars(args), "eps_high": eps_high, "ref_model": args.ref_model or args.model,
                "max_prompt_tokens": max_prompt, "lean": use_lean}
    print(json.dumps(resolved, indent=1))
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(resolved, f, indent=1)


# -----------------------------------------------------------------------------
# helpers
def sample_prompts(examples, generators):
    """The run's rollout of these examples: G completions each, one generator per prompt."""
    with parallel.gathered(policy):  # --fsdp: the whole model, so the decode loop issues no collective
        return sample(policy, tokenizer, [task.prompt(ex) for ex in examples], args.group_size, args.max_new_tokens,
                      stops, args.temperature, args.top_p, args.top_k, generators, dtype, decoder, max_prompt)


def score(r, examples, step):
    """(total reward per completion, {reward fn: values}); the examples' fields repeated G times."""
    fields = {k: [ex[k] for ex in examples for _ in range(args.group_size)] for k in examples[0]}
    try:
        return combine_rewards(reward_fns, weights, r.completions, num_tokens=r.completion_mask.sum(1).tolist(),
                               **fields)
    except RewardError as e:
        sys.exit(f"error: step {step + 1}: {e}")


@torch.no_grad()
def blend_into(dst, src, alpha=1.0):
    """dst <- alpha * src + (1 - alpha) * dst, parameter by parameter, across devices and dtypes."""
    for d, s in zip(dst.parameters(), src.parameters()):
        d.copy_(s if alpha == 1 else alpha * s.to(d) + (1 - alpha) * d)


def all_reduce(x, op="mean"):
    """Mean / max / min over ranks of a float tensor (identity without torchrun)."""
    if ddp:
        dist.all_reduce(x, {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        x = x / world if op == "mean" else x
    return x


def run_eval(step):
    with parallel.gathered(policy):  # --fsdp: every rank gathers the weights, rank 0 evaluates
        if master and test_set:
            summary, _ = evaluate(policy, tokenizer, task, test_set, args.max_new_tokens, progress=False,
                                  dtype=dtype, decoder=decoder)
            print(f"eval step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in summary.items()))
            log.write({"step": step, **{f"eval/{k}": v for k, v in summary.items()}})


# -----------------------------------------------------------------------------
# the loop
log = MetricsLog(args.out_dir, args.log_to, vars(args), start_step) if master else None
if start_step == 0 and args.eval_every:
    run_eval(0)
drift = DriftWatch()  # says "lower --lr" when the policy runs away from the reference or the sampler
bad_steps, save_failed = 0, None
for step in tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not master):
    t0 = time.time()
    # 1. rollout and rewards: G completions per prompt, groups contiguous (batch.collect)
    r, examples, rewards, keep, row = batch.collect(step, train_set, sample_prompts, score, args, rank * local_prompts,
                                                    local_prompts)
    rewards, keep = rewards.to(device), keep.to(device)
    lengths = r.completion_mask.sum(1)  # (N,)
    t1 = time.time()
    # 2. advantages (groups never span ranks; "batch" scale gathers the whole batch)
    all_rewards = rewards
    if ddp:
        everyone = [torch.empty_like(rewards) for _ in range(world)]
        dist.all_gather(everyone, rewards)
        all_rewards = torch.cat(everyone)  # (world*N,)
    adv, frac_zero = grpo.group_advantages(all_rewards, args.group_size, args.scale_rewards)
    adv = adv[rank * N:(rank + 1) * N]  # (N,) this rank's rows
    if args.supervision == "process":  # per-token advantages from the task's step rewards
        adv, row["reward/step"] = batch.process_advantages(task.step_rewards, tokenizer, r, examples, args.group_size)
        adv = adv.to(device)
    loss_mask = r.completion_mask * keep.long()[:, None]  # (N, C) --dynamic-sampling's filler rows get no loss
    if args.mask_truncated:
        loss_mask = loss_mask * (~r.truncated).long()[:, None]
    num_tokens = all_reduce(loss_mask.sum().float()).clamp(min=1)  # per-rank share of the global count (dapo)
    num_sequences = all_reduce(keep.sum().float())  # per-rank share of the rows that train
    C = r.completion_ids.size(1)
    # 3. reference (and old-policy) log-probs, no grad, micro-batched, in the training pass's numerics
    full_kl = args.kl_estimator == "full" and ref is not None
    ref_logp = torch.zeros(N, C, device=device) if ref is not None and not full_kl else None
    ref_h, old_logp = [], torch.zeros(N, C, device=device) if args.mu > 1 else None
    with torch.no_grad():
        for rows, ids, mask, c in micro_batches(r, args.micro_batch):
            with torch.autocast(ref_device.type, dtype=dtype, enabled=ref is not None and dtype != torch.float32):
                if full_kl:  # the reference's final hidden states: (rows, c, H) floats, its logits made chunk by chunk
                    ref_h.append(ref_hidden(ref, ids, mask, c, group_size=share))
                elif ref is not None:
                    ref_logp[rows, :c] = ref_logprobs(ref, ids, mask, c, args.temperature, out_device=device,
                                                      group_size=share)[0]
            if old_logp is not None:
                with autocast:
                    old_logp[rows, :c] = logprobs(policy, ids, mask, c, args.temperature, group_size=share)[0]
    t2 = time.time()
    # 4. mu optimizer steps on this batch, each accumulating gradients over micro-batches
    stats, n_micro, first_logp = {}, N // args.micro_batch, torch.zeros(N, C, device=device)
    skip = num_sequences.item() == 0  # --dynamic-sampling found no group with a reward spread: nothing to learn
    for it in range(0 if skip else args.mu):
        for j, (rows, ids, mask, c) in enumerate(micro_batches(r, args.micro_batch)):
            with autocast:
                # entropy is logged always; it only enters the loss with --entropy-coef / --top-entropy-quantile
                logp, entropy, kl = logprobs(policy, ids, mask, c, args.temperature, with_entropy=True,
                                             group_size=share, ref=(ref.get_output_embeddings(), ref_h[j]) if full_kl else None)
            m_mask, old = loss_mask[rows, :c], None if old_logp is None else old_logp[rows, :c]
            a = adv[rows, :c] if adv.dim() == 2 else adv[rows]  # process supervision: per token, (rows, c)
            # the sampler's numerics differ from the trainer's: reweight the policy term (truncated IS)
            w, w_stats = grpo.behaviour_weights(logp.detach() if old is None else old, r.sample_logp[rows, :c],
                                                m_mask, args.is_mode, args.is_cap)
            loss, metrics = grpo.grpo_loss(
                logp, old, ref_logp[rows, :c] if ref_logp is not None else None, a, m_mask, beta=args.beta,
                eps_low=args.eps, eps_high=eps_high, delta=args.delta, kl_estimator=args.kl_estimator, kl=kl,
                loss_type=args.loss_type, importance_level=args.importance_level, entropy=entropy,
                entropy_coef=args.entropy_coef, top_entropy_quantile=args.top_entropy_quantile, behaviour_weights=w,
                num_sequences=num_sequences, num_tokens=num_tokens, max_len=args.max_new_tokens)
            scaler.scale(loss).backward()
            metrics["loss"] = loss.detach()
            if it == 0:
                first_logp[rows, :c] = logp.detach()
                metrics["is_capped"] = w_stats["is_capped"]
            for k, v in metrics.items():
                stats[k] = stats.get(k, []) + [v.float()]
        if ddp and not args.fsdp:  # average gradients over ranks (each rank owns whole groups); FSDP did
            parallel.average_gradients(params, world)
        scaler.unscale_(optimizer)
        grad_norm = parallel.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
        # fp16 overflows are the scaler's business (it skips and lowers the scale); anything else non-finite is ours
        finite = all_reduce(torch.isfinite(sum(stats["loss"][-n_micro:])).float(), "min") > 0  # every rank agrees
        if finite and (scaler.is_enabled() or torch.isfinite(grad_norm)):
            scaler.step(optimizer)
            bad_steps = 0
        else:
            bad_steps += 1
            tqdm.write(f"warning: step {step + 1}: non-finite loss or gradient, update skipped ({bad_steps} in a row)")
            if bad_steps >= 5:
                sys.exit("error: 5 non-finite updates in a row; lower --lr or use --dtype bfloat16/float32")
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]  # the rate this update used; the scheduler now moves on
        scheduler.step()
    if skip:
        grad_norm, lr = torch.tensor(0.0), optimizer.param_groups[0]["lr"]
        tqdm.write(f"step {step + 1}: no group with a reward spread after {args.max_resample} extra rollouts: skipped")
    if ref is not None and args.ref_sync_every and (step + 1) % args.ref_sync_every == 0:
        blend_into(ref, policy, args.ref_sync_alpha)  # iterative GRPO (DeepSeekMath §4.2) / TR-DPO soft update
    t3 = time.time()
    # 5. metrics: per-rank values averaged over ranks (max / min for *_max / *_min), only rank 0 writes
    if not skip:  # |sampling log-prob - training log-prob| of the first pass, over the whole batch
        gap = grpo.behaviour_weights(first_logp, r.sample_logp, r.completion_mask, "none")[1]
        row.update({k: v for k, v in gap.items() if k.startswith("dlogp")})
    row.update(loss=sum(stats.pop("loss", [torch.tensor(0.0)])) / args.mu, reward=rewards.mean(),
               reward_std=all_rewards.std(), frac_zero_std=frac_zero, completion_len=lengths.float().mean(),
               completion_len_max=lengths.max().float(), truncated=r.truncated.float().mean(),
               prompt_cut=r.prompt_cut.float().mean(), grad_norm=grad_norm, skipped=torch.tensor(float(skip)))
    for k, v in stats.items():
        row[k] = max(v) if k.endswith("_max") else min(v) if k.endswith("_min") else sum(v) / len(v)
    op = lambda k: "max" if k.endswith("_max") else "min" if k.endswith("_min") else "mean"
    row = {k: all_reduce(torch.as_tensor(v, dtype=torch.float32, device=device).detach(), op(k)).item()
           for k, v in row.items()}
    gen_tokens = all_reduce(lengths.sum().float()).item() * world
    row.update(step=step + 1, lr=lr, t_generate=t1 - t0, t_reference=t2 - t1,
               t_train=t3 - t2, t_step=t3 - t0, gen_tok_s=gen_tokens / (t1 - t0))
    if master:
        log.write(row)
        tqdm.write(f"step {step + 1}: reward {row['reward']:.3f} loss {row['loss']:.4f} kl {row.get('kl', 0):.4f} "
                   f"len {row['completion_len']:.0f} gen {row['t_generate']:.1f}s ref {row['t_reference']:.1f}s "
                   f"train {row['t_train']:.1f}s")
        if args.log_completions and (step + 1) % args.log_completions == 0:
            tqdm.write(f"--- sample (reward {rewards[0]:.2f}, gold {examples[0]['answer']}):\n{r.completions[0]}\n---")
        for line in drift.update(row):
            tqdm.write(f"warning: step {step + 1}: {line}")
    if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
        run_eval(step + 1)
    if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
        save_failed = checkpoint.save_run(args.out_dir, step + 1, args, policy, optimizer, scheduler, scaler, ref,
                                          rank, world)
        if save_failed:
            tqdm.write(f"warning: step {step + 1}: {save_failed}")

# -----------------------------------------------------------------------------
# final eval, then the export (last: a LoRA policy is merged into its base in place)
if start_step < args.steps:
    run_eval(args.steps)
export_failed = None
if args.export != "none" and start_step < args.steps:
    state = parallel.full_state_dict(policy) if args.fsdp else None  # every rank: the shards, gathered on rank 0
    if master:
        hf = os.path.join(args.out_dir, "hf")
        export_failed = checkpoint.export_hf(policy, tokenizer, hf, dtype, args.export == "adapter", state)
        print(f"warning: {export_failed}" if export_failed else f"exported the policy ({args.export}) to {hf}")
if master:
    log.close()
if ddp:
    dist.destroy_process_group()
if save_failed or export_failed:
    sys.exit(f"error: {'the last checkpoint was not written: ' + save_failed if save_failed else export_failed}")
