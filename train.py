"""
GRPO (DeepSeekMath, arXiv 2402.03300 §4) on a Hugging Face causal LM, top to bottom. A step: prompts -> G completions
each -> rewards -> group advantages -> reference log-probs -> mu optimizer steps over micro-batches. The README lists
where the defaults depart from the paper. `torchrun --nproc_per_node=N train.py ...` runs over N processes.
"""

import argparse, copy, dataclasses, importlib.util, math, os, sys, time  # noqa: E401
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

import grpo, rollout, run, tasks  # noqa: E401
from models import DTYPES, check_dtype, load_model, load_tokenizer, native, resolve_device, resolve_dtype
from rewards import REWARDS, RewardError, check_fields, combine_rewards, overlong_reward, parse_weights

# --- flags: defaults here, then --config files, then the command line (run.parse checks every value)
fmt = type("Help", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {})  # + defaults
p = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
p.add_argument("--config", action="append", default=[], help="a file of `name = value` lines, or name=value")
g = p.add_argument_group("task and model")
g.add_argument("--task", default="gsm8k", help="tasks.py, extra_tasks.py, rg:NAME (reasoning-gym; rg:A+B a mix)")
g.add_argument("--data-dir", default=None, help="local GSM8K dir (else $GSM8K_DIR, else download once)")
g.add_argument("--model", default="smollm2-135m", help="hub id, local HF dir, .gguf file or smollm2-135m")
g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:1 | mps")
g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="compute dtype; auto: bf16 where native")
g.add_argument("--ref-device", default=None, help="the reference model's device, e.g. cpu to offload it; --device")
g.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
g = p.add_argument_group("rollout and optimisation")
g.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
g.add_argument("--prompts-per-step", type=int, default=2, help="prompts per step, over all ranks")
g.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
g.add_argument("--max-new-tokens", type=int, default=256, help="completion budget (tools' replies included)")
g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
g.add_argument("--dynamic-sampling", action="store_true", help="DAPO: replace groups of equal rewards by new ones")
g.add_argument("--steps", type=int, default=100, help="generation batches")
g.add_argument("--mu", type=int, default=1, help="optimizer steps per generation batch (GRPO's mu)")
g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
g = p.add_argument_group("the GRPO objective (grpo.py)")
g.add_argument("--beta", type=float, default=0.04, help="KL coefficient; 0 = no reference model")
g.add_argument("--kl-estimator", default="k3_clamped", choices=[*grpo.KL_ESTIMATORS, "full"], help="full: exact")
g.add_argument("--loss-type", default="grpo", choices=grpo.LOSS_TYPES, help="the surrogate and its aggregation")
g.add_argument("--scale-rewards", default="group", choices=grpo.ADVANTAGES, help="none = Dr. GRPO")
g.add_argument("--eps", type=float, default=0.2, help="clip epsilon (low)")
g.add_argument("--eps-high", type=float, default=None, help="clip-higher (DAPO); None = --eps")
g.add_argument("--delta", type=float, default=None, help="cap on the ratio (INTELLECT-2 two-sided clip)")
g.add_argument("--importance-level", default="token", choices=grpo.IMPORTANCE_LEVELS, help="sequence = GSPO")
g.add_argument("--mask-truncated", action="store_true", help="no loss on completions cut at --max-new-tokens")
g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus")
g.add_argument("--top-entropy-quantile", type=float, default=1.0, help="train only the top-rho entropy tokens")
g.add_argument("--is-mode", default="token_truncate", choices=grpo.BEHAVIOUR_MODES, help="pi_train / pi_sample")
g.add_argument("--supervision", default="outcome", choices=("outcome", "process"), help="process: step rewards")
g.add_argument("--overlong-buffer", type=int, default=0, help="DAPO soft overlong punishment over the last N tokens")
g.add_argument("--reward-weights", default=None, help="e.g. correct=1,format=0.1,overlong=0.5 (default: the task's)")
g = p.add_argument_group("run")
g.add_argument("--seed", type=int, default=0, help="prompts, sampling, LoRA init")
g.add_argument("--out-dir", default="out/run", help="run.json, metrics.jsonl, ckpt.pt, hf/")
g.add_argument("--overwrite", action="store_true", help="replace the run in --out-dir")
g.add_argument("--resume", default=None, help="a run's --out-dir (or its ckpt.pt) to continue")
g.add_argument("--eval-every", type=int, default=0, help="steps between evals on the test split; 0 = at the end")
g.add_argument("--eval-n", type=int, default=200, help="test examples per eval (the first N); 0 = no eval")
g = p.add_argument_group("scale (scale.py)")
g.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (peft); 0 = full fine-tuning")
g.add_argument("--fsdp", action="store_true", help="under torchrun: shard weights, grads, AdamW states (FSDP2)")

