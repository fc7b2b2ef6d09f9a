"""
Checkpoints of a train.py run: written whole or not at all, never mixed with another run's files.

`ckpt.pt` holds everything needed to continue exactly (model or adapter weights, optimizer, scheduler,
grad scaler, step, flags, every rank's RNG states). It is written to `ckpt.pt.tmp` and renamed over the
old one, so a kill mid-write leaves the last good checkpoint; a failed write (a full disk) removes the
temp file and says where space is needed.
"""

import math
import os

import torch

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


def existing_run(out_dir):
    """The run files already in out_dir (empty when it holds no run)."""
    return [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]


def clear_run(out_dir):
    """Remove a previous run's files from out_dir (for --overwrite)."""
    for f in RUN_FILES + ("ckpt.pt.tmp",):
        path = os.path.join(out_dir, f)
        if os.path.exists(path):
            os.remove(path)
