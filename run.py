"""A run's directory (run.json, metrics.jsonl, ckpt.pt, hf/; locked while it runs, nothing else there touched), its
checkpoints, its metrics log and what the processes agree on. The knobs that make a run are config.py's."""

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
import zipfile

import torch
import torch.distributed as dist
from tqdm import tqdm

import grpo

OWN = ("run.json", "metrics.jsonl", "ckpt.pt", "tensorboard", "wandb", "hf")  # + dcp-*, temp files (_own)
EXPORT_MARK = ".grpo-export"  # in hf/: the folder is a run's export, which a later export may replace
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


def _own(name, temp_only=False):  # whether a run writes it; temp_only: what a cut write leaves (*.tmp, hf.old, .hf.*)
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


def read_jsonl(path):  # JSON lines -> a list of dicts
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a blank or torn line (what a kill during a write leaves)
                continue
    return [r for r in rows if isinstance(r, dict)]


def exit_on_interrupt(where):
    """From here on Ctrl-C or SIGTERM ends the process in one line, `error: interrupted; <where>` (a str or a function
    giving it), exit code 130 / 143; its SystemExit runs every cleanup: a file being written stays whole or absent."""

    def stop(sig, frame):
        for s in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        for bar in list(getattr(tqdm, "_instances", [])):  # progress bars end before the line, not after it
            bar.close()
        print(f"error: interrupted; {where() if callable(where) else where}", file=sys.stderr)
        sys.exit(128 + sig)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)


def last_checkpoint(out_dir, steps):  # where an interrupted run's last checkpoint is and how to go on from it
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
    """A run dir or its ckpt.pt -> (path, dict), or ValueError in one line; weights_only: no pickled object runs."""
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


def save_run(out_dir, step, config, checkpointed, *, rank=0, world=1):
    """The run's state after `step` (policy, optimizer, scheduler, scaler, ref; each rank's RNG) -> None, or why not."""
    policy, optimizer, ref = checkpointed["policy"], checkpointed["optimizer"], checkpointed["ref"]
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}  # nothing here draws from numpy's
    state = {k: checkpointed[k].state_dict() for k in ("scheduler", "scaler", "entropy") if k in checkpointed}
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


def restore(ckpt, out_dir, checkpointed, *, rank=0):
    """Load save_run's state (load_checkpoint's dict) into its objects and this rank's RNG -> the step to go on from."""
    policy, optimizer, ref = checkpointed["policy"], checkpointed["optimizer"], checkpointed["ref"]
    if hasattr(policy, "unshard") or hasattr(policy, "peft_config"):
        import scale

        try:
            scale.load_state(ckpt, out_dir, policy, optimizer)
        except ValueError as e:  # a DCP folder holding more than data, a LoRA state without its adapters
            sys.exit(f"error: --resume: {e}")
    else:
        policy.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    checkpointed["scheduler"].load_state_dict(ckpt["scheduler"])
    if ckpt["scaler"]:  # an fp16 run's; a resume in another dtype makes its own
        checkpointed["scaler"].load_state_dict(ckpt["scaler"])
    if ref is not None and ckpt.get("ref") is not None:
        ref.load_state_dict(ckpt["ref"])
    if "entropy" in ckpt and "entropy" in checkpointed:  # use_adaptive_entropy's coef goes on from where it was
        checkpointed["entropy"].load_state_dict(ckpt["entropy"])
    for state in optimizer.state.values():  # load_state_dict may keep the file's own (mmap'd) tensors: copies
        state.update({k: v.clone() for k, v in state.items() if torch.is_tensor(v)})
    torch.set_rng_state(ckpt["rng"][rank]["torch"])
    random.setstate(ckpt["rng"][rank]["python"])
    return ckpt["step"]