LR_SCHEDULES = {  # lr_schedule: fn(t, the fraction done of the updates after the warmup) -> the factor on --lr
    "constant": lambda t: 1.0,
    "cosine": lambda t: 0.55 + 0.45 * math.cos(math.pi * t),  # from 1 down to 0.1 at the last update
}
CONSTANTS = {  # knobs few would sweep: (default, range or choices); set in a config file or as --config name=value
    "lr_schedule": ("constant", LR_SCHEDULES),
    "warmup_steps": (0, ">= 0"),  # a linear warmup to --lr
    "weight_decay": (0.0, ">= 0"),
    "grad_clip": (1.0, ">= 0"),  # grad_clip 0: off
    "max_resample": (4, ">= 0"),  # --dynamic-sampling's extra rollouts at most
    "ref_sync_every": (0, ">= 0"),  # every N steps the reference becomes the policy (§4.2); 0 = never
    "save_every": (50, ">= 0"),
    "log_completions": (10, ">= 0"),  # checkpoints (+ one at the end); samples shown
    "export": ("none", ("none", "model", "adapter")),  # OUT_DIR/hf at the end: a HF model (LoRA merged), adapters
    "log_to": ("none", ("none", "tensorboard", "wandb")),  # a tracker besides metrics.jsonl
    "task_options": ({}, None),  # the task's options: its load's and environment's keywords, an rg: dataset's config
    "micro_batch_tokens": (0, ">= 0"),  # a cap on a micro-batch's rows x their padded width too (0: rows alone)
}
RANGES = {
    "group_size": ">= 2",
    "prompts_per_step": ">= 1",
    "micro_batch": ">= 1",
    "max_new_tokens": ">= 1",
    "temperature": "> 0",
    "steps": ">= 1",
    "mu": ">= 1",
    "lr": "> 0",
    "eps": "[0, 1)",
    "delta": "> 1",
    "top_entropy_quantile": "(0, 1]",
    "seed": "[0, 9e18]",
}  # any other number: >= 0
# the fields of grpo.Objective and rollout.Sampler that are no flag are config keys too: a fork's option is one field
args, ckpt, given = run.parse(p, RANGES, CONSTANTS, knobs=(grpo.Objective, rollout.Sampler))  # given: what was set
run.exit_on_interrupt(partial(run.last_checkpoint, args.out_dir, args.steps))  # Ctrl-C / SIGTERM: one line

# --- setup: processes, the checks that need more than one flag, device and dtype, the out dir
ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
master = rank == 0
G = args.group_size
local_prompts = args.prompts_per_step // world
N = local_prompts * G  # completions per rank per step
try:  # the task, its options, the objective and the sampler: each a one-line error before anything loads
    task = tasks.get(args.task, args.task_options)
    obj = grpo.Objective(**{f.name: getattr(args, f.name) for f in dataclasses.fields(grpo.Objective)})
    sampler = rollout.Sampler(**{f.name: getattr(args, f.name) for f in dataclasses.fields(rollout.Sampler)})
except ValueError as e:
    p.error(str(e))
