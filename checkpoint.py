"""
Checkpoints of a train.py run: written whole or not at all, never mixed with another run's files.

`ckpt.pt` holds everything needed to continue exactly (model or adapter weights, optimizer, scheduler,
grad scaler, step, flags, every rank's RNG states). It is written to `ckpt.pt.tmp` and renamed over the
old one, so a kill mid-write leaves the last good checkpoint; a failed write (a full disk) removes the
temp file and says where space is needed. A sharded (--fsdp) run keeps its model and optimizer in a
DCP directory (parallel.save) that ckpt.pt names; a new one is written beside it before ckpt.pt moves.

`export_hf` writes a Hugging Face folder (save_pretrained + tokenizer + generation config) the same way:
into a temp directory, renamed into place.
"""

import math
import os
import shutil
import tempfile

import random

import numpy as np
import torch
import torch.distributed as dist

import parallel
from parallel import DCP_PREFIX
from models import load_trainable_state, trainable_state

RUN_FILES = ("metrics.jsonl", "ckpt.pt", "config.json")  # what makes a directory hold a run


def state_bytes(obj):
    """Bytes of the tensors in a nested state (what the checkpoint will take on disk, roughly)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def save(state, path):
    """torch.save to path via path.tmp and a rename -> None, or a one-line reason it could not be written
    (the temp file removed, the previous checkpoint at path untouched)."""
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, whole
        return None
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        need = math.ceil(state_bytes(state) / 2**20)  # rounded up: a small state never reads "0 MiB"
        return (f"could not write {path} ({e.strerror or e}); about {need} MiB are needed in "
                f"{os.path.dirname(os.path.abspath(path))}; the last good checkpoint there is kept")


def save_run(out_dir, step, args, policy, optimizer, scheduler, scaler, ref=None, rank=0, world=1):
    """A train.py run's state after `step`, all ranks' RNG included -> None, or why it could not be written
    (the last good checkpoint stays). ckpt.pt holds the weights (LoRA: the adapters); with --fsdp each
    rank writes its shards of the model and optimizer (DCP) into dcp-<step>/, which ckpt.pt names."""
    state = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step, "config": vars(args),
             "ref": ref.state_dict() if ref is not None and args.ref_sync_every else None}
    if args.fsdp:
        state["dcp"], failed = parallel.save(policy, optimizer, out_dir, step)
        if failed:
            return failed
    else:
        state.update(model=trainable_state(policy), optimizer=optimizer.state_dict())
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    state["rng"] = [None] * world
    dist.all_gather_object(state["rng"], rng) if world > 1 else state["rng"].__setitem__(0, rng)
    if rank:
        return None
    failed = save(state, os.path.join(out_dir, "ckpt.pt"))
    if args.fsdp and not failed:
        parallel.remove_old(out_dir, keep=state["dcp"])
    return failed


def restore(path, policy, optimizer, scheduler, scaler, ref, args, rank=0):
    """Load what save_run wrote into the run's objects and this rank's RNG -> the step to continue from.
    ValueError (one line) when the run's layout differs: --fsdp or --lora-rank must stay as they were."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ("dcp" in ckpt) != args.fsdp or ckpt["config"].get("lora_rank", 0) != args.lora_rank:
        raise ValueError(f"--resume: {path} was written with --fsdp {'dcp' in ckpt}, --lora-rank "
                         f"{ckpt['config'].get('lora_rank', 0)}: resume with the same")
    if args.fsdp:  # each rank reads its shards of the model and optimizer
        parallel.load(os.path.join(os.path.dirname(path), ckpt["dcp"]), policy, optimizer)
    else:
        load_trainable_state(policy, ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    if ref is not None and ckpt.get("ref") is not None:
        ref.load_state_dict(ckpt["ref"])
    rng = ckpt["rng"][rank]
    torch.set_rng_state(rng["torch"]), random.setstate(rng["python"]), np.random.set_state(rng["numpy"])
    return ckpt["step"]


def existing_run(out_dir):
    """The run files already in out_dir (empty when it holds no run)."""
    return [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]


def prepare_out_dir(out_dir, resume, overwrite, rank=0):
    """Make out_dir ready for a run -> None, or the one-line reason it is not: it holds another run (unless
    resuming it, or --overwrite clears it first), or it cannot be written."""
    if rank == 0 and not resume and existing_run(out_dir):
        if not overwrite:
            return (f"--out-dir {out_dir} holds a run ({', '.join(existing_run(out_dir))}): pass --resume {out_dir} "
                    "to continue it, --overwrite to replace it, or another --out-dir")
        clear_run(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{rank}")  # one per rank: they run this at the same time
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        return f"--out-dir {out_dir} is not writable ({e.strerror}); pass another directory"
    return None


def clear_run(out_dir):
    """Remove a previous run's files from out_dir (for --overwrite)."""
    for f in RUN_FILES + ("ckpt.pt.tmp",):
        path = os.path.join(out_dir, f)
        if os.path.exists(path):
            os.remove(path)
    for f in os.listdir(out_dir):  # its export (and a temp one), its DCP checkpoints
        if f in ("hf", "hf.old") or f.startswith((".hf.", DCP_PREFIX)):
            shutil.rmtree(os.path.join(out_dir, f), ignore_errors=True)


def export_hf(model, tokenizer, path, dtype, adapter=False, state_dict=None):
    """Write `model` as a folder that AutoModelForCausalLM.from_pretrained loads -> None, or a one-line
    reason it could not be written (the previous folder at path kept).

    A plain model is saved with its weights in `dtype`; a LoRA (peft) model is merged into its base first
    (peft's merge_and_unload, which changes `model` in place), or with adapter=True saved as a peft
    adapter folder (fp32 adapter weights; transformers loads it on top of base_model_name_or_path).
    state_dict: the gathered weights of a sharded model (parallel.full_state_dict), saved instead of
    model.state_dict(). Written into a temp directory beside path, then renamed.
    """
    from models import is_lora, plain_copy
    parent = os.path.dirname(os.path.abspath(path))
    tmp = old = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".hf.", dir=parent)
        if adapter:
            model.save_pretrained(tmp)
        else:
            if is_lora(model):
                model, state_dict = model.merge_and_unload(), None
            plain_copy(model.config, state_dict if state_dict is not None else model.state_dict(), dtype,
                       model.generation_config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if os.path.exists(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        tmp = None
        if old:
            shutil.rmtree(old)
        return None
    except OSError as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if old and not os.path.exists(path) and os.path.exists(old):
            os.replace(old, path)  # put the previous export back
        return f"could not write {path} ({e.strerror or e}); the previous export there is kept"
