"""
What a run owns: its flags, its directory, its checkpoints, its metrics log and its export.

- Flags: argparse defaults < config files (`name = literal` lines, read as data with `ast`, never run; or
  inline `--config name=value`) < the command line; every value checked for type and range before
  anything loads. `--resume DIR` puts the checkpoint's flags under the config files and the command line.
- The directory: a run holds `run.json` (its resolved flags), `metrics.jsonl`, `ckpt.pt`, `hf/`; it writes
  nothing into a directory that holds anything else, deletes only its own files, and holds `.lock` while
  it runs, so two runs never share a directory.
- Files are written whole or not at all: a temp file renamed into place; a kill leaves the last good one.
"""

import ast
import fcntl
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

OWN = ("run.json", "metrics.jsonl", "ckpt.pt", "ckpt.pt.tmp", "tensorboard", "wandb", "hf")  # + dcp-*, .hf.*
EXPORT_MARK = ".grpo-export"  # in hf/: the folder is a run's export, which a later export may replace
IDENTITY = ("model", "task", "data_dir", "lora_rank", "fsdp", "seed")  # what --resume may not change

# -----------------------------------------------------------------------------
# flags


def _config(p, spec, keys):
    """A config file, or an inline `name=value` (a bare word is a string) -> {name: value}, or one p.error line."""
    inline = "=" in spec and not os.path.isfile(spec)
    try:
        with open(spec, encoding="utf-8") if not inline else nullcontext(None) as f:
            tree = ast.parse(spec if inline else f.read(), spec)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        p.error(f"cannot read config {spec} ({type(e).__name__}); pass a file of `name = value` lines or name=value")
    cfg = {}
    for node in tree.body:
        where = "--config" if inline else f"{spec}:{node.lineno}"
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            p.error(f"{where}: only `name = value` lines are allowed")
        name = node.targets[0].id
        if name not in keys:
            p.error(f"{where}: unknown key '{name}'; keys are the flags with _ for - (e.g. group_size) and the "
                    "config-only ones listed in train.py")
        try:
            cfg[name] = node.value.id if inline and isinstance(node.value, ast.Name) else ast.literal_eval(node.value)
        except ValueError:
            p.error(f"{where}: the value of '{name}' must be a literal")
    return cfg


def parse(p, ranges, constants, argv=None):
    """Flags with config files and --resume applied, every value checked -> (args, checkpoint path or None).
    constants: {name: (default, choices tuple or range)} of the values only config files set."""
    flags = {a.dest for a in p._actions} - {"help", "config"}
    pre = p.parse_known_args(argv)[0]
    configs = [_config(p, c, flags | set(constants)) for c in pre.config]
    resume = pre.resume or next((c["resume"] for c in reversed(configs) if c.get("resume")), None)
    values, ckpt_path, saved = {k: d for k, (d, _) in constants.items()}, None, {}
    if resume:
        ckpt_path = os.path.join(resume, "ckpt.pt") if os.path.isdir(resume) else resume
        try:
            ckpt = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
            saved, done = ckpt["config"], ckpt["step"]
        except Exception as e:  # missing, truncated or foreign
            p.error(f"--resume {resume}: no readable checkpoint at {ckpt_path} ({type(e).__name__}); pass a run's --out-dir")
        values.update({k: v for k, v in saved.items() if k in flags | set(constants) and k not in ("resume", "overwrite")})
        values["out_dir"] = os.path.dirname(os.path.abspath(ckpt_path))
    for c in configs:  # a base config, then an ablation that changes two lines of it
        values.update(c)
    p.set_defaults(**{k: v for k, v in values.items() if k in flags})
    args = p.parse_args(argv)
    vars(args).update({k: values[k] for k in constants}, resume=resume)
    check(p, args, ranges, constants)
    if resume:
        if os.path.abspath(args.out_dir) != os.path.dirname(os.path.abspath(ckpt_path)):
            p.error(f"--resume continues a run in its own directory ({os.path.dirname(ckpt_path)}): drop --out-dir")
        if args.overwrite:
            p.error("--resume continues a run and --overwrite replaces one: pass one of them")
        if args.steps <= done:
            p.error(f"--resume {resume}: the checkpoint is at step {done}; pass --steps > {done} to train further")
        for k in IDENTITY:
            if k in saved and saved[k] != getattr(args, k):
                p.error(f"--resume {resume}: the run was trained with {k}={saved[k]!r}, not {getattr(args, k)!r}; "
                        f"resuming would mix two runs: drop that flag or start a new --out-dir")
    return args, ckpt_path


def _in_range(v, spec):
    """spec: '> 0', '>= 1', '(0, 1]', '[0, 1)' ..."""
    if spec[0] in "([":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (lo < v if spec[0] == "(" else lo <= v) and (v < hi if spec[-1] == ")" else v <= hi)
    op, bound = spec.split()
    return {">": v > float(bound), ">=": v >= float(bound)}[op]


def _is(v, kind):
    if kind is bool:
        return isinstance(v, bool)
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return isinstance(v, str)