for bad, why in [  # one line each, before anything loads
    (args.prompts_per_step % world, f"--prompts-per-step must be a multiple of the {world} processes"),
    (
        N % args.micro_batch and not args.micro_batch_tokens,
        f"--micro-batch {args.micro_batch} must divide the {N} completions per rank per step",
    ),
    (
        args.overlong_buffer > args.max_new_tokens,
        f"--overlong-buffer {args.overlong_buffer} must be <= --max-new-tokens {args.max_new_tokens}",
    ),
    (
        args.supervision == "process" and (not task.step_rewards or task.env),
        f"--supervision process needs per-step rewards and no environment; task {args.task} does not fit",
    ),
    (args.fsdp and not ddp, "--fsdp shards over torchrun's processes: torchrun --nproc_per_node N train.py --fsdp"),
    (
        args.fsdp and (args.lora_rank or args.ref_sync_every or args.ref_device or args.dtype == "float16"),
        "--fsdp takes neither --lora-rank, ref_sync_every, --ref-device nor --dtype float16 (use bfloat16)",
    ),
    (
        args.lora_rank and (args.ref_sync_every or args.ref_device),
        "--lora-rank: the reference is the base (adapters off); it takes no ref_sync_every, no --ref-device",
    ),
    (args.export == "adapter" and not args.lora_rank, "export = 'adapter' needs --lora-rank"),
    (args.lora_rank and not importlib.util.find_spec("peft"), "--lora-rank needs peft: pip install peft"),
    (args.log_to != "none" and not importlib.util.find_spec(args.log_to), f"log_to: pip install {args.log_to}"),
]:
    if bad:
        p.error(why)
notes = []  # a value that was set but changes nothing in this combination: a note line each
for names, why in [
    ("kl_estimator ref_device ref_sync_every", args.beta == 0 and "--beta 0: no reference"),
    ("cispo_cap", obj.surrogate != "cispo" and "not --loss-type cispo"),
    ("sapo_temperature_pos sapo_temperature_neg", obj.surrogate != "sapo" and "not --loss-type sapo"),
    ("is_cap", obj.is_mode == "none" and "--is-mode none"),
    ("eval_every", args.eval_n == 0 and "--eval-n 0"),
    ("max_resample", not args.dynamic_sampling and "no --dynamic-sampling"),
]:
    notes += [f"note: {name} has no effect in this run ({why})" for name in sorted(given & set(names.split())) if why]
reward_fns = {**REWARDS, **task.reward_fns}  # any reward, for any task: --reward-weights name=w switches it on
if args.overlong_buffer:  # DAPO eq. 13 beside the task's rewards (weight 1 unless --reward-weights says)
    reward_fns["overlong"] = overlong_reward(args.max_new_tokens, args.overlong_buffer)
try:
    weights = {**task.reward_weights, "overlong": 1.0} if args.overlong_buffer else dict(task.reward_weights)
    weights.update(parse_weights(args.reward_weights, reward_fns))  # weight 0: computed and logged only
    reward_fns = {name: reward_fns[name] for name in weights}
    device = resolve_device(args.device, int(os.environ["LOCAL_RANK"]) if ddp else None)
    ref_device = resolve_device(args.ref_device) if args.ref_device else device
    dtype, note = resolve_dtype(args.dtype, device)
    check_dtype(device, dtype)
    tokenizer = load_tokenizer(args.model)  # the model, data and out dir are checked before anything is created
    train_set = task.load("train", data_dir=args.data_dir)
    test_set = task.load("test", data_dir=args.data_dir)[: args.eval_n] if master and args.eval_n else []
    env = task.env(tokenizer) if task.env else None  # an envs.EnvDriver: an environment for each row
    state = env.probe(train_set[0]) if env else {}  # a fresh environment's state: its keys are reward fields
    check_fields(reward_fns, {*train_set[0], *rollout.ROW_FIELDS, *state})  # what each fn asks for, the task gives
except ValueError as e:  # ModelError, DataError: what was named cannot be used
    p.error(str(e))
if len(train_set) < args.prompts_per_step:
    p.error(f"the train split has {len(train_set)} examples, fewer than --prompts-per-step {args.prompts_per_step}")
args.dtype = str(dtype).removeprefix("torch.")  # run.json records what ran: a resume keeps it
rdt = dtype if ref_device == device or native(ref_device, dtype) else torch.float32  # the reference's dtype
notes += [note, rdt != dtype and f"note: the reference on {ref_device} computes in fp32 (no native {dtype})"]
if master and (problem := run.claim(args.out_dir, args.resume, args.overwrite)):  # else locked until the end
    p.error(problem)
for line in filter(None, notes):
    if master:
        print(line)
if ddp:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dist.barrier()  # rank 0 has made the out dir
if args.fsdp or args.lora_rank or ddp:
    import scale
