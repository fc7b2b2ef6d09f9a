"""
Several processes under torchrun: gradient averaging for models that fit on each device, FSDP2 sharding
(`torch.distributed.fsdp.fully_shard`) for those that do not, and DCP checkpoints of sharded runs.

Each rank owns whole groups of completions either way (train.py), so a step is the same computation
on 1 or N processes, up to the order of fp32 sums.

FSDP2 layout (`shard`): one unit per decoder layer, and the root, which keeps the rest: embeddings,
final norm, lm_head (tied to the embeddings or not: one unit holds both, so they stay one tensor).
- The log-prob pass (rollout.token_logprobs) calls the decoder and then the lm_head module chunk by
  chunk, never the root's forward, so FSDP's hooks never gather the root. `root_unsharded` gathers it
  before the pass; the pass then issues no collective of its own (the number of head chunks differs
  between ranks), and at the end of backward FSDP reduce-scatters the root's gradients once and frees
  it (its end-of-backward callback runs that for a unit whose forward did not run). A decoder layer's
  hooks run once per micro-batch on every rank, so their collectives match.
- Sampling (`gathered`) gathers every unit first and keeps them gathered through the decode loop:
  ranks stop decoding at different steps, so the loop must not issue collectives.
"""

# torch.distributed.fsdp and .checkpoint are imported inside the functions that use them: ~1 s at
# startup that runs without --fsdp do not need

import os
import shutil
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist


# -----------------------------------------------------------------------------
# the multi-process path for models that fit on each device

DCP_PREFIX = "dcp-"  # out_dir/dcp-000040: a sharded run's model and optimizer after step 40 (parallel.save)


def average_gradients(params, world):
    """Mean of each gradient over the ranks: one all-reduce per parameter, issued together."""
    for h in [dist.all_reduce(q.grad, async_op=True) for q in params if q.grad is not None]:
        h.wait()
    for q in params:
        if q.grad is not None:
            q.grad.div_(world)

# -----------------------------------------------------------------------------
# FSDP2


def shard(model, device, dtype):
    """Shard `model` in place over all ranks: each decoder layer a unit, the root the rest (see the top).

    Parameters are gathered in `dtype` for compute (fp32 master shards stay), gradients reduced in fp32.
    The model may sit on the CPU: each rank moves only its shards to `device`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # FSDP2 makes the first unit to run forward the root; the log-prob pass starts in a decoder layer,
    # so run one token through the root first (every rank does: its collectives match)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    model.reshard()  # the root keeps its parameters after forward; free them until they are needed
    return model


def is_sharded(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


@contextmanager
def _gathered(model):
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for m in units + [model]:
        m.unshard()
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)  # forwards inside issue no collective
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()
        model.reshard()


def gathered(model):
    """Context: every parameter of a sharded model gathered (in its compute dtype) for sampling or an
    eval, which then issue no collective; every rank must enter it. A no-op for other models."""
    return _gathered(model) if is_sharded(model) else nullcontext()


def root_unsharded(logprobs):
    """A token_logprobs for sharded models: the root's parameters gathered before the pass (see the top);
    without grad they are freed after it, with grad FSDP frees them at the end of backward."""
    def run(model, *args, **kwargs):
        if not is_sharded(model):  # a reference kept whole on --ref-device
            return logprobs(model, *args, **kwargs)
        model.unshard()
        out = logprobs(model, *args, **kwargs)
        if not torch.is_grad_enabled():
            model.reshard()
        return out
    return run


def clip_grad_norm_(params, max_norm):
    """torch's clip_grad_norm_ -> the global norm as a plain tensor. On sharded (DTensor) gradients torch
    computes the norm over all ranks' shards and returns it as a DTensor; full_tensor() reads it."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state_dict(model):
    """The whole model's state dict, gathered to rank 0's CPU for a sharded model (every rank must call;
    other ranks get {}); a plain model's own state dict otherwise."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

# -----------------------------------------------------------------------------
# DCP checkpoints: each rank writes and reads its own shards


def save(model, optimizer, out_dir, step):
    """Model and optimizer shards into out_dir/dcp-<step> (every rank must call) -> (name, None) or
    (None, a one-line reason). Written into a temp directory that rank 0 renames into place once
    every rank's shards and the metadata are written; train.py's ckpt.pt then points at it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    name = f"{DCP_PREFIX}{step:06d}"
    path, tmp = os.path.join(out_dir, name), os.path.join(out_dir, name + ".tmp")
    if dist.get_rank() == 0:
        for old in (tmp, path):  # left by a run killed before its ckpt.pt pointed at them
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        error = None
    except Exception as e:  # DCP gathers every rank's write errors (a full disk) and raises on all ranks
        error = f"could not write {tmp} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True) if error else os.replace(tmp, path)
    dist.barrier()
    return (None, error + "; the last good checkpoint is kept") if error else (name, None)


def remove_old(out_dir, keep):
    """Delete the dcp-* directories other than `keep` (rank 0, after ckpt.pt points at `keep`)."""
    for f in os.listdir(out_dir):
        if f.startswith(DCP_PREFIX) and f != keep:
            shutil.rmtree(os.path.join(out_dir, f), ignore_errors=True)


def load(path, model, optimizer=None):
    """Model (and optimizer) state from a DCP directory, for a sharded model (each rank reads its shards)
    or, without a process group, a plain one (one process reads the whole model, e.g. eval.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())  # eval.py: one process
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
