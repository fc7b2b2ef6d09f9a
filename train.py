"""
GRPO (DeepSeekMath, arXiv 2402.03300 §4) on a Hugging Face causal LM, top to bottom. A step: prompts -> G completions
each -> rewards -> group advantages -> reference log-probs -> mu optimizer steps over micro-batches -> metrics. The
README lists where the defaults depart from the paper. `torchrun --nproc_per_node=N train.py ...` runs over N processes.
"""

import copy, importlib.util, math, os, sys, time  # noqa: E401
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import Annotated

import torch
import torch.distributed as dist
from tqdm import tqdm

import config, grpo, rollout, run, tasks  # noqa: E401
from config import FIXED, NEVER, Knob, flag
from models import DTYPES, check_dtype, load_model, load_tokenizer, native, resolve_device, resolve_dtype
from rewards import REWARDS, RewardError, check_fields, combine_rewards, parse_weights

LR_SCHEDULES = {  # lr_schedule: fn(t, the fraction done of the updates after the warmup) -> the factor on --lr
    "constant": lambda t: 1.0,
    "cosine": lambda t: 0.55 + 0.45 * math.cos(math.pi * t),  # from 1 down to 0.1 at the last update
}


# --- knobs: each declared once below (or in grpo.Objective, rollout.Sampler); config.py makes the flags and checks
class Knobs:  # a declaration, never made: config.parser reads its lines
    """The task, the model, the rollout, the updates and the run (train.py). A line a knob: Annotated[type, Knob(range
    or choices, help, resume=what --resume does with it)] = default; flag(...): a Knob that is a flag."""

    task: Annotated[str, flag(None, "in tasks.py, extra_tasks.py; jsonl; rg:NAME (rg:A+B)", resume=FIXED)] = "gsm8k"
    data_dir: Annotated[str | None, flag(None, "GSM8K's dir; jsonl's .jsonl or dir", resume=FIXED, path=True)] = None
    model: Annotated[str, flag(None, "hub id, HF dir, .gguf file, alias", resume=FIXED, path="local")] = "smollm2-135m"
    device: Annotated[str, flag(None, "auto | cpu | cuda | cuda:1 | mps")] = "auto"
    dtype: Annotated[str, flag(("auto", *DTYPES), "compute dtype; auto: bf16 where native")] = "auto"
    ref_device: Annotated[str | None, flag(None, "the reference model's device, e.g. cpu to offload it")] = None
    gradient_checkpointing: Annotated[bool, flag(None, "recompute activations in backward")] = False
    group_size: Annotated[int, flag(">= 2", "G: completions per prompt")] = 8
    prompts_per_step: Annotated[int, flag(">= 1", "prompts per step, over all ranks", resume=FIXED)] = 2
    micro_batch: Annotated[int, flag(">= 1", "completions per forward/backward")] = 8
    micro_batch_tokens: Annotated[int, Knob(">= 0", "a cap on a micro-batch's rows x padded width (0: rows alone)")] = 0
    max_new_tokens: Annotated[int, flag(">= 1", "completion budget (tools' replies included)")] = 256
    dynamic_sampling: Annotated[bool, flag(None, "DAPO: replace groups of equal rewards by new ones")] = False
    max_resample: Annotated[int, Knob(">= 0", "--dynamic-sampling's extra rollouts at most")] = 4
    steps: Annotated[int, flag(">= 1", "generation batches")] = 100
    mu: Annotated[int, flag(">= 1", "optimizer steps per generation batch (GRPO's mu)")] = 1
    steps_per_generation: Annotated[int, Knob(">= 1", "a generation batch's disjoint parts, an update each")] = 1
    lr: Annotated[float, flag("> 0", "AdamW learning rate")] = 1e-6
    lr_schedule: Annotated[str, Knob(LR_SCHEDULES, "the factor on --lr after the warmup")] = "constant"
    warmup_steps: Annotated[int, Knob(">= 0", "updates of a linear warmup to --lr")] = 0
    weight_decay: Annotated[float, Knob(">= 0", "AdamW's")] = 0.0
    grad_clip: Annotated[float, Knob(">= 0", "the gradient norm's cap; 0: off")] = 1.0
    scale_rewards: Annotated[str, flag(grpo.ADVANTAGES, "none = Dr. GRPO")] = "group"
    multi_objective_aggregation: Annotated[str, Knob(grpo.REWARD_AGGREGATIONS, "GDPO")] = "sum_then_normalize"
    mask_truncated: Annotated[bool, flag(None, "no loss on completions cut at --max-new-tokens")] = False
    supervision: Annotated[str, flag(("outcome", "process"), "process: step rewards")] = "outcome"
    overlong_buffer: Annotated[int, flag(">= 0", "DAPO's soft overlong punishment over the last N tokens")] = 0
    reward_weights: Annotated[str | None, flag(None, "e.g. correct=1,format=0.1 (default: the task's)")] = None
    ref_sync_every: Annotated[int, Knob(">= 0", "every N steps: reference := policy (§4.2)", resume=FIXED)] = 0
    task_options: Annotated[dict, Knob(None, "the task's options (tasks.py declares them)", resume=FIXED)] = {}
    seed: Annotated[int, flag("[0, 9e18]", "prompts, sampling, LoRA init", resume=FIXED)] = 0
    out_dir: Annotated[str, flag(None, "run.json, metrics.jsonl, ckpt.pt, hf/", resume=FIXED, path=True)] = "out/run"
    overwrite: Annotated[bool, flag(None, "replace the run in --out-dir", resume=NEVER)] = False
    resume: Annotated[str | None, flag(None, "a run's --out-dir or ckpt.pt", resume=NEVER, path=True)] = None
    eval_every: Annotated[int, flag(">= 0", "steps between evals on the test split; 0 = at the end")] = 0
    eval_n: Annotated[int, flag(">= 0", "test examples per eval (the first N); 0 = no eval")] = 200
    save_every: Annotated[int, Knob(">= 0", "steps between checkpoints (and one at the end); 0: none")] = 50
    log_completions: Annotated[int, Knob(">= 0", "steps between the samples shown; 0: none")] = 10
    export: Annotated[str, Knob(("none", "model", "adapter"), "OUT_DIR/hf at the end: a model, adapters")] = "none"
    log_to: Annotated[str, Knob(("none", "tensorboard", "wandb"), "a tracker besides metrics.jsonl")] = "none"
    lora_rank: Annotated[int, flag(">= 0", "LoRA adapters of this rank (peft); 0 = full fine-tuning", resume=FIXED)] = 0
    fsdp: Annotated[bool, flag(None, "under torchrun: shard weights, grads, AdamW states", resume=FIXED)] = False