gathered = scale.gathered if args.fsdp else nullcontext  # --fsdp: sampling needs whole weights
torch.manual_seed(args.seed + rank)
autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

# --- models
try:
    home = torch.device("cpu") if args.fsdp else device  # --fsdp: each rank moves only its shards to device
    policy = load_model(args.model, home, torch.float32, matmul_dtype=dtype if args.lora_rank else None)  # fp32 master
    if args.lora_rank:  # the same adapters on every rank; the reference is the base, adapters off
        policy = scale.add_lora(policy, args.lora_rank, seed=args.seed)
    ref = None  # beta 0: no reference model
    if args.beta and args.lora_rank:
        ref = policy  # run with its adapters off
    elif args.beta and args.fsdp:
        ref = load_model(args.model, home, dtype, trainable=False, matmul_dtype=rdt)  # sharded below
    elif args.beta:  # matmul weights as autocast casts them
        ref = load_model(args.model, ref_device, torch.float32, trainable=False, matmul_dtype=rdt)
    if args.fsdp:  # each decoder layer a unit, the root the rest (scale.py)
        for m in [x for x in (policy, ref) if x is not None]:
            scale.shard(m, device, dtype)
    if args.gradient_checkpointing:
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    policy.train(args.gradient_checkpointing)  # eval mode, so no dropout (as TRL), except for HF's checkpointing
    # the log-prob passes run each prompt once through the KV cache where a probe finds that exact (or refuse an edit)
    why = rollout.sharing_problem(policy, dtype) or ref not in (None, policy) and rollout.sharing_problem(ref, rdt)
except ValueError as e:  # ModelError too
    p.error(str(e))
ref_off = policy.disable_adapter if args.lora_rank else nullcontext  # runs the LoRA policy as the reference
context = getattr(policy.config, "max_position_embeddings", None) or 10**9  # a longer prompt keeps its last tokens
if args.max_new_tokens >= context:
    p.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's {context} tokens")
loop = rollout.decode_dynamic  # on CUDA the decode step captured as a CUDA graph (decode.py), where its probe passes
if device.type == "cuda":
    loop = importlib.import_module("decode").on_cuda
sampling = dict(max_new_tokens=args.max_new_tokens, sampler=sampler, dtype=dtype, env=env, loop=loop)  # every step's
sampling.update(stop_ids=rollout.stop_token_ids(tokenizer, policy), max_prompt_tokens=context - args.max_new_tokens)
full_kl = args.kl_estimator == "full" and ref is not None
if full_kl and ref_device != device:  # the full KL's reference head runs where the policy's hidden states are
    ref.set_output_embeddings(copy.deepcopy(ref.get_output_embeddings()).to(device))  # (untied: a copy)
share = not why
params = [q for q in policy.parameters() if q.requires_grad]
fused = device.type in ("cpu", "cuda")  # one kernel for all tensors
optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay, fused=fused)


def lr_factor(u):  # update u's factor on --lr: a linear warmup, then lr_schedule over the updates after it
    warm = min(1, (u + 1) / (args.warmup_steps + 1))
    T = max(1, args.steps * args.mu - 1 - args.warmup_steps)  # updates after the warmup
    return warm * LR_SCHEDULES[args.lr_schedule](min(1, max(0, u - args.warmup_steps) / T))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 needs loss scaling
saved_ref = ref if args.ref_sync_every else None  # the reference moves: checkpoints keep it
held = dict(policy=policy, optimizer=optimizer, scheduler=scheduler, scaler=scaler, ref=saved_ref)  # checkpointed
start_step = run.restore(ckpt, args.out_dir, held, rank=rank) if ckpt else 0
del ckpt  # it maps the file it was read from: replacing that file frees its space once it goes
if master:  # run.json, the resolved flags: the marker that out_dir holds a run (--resume reads ckpt.pt's)
    print(f"prompt sharing off: {why}; the log-prob passes run whole rows" if why else "prompt sharing: on")
    run.write_json(os.path.join(args.out_dir, "run.json"), {**vars(args), "eps_high": obj.eps_high})
names, reward_w = list(weights), torch.tensor(list(weights.values()))  # a Rollout's reward columns (N, K), (K,)