# --- seeds, the metrics log and what processes agree on
def seed_of(*parts):  # a generator's seed from the run's seed, the step, ...: the same in any process, on resume
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def draw_prompts(train_set, step, attempt, *, seed, per_step, slots):
    """The examples of this rank's prompt `slots` and a generator each: a fixed shuffle per epoch (a resample, attempt >
    0: fresh prompts); each slot's generator seeded by (seed, step, attempt, slot), so a resumed run, or one over more
    processes, samples the same."""
    epoch, place = divmod(step, len(train_set) // per_step)  # the step's place in its epoch's shuffle
    shuffle = seed + epoch if attempt == 0 else seed_of(seed, step, attempt)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(shuffle))
    slots = [i + (0 if attempt else place * per_step) for i in slots]
    generators = [torch.Generator().manual_seed(seed_of(seed, step, attempt, i)) for i in slots]
    return [train_set[order[i]] for i in slots], generators


def all_reduce(x, op="mean"):  # mean / max / min over torchrun's processes; x itself in one process
    if not dist.is_initialized():
        return x
    dist.all_reduce(x, {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return x / dist.get_world_size() if op == "mean" else x


def reduce_op(name):  # how a metric is summarised over micro-batches and processes: *_max, *_min, else the mean
    return name[-3:] if name.endswith(("_max", "_min")) else "mean"


def reduce(name, values):  # a metric's values over micro-batches -> one value, as reduce_op(name) says
    return {"mean": lambda v: sum(v) / len(v), "max": max, "min": min}[reduce_op(name)](values)


def step_metrics(r, every_reward, frac_zero, metrics, per_update=(), *, first_logp=None, with_env=False):
    """A step's `metrics`, its Rollout's (reward, lengths, environments' states), the batch's rewards (world * N,), its
    optimizer steps' (per_update: a dict each, reduced over them; each one's as update{i}/ when more than one), the
    sampler gap from first_logp (N, C) (dlogp_*), reduced over ranks -> {name: float}, in one device read."""
    updates = per_update or [{"loss": 0.0, "grad_norm": 0.0}]  # a skipped step: none
    metrics.update({k: reduce(k, [u[k] for u in updates]) for k in updates[0]})
    if len(per_update) > 1:
        metrics.update({f"update{i}/{k}": v for i, u in enumerate(per_update, 1) for k, v in u.items()})
    lengths = r.completion_mask.sum(1)  # (N,) the model's own tokens
    if first_logp is not None:  # |sampling log-prob - training log-prob|, over the whole batch (dlogp_*)
        gap = grpo.behaviour_weights(first_logp, r.sample_logp, r.completion_mask, "none")[1]
        metrics.update({k: v for k, v in gap.items() if k.startswith("dlogp")})
    metrics.update(
        reward=r.reward.mean(),
        reward_std=every_reward.std(),
        frac_zero_std=frac_zero,
        completion_len=lengths.float().mean(),
        completion_len_max=lengths.max().float(),
        truncated=r.truncated.float().mean(),
        prompt_cut=r.prompt_cut.float().mean(),
        prompt_len=r.prompt_mask.sum(1).float().mean(),
    )
    if with_env:  # per row: its environment's state (env/tool_calls, env/attempts ...), the replies read
        metrics.update({f"env/{k}": torch.tensor([s[k] for s in r.env_state]).float().mean() for k in r.env_state[0]})
        metrics.update(
            env_tokens=r.env_mask.sum(1).float().mean(),
            turns=1 + (r.env_mask[:, 1:] & ~r.env_mask[:, :-1]).sum(1).float().mean(),  # 1 + its replies
        )
    values = [torch.as_tensor(v, dtype=torch.float32, device=every_reward.device).detach() for v in metrics.values()]
    values = [all_reduce(v, reduce_op(k)) for k, v in zip(metrics, values)]  # over ranks, as each name says
    return dict(zip(metrics, torch.stack(values).tolist()))


class MetricsLog:  # OUT_DIR/metrics.jsonl (non-finite: null) + a tracker; a resume drops later and torn lines first
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
        """One row; a training row's kl or dlogp_p99 above 1 (far above healthy) 3 steps in a row warns: lower --lr."""
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