p = config.parser(__doc__, Knobs, grpo.Objective, rollout.Sampler)
args, ckpt, given = config.parse(p, run.load_checkpoint)  # given: the knobs set to other than their default
run.exit_on_interrupt(partial(run.last_checkpoint, args.out_dir, args.steps))  # Ctrl-C / SIGTERM: one line

# --- setup: processes, the checks that need more than one knob, device and dtype, the out dir
ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
master = rank == 0
G = args.group_size
local_prompts = args.prompts_per_step // world
N = local_prompts * G  # completions per rank per step
try:  # the task with its options, the objective and the sampler: each a one-line error before anything loads
    tasks_of = tasks if args.task in tasks.TASKS else importlib.import_module("extra_tasks")  # the others: imported
    task = tasks_of.get(args.task, args.task_options)  # only when one is named
    obj = grpo.Objective(
        **{k: getattr(args, k) for k in config.declared(grpo.Objective)}, max_new_tokens=args.max_new_tokens
    )
    sampler = rollout.Sampler(**{k: getattr(args, k) for k in config.declared(rollout.Sampler)})
except ValueError as e:
    p.error(str(e))
for bad, why in [  # one line each, before anything loads
    (args.prompts_per_step % world, f"--prompts-per-step must be a multiple of the {world} processes"),
    (
        N % (args.steps_per_generation * (1 if args.micro_batch_tokens else args.micro_batch)),
        f"steps_per_generation x --micro-batch {args.micro_batch} must divide the {N} completions per rank per step",
    ),
    (obj.kl_estimator == "full" and sampler.truncates, "--kl-estimator full sums over V: no top_k, top_p, min_p"),
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
    ("is_cap is_cap_min", obj.is_mode == "none" and "--is-mode none"),
    ("vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg", obj.surrogate != "vespo" and "not --loss-type vespo"),
    ("entropy_target entropy_coef_delta entropy_coef_min entropy_coef_max", not obj.use_adaptive_entropy and "off"),
    ("scale_rewards", args.multi_objective_aggregation == "normalize_then_sum" and "GDPO normalises its own way"),
    ("multi_objective_aggregation", args.supervision == "process" and "--supervision process: the steps' rewards"),
    ("eval_every", args.eval_n == 0 and "--eval-n 0"),
    ("max_resample", not args.dynamic_sampling and "no --dynamic-sampling"),
]:
    notes += [f"note: {name} has no effect in this run ({why})" for name in sorted(given & set(names.split())) if why]
