"""A GGUF model (the offline SmolLM2) dequantised once into a cached HF folder ($GRPO_CACHE, default
~/.cache/grpo-mini), imported only then. Written aside and renamed into place: a kill never leaves half a folder, and
processes side by side may race."""

import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def gguf_model(gguf_path, out):
    """Dequantise a GGUF file into the HF folder `out`: plain, trainable nn.Linear weights in bf16 -> None, or why
    the file could not be read."""
    folder, fname = os.path.split(gguf_path)
    print(f"converting {gguf_path} to a bf16 HF folder in {out} (once)")
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=fname, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
    except Exception as e:  # not a GGUF file, a truncated one, an architecture transformers cannot read
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    model.config.quantization_config = None  # dequantized: plain weights
    model.config.name_or_path = gguf_path
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out), ignore_cleanup_errors=True) as tmp:  # gone once renamed
        model.to(torch.bfloat16).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if not os.path.exists(out):  # else a process beside this one converted it first
            os.replace(tmp, out)
    return None
