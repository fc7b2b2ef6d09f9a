"""
GRPO (DeepSeekMath, arXiv 2402.03300 §4) on a Hugging Face causal LM. Reads top to bottom.

    python train.py --task gsm8k                          # defaults below
    python train.py --config configs/arith_smollm2_cpu.py  # a config file, then flags override it
    torchrun --nproc_per_node=2 train.py --config ...      # several GPUs (or CPU processes, gloo)

Each step: sample prompts -> G completions each -> rewards -> group advantages -> reference
log-probs -> mu passes of micro-batched loss, gradient accumulation, clip, optimizer step.
Where the defaults depart from the paper (grpo.py's docstring lists the variants):
- beta=0.04 k3 KL in the loss (the paper), but the loss is aggregated per the --loss-type flag;
- sampling runs in --dtype (bf16 by default; max_dlogp in the logs measures the mismatch): on the
  policy's weights cast per rollout (lean.py models), else on a --dtype copy synced after updates;
- multi-GPU averages gradients with one all-reduce per update instead of wrapping in DDP, because
  the log-prob pass calls the decoder and LM head separately (see rollout.token_logprobs).
"""

import argparse
import ast
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import grpo
import lean
from eval import evaluate
from models import DTYPES, ModelError, check_dtype, load_model, load_tokenizer, resolve_device, stop_token_ids
from rewards import combine_rewards
from rollout import micro_batches, sample, shared_prompt_rows, token_logprobs
from tasks import TASKS, DataError

# -----------------------------------------------------------------------------
# flags: defaults here, then --config file, then the command line
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
g.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="autocast dtype; master weights stay fp32")
g.add_argument("--ref-device", default=None, help="reference model device, e.g. cpu to offload; None = --device")
g.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
# --- rollout
g = p.add_argument_group("rollout")
g.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
g.add_argument("--prompts-per-step", type=int, default=2, help="prompts per step, over all ranks")
g.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
g.add_argument("--max-new-tokens", type=int, default=256)
g.add_argument("--temperature", type=float, default=1.0)
g.add_argument("--top-p", type=float, default=1.0)
g.add_argument("--top-k", type=int, default=0, help="0 = off")
# --- optimisation
g = p.add_argument_group("optimisation")
g.add_argument("--steps", type=int, default=100, help="generation batches")
g.add_argument("--mu", type=int, default=1, help="optimizer steps per generation batch (GRPO's mu)")
g.add_argument("--lr", type=float, default=1e-6)
g.add_argument("--warmup-steps", type=int, default=0, help="linear warmup, in optimizer steps")
g.add_argument("--weight-decay", type=float, default=0.0)
g.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm; 0 = off")
# --- the GRPO objective (grpo.py)
g = p.add_argument_group("the GRPO objective (grpo.py)")
g.add_argument("--beta", type=float, default=0.04, help="KL coefficient; 0 = no reference model loaded")
g.add_argument("--kl-estimator", default="k3", choices=grpo.KL_ESTIMATORS)
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
g.add_argument("--reward-weights", default=None, help="e.g. correct=1,format=0.1 (default: the task's)")
# --- run
g = p.add_argument_group("run")
g.add_argument("--seed", type=int, default=0)
g.add_argument("--out-dir", default="out/run")
g.add_argument("--eval-every", type=int, default=0, help="steps between evals on the test split; 0 = only at the end")
g.add_argument("--eval-n", type=int, default=200, help="test examples per eval (the first N); 0 = no eval")
g.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (and one at the end); 0 = none")
g.add_argument("--resume", default=None, help="out dir or ckpt.pt to continue from")
g.add_argument("--log-completions", type=int, default=10, help="print a sample completion every N steps; 0 = never")


def load_config(path):
    """A config file of `name = literal` lines -> dict; read as data (ast), never exec'd."""
    try:
        tree = ast.parse(open(path).read(), path)
    except (OSError, SyntaxError) as e:
        p.error(f"cannot read config {path}: {e}")
    cfg, actions = {}, {a.dest: a for a in p._actions}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            p.error(f"{path}:{node.lineno}: only `name = value` lines are allowed")
        name = node.targets[0].id
        if name not in actions:
            p.error(f"{path}:{node.lineno}: unknown key '{name}'; keys are the flags with _ for -, e.g. group_size")
        try:
            cfg[name] = ast.literal_eval(node.value)
        except ValueError:
            p.error(f"{path}:{node.lineno}: the value of '{name}' must be a literal")
        choices = actions[name].choices  # argparse checks choices on the command line only
        if choices is not None and cfg[name] not in choices:
            p.error(f"{path}:{node.lineno}: {name} = {cfg[name]!r}: choose from {sorted(choices)}")
    return cfg