reward_fns = {**REWARDS, **task.reward_fns}  # any reward, for any task: --reward-weights name=w switches it on
if task.env:  # and, for a task with an environment, the tool calls' (envs.REWARDS)
    reward_fns = {**importlib.import_module("envs").REWARDS, **reward_fns}
if args.overlong_buffer:  # DAPO eq. 13 beside the task's rewards (weight 1 unless --reward-weights says)
    overlong_reward = importlib.import_module("variants").overlong_reward
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
except ValueError as e:  # ModelError, DataError, RewardError: what was named cannot be used
    p.error(str(e))
if len(train_set) < args.prompts_per_step:
    p.error(f"the train split has {len(train_set)} examples, fewer than --prompts-per-step {args.prompts_per_step}")
if not any(weights.values()):
    notes.append("note: every reward weight is 0: every advantage is 0 and nothing trains (--reward-weights)")
args.dtype = str(dtype).removeprefix("torch.")  # run.json records what ran: a resume keeps it
ref_dtype = dtype if ref_device == device or native(ref_device, dtype) else torch.float32
notes += [note, ref_dtype != dtype and f"note: the reference on {ref_device} computes in fp32 (no native {dtype})"]
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
        ref = load_model(args.model, home, dtype, trainable=False, matmul_dtype=ref_dtype)  # sharded below
    elif args.beta:  # matmul weights as autocast casts them
        ref = load_model(args.model, ref_device, torch.float32, trainable=False, matmul_dtype=ref_dtype)
    if args.fsdp:  # each decoder layer a unit, the root the rest (scale.py)
        for m in [x for x in (policy, ref) if x is not None]:
            scale.shard(m, device, dtype)
    if args.gradient_checkpointing:
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    policy.train(args.gradient_checkpointing)  # eval mode, so no dropout (as TRL), except for HF's checkpointing
    # the log-prob passes run each prompt once through the KV cache where a probe finds that exact (or refuse an edit)
    no_sharing = rollout.sharing_problem(policy, dtype)
    no_sharing = no_sharing or ref not in (None, policy) and rollout.sharing_problem(ref, ref_dtype)
except ValueError as e:  # ModelError too
    p.error(str(e))
as_reference = policy.disable_adapter if args.lora_rank else nullcontext  # runs the LoRA policy as the reference
context = getattr(policy.config, "max_position_embeddings", None) or 10**9  # a longer prompt keeps its last tokens
if args.max_new_tokens >= context:
    p.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's {context} tokens")
