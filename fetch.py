"""What a first run fetches or converts once into the cache ($GRPO_CACHE, default ~/.cache/grpo-mini), imported only
then: GSM8K, downloaded and checked by sha256; a GGUF model (the offline SmolLM2), dequantised into a HF folder. Each
is written aside and renamed into place: a kill never leaves half of one, and processes side by side may race."""

import hashlib
import os
import tempfile
import urllib.request

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
GSM8K_SHA256 = {
    "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}


def gsm8k(split, path):
    """GSM8K's `split` downloaded to `path` (a Path), once its sha256 checks out -> None, or why it could not be."""
    url = GSM8K_URL.format(split=split)
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            data = r.read()
    except OSError as e:  # URLError, timeouts, refused connections are all OSErrors
        return f"could not download GSM8K from {url} ({e})"
    if (got := hashlib.sha256(data).hexdigest()) != GSM8K_SHA256[split]:
        return f"downloaded {url} has sha256 {got}, expected {GSM8K_SHA256[split]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".part", delete=False) as f:
        f.write(data)
    os.replace(f.name, path)  # atomic: a reader never sees half a file
    return None


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
