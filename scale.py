"""
What a run needs only when asked: LoRA adapters (peft, --lora-rank), gradient averaging over torchrun's
processes, FSDP2 sharding with DCP checkpoints (--fsdp), and a tracker (log_to). Nothing imports this file
otherwise.

Each rank owns whole groups of completions, so a step is the same computation on 1 or N processes, up to
the order of fp32 sums. FSDP2 layout (`shard`): one unit per decoder layer, and the root, which keeps the
rest (embeddings, final norm, lm_head: tied or not, one unit holds both). The log-prob pass calls the
decoder and the lm_head, never the root's forward, so rollout.py gathers the root itself; sampling and
evals run inside `gathered`, since ranks stop decoding at different steps and must issue no collective.
"""

import os
import pickle
import shutil
import sys
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, set_element  # set_element: its own

# -----------------------------------------------------------------------------
# LoRA through peft: the adapters train, the base is frozen; the base with its adapters off is the reference


def add_lora(model, rank, seed=0):
    """`model` with LoRA adapters of rank `rank` (alpha = 2 * rank, no dropout) on every linear of attention
    and MLP. Adapter B starts at 0, so the model computes what the base computes until the first update.
    A is drawn from `seed` on the CPU: every rank of a run starts from the same adapters."""
    import warnings

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("error: --lora-rank needs peft: pip install peft") from None
    # peft calls a transformers property by its deprecated name: a warning a run cannot act on
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):  # the CPU generator, restored after
        torch.default_generator.manual_seed(seed)
        return get_peft_model(model, cfg)


def is_lora(model):
    return hasattr(model, "peft_config")


