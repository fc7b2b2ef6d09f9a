"""What a run owns: its flags (defaults < config files < the command line, each checked before anything loads), its
directory (`run.json`, `metrics.jsonl`, `ckpt.pt`, `hf/`; locked while it runs; nothing else there is touched), its
checkpoints, written whole or not at all (a temp file renamed into place; the next start removes a kill's temp file),
holding only tensors, numbers, strings and plain containers: read with torch.load(weights_only=True)."""

import ast
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import textwrap
import zipfile

import torch
import torch.distributed as dist
from tqdm import tqdm

OWN = ("run.json", "metrics.jsonl", "ckpt.pt", "tensorboard", "wandb", "hf")  # + dcp-*, temp files (_own)
EXPORT_MARK = ".grpo-export"  # in hf/: the folder is a run's export, which a later export may replace
IDENTITY = ("model", "task", "data_dir", "task_options", "lora_rank", "fsdp", "seed")  # what --resume may not change
PATHS = ("config", "data_dir", "model", "out_dir", "resume")  # ~ and $VARS expanded, in config files too


def user_path(path):
    return os.path.expandvars(os.path.expanduser(path)) if isinstance(path, str) else path


# --- flags
def _config(p, spec, keys):
    """A config file, or an inline `name=value` (a value that is no literal is a string) -> {name: value}; a
    mistake is one p.error line."""
    if "=" in spec and not os.path.isfile(user_path(spec)):
        name, _, text = (x.strip() for x in spec.partition("="))
        try:
            lines = [(name, ast.literal_eval(text), f"--config {spec}")]
        except (ValueError, SyntaxError):
            lines = [(name, text, f"--config {spec}")]
    else:
        try:
            with open(user_path(spec), encoding="utf-8") as f:
                tree = ast.parse(f.read(), spec)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
            p.error(f"cannot read config {spec} ({type(e).__name__}); pass a file of `name = value` lines")
        lines = []
        for node in tree.body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                p.error(f"{spec}:{node.lineno}: only `name = value` lines are allowed")
            try:
                lines.append((node.targets[0].id, ast.literal_eval(node.value), f"{spec}:{node.lineno}"))
            except ValueError:
                p.error(f"{spec}:{node.lineno}: the value of '{node.targets[0].id}' must be a literal")
    for name, _, where in lines:
        if name not in keys:
            p.error(
                f"{where}: unknown key '{name}'; keys are the flags with _ for - (e.g. group_size) and the "
                "config-only ones listed in train.py"
            )
    return {name: user_path(value) if name in PATHS else value for name, value, _ in lines}


def parse(p, ranges, constants, argv=None, knobs=()):
    """Flags with config files and --resume applied, every value checked -> (args, the checkpoint to resume
    from or None, the names whose value is not the default). constants: {name: (default, choices tuple or range)}
    of the values only config files set; knobs: dataclasses whose fields that are no flag are such values too."""
    flags = {a.dest for a in p._actions} - {"help", "config"}
    for cls in knobs:
        constants.update({f.name: (f.default, ">= 0") for f in dataclasses.fields(cls) if f.name not in flags})
    keys = ", ".join(f"{k}={d!r}" for k, (d, _) in constants.items())
    p.epilog = textwrap.fill(f"config keys (--config FILE or --config name=value), with their defaults: {keys}", 100)
    pre = p.parse_known_args(argv)[0]
    configs = [_config(p, c, flags | set(constants)) for c in pre.config]
    resume = user_path(pre.resume) or next((c["resume"] for c in reversed(configs) if c.get("resume")), None)
    values = {k: d for k, (d, _) in constants.items()}
    defaults = {**vars(p.parse_args([])), **values}
    ckpt = None
    if resume:
        try:
            ckpt_path, ckpt = load_checkpoint(resume)
        except ValueError as e:
            p.error(f"--resume: {e}")
        saved, done = ckpt["config"], ckpt["step"]
        values.update({k: v for k, v in saved.items() if k in (flags | set(constants)) - {"resume", "overwrite"}})
        values["out_dir"], name = os.path.split(os.path.realpath(ckpt_path))  # a resume writes there, and only there:
        if name != "ckpt.pt" or not os.path.isfile(os.path.join(values["out_dir"], "run.json")):  # a run's own
            p.error(f"--resume {resume}: not a run's ckpt.pt (beside its run.json); pass the run's --out-dir")
    for c in configs:  # a base config, then an ablation that changes two lines of it
        values.update(c)
    nullable = {a.dest for a in p._actions if a.default is None}  # before config files set defaults
    p.set_defaults(**{k: v for k, v in values.items() if k in flags})
    args = p.parse_args(argv)
    vars(args).update({k: values[k] for k in constants}, resume=resume)
    vars(args).update({k: user_path(getattr(args, k)) for k in PATHS if k != "config"})
    check(p, args, ranges, constants, nullable)
    if resume:
        if os.path.realpath(args.out_dir) != values["out_dir"]:
            p.error(f"--resume continues a run in its own directory ({values['out_dir']}): drop --out-dir")
        if args.overwrite:
            p.error("--resume continues a run and --overwrite replaces one: pass one of them")
        if args.steps <= done:
            p.error(f"--resume {resume}: the checkpoint is at step {done}; pass --steps > {done} to train further")
        for k in IDENTITY:
            if k in saved and saved[k] != getattr(args, k):
                name = f"--{k.replace('_', '-')}" if k in flags else k  # a flag, or a config key
                p.error(
                    f"--resume {resume}: the run was trained with {name} {saved[k]!r}, not {getattr(args, k)!r}; "
                    "resuming would mix two runs: drop that value or start a new --out-dir"
                )
    return args, ckpt, {k for k, v in vars(args).items() if v != defaults.get(k, v)}