# --- helpers
def collect(step):
    """This rank's batch -> (Rollout with its examples and rewards (N, K), keep (N,) bool, stats). A fixed shuffle per
    epoch, a generator per prompt slot: a resumed run, or one over more processes, samples the same. --dynamic-sampling
    (DAPO §3.2): max_resample rollouts of fresh prompts replace flat groups; a shortfall keeps some, keep=False."""
    epoch, k = divmod(step, len(train_set) // args.prompts_per_step)
    parts = []
    for attempt in range(1 + args.max_resample * args.dynamic_sampling):
        seed = args.seed + epoch if attempt == 0 else run.seed_of(args.seed, step, attempt)  # a resample: fresh prompts
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed))
        first = (0 if attempt else k * args.prompts_per_step) + rank * local_prompts
        slots = range(first, first + local_prompts)
        exs = [train_set[order[i]] for i in slots]
        gens = [torch.Generator().manual_seed(run.seed_of(args.seed, step, attempt, i)) for i in slots]
        with gathered(policy):
            r = rollout.sample(
                policy, tokenizer, [task.prompt(e) for e in exs], G, generator=gens, examples=exs, **sampling
            )
        try:  # the model's own words (completions) and each row's fields: its example's, its environment's, ...
            values = combine_rewards(reward_fns, weights, r.completions, **r.reward_fields())[1]
        except RewardError as e:
            sys.exit(f"error: step {step + 1}: {e}")
        r.rewards = torch.tensor([values[k] for k in names]).T  # (N, K)
        parts.append(r)
        rewards = torch.cat([x.rewards for x in parts]) @ reward_w  # (attempts * N,) in sampling order
        if grpo.informative_groups(rewards, G).sum() >= local_prompts:
            break
    r = rollout.concat(parts)
    stats = {f"reward/{k}": r.rewards[:, i].mean() for i, k in enumerate(names)}
    if not args.dynamic_sampling:
        return r, torch.ones(N, dtype=torch.bool), stats
    groups = grpo.pick_groups(rewards, G, local_prompts)  # (local_prompts,) of all attempts' groups
    rows = (groups[:, None] * G + torch.arange(G)).flatten()  # (N,)
    keep = grpo.informative_groups(rewards, G)[groups].repeat_interleave(G)  # (N,)
    stats.update(reward_sampled=rewards.mean(), kept_groups=keep.sum() / G, extra_rollouts=torch.tensor(len(parts) - 1))
    return r[rows], keep, stats


def update(losses, step):
    """Average over ranks, clip, step -> (grad norm, lr used); a non-finite loss or gradient skips it on all ranks."""
    global bad_steps
    if ddp and not args.fsdp:  # FSDP reduce-scatters by itself
        scale.average_gradients(params, world)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip or math.inf)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
    # fp16 overflows are the scaler's business (it skips and lowers its scale); anything else non-finite is ours
    finite = run.all_reduce(torch.isfinite(sum(losses)).float(), "min") > 0 and (scaler.is_enabled() or norm.isfinite())
    if finite:
        scaler.step(optimizer)
    else:
        tqdm.write(f"warning: step {step + 1}: non-finite loss or gradient, skipped")
    bad_steps = 0 if finite else bad_steps + 1
    if bad_steps >= 5:
        sys.exit("error: 5 non-finite updates in a row; lower --lr or use --dtype bfloat16/float32")
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    lr = optimizer.param_groups[0]["lr"]  # the rate this update used; the scheduler moves on
    scheduler.step()
    return norm, lr


