"""
Flags from three places, later wins: argparse defaults, config files, the command line; and every value
checked for type and range before anything loads, so a mistake is one line, not a traceback or a run
that trains on something else than asked.

A config file holds `name = literal` lines (the flag names with _ for -), read as data with `ast`,
never run. `--resume DIR` (on the command line or in a config file) puts the checkpoint's own flags
under the config files and the command line.
"""

import ast
import importlib.util
import math
import os

import torch


def load_config(p, path):
    """A config file -> dict of flag values; unknown keys, non-literals and bad choices are p.error."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        p.error(f"cannot read config {path}: {e}")
    cfg, actions = {}, {a.dest: a for a in p._actions}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            p.error(f"{path}:{node.lineno}: only `name = value` lines are allowed")
        name = node.targets[0].id
        if name not in actions or name in ("help", "config"):
            p.error(f"{path}:{node.lineno}: unknown key '{name}'; keys are the flags with _ for -, e.g. group_size")
        try:
            cfg[name] = ast.literal_eval(node.value)
        except ValueError:
            p.error(f"{path}:{node.lineno}: the value of '{name}' must be a literal")
    return cfg


def read_checkpoint_config(p, resume):
    """--resume DIR or FILE -> (path of the checkpoint, its saved flags); p.error when unreadable."""
    path = os.path.join(resume, "ckpt.pt") if os.path.isdir(resume) else resume
    try:
        cfg = torch.load(path, map_location="cpu", weights_only=False)["config"]
    except Exception as e:  # missing, truncated or foreign file
        p.error(f"--resume {resume}: no readable checkpoint at {path} ({type(e).__name__}); pass a run's --out-dir")
    return path, cfg


def parse(p, ranges, argv=None):
    """Parse with config files and --resume applied; check types, choices and `ranges` -> (args, ckpt path)."""
    nullable = {a.dest for a in p._actions if a.default is None}
    pre = p.parse_known_args(argv)[0]
    configs = [load_config(p, path) for path in pre.config]
    resume = pre.resume
    for cfg in configs:  # a config file may name the run to resume; the command line wins
        resume = cfg.get("resume", resume) if pre.resume is None else resume
    ckpt_path = None
    if resume:
        ckpt_path, saved = read_checkpoint_config(p, resume)
        known = {a.dest for a in p._actions}
        saved = {k: v for k, v in saved.items() if k in known and k not in ("resume", "overwrite")}
        p.set_defaults(**{**saved, "out_dir": os.path.dirname(os.path.abspath(ckpt_path))})
    for cfg in configs:  # e.g. a base config, then an ablation that changes two lines of it
        p.set_defaults(**cfg)
    args = p.parse_args(argv)
    args.resume = resume
    check(p, args, ranges, nullable)
    return args, ckpt_path


def _in_range(v, spec):
    """spec: '> 0', '>= 1', '(0, 1]', '[0, 1)' ..."""
    if spec[0] in "([":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (lo < v if spec[0] == "(" else lo <= v) and (v < hi if spec[-1] == ")" else v <= hi)
    op, bound = spec.split()
    return {">": v > float(bound), ">=": v >= float(bound), "<": v < float(bound), "<=": v <= float(bound)}[op]


def check(p, args, ranges, nullable=()):
    """Every flag's value: its type (config files bypass argparse's conversion), its choices, its range."""
    for a in p._actions:
        if a.dest in ("help", "config") or not hasattr(args, a.dest):
            continue
        v, flag = getattr(args, a.dest), a.option_strings[-1]
        if v is None:
            if a.dest not in nullable:
                p.error(f"{flag} needs a value, got None")
            continue
        want = a.type or (bool if a.const is True or a.const is False else str)
        ok = isinstance(v, bool) if want is bool else \
            isinstance(v, int) and not isinstance(v, bool) if want is int else \
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) if want is float else \
            isinstance(v, str)
        if not ok:
            kind = {int: "an integer", float: "a finite number", bool: "True or False"}.get(want, "a string")
            p.error(f"{flag} must be {kind}, got {v!r}")
        if a.choices is not None and v not in a.choices:
            p.error(f"{flag} {v!r}: choose from {sorted(a.choices)}")
        if a.dest in ranges and not _in_range(v, ranges[a.dest]):
            p.error(f"{flag} must be {ranges[a.dest]}, got {v!r}")


def check_combinations(p, args, world, ddp, task):
    """train.py's checks that need more than one flag (or the task), one line each, before anything loads."""
    eps_high = args.eps if args.eps_high is None else args.eps_high
    N = args.prompts_per_step // world * args.group_size  # completions per rank per step
    if args.prompts_per_step % world:
        p.error(f"--prompts-per-step {args.prompts_per_step} does not split over {world} ranks: use a multiple of {world}")
    if N % args.micro_batch:
        p.error(f"--micro-batch {args.micro_batch} must divide the {N} completions per rank per step")
    if eps_high < args.eps:
        p.error(f"--eps-high {eps_high} < --eps {args.eps}: clip-higher needs eps_high >= eps")
    if args.delta is not None and args.delta <= 1 + eps_high:
        p.error(f"--delta {args.delta} must be > 1 + eps_high = {1 + eps_high}")
    # LoRA, FSDP2, export: what combines with what
    lora_ref = args.lora_rank > 0 and not args.ref_model
    if args.lora_rank and importlib.util.find_spec("peft") is None:
        p.error("--lora-rank needs peft: pip install peft")
    if args.lora_rank and args.fsdp:
        p.error("--lora-rank with --fsdp is not supported: a frozen bf16 base fits one device up to ~14B; drop --fsdp")
    if args.lora_rank and (args.ref_sync_every or lora_ref and args.ref_device):
        p.error("--lora-rank: the reference is the base (adapters off); it cannot take --ref-sync-every or --ref-device")
    if lora_ref and args.kl_estimator == "full" and "lm_head" in args.lora_targets:
        p.error("--kl-estimator full with a LoRA reference needs the lm_head without adapters: drop it from --lora-targets")
    if args.export == "adapter" and not args.lora_rank:
        p.error("--export adapter needs --lora-rank; a full fine-tune exports as --export model")
    if args.fsdp and (args.ref_sync_every or args.dtype == "float16"):
        p.error("--fsdp supports neither --ref-sync-every nor --dtype float16 (use bfloat16)")
    if args.fsdp and not ddp:
        p.error("--fsdp shards over torchrun's processes: torchrun --nproc_per_node N train.py ... --fsdp")
    if args.overlong_buffer > args.max_new_tokens:
        p.error(f"--overlong-buffer {args.overlong_buffer} must be <= --max-new-tokens {args.max_new_tokens}")
    if args.supervision == "process" and task.step_rewards is None:
        p.error(f"--supervision process needs per-step rewards; task {args.task} has none (try --task arith_steps)")


def reward_weights(p, spec, reward_fns):
    """--reward-weights "name=number,..." -> {name: weight}; names must be the run's reward functions."""
    weights = {}
    for item in spec.split(",") if spec else []:
        name, _, w = item.partition("=")
        try:
            weights[name] = float(w)
        except ValueError:
            weights[name] = math.nan
        if name not in reward_fns or not math.isfinite(weights[name]):
            p.error(f"--reward-weights: '{item}' is not name=number with name in {sorted(reward_fns)}")
    return weights