loop = rollout.decode_dynamic  # on CUDA the decode step captured as a CUDA graph (decode.py), where its probe passes
if device.type == "cuda":
    loop = importlib.import_module("decode").on_cuda
sampling = dict(max_new_tokens=args.max_new_tokens, sampler=sampler, dtype=dtype, env=env, loop=loop)  # every step's
sampling.update(stop_ids=rollout.stop_token_ids(tokenizer, policy), max_prompt_tokens=context - args.max_new_tokens)
exact_kl = args.kl_estimator == "full" and ref is not None
if exact_kl and ref_device != device:  # the exact KL's reference head runs where the policy's hidden states are
    ref.set_output_embeddings(copy.deepcopy(ref.get_output_embeddings()).to(device))  # (untied: a copy)

# --- the optimizer; a resume's state, then its --lr and weight_decay (the checkpoint's are the old run's)
params = [q for q in policy.parameters() if q.requires_grad]
fused = device.type in ("cpu", "cuda")  # one kernel for all tensors
optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay, fused=fused)


def lr_factor(u, *, warmup, updates, schedule):
    """Update u's factor on --lr: a linear warmup over `warmup` updates, then `schedule` over the rest of `updates`."""
    rest = max(1, updates - 1 - warmup)
    return min(1, (u + 1) / (warmup + 1)) * schedule(min(1, max(0, u - warmup) / rest))


updates = args.steps * args.mu * args.steps_per_generation  # optimizer steps in the run
factor = partial(lr_factor, warmup=args.warmup_steps, updates=updates, schedule=LR_SCHEDULES[args.lr_schedule])
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 needs loss scaling
synced_ref = ref if args.ref_sync_every else None  # the reference moves: checkpoints keep it
checkpointed = dict(policy=policy, optimizer=optimizer, scheduler=scheduler, scaler=scaler, ref=synced_ref)
if obj.use_adaptive_entropy:  # its coef, updated each optimizer step, kept by checkpoints
    checkpointed["entropy"] = importlib.import_module("variants").EntropyControl.of(obj)
start_step = run.restore(ckpt, args.out_dir, checkpointed, rank=rank) if ckpt else 0
del ckpt  # it maps the file it was read from: replacing that file frees its space once it goes
scheduler.base_lrs = [args.lr for _ in optimizer.param_groups]
for group in optimizer.param_groups:
    group.update(lr=args.lr * factor(scheduler.last_epoch), weight_decay=args.weight_decay)
if master:  # run.json, the resolved values: the marker that out_dir holds a run (--resume reads ckpt.pt's)
    print(
        f"prompt sharing off: {no_sharing}; the log-prob passes run whole rows" if no_sharing else "prompt sharing: on"
    )
    run.write_json(os.path.join(args.out_dir, "run.json"), {**vars(args), "eps_high": obj.eps_high})
passes = dict(sampler=sampler, share=not no_sharing)  # how every log-prob pass scores a token