KINDS = {
    bool: (lambda v: isinstance(v, bool), "True or False"),
    int: (lambda v: type(v) is int, "an integer"),
    float: (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    str: (lambda v: isinstance(v, str), "a string"),
    dict: (lambda v: isinstance(v, dict), "a dict literal, e.g. {'max_digits': 1}"),
}


def _in_range(v, spec):
    """spec: '> 0', '>= 1', '(0, 1]', '[0, 1)' ..."""
    if spec[0] in "([":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (lo < v if spec[0] == "(" else lo <= v) and (v < hi if spec[-1] == ")" else v <= hi)
    op, bound = spec.split()
    return v > float(bound) if op == ">" else v >= float(bound)


def _kind(action):  # the type a flag's value must have: its own, bool for a switch, else str
    if action.type in KINDS:
        return action.type
    if action.const in (True, False):
        return bool
    return str


def check(p, args, ranges, constants=None, nullable=None):
    """Every value's type (config files bypass argparse's conversion), choices and range -> p.error. A number is
    >= 0 unless `ranges` says otherwise."""
    items = []  # (name, as the user wrote it, kind, choices, range, may be None)
    for a in p._actions:
        if a.option_strings and a.nargs not in ("+", "*") and hasattr(args, a.dest) and a.dest != "config":
            none_ok = a.default is None if nullable is None else a.dest in nullable
            items.append((a.dest, a.option_strings[-1], _kind(a), a.choices, ranges.get(a.dest, ">= 0"), none_ok))
    for k, (d, spec) in (constants or {}).items():
        choices, spec = (spec, None) if isinstance(spec, (tuple, dict)) else (None, spec)  # a dict: its keys, live
        items.append((k, f"config key {k}", str if d is None else type(d), choices, spec, d is None))
    for dest, flag, kind, choices, spec, can_be_none in items:
        v = getattr(args, dest)
        if v is None and not can_be_none:
            p.error(f"{flag} needs a value, got None")
        elif v is not None and not KINDS[kind][0](v):
            p.error(f"{flag} must be {KINDS[kind][1]}, got {v!r}")
        elif v is not None and choices is not None and v not in choices:
            p.error(f"{flag} {v!r}: choose from {sorted(choices)}")
        elif v is not None and spec and kind in (int, float) and not _in_range(v, spec):
            p.error(f"{flag} must be {spec}, got {v!r}")


# --- the directory
HELD = []  # the locks this process holds (a test running train.py in process releases them)


def claim(out_dir, resume, overwrite):
    """Make out_dir this run's (rank 0): its lock held in HELD -> None, or the one-line reason it is not."""
    found = sorted(set(os.listdir(out_dir)) - {".lock"}) if os.path.isdir(out_dir) else []
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"--out-dir {out_dir} is a file: pass a directory"
    is_run = "run.json" in found
    if found and not is_run and not resume:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        return f"--out-dir {out_dir} holds files that are not a run's ({shown}): pass a new or empty directory"
    if is_run and not resume and not overwrite:
        return (
            f"--out-dir {out_dir} holds a run: pass --resume {out_dir} to continue it, --overwrite "
            "to replace it, or another --out-dir"
        )
    hf = os.path.join(out_dir, "hf")
    if os.path.isdir(hf) and not os.path.exists(os.path.join(hf, EXPORT_MARK)):
        return f"{hf} was not exported by a run: move it away or pass another --out-dir"
    for name in ("run.json", "metrics.jsonl", "ckpt.pt"):  # a run's files, which it reads and appends to
        if os.path.exists(os.path.join(out_dir, name)) and not os.path.isfile(os.path.join(out_dir, name)):
            return f"{os.path.join(out_dir, name)} is not a file: move it away or pass another --out-dir"
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, ".lock"), "a")
    except OSError as e:
        return f"--out-dir {out_dir} is not writable ({e.strerror}); pass another directory"
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when this process ends, however it ends
    except OSError:
        lock.close()
        return f"--out-dir {out_dir} is in use by another running train.py: wait for it or pass another --out-dir"
    HELD.append(lock)
    for f in os.listdir(out_dir):  # what a kill mid-write left; with --overwrite the run's files (a user's stay)
        if _own(f, temp_only=not (is_run and overwrite)):
            remove(os.path.join(out_dir, f))
    return None