pre = p.parse_known_args()[0]
for path in pre.config:  # e.g. a base config, then an ablation that changes two lines of it
    p.set_defaults(**load_config(path))
ckpt = None
if pre.resume:  # the checkpoint's config, then the command line on top
    path = os.path.join(pre.resume, "ckpt.pt") if os.path.isdir(pre.resume) else pre.resume
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        p.set_defaults(**{**ckpt["config"], "out_dir": os.path.dirname(os.path.abspath(path))})
    except Exception as e:
        p.error(f"--resume {pre.resume}: no readable checkpoint at {path} ({type(e).__name__})")
args = p.parse_args()  # saved as given: a resumed run re-resolves eps_high and ref_model from its own flags
eps_high = args.eps if args.eps_high is None else args.eps_high

# -----------------------------------------------------------------------------
# setup: distributed, device, checks that turn user mistakes into one-line errors
ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
master = rank == 0
try:
    device = resolve_device(args.device)
    if ddp and device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    ref_device = resolve_device(args.ref_device) if args.ref_device else device
    dtype = DTYPES[args.dtype]
    check_dtype(device, dtype)
    check_dtype(ref_device, dtype)
except ModelError as e:
    p.error(str(e))
if ddp:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
local_prompts = args.prompts_per_step // world
N = local_prompts * args.group_size  # completions per rank per step
if args.group_size < 2:
    p.error("--group-size must be >= 2: group advantages need at least two completions per prompt")
if args.prompts_per_step % world:
    p.error(f"--prompts-per-step {args.prompts_per_step} does not split over {world} ranks: use a multiple of {world}")
if N % args.micro_batch:
    p.error(f"--micro-batch {args.micro_batch} must divide the {N} completions per rank per step")
if eps_high < args.eps:
    p.error(f"--eps-high {eps_high} < --eps {args.eps}: clip-higher needs eps_high >= eps")
if not 0 < args.top_entropy_quantile <= 1:
    p.error("--top-entropy-quantile must be in (0, 1]")
if args.mu < 1 or args.steps < 1:
    p.error("--mu and --steps must be >= 1")
task = TASKS[args.task]
weights = dict(task.reward_weights)
for item in (args.reward_weights.split(",") if args.reward_weights else []):
    name, _, w = item.partition("=")
    if name not in weights or not w:
        p.error(f"--reward-weights: '{item}' is not name=weight with name in {sorted(weights)}")
    weights[name] = float(w)
try:
    os.makedirs(args.out_dir, exist_ok=True)
    probe = os.path.join(args.out_dir, f".write_test.{rank}")  # one per rank: they run this at the same time
    open(probe, "w").close()
    os.remove(probe)
except OSError as e:
    p.error(f"--out-dir {args.out_dir} is not writable ({e.strerror}); pass another directory")
if master:  # resolved values here; the checkpoint keeps the flags as given, for --resume
    resolved = {**vars(args), "eps_high": eps_high, "ref_model": args.ref_model or args.model}
    print(json.dumps(resolved, indent=1))
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(resolved, f, indent=1)
torch.manual_seed(args.seed + rank)
autocast = torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)
share = shared_prompt_rows(args.group_size, args.micro_batch)  # prefix reuse: rows sharing a prompt run it once

# -----------------------------------------------------------------------------
# models and data
try:
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, device, torch.float32)  # fp32 master weights
    # sampling reads every weight once per token, in --dtype: the lean decoder casts the policy's weights once
    # per rollout; other models sample from a --dtype copy, faster than autocast (bench_rollout.py)
    sampler = policy if dtype == torch.float32 or lean.supports(policy) else \
        load_model(args.model, device, dtype, trainable=False)
    ref = load_model(args.ref_model or args.model, ref_device, dtype, trainable=False) if args.beta > 0 else None
    train_set = task.load("train", data_dir=args.data_dir)
    test_set = task.load("test", data_dir=args.data_dir)[:args.eval_n] if master and args.eval_n else []
except (ModelError, DataError) as e:
    p.error(str(e))
stops = stop_token_ids(tokenizer, policy)
if args.gradient_checkpointing:
    policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