# --- the step's phases, in the loop's order; each takes what it reads besides the run's settings above
def collect(step, policy, draw, *, reward_fns, weights, max_resample):
    """1. This rank's batch, draw(step, attempt) -> (examples, generators) -> (its Rollout with the rewards (N, K) and
    their weighted sum (N,), keep (N,) bool: the rows that train, metrics). --dynamic-sampling (DAPO §3.2; max_resample
    None: off): fresh prompts' rollouts replace flat groups; a shortfall keeps some, keep=False. A reward's or an
    environment's error ends the run in one line."""
    parts, informative = [], []
    for attempt in range(1 + (max_resample or 0)):
        examples, generators = draw(step, attempt)
        try:  # the model's own words (completions) and each row's fields: its example's, its environment's, ...
            with gathered(policy):  # --fsdp: whole weights to sample
                r = rollout.sample(
                    policy,
                    tokenizer,
                    [task.prompt(e) for e in examples],
                    G,
                    generator=generators,
                    examples=examples,
                    **sampling,
                )
            total, values = combine_rewards(reward_fns, weights, r.completions, **r.reward_fields())
        except RewardError as e:
            sys.exit(f"error: step {step + 1}: {e}")
        r.rewards, r.reward = torch.tensor([values[k] for k in weights]).T, torch.tensor(total)  # (N, K), (N,)
        parts.append(r)
        informative.append(grpo.informative_groups(r.reward, G))  # (prompts,)
        if torch.cat(informative).sum() >= len(examples):
            break
    r, informative = rollout.concat(parts), torch.cat(informative)  # every attempt's rows, in sampling order
    metrics = {f"reward/{k}": r.rewards[:, i].mean() for i, k in enumerate(weights)}
    if max_resample is None:
        return r, torch.ones(len(r.reward), dtype=torch.bool), metrics
    rows, keep = importlib.import_module("variants").pick_rows(informative, len(examples), G)  # (N,) each
    metrics.update(reward_sampled=r.reward.mean(), kept_groups=keep.sum() / G, extra_rollouts=len(parts) - 1.0)
    return r[rows], keep, metrics


def advantages(r, how, aggregation):
    """2. Group advantages of this rank's rewards (r.rewards (N, K), r.reward (N,)) by REWARD_AGGREGATIONS[aggregation]
    -> (its (N, 1), every rank's rewards, the flat share); "batch" and GDPO's last step read every rank's rewards."""
    every, each = (scale.all_gather(x) if ddp else x for x in (r.reward.to(device), r.rewards.to(device)))
    w = torch.tensor(list(weights.values()), device=device)  # (K,) in r.rewards' column order
    adv, frac_zero = grpo.REWARD_AGGREGATIONS[aggregation](each, every, w, G, how)
    return adv[rank * N : (rank + 1) * N, None], every, frac_zero


def no_grad_passes(r, micro, *, policy, ref, updates):
    """3. -> (the reference's log-probs (N, C), or for the exact KL its final hidden states (rows, c, H) a micro-batch
    (the other None; both None without a reference), the policy's own before this batch's updates when updates > 1)."""
    ref_logp = ref_hidden = old_logp = None
    with as_reference():
        if ref is not None and exact_kl:
            ref_hidden = rollout.batch_logprobs(ref, r, micro, dtype=ref_dtype, hidden=True, **passes)
        elif ref is not None:
            ref_logp = rollout.batch_logprobs(ref, r, micro, dtype=ref_dtype, **passes)
    if updates > 1:
        old_logp = rollout.batch_logprobs(policy, r, micro, dtype=dtype, **passes)
    return ref_logp, ref_hidden, old_logp


def accumulate(r, batches, js, policy, obj, *, adv, loss_mask, ref_logp, ref_hidden, old_logp, counts, first_logp=None):
    """4. One pass over batches[j] for j in js (an update's): r's (the step's Rollout) MicroBatches, gradients summed
    -> {metric: [a value a micro-batch]}. (N, C) each: loss_mask, the reference's log-probs (None: none, or the exact
    KL's hidden states a micro-batch), the policy's before this batch's updates (or None); adv (N, 1) or (N, C);
    counts: the update's rows and tokens that train, over ranks; first_logp (N, C), given: takes the log-probs."""
    stats, ref_head = {}, ref.get_output_embeddings() if exact_kl else None
    with rollout.cast_once(device):  # each weight cast to bf16 once for the micro-batches
        for j in js:
            rows, ids, mask, c, sizes, kept = batches[j]
            kl_ref = rollout.RefStates(ref_head, ref_hidden[j]) if exact_kl else None
            with autocast:  # entropy is always logged; it enters the loss only through the entropy knobs
                logp, entropy, kl = rollout.token_logprobs(
                    policy, ids, mask, c, with_entropy=True, ref=kl_ref, sizes=sizes, kept=kept, **passes
                )
            loss, metrics = grpo.grpo_loss(  # the policy term reweighted by pi_train / pi_sample (--is-mode)
                logp,
                old_logp=None if old_logp is None else old_logp[rows, :c],
                ref_logp=None if ref_logp is None else ref_logp[rows, :c],
                advantages=adv[rows, :c].expand(-1, c),
                mask=loss_mask[rows, :c],
                obj=obj,
                entropy=entropy,
                kl=kl,
                sample_logp=r.sample_logp[rows, :c],
                num_sequences=counts[0],
                num_tokens=counts[1],
            )
            scaler.scale(loss).backward()
            if first_logp is not None:
                first_logp[rows, :c] = logp.detach()
            for k, v in {**metrics, "loss": loss.detach()}.items():
                stats.setdefault(k, []).append(v.float())
    return stats