def check(p, args, ranges, constants=None, nullable=None):
    """Every value's type (config files bypass argparse's conversion), choices and range -> p.error."""
    items = [(a.dest, a.option_strings[-1], a.type or (bool if a.const in (True, False) else str), a.choices,
              ranges.get(a.dest), a.default is None if nullable is None else a.dest in nullable)
             for a in p._actions if a.dest not in ("help", "config") and hasattr(args, a.dest)]
    items += [(k, f"config key {k}", type(d), spec if isinstance(spec, tuple) else None,
               spec if isinstance(spec, str) else None, False) for k, (d, spec) in (constants or {}).items()]
    for dest, flag, kind, choices, spec, can_be_none in items:
        v = getattr(args, dest)
        if v is None:
            if not can_be_none:
                p.error(f"{flag} needs a value, got None")
            continue
        if not _is(v, kind):
            p.error(f"{flag} must be {({int: 'an integer', float: 'a finite number', bool: 'True or False'}).get(kind, 'a string')}, got {v!r}")
        if choices is not None and v not in choices:
            p.error(f"{flag} {v!r}: choose from {sorted(choices)}")
        if spec and not _in_range(v, spec):
            p.error(f"{flag} must be {spec}, got {v!r}")

# -----------------------------------------------------------------------------
# the directory


def claim(out_dir, resume, overwrite):
    """Make out_dir this run's (rank 0) -> (the held lock file, None) or (None, the one-line reason not)."""
    found = sorted(set(os.listdir(out_dir)) - {".lock"}) if os.path.isdir(out_dir) else []
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return None, f"--out-dir {out_dir} is a file: pass a directory"
    is_run = "run.json" in found
    if found and not is_run and not resume:
        return None, (f"--out-dir {out_dir} holds files that are not a run's ({', '.join(found[:3])}"
                      f"{', ...' if len(found) > 3 else ''}): pass a new or empty directory")
    if is_run and not resume and not overwrite:
        return None, (f"--out-dir {out_dir} holds a run: pass --resume {out_dir} to continue it, --overwrite "
                      "to replace it, or another --out-dir")
    hf = os.path.join(out_dir, "hf")
    if os.path.isdir(hf) and not os.path.exists(os.path.join(hf, EXPORT_MARK)):
        return None, f"{hf} was not exported by a run: move it away or pass another --out-dir"
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, ".lock"), "a")
    except OSError as e:
        return None, f"--out-dir {out_dir} is not writable ({e.strerror}); pass another directory"
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when this process ends, however it ends
    except OSError:
        lock.close()
        return None, f"--out-dir {out_dir} is in use by another running train.py: wait for it or pass another --out-dir"
    if is_run and overwrite:  # only what a run writes; a user's file there stays
        for f in os.listdir(out_dir):
            path = os.path.join(out_dir, f)
            if f in OWN or f.startswith(("dcp-", ".hf.")):
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return lock, None


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def read_jsonl(path):
    """JSON lines -> list of dicts, skipping blank and torn lines (what a kill during a write leaves)."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rows.append(json.loads(line)) if line.strip() else None
            except json.JSONDecodeError:
                continue
    return [r for r in rows if isinstance(r, dict)]


@contextmanager
def interruptible(out_dir):
    """Ctrl-C or SIGTERM ends the run in one line that says where its last checkpoint is; files written
    whole or not at all stay as they were."""
    signal.signal(signal.SIGTERM, lambda sig, frame: (_ for _ in ()).throw(KeyboardInterrupt("SIGTERM")))
    try:
        yield
    except KeyboardInterrupt as e:
        ckpt = os.path.join(out_dir, "ckpt.pt")
        try:
            step = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=False)["step"]
            where = f"the last checkpoint is {ckpt} (step {step}): python train.py --resume {out_dir} continues"
        except Exception:
            where = f"no checkpoint was written; python train.py --out-dir {out_dir} --overwrite starts again"
        print(f"error: interrupted; {where}", file=sys.stderr)
        sys.exit(143 if str(e) == "SIGTERM" else 130)

# -----------------------------------------------------------------------------
# checkpoints


def save(state, path):
    """torch.save to path via path.tmp and a rename -> None, or a one-line reason it could not (temp removed)."""
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, whole
        return None
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if not isinstance(e, OSError):
            raise
        return (f"could not write {path} ({e.strerror or e}); make room in {os.path.dirname(os.path.abspath(path))}"
                "; the last good checkpoint there is kept")


def save_run(out_dir, step, config, policy, optimizer, scheduler, scaler, ref=None, rank=0, world=1):
    """The run's state after `step`, every rank's RNG included -> None, or why it could not be written.
    ckpt.pt holds the weights (LoRA: the adapters) and `ref` when given; a sharded (FSDP2) run writes each
    rank's shards into dcp-<step>/ (DCP), which ckpt.pt names."""
    state = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step, "config": config,
             "ref": None if ref is None else ref.state_dict()}
    plain = not (hasattr(policy, "unshard") or hasattr(policy, "peft_config"))  # else: LoRA or FSDP2 (scale.py)
    if not plain:
        import scale
    if hasattr(policy, "unshard"):
        state["dcp"], failed = scale.save_dcp(policy, optimizer, out_dir, step)
        if failed:
            return failed
    else:
        state.update(model=policy.state_dict() if plain else scale.trainable_state(policy),
                     optimizer=optimizer.state_dict())
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    state["rng"] = [None] * world
    dist.all_gather_object(state["rng"], rng) if world > 1 else state["rng"].__setitem__(0, rng)
    failed = None if rank else save(state, os.path.join(out_dir, "ckpt.pt"))
    if "dcp" in state and not failed and not rank:
        scale.remove_old_dcp(out_dir, keep=state["dcp"])
    return failed