policy.train()
params = [q for q in policy.parameters() if q.requires_grad]
optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay,
                              fused=device.type in ("cpu", "cuda"))  # one kernel a tensor: 0.33 -> 0.09 s on CPU
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 needs loss scaling
generator = torch.Generator(device=device).manual_seed(args.seed + 1000 * rank)
start_step = 0
if ckpt is not None:
    policy.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    if ref is not None and ckpt.get("ref") is not None:
        ref.load_state_dict(ckpt["ref"])
    rng = ckpt["rng"][rank]
    torch.set_rng_state(rng["torch"]), random.setstate(rng["python"]), np.random.set_state(rng["numpy"])
    generator.set_state(rng["generator"])
    start_step = ckpt["step"]
    if sampler is not policy:
        sampler.load_state_dict(policy.state_dict())  # the sampling copy follows the resumed policy
    del ckpt


# -----------------------------------------------------------------------------
# helpers
def prompts_for_step(step):
    """This rank's examples at `step`: a fixed shuffle per epoch, so a resumed run sees the same ones."""
    per_epoch = len(train_set) // args.prompts_per_step
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed + epoch))
    start = k * args.prompts_per_step + rank * local_prompts
    return [train_set[i] for i in order[start:start + local_prompts].tolist()]


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


def save_checkpoint(step):
    """Everything needed to continue exactly; written to a temp file and renamed over the old one."""
    state = {"model": policy.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "scaler": scaler.state_dict(), "step": step, "config": vars(args),
             "ref": ref.state_dict() if ref is not None and args.ref_sync_every else None}
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
           "generator": generator.get_state()}
    gathered = [None] * world
    dist.all_gather_object(gathered, rng) if ddp else gathered.__setitem__(0, rng)
    if master:
        state["rng"] = gathered
        path = os.path.join(args.out_dir, "ckpt.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # atomic: a kill mid-save leaves the last good ckpt.pt


def run_eval(step, log):
    if master and test_set:
        summary, _ = evaluate(sampler, tokenizer, task, test_set, args.max_new_tokens, progress=False, dtype=dtype)
        print(f"eval step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in summary.items()))
        log.write(json.dumps({"step": step, **{f"eval/{k}": v for k, v in summary.items()}}) + "\n")


# -----------------------------------------------------------------------------
# the loop
metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
if master and start_step and os.path.exists(metrics_path):  # drop what was logged after the checkpoint
    kept = [line for line in open(metrics_path) if json.loads(line)["step"] <= start_step]
    open(metrics_path, "w").writelines(kept)
log = open(metrics_path, "a") if master else None
if start_step == 0 and args.eval_every:
    run_eval(0, log)
bad_steps = 0
for step in tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not master):
    t0 = time.time()
    # 1. rollout: G completions per prompt, groups contiguous
    examples = prompts_for_step(step)
    r = sample(sampler, tokenizer, [task.prompt(ex) for ex in examples], args.group_size, args.max_new_tokens,
               stops, args.temperature, args.top_p, args.top_k, generator, dtype)
    lengths = r.completion_mask.sum(1)  # (N,)
    t1 = time.time()
    # 2. rewards -> advantages (groups never span ranks; "batch" scale gathers the whole batch)
    fields = {k: [ex[k] for ex in examples for _ in range(args.group_size)] for k in examples[0]}
    total, per_fn = combine_rewards(task.reward_fns, weights, r.completions, num_tokens=lengths.tolist(), **fields)
    rewards = torch.tensor(total, dtype=torch.float32, device=device)  # (N,)
    all_rewards = rewards
    if ddp:
        everyone = [torch.empty_like(rewards) for _ in range(world)]
        dist.all_gather(everyone, rewards)
        all_rewards = torch.cat(everyone)  # (world*N,)
    adv, frac_zero = grpo.group_advantages(all_rewards, args.group_size, args.scale_rewards)
    adv = adv[rank * N:(rank + 1) * N]  # (N,) this rank's rows
    loss_mask = r.completion_mask * (~r.truncated).long()[:, None] if args.mask_truncated else r.completion_mask
    num_tokens = all_reduce(loss_mask.sum().float()).clamp(min=1)  # per-rank share of the global count (dapo)
    C = r.completion_ids.size(1)
    # 3. reference (and old-policy) log-probs, no grad, micro-batched; old ones only when mu > 1
    ref_logp = torch.zeros(N, C, device=device) if ref is not None else None
    old_logp = torch.zeros(N, C, device=device) if args.mu > 1 else None
    with torch.no_grad():
        for rows, ids, mask, c in micro_batches(r, args.micro_batch):
            if ref is not None:
                ref_logp[rows, :c] = token_logprobs(ref, ids, mask, c, args.temperature, out_device=device,
                                                    group_size=share)[0]
            if old_logp is not None:
                with autocast:
                    old_logp[rows, :c] = token_logprobs(policy, ids, mask, c, args.temperature, group_size=share)[0]
    t2 = time.time()
    # 4. mu optimizer steps on this batch, each accumulating gradients over micro-batches
    stats, n_micro = {}, N // args.micro_batch
    for it in range(args.mu):
        for rows, ids, mask, c in micro_batches(r, args.micro_batch):
            with autocast:
                # entropy is logged always; it only enters the loss with --entropy-coef / --top-entropy-quantile
                logp, entropy = token_logprobs(policy, ids, mask, c, args.temperature, with_entropy=True,
                                               group_size=share)
            m_mask = loss_mask[rows, :c]
            loss, metrics = grpo.grpo_loss(
                logp, None if old_logp is None else old_logp[rows, :c], None if ref is None else ref_logp[rows, :c],
                adv[rows], m_mask, beta=args.beta, eps_low=args.eps, eps_high=eps_high, delta=args.delta,
                kl_estimator=args.kl_estimator, loss_type=args.loss_type, importance_level=args.importance_level,
                entropy=entropy, entropy_coef=args.entropy_coef, top_entropy_quantile=args.top_entropy_quantile,
                num_sequences=N, num_tokens=num_tokens, max_len=args.max_new_tokens)
            scaler.scale(loss).backward()
            metrics["loss"] = loss.detach()
            if it == 0:  # how far the training pass is from the sampling distribution
                d = ((logp.detach().float() - r.sample_logp[rows, :c]).abs() * r.completion_mask[rows, :c]).max()
                metrics["max_dlogp"] = d
            for k, v in metrics.items():
                stats[k] = stats.get(k, []) + [v.float()]
        if ddp:  # average gradients over ranks (each rank owns whole groups)
            for h in [dist.all_reduce(q.grad, async_op=True) for q in params if q.grad is not None]:
                h.wait()
            for q in params:
                q.grad is not None and q.grad.div_(world)
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
        # fp16 overflows are the scaler's business (it skips and lowers the scale); anything else non-finite is ours
        if torch.isfinite(sum(stats["loss"][-n_micro:])) and (scaler.is_enabled() or torch.isfinite(grad_norm)):
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
    if sampler is not policy:
        blend_into(sampler, policy)  # keep the sampling copy equal to the policy
    if ref is not None and args.ref_sync_every and (step + 1) % args.ref_sync_every == 0:
        blend_into(ref, policy, args.ref_sync_alpha)  # iterative GRPO (DeepSeekMath §4.2) / TR-DPO soft update
    t3 = time.time()
    # 5. metrics: per-rank values averaged over ranks, only rank 0 writes
    row = {"loss": sum(stats.pop("loss")) / args.mu, "reward": all_rewards.mean(), "reward_std": all_rewards.std(),
           "frac_zero_std": frac_zero, "completion_len": lengths.float().mean(),
           "completion_len_max": lengths.max().float(), "truncated": r.truncated.float().mean(),
           "grad_norm": grad_norm, **{f"reward/{k}": torch.tensor(v).mean() for k, v in per_fn.items()}}
    for k, v in stats.items():
        row[k] = max(v) if k.endswith("_max") or k == "max_dlogp" else min(v) if k.endswith("_min") else sum(v) / len(v)
    op = lambda k: "max" if k.endswith("_max") or k == "max_dlogp" else "min" if k.endswith("_min") else "mean"
    row = {k: all_reduce(torch.as_tensor(v, dtype=torch.float32, device=device).detach(), op(k)).item()
           for k, v in row.items()}
    gen_tokens = all_reduce(lengths.sum().float()).item() * world
    row.update(step=step + 1, lr=lr, t_generate=t1 - t0, t_reference=t2 - t1,
               t_train=t3 - t2, t_step=t3 - t0, gen_tok_s=gen_tokens / (t1 - t0))
    if master:
        log.write(json.dumps(row) + "\n")
        log.flush()
        tqdm.write(f"step {step + 1}: reward {row['reward']:.3f} loss {row['loss']:.4f} kl {row.get('kl', 0):.4f} "
                   f"len {row['completion_len']:.0f} gen {row['t_generate']:.1f}s ref {row['t_reference']:.1f}s "
                   f"train {row['t_train']:.1f}s")
        if args.log_completions and (step + 1) % args.log_completions == 0:
            tqdm.write(f"--- sample (reward {total[0]:.2f}, gold {examples[0]['answer']}):\n{r.completions[0]}\n---")
    if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
        run_eval(step + 1, log)
    if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
        save_checkpoint(step + 1)

# -----------------------------------------------------------------------------
# final eval
if start_step < args.steps:
    run_eval(args.steps, log)
if master:
    log.close()
if ddp:
    dist.destroy_process_group()