def _own(name, temp_only=False):
    """Whether a run writes `name`; temp_only: only what a write cut short leaves (*.tmp, hf.old, .hf.*)."""
    base = name.removesuffix(".tmp")
    ours = base in OWN or base.startswith("dcp-")
    if name.startswith(".hf.") or name == "hf.old" or (ours and name != base):
        return True
    return ours and not temp_only


def remove(path):  # a file or a folder, if there is one
    if path and os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif path and os.path.exists(path):
        os.remove(path)


def write_json(path, obj):  # whole or not at all
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def read_jsonl(path):
    """JSON lines -> list of dicts, skipping blank and torn lines (what a kill during a write leaves)."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a blank or torn line
                continue
    return [r for r in rows if isinstance(r, dict)]


def exit_on_interrupt(where):
    """From here on Ctrl-C or SIGTERM, at any moment, end the process in one line, `error: interrupted; <where>`
    (a str, or a function giving it), exit code 130 / 143 as a shell reports them. The SystemExit it raises runs
    every cleanup on its way out: a file being written is left whole or not at all."""

    def stop(sig, frame):
        for s in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        for bar in list(getattr(tqdm, "_instances", [])):  # progress bars end before the line, not after it
            bar.close()
        print(f"error: interrupted; {where() if callable(where) else where}", file=sys.stderr)
        sys.exit(128 + sig)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)


def last_checkpoint(out_dir, steps):
    """Where an interrupted run's last checkpoint is and how to go on from it."""
    try:
        step = load_checkpoint(out_dir)[1]["step"]
    except ValueError:
        return f"no checkpoint was written in {out_dir}; the same command with --overwrite starts again"
    last = f"the last checkpoint is {os.path.join(out_dir, 'ckpt.pt')} (step {step})"
    if step < steps:
        return f"{last}: python train.py --resume {out_dir} continues"
    return f"{last}: python eval.py --ckpt {out_dir} --export DIR exports it"


# --- checkpoints
def save(state, path):
    """torch.save to path via path.tmp and a rename -> None, or a one-line reason it could not (temp removed)."""
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, whole
    except (OSError, RuntimeError) as e:  # torch.save on a full disk raises RuntimeError ("unexpected pos ...")
        why = getattr(e, "strerror", None) or f"{type(e).__name__}: {e}".splitlines()[0]  # a C++ trace may follow
        return f"could not write {path} ({why}); make room there: the last good checkpoint is kept"
    finally:
        remove(tmp)  # what a failed or interrupted write left; nothing after the rename


def load_checkpoint(path):
    """A run dir or its ckpt.pt -> (path, checkpoint dict), or ValueError in one line. weights_only: tensors,
    numbers, strings and plain containers, nothing else; a file holding more (a pickled object, which could run
    code) is refused without running it."""
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path}; pass a train.py --out-dir or its ckpt.pt")
    try:  # mmap: tensors are read when used (a zip file, as torch.save writes; a legacy pickle is read whole)
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:  # what weights_only refused: a GLOBAL module.name, or an opcode
        held = re.search(r"GLOBAL (\S+)|(Unsupported operand \d+)", str(e))
        raise ValueError(
            f"checkpoint {path} holds {held[1] or held[2] if held else 'an object'}, which torch.load"
            "(weights_only=True) refuses: not a checkpoint train.py wrote; nothing in it ran"
        ) from None
    except Exception as e:  # truncated, or not a torch file
        raise ValueError(f"checkpoint {path} is unreadable ({type(e).__name__}); pass another one") from None
    has_keys = isinstance(ckpt, dict) and {"config", "step"} <= ckpt.keys()
    if not has_keys or not re.fullmatch(r"dcp-\d+", ckpt.get("dcp", "dcp-0")):  # dcp: a folder beside it, by name
        raise ValueError(f"{path} is not a train.py checkpoint (no config and step in it); pass another one")
    return path, ckpt