def update(losses, step, bad_steps):
    """Average over ranks, clip, step -> (grad norm, lr used, non-finite updates in a row); a non-finite loss or
    gradient skips it on all ranks."""
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
    return norm, lr, bad_steps


def run_eval(step):
    with gathered(policy):  # --fsdp: every rank gathers the weights, rank 0 evaluates (eval.py, imported then)
        if master and test_set:
            at = dict(max_new_tokens=args.max_new_tokens, dtype=dtype, env=env, loop=loop)
            importlib.import_module("eval").log_eval(policy, tokenizer, task, test_set, step, log, **at)


# --- the loop
slots = range(rank * local_prompts, (rank + 1) * local_prompts)
draw = partial(run.draw_prompts, train_set, seed=args.seed, per_step=args.prompts_per_step, slots=slots)
max_resample = args.max_resample if args.dynamic_sampling else None
log = run.MetricsLog(args.out_dir, args.log_to, vars(args), start_step) if master else None
bad_steps = 0  # non-finite updates in a row
save_failed = export_failed = None  # reported at the end: the run goes on without them
if start_step == 0 and args.eval_every:
    run_eval(0)
for step in tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not master):
    t0 = time.time()
    # 1. G completions per prompt, their rewards (N, K) and weighted sum (N,)
    r, keep, metrics = collect(step, policy, draw, reward_fns=reward_fns, weights=weights, max_resample=max_resample)
    t1 = time.time()
    adv, every_reward, frac_zero = advantages(r, args.scale_rewards, args.multi_objective_aggregation)  # 2. (N, 1)
    if args.supervision == "process":  # per-token advantages (N, C) from the task's step rewards (§4.1.3)
        ends, values, smask = importlib.import_module("extra_tasks").step_positions(task.step_rewards, tokenizer, r)
        adv = importlib.import_module("variants").process_advantages(values, ends, smask, G, r.sample_logp.size(1))
        adv = adv.to(device)  # on the step rewards' device (the host)
        metrics["reward/step"] = values[smask].mean()
    keep = keep.to(device)
    loss_mask = r.completion_mask * keep[:, None] * (~r.truncated[:, None] if args.mask_truncated else 1)  # (N, C)
    width = run.all_reduce(r.input_ids.new_tensor(r.input_ids.size(1)), "max")  # the widest rank's: as many calls
    fit = max(1, args.micro_batch_tokens // int(width)) if args.micro_batch_tokens else N  # rows that cap holds
    k = args.steps_per_generation  # the batch's parts, an optimizer step each
    micro = max(d for d in range(1, min(args.micro_batch, fit) + 1) if k == 1 or N // k % d == 0)  # rows a micro-batch
    ref_logp, ref_hidden, old_logp = no_grad_passes(r, micro, policy=policy, ref=ref, updates=args.mu * k)  # 3.
    t2 = time.time()
    # 4. mu passes over this batch, an optimizer step on each of its k parts, gradients accumulated by micro-batch
    skip = run.all_reduce(keep.sum().float()).item() == 0  # no group with a reward spread: nothing to learn
    # the sampler gap's metric: the policy's log-probs before this batch's updates (without old_logp, the pass fills it)
    first_logp = old_logp if old_logp is not None or skip else torch.zeros(r.sample_logp.shape, device=device)
    per_update = []
    inputs = dict(adv=adv, loss_mask=loss_mask, ref_logp=ref_logp, ref_hidden=ref_hidden, old_logp=old_logp)
    batches = list(rollout.micro_batches(r, micro))  # once a step: each update takes its part
    for part in list(range(k)) * (0 if skip else args.mu):  # mu passes, k parts each
        rows = slice(part * N // k, (part + 1) * N // k)
        counts = [run.all_reduce(x[rows].sum().float()).clamp(min=1) for x in (keep, loss_mask)]  # over ranks
        step_obj = replace(obj, entropy_coef=checkpointed["entropy"].applied()) if obj.use_adaptive_entropy else obj
        js = range(part * N // k // micro, -(-(part + 1) * N // k // micro))  # the part's whole micro-batches
        first = first_logp if old_logp is None else None
        out = accumulate(r, batches, js, policy, step_obj, **inputs, counts=counts, first_logp=first)
        grad_norm, lr, bad_steps = update(out["loss"], step, bad_steps)
        row = {key: run.reduce(key, v) for key, v in out.items()}
        per_update.append({**row, "loss": sum(out["loss"]), "grad_norm": grad_norm, "lr": lr})
        if obj.use_adaptive_entropy:  # the update's mean entropy over ranks
            checkpointed["entropy"].update(run.all_reduce(torch.stack(out["entropy"]).mean()).item())
    if skip:
        lr = optimizer.param_groups[0]["lr"]
        tqdm.write(f"step {step + 1}: skipped, no group with a reward spread after {args.max_resample} resamples")
    if ref is not None and args.ref_sync_every and (step + 1) % args.ref_sync_every == 0:
        ref.load_state_dict(policy.state_dict())  # iterative GRPO (DeepSeekMath §4.2): ref := policy
    t3 = time.time()
    # 5. metrics: one read of the device a step; rank 0 writes them
    metrics.update(skipped=float(skip), gen_tok_s=r.completion_mask.sum() * world / (t1 - t0))
    if obj.use_adaptive_entropy:
        metrics.update(entropy_coef=checkpointed["entropy"].coef)
    at = dict(first_logp=first_logp, with_env=env is not None)
    metrics = run.step_metrics(r, every_reward, frac_zero, metrics, per_update, **at)
    metrics.update(step=step + 1, lr=lr, t_generate=t1 - t0, t_reference=t2 - t1, t_train=t3 - t2, t_step=t3 - t0)
    if master:
        log.write(metrics)
        tqdm.write(
            f"step {step + 1}: reward {metrics['reward']:.3f} loss {metrics['loss']:.4f} kl {metrics.get('kl', 0):.4f} "
            f"len {metrics['completion_len']:.0f} gen {t1 - t0:.1f}s ref {t2 - t1:.1f}s train {t3 - t2:.1f}s"
        )
        if args.log_completions and (step + 1) % args.log_completions == 0:
            tqdm.write(f"--- reward {r.reward[0]:.2f}, gold {r.examples[0]['answer']}:\n{r.completions[0]}\n---")
    if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
        run_eval(step + 1)
    if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
        save_failed = run.save_run(args.out_dir, step + 1, vars(args), checkpointed, rank=rank, world=world)
        if save_failed:
            tqdm.write(f"warning: step {step + 1}: {save_failed}")

# --- the end: a final eval, then the export when asked (else `eval.py --ckpt OUT_DIR --export DIR` does it any time)
run_eval(args.steps)
state = scale.full_state_dict(policy) if args.fsdp and args.export != "none" else None  # every rank gathers
if master and args.export != "none":  # last: a LoRA policy is merged into its base in place
    from export import export_hf

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