def run_eval(step):
    with gathered(policy):  # --fsdp: every rank gathers the weights, rank 0 evaluates
        if master and test_set:
            summary, _ = tasks.evaluate(
                policy, tokenizer, task, test_set, max_new_tokens=args.max_new_tokens, dtype=dtype, env=env, loop=loop
            )
            tqdm.write(f"eval step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in summary.items()))
            log.write({"step": step, **{f"eval/{k}": v for k, v in summary.items()}})


# --- the loop
log = run.MetricsLog(args.out_dir, args.log_to, vars(args), start_step) if master else None
bad_steps = 0  # non-finite updates in a row
save_failed = export_failed = None  # reported at the end: the run goes on without them
if start_step == 0 and args.eval_every:
    run_eval(0)
for step in tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not master):
    t0 = time.time()
    r, keep, row = collect(step)  # 1. G completions per prompt, their examples and rewards (N, K)
    t1 = time.time()
    rewards, keep = (r.rewards @ reward_w).to(device), keep.to(device)  # (N,) each: the weighted sum, which rows train
    lengths = r.completion_mask.sum(1)  # (N,) the model's own tokens
    C = r.sample_logp.shape[1]
    # 2. advantages: groups never span ranks, but the "batch" scale needs every rank's rewards
    all_rewards = scale.all_gather(rewards) if ddp else rewards  # (world*N,)
    adv, frac_zero = grpo.group_advantages(all_rewards, G, args.scale_rewards)
    adv = adv[rank * N : (rank + 1) * N, None]  # (N, 1)
    if args.supervision == "process":  # per-token advantages (N, C) from the task's step rewards (§4.1.3)
        import extra_tasks  # the steps' token positions: imported only when asked

        ends, values, smask = extra_tasks.step_positions(task.step_rewards, tokenizer, r)
        adv = grpo.process_advantages(values, ends, smask, G, C).to(device)
        row["reward/step"] = values[smask].mean()
    loss_mask = r.completion_mask * keep[:, None] * (~r.truncated[:, None] if args.mask_truncated else 1)  # (N, C)
    num_tokens = run.all_reduce(loss_mask.sum().float()).clamp(min=1)  # per-rank shares of the batch's counts
    num_sequences = run.all_reduce(keep.sum().float())
    width = run.all_reduce(r.input_ids.new_tensor(r.input_ids.size(1)), "max")  # the widest rank's: as many calls
    fit = args.micro_batch_tokens // int(width) if args.micro_batch_tokens else N  # rows micro_batch_tokens holds
    micro = max(1, min(args.micro_batch, fit))  # rows a micro-batch
    ref_out = None  # 3. the reference's log-probs (N, C) on its device (full KL: its hidden states, per micro-batch)
    if ref is not None:
        with ref_off():
            ref_out = rollout.batch_logprobs(ref, r, micro, sampler=sampler, share=share, dtype=rdt, hidden=full_kl)
    old_logp = None  # the old policy's: the ratio's denominator when the batch is reused
    if args.mu > 1:
        old_logp = rollout.batch_logprobs(policy, r, micro, sampler=sampler, share=share, dtype=dtype)
    t2 = time.time()
    # 4. mu optimizer steps on this batch, each accumulating gradients over micro-batches
    stats = {}
    first_logp = torch.zeros(N, C, device=device)
    skip = num_sequences.item() == 0  # no group with a reward spread: nothing to learn
    iterations = 0 if skip else args.mu
    for it in range(iterations):
        with rollout.cast_once(device):  # each weight cast to bf16 once for the micro-batches
            for j, (rows, ids, mask, c, sizes) in enumerate(rollout.micro_batches(r, micro)):
                kl_ref = (ref.get_output_embeddings(), ref_out[j]) if full_kl else None  # the full KL's reference
                with autocast:  # entropy is always logged; it enters the loss only through --entropy-* flags
                    logp, entropy, kl = rollout.token_logprobs(
                        policy, ids, mask, c, sampler=sampler, with_entropy=True, ref=kl_ref, share=share, sizes=sizes
                    )
                old = None if old_logp is None else old_logp[rows, :c]
                ref_logp = None if ref is None or full_kl else ref_out[rows, :c]
                loss, metrics = grpo.grpo_loss(  # the policy term reweighted by pi_train / pi_sample (--is-mode)
                    logp,
                    old,
                    ref_logp,
                    adv[rows, :c].expand(-1, c),
                    loss_mask[rows, :c],
                    obj,
                    entropy=entropy,
                    kl=kl,
                    sample_logp=r.sample_logp[rows, :c],
                    num_sequences=num_sequences,
                    num_tokens=num_tokens,
                )
                scaler.scale(loss).backward()
                if it == 0:
                    first_logp[rows, :c] = logp.detach()
                for k, v in {**metrics, "loss": loss.detach()}.items():
                    stats.setdefault(k, []).append(v.float())
        grad_norm, lr = update(stats["loss"][-math.ceil(N / micro) :], step)
    if skip:
        grad_norm, lr = torch.tensor(0.0), optimizer.param_groups[0]["lr"]
        tqdm.write(f"step {step + 1}: skipped, no group with a reward spread after {args.max_resample} resamples")
    if ref is not None and args.ref_sync_every and (step + 1) % args.ref_sync_every == 0:
        ref.load_state_dict(policy.state_dict())  # iterative GRPO (DeepSeekMath §4.2): ref := policy
    t3 = time.time()
    # 5. metrics: per-rank values averaged over ranks (max / min for *_max / *_min); rank 0 writes
    if not skip:  # |sampling log-prob - training log-prob| of the first pass, over the whole batch
        row.update(grpo.behaviour_weights(first_logp, r.sample_logp, r.completion_mask, "none")[1])
    row.update(
        {k: run.reduce(k, v) for k, v in stats.items()},
        loss=sum(stats.get("loss", [0])) / args.mu,
        reward=rewards.mean(),
        reward_std=all_rewards.std(),
        frac_zero_std=frac_zero,
        completion_len=lengths.float().mean(),
        completion_len_max=lengths.max().float(),
        truncated=r.truncated.float().mean(),
        grad_norm=grad_norm,
        prompt_cut=r.prompt_cut.float().mean(),
        prompt_len=r.prompt_mask.sum(1).float().mean(),
        skipped=float(skip),
        gen_tok_s=lengths.sum().float() * world / (t1 - t0),
    )
    if env is not None:  # per row: its environment's state (env/tool_calls, env/attempts ...), the replies read
        row.update({f"env/{k}": torch.tensor([s[k] for s in r.env_state]).float().mean() for k in r.env_state[0]})
        row.update(
            env_tokens=r.env_mask.sum(1).float().mean(),
            turns=1 + (r.env_mask[:, 1:] & ~r.env_mask[:, :-1]).sum(1).float().mean(),  # 1 + its replies
        )
    values = [torch.as_tensor(v, dtype=torch.float32, device=device).detach() for v in row.values()]
    values = [run.all_reduce(v, run.reduce_op(k)) for k, v in zip(row, values)]  # over ranks, as each name says
    row = dict(zip(row, torch.stack(values).tolist()))  # one read of the device a step
    row.update(step=step + 1, lr=lr, t_generate=t1 - t0, t_reference=t2 - t1, t_train=t3 - t2, t_step=t3 - t0)
    if master:
        log.write(row)
        tqdm.write(
            f"step {step + 1}: reward {row['reward']:.3f} loss {row['loss']:.4f} kl {row.get('kl', 0):.4f} "
            f"len {row['completion_len']:.0f} gen {t1 - t0:.1f}s ref {t2 - t1:.1f}s train {t3 - t2:.1f}s"
        )
        if args.log_completions and (step + 1) % args.log_completions == 0:
            tqdm.write(f"--- reward {rewards[0]:.2f}, gold {r.examples[0]['answer']}:\n{r.completions[0]}\n---")
    if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
        run_eval(step + 1)
    if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
        save_failed = run.save_run(args.out_dir, step + 1, vars(args), held, rank=rank, world=world)
        if save_failed:
            tqdm.write(f"warning: step {step + 1}: {save_failed}")

# --- the end: a final eval, then the export when asked (else `eval.py --ckpt OUT_DIR --export DIR` does it any time)
run_eval(args.steps)
state = scale.full_state_dict(policy) if args.fsdp and args.export != "none" else None  # every rank gathers
if master and args.export != "none":  # last: a LoRA policy is merged into its base in place
    from eval import export_hf

    hf_dir = os.path.join(args.out_dir, "hf")
    export_failed = export_hf(policy, tokenizer, hf_dir, dtype, adapter=args.export == "adapter", state_dict=state)
    print(f"warning: {export_failed}" if export_failed else f"exported ({args.export}) to {args.out_dir}/hf")
if master:
    log.close()
error = f"the last checkpoint was not written: {save_failed}" if save_failed else export_failed
if ddp:  # every rank leaves together, and ends without the interpreter's teardown (scale.end says why)
    scale.end(error)
if error:
    sys.exit(f"error: {error}")