def save_run(out_dir, step, config, held, *, rank=0, world=1):
    """The run's state after `step`: held = {policy, optimizer, scheduler, scaler, ref (None: not saved)}, every rank's
    RNG -> None, or why it could not be written. A LoRA or FSDP2 policy saves its own part (scale.py: the adapters;
    DCP shards)."""
    policy, optimizer, ref = held["policy"], held["optimizer"], held["ref"]
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}  # nothing here draws from numpy's
    state = {k: held[k].state_dict() for k in ("scheduler", "scaler")}
    state.update(step=step, config=config, ref=None if ref is None else ref.state_dict(), rng=[rng] * world)
    if world > 1:
        dist.all_gather_object(state["rng"], rng)
    failed = None
    if hasattr(policy, "unshard") or hasattr(policy, "peft_config"):  # LoRA, FSDP2: scale.py saves their part
        import scale

        failed = scale.save_state(state, policy, optimizer, out_dir, step)
    else:
        state.update(model=policy.state_dict(), optimizer=optimizer.state_dict())
    if not failed and not rank:
        failed = save(state, os.path.join(out_dir, "ckpt.pt"))
    if "dcp" in state and not failed and not rank:  # the older shards, now that ckpt.pt names the new ones
        scale.remove_old_dcp(out_dir, keep=state["dcp"])
    return failed


def restore(ckpt, out_dir, held, *, rank=0):
    """Load what save_run wrote (load_checkpoint's dict) into the run's objects (save_run's held) and this rank's RNG
    -> the step to continue from. They keep none of its tensors: once the dict goes, so does the file's mapping."""
    policy, optimizer, ref = held["policy"], held["optimizer"], held["ref"]
    if hasattr(policy, "unshard") or hasattr(policy, "peft_config"):
        import scale

        try:
            scale.load_state(ckpt, out_dir, policy, optimizer)
        except ValueError as e:  # a DCP folder holding more than data, a LoRA state without its adapters
            sys.exit(f"error: --resume: {e}")
    else:
        policy.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    held["scheduler"].load_state_dict(ckpt["scheduler"])
    held["scaler"].load_state_dict(ckpt["scaler"])
    if ref is not None and ckpt.get("ref") is not None:
        ref.load_state_dict(ckpt["ref"])
    for state in optimizer.state.values():  # load_state_dict may keep the file's own (mmap'd) tensors: copies
        state.update({k: v.clone() for k, v in state.items() if torch.is_tensor(v)})
    torch.set_rng_state(ckpt["rng"][rank]["torch"])
    random.setstate(ckpt["rng"][rank]["python"])
    return ckpt["step"]


# --- seeds, the metrics log and what processes agree on
def seed_of(*parts):  # a generator's seed from the run's seed, the step, ...: the same in any process, on resume
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def all_reduce(x, op="mean"):
    """Mean / max / min of a float tensor over torchrun's processes; x itself in one process."""
    if not dist.is_initialized():
        return x
    dist.all_reduce(x, {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return x / dist.get_world_size() if op == "mean" else x


def reduce_op(name):  # how a metric is summarised over micro-batches and processes: *_max, *_min, else the mean
    return name[-3:] if name.endswith(("_max", "_min")) else "mean"


def reduce(name, values):  # a metric's values over micro-batches -> one value, as reduce_op(name) says
    return {"mean": lambda v: sum(v) / len(v), "max": max, "min": min}[reduce_op(name)](values)


class MetricsLog:
    """OUT_DIR/metrics.jsonl (a non-finite value as null) + a tracker; a resume drops later and torn lines first."""

    def __init__(self, out_dir, tracker="none", config=None, resume_step=0):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if resume_step and os.path.exists(self.path):
            rows = [r for r in read_jsonl(self.path) if r.get("step", math.inf) <= resume_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            os.replace(self.path + ".tmp", self.path)
        self.file = open(self.path, "a")
        self.streak = {}  # steps in a row above the warning's threshold, per metric
        self.tracker = None
        if tracker != "none":  # TensorBoard or W&B: (log, close), from scale.py
            import scale

            self.tracker = scale.tracker(tracker, out_dir, config, resume_step)

    def write(self, row):
        """One row; a training row's KL to the reference, or p99 gap to the sampler, above 1 (far above a
        healthy run's) for 3 steps in a row prints a warning that says: lower --lr."""
        watched = ("kl", "dlogp_p99") if "reward" in row else ()  # training rows only
        for k in watched:
            self.streak[k] = self.streak.get(k, 0) + 1 if (row.get(k) or 0) > 1.0 else 0
            if self.streak[k] == 3:
                tqdm.write(
                    f"warning: step {row['step']}: {k} > 1 for 3 steps: the policy runs away from the "
                    f"{'reference' if k == 'kl' else 'sampler'}; lower --lr"
                )
        row = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tracker is not None:
            self.tracker[0]({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

    def close(self):
        self.file.close()
        if self.tracker is not None:
            self.tracker[1]()