def restore(path, policy, optimizer, scheduler, scaler, ref=None, rank=0):
    """Load what save_run wrote into the run's objects and this rank's RNG -> the step to continue from."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if hasattr(policy, "unshard") or hasattr(policy, "peft_config"):
        import scale
    if "dcp" in ckpt:
        scale.load_dcp(os.path.join(os.path.dirname(path), ckpt["dcp"]), policy, optimizer)
    elif hasattr(policy, "peft_config"):
        scale.load_trainable_state(policy, ckpt["model"])
    else:
        policy.load_state_dict(ckpt["model"])
    if "dcp" not in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    if ref is not None and ckpt.get("ref") is not None:
        ref.load_state_dict(ckpt["ref"])
    rng = ckpt["rng"][rank]
    torch.set_rng_state(rng["torch"]), random.setstate(rng["python"]), np.random.set_state(rng["numpy"])
    return ckpt["step"]


def load_checkpoint(path):
    """A run dir or its ckpt.pt -> (path, the checkpoint dict); ValueError in one line when unreadable."""
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path}; pass a train.py --out-dir or its ckpt.pt")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        ckpt["config"]
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"checkpoint {path} is unreadable ({type(e).__name__}); pass another one") from None
    return path, ckpt

# -----------------------------------------------------------------------------
# the metrics log and the export


class MetricsLog:
    """OUT_DIR/metrics.jsonl, one JSON line a step or eval (a non-finite value as null), + a tracker. On
    resume the lines after the checkpoint's step (and any torn line) are dropped first."""

    def __init__(self, out_dir, tracker="none", config=None, resume_step=0):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if resume_step and os.path.exists(self.path):
            rows = [r for r in read_jsonl(self.path) if r.get("step", math.inf) <= resume_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            os.replace(self.path + ".tmp", self.path)
        self.file = open(self.path, "a")
        self.tb = self.wandb = None
        self.streak = {}
        if tracker == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=resume_step or None)
        elif tracker == "wandb":  # WANDB_MODE=offline keeps it on this machine
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-mini"), config=config,
                                    dir=out_dir, name=os.path.basename(os.path.abspath(out_dir)), resume="allow")

    def write(self, row):
        """One row; a training row's KL to the reference, or p99 gap to the sampler, above 1 (far above a
        healthy run's) for 3 steps in a row prints a warning that says: lower --lr."""
        for k in ("kl", "dlogp_p99") if "reward" in row else ():
            self.streak[k] = self.streak.get(k, 0) + 1 if (row.get(k) or 0) > 1.0 else 0
            if self.streak[k] == 3:
                tqdm.write(f"warning: step {row['step']}: {k} > 1 for 3 steps: the policy runs away from the "
                           f"{'reference' if k == 'kl' else 'sampler'}; lower --lr")
        row = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        for k, v in scalars.items() if self.tb is not None else ():
            self.tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def close(self):
        self.file.close()
        self.tb.close() if self.tb is not None else None
        self.wandb.finish() if self.wandb is not None else None


def export_hf(model, tokenizer, path, dtype, adapter=False, state_dict=None):
    """Write `model` as a folder AutoModelForCausalLM.from_pretrained loads -> None, or a one-line reason it
    could not (the previous export kept). Weights in `dtype`; a LoRA model merged into its base first
    (peft's merge_and_unload, in place), or with adapter=True saved as a peft adapter folder. state_dict:
    a sharded model's gathered weights. Written into a temp directory beside path, then renamed."""
    from models import plain_copy
    parent = os.path.dirname(os.path.abspath(path))
    tmp = old = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".hf.", dir=parent)
        if adapter:
            model.save_pretrained(tmp)
        else:
            if hasattr(model, "merge_and_unload"):
                model, state_dict = model.merge_and_unload(), None
            plain_copy(model.config, model.state_dict() if state_dict is None else state_dict, dtype,
                       model.generation_config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        open(os.path.join(tmp, EXPORT_MARK), "w").close()
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if os.path.exists(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        tmp = None
        shutil.rmtree(old) if old else None
        return None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True) if tmp else None
        if old and not os.path.exists(path) and os.path.exists(old):
            os.replace(old, path)  # put the previous export back
        if not isinstance(e, Exception):
            raise
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {str(e)[:120]}"
        return f"could not write {path} ({why}); the previous export there is kept"
