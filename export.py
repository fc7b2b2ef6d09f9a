"""A model as a folder transformers loads (`AutoModelForCausalLM.from_pretrained`): a run's export at its end
(train.py, export = "model" or "adapter") and `eval.py --ckpt RUN --export DIR`. Imported only then."""

import copy
import os
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM

import run


def export_hf(model, tokenizer, path, dtype, adapter=False, state_dict=None):
    """Write `model` as a folder AutoModelForCausalLM.from_pretrained loads -> None, or a one-line reason it
    could not (the previous export kept). Weights in `dtype`; a LoRA model merged into its base first
    (peft's merge_and_unload, in place), or with adapter=True saved as a peft adapter folder. state_dict:
    a sharded model's gathered weights. Written into a temp directory beside path, then renamed."""
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
            with torch.device("meta"):  # a plain model of the weights in `dtype`: no random init, no extra copy
                plain = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype)
            weights = model.state_dict() if state_dict is None else state_dict
            plain.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True)
            plain.tie_weights()  # tied keys were assigned one by one: one tensor again
            plain.generation_config = copy.deepcopy(model.generation_config)
            plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        open(os.path.join(tmp, run.EXPORT_MARK), "w").close()
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if os.path.exists(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        tmp = None
        run.remove(old)
        return None
    except BaseException as e:
        run.remove(tmp)
        if old and not os.path.exists(path) and os.path.exists(old):
            os.replace(old, path)  # put the previous export back
        if not isinstance(e, Exception):
            raise
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {str(e)[:120]}"
        return f"could not write {path} ({why}); the previous export there is kept"