def trainable_state(model):
    """What a checkpoint keeps: a LoRA model's adapter weights (peft's keys), else the whole state."""
    if not is_lora(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_trainable_state(model, state):
    """Inverse of trainable_state; every adapter weight must be in `state`."""
    if not is_lora(model):
        return model.load_state_dict(state)
    from peft import set_peft_model_state_dict

    missing = [k for k in set_peft_model_state_dict(model, state).missing_keys if "lora_" in k]
    if missing:
        raise ValueError(f"the checkpoint lacks adapter weights such as {missing[0]}")


# -----------------------------------------------------------------------------
# several processes


def average_gradients(params, world):
    """Mean of each gradient over the ranks: one all-reduce per parameter, issued together."""
    for h in [dist.all_reduce(q.grad, async_op=True) for q in params if q.grad is not None]:
        h.wait()
    for q in params:
        if q.grad is not None:
            q.grad.div_(world)


def end(error=None):
    """A torchrun worker's end: every rank leaves together (one that left while rank 0 exports could abort the run), the
    process groups destroyed, `error` (a line, or None) printed, and the process ended here, exit code 1 with an error.
    Not through the interpreter's teardown: FSDP2's state keeps its gloo group alive past destroy_process_group, and a
    thread of that group still freeing a collective's tensors (which takes the GIL) during the teardown is ended by
    pthread_exit, whose unwinding aborts the worker ('terminate called without an active exception')."""
    dist.barrier()
    dist.destroy_process_group()
    if error:
        print(f"error: {error}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if error else 0)


def all_gather(x):
    """Every rank's x (n, ...) -> (world * n, ...), in rank order."""
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    return torch.cat(everyone)


def shard(model, device, dtype):
    """Shard `model` in place over all ranks (FSDP2): parameters gathered in `dtype` for compute, fp32
    master shards, gradients reduced in fp32. The model may sit on the CPU: each rank moves its shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # FSDP2 makes the first unit to run forward the root; the log-prob pass starts in a decoder layer,
    # so run one token through the root first (on every rank: the collectives match)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    model.reshard()
    return model


@contextmanager
def root_gathered(model):
    """FSDP2 gathers a unit in its forward; the decoder and the lm_head run without the root's, so the root
    (embeddings, norm, head) is gathered here (rollout's log-prob pass). With grad, FSDP frees it after backward."""
    model.unshard()
    yield
    if not torch.is_grad_enabled():
        model.reshard()


@contextmanager
def gathered(model):
    """Every parameter of a sharded model gathered, for sampling or an eval that then issue no collective
    (every rank must enter). A no-op for a model that is not sharded."""
    if not hasattr(model, "unshard"):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for m in units + [model]:
        m.unshard()
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()
        model.reshard()


def full_state_dict(model):
    """The whole state dict, gathered to rank 0's CPU for a sharded model (every rank must call; others
    get {}); a plain model's own state dict otherwise."""
    if not hasattr(model, "unshard"):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# -----------------------------------------------------------------------------
# checkpoints: a LoRA run keeps its adapters; a sharded run its DCP shards, each rank its own


def save_state(state, policy, optimizer, out_dir, step):
    """Add this policy's part to a checkpoint's `state` (run.save_run) -> None or a one-line reason it failed.
    FSDP2: every rank writes its shards of model and optimizer into out_dir/dcp-<step>, which state names."""
    if not hasattr(policy, "unshard"):
        state.update(model=trainable_state(policy), optimizer=optimizer.state_dict())
        return None
    state["dcp"], failed = save_dcp(policy, optimizer, out_dir, step)
    return failed


def load_state(ckpt, run_dir, policy, optimizer):
    if "dcp" in ckpt:
        return load_dcp(os.path.join(run_dir, ckpt["dcp"]), policy, optimizer)
    load_trainable_state(policy, ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])


def save_dcp(model, optimizer, out_dir, step):
    """Model and optimizer shards into out_dir/dcp-<step> (every rank calls) -> (name, None) or (None, a
    one-line reason). Written into a temp directory that rank 0 renames once every rank is done; older
    dcp-* directories go once ckpt.pt names the new one (remove_old_dcp)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = f"dcp-{step:06d}"
    path, tmp = os.path.join(out_dir, name), os.path.join(out_dir, name + ".tmp")
    if dist.get_rank() == 0:
        for old in (tmp, path):  # left by a run killed before its ckpt.pt named them
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        error = None
    except Exception as e:  # DCP gathers every rank's write errors (a full disk) and raises on all ranks
        error = f"could not write {tmp} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    if dist.get_rank() == 0 and error:
        shutil.rmtree(tmp, ignore_errors=True)
    elif dist.get_rank() == 0:
        os.replace(tmp, path)
    dist.barrier()
    return (None, error + "; the last good checkpoint is kept") if error else (name, None)


def remove_old_dcp(out_dir, keep):
    for f in os.listdir(out_dir):
        if f.startswith("dcp-") and f != keep:
            shutil.rmtree(os.path.join(out_dir, f), ignore_errors=True)


# DCP unpickles its .metadata and its non-tensor items whole, which could run code: only its own types and data pass
DCP_TYPES = {
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _Metadata(pickle.Unpickler):
    def find_class(self, module, name):  # DCP's dataclasses and enums, torch's sizes, dtypes and layouts
        if (
            module == "torch.distributed.checkpoint.metadata"
            and "." not in name
            or (module, name) in DCP_TYPES
            or module == "torch"
            and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


class _Planner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):  # DefaultLoadPlanner's own, with torch.load's weights-only unpickler
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_dcp(path, model, optimizer=None):
    """Model (and optimizer) state from a DCP directory: a sharded model reads its shards; without a process
    group one process reads the whole model (eval.py). ValueError in one line for a folder holding more than
    DCP's own types and plain data (nothing in it runs)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    state = (
        {"model": get_model_state_dict(model)}
        if optimizer is None
        else dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    )
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            _Metadata(f).load()
        with warnings.catch_warnings():  # one process reading a sharded checkpoint is what eval.py means to do
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, planner=_Planner(), no_dist=not dist.is_initialized())
    except (OSError, pickle.UnpicklingError, dcp.api.CheckpointException) as e:
        why = str(e).splitlines()[0][:160] if isinstance(e, pickle.UnpicklingError) else type(e).__name__
        raise ValueError(f"{path} is not a DCP checkpoint train.py wrote ({why}); nothing in it ran") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


# -----------------------------------------------------------------------------
# log_to: the metrics also to TensorBoard or Weights & Biases (WANDB_MODE=offline keeps them on this machine)


def tracker(name, out_dir, config, resume_step=0):
    """-> (log(scalars, step=), close())."""
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=resume_step or None)

        def log(scalars, step):
            for k, v in scalars.items():
                tb.add_scalar(k, v, step)
            tb.flush()

        return log, tb.close
    import wandb

    w = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "grpo-mini"),
        config=config,
        dir=out_dir,
        name=os.path.basename(os.path.abspath(out_dir)),
        resume="allow",
    )
    return w.log, w.finish
