"""
Accuracy of a model or a train.py checkpoint on a task's test split.

    python eval.py --task gsm8k --model smollm2-135m --limit 200
    python eval.py --task arith --ckpt out/arith            # a train.py run (its ckpt.pt)
    python eval.py --task gsm8k --model X --n 8 --temperature 1.0   # sampled pass@8
    python eval.py --ckpt out/arith --export out/arith_hf    # a HF folder from a checkpoint; no eval

Greedy decoding by default (n=1). Reports strict accuracy (the `#### N` / \\boxed{} final-answer
line is right), flexible accuracy (the last number in the text is right) and the format rate,
writes one jsonl line per prediction, and prints a one-line summary. train.py reuses `evaluate`.
A checkpoint may be a full fine-tune, a LoRA run (its adapters merged into the base for evaluation)
or an --fsdp run (its DCP shards read by this one process).
"""

import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

import checkpoint
import cli
import lean
import parallel
from models import (DTYPES, ModelError, add_lora, check_dtype, load_model, load_tokenizer, load_trainable_state,
                    resolve_device, resolve_dtype, stop_token_ids)
from rollout import HFDecoder, sample
from tasks import TASKS, DataError


@torch.no_grad()
def evaluate(model, tokenizer, task, examples, max_new_tokens=256, batch_size=32, n=1, temperature=1.0,
             seed=0, progress=True, dtype=None, decoder=HFDecoder):
    """Score `examples`; n=1 is greedy, n>1 samples n completions each (pass@n and mean@n).
    dtype, decoder: the compute dtype and the decode step of sampling (rollout.sample).

    Returns (summary dict, one record per example).
    """
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer, model)
    generator = torch.Generator(device=device).manual_seed(seed)
    per_batch = max(1, batch_size // n)
    records = []
    for i in tqdm(range(0, len(examples), per_batch), desc="eval", disable=not progress, leave=False):
        batch = examples[i:i + per_batch]
        r = sample(model, tokenizer, [task.prompt(ex) for ex in batch], n, max_new_tokens, stops,
                   temperature=temperature if n > 1 else 0.0, generator=generator, dtype=dtype, decoder=decoder)
        for j, ex in enumerate(batch):
            outs = r.completions[j * n:(j + 1) * n]
            scores = [task.score(c, ex) for c in outs]
            records.append({"question": ex["question"], "gold": ex["answer"], "completion": outs[0],
                            "pred": scores[0]["pred"], "correct": scores[0]["strict"],
                            "strict": sum(s["strict"] for s in scores) / n,
                            "flexible": sum(s["flexible"] for s in scores) / n,
                            "format": sum(s["format"] for s in scores) / n,
                            "pass": any(s["strict"] for s in scores),
                            **({"completions": outs} if n > 1 else {})})
    k = max(len(records), 1)
    summary = {"n_examples": len(records), "strict_acc": sum(r["strict"] for r in records) / k,
               "flexible_acc": sum(r["flexible"] for r in records) / k,
               "format_rate": sum(r["format"] for r in records) / k}
    if n > 1:
        summary[f"pass@{n}"] = sum(r["pass"] for r in records) / k
    return summary, records


def load_checkpoint_model(path, device, dtype, merge=True):
    """A train.py checkpoint (ckpt.pt or its run dir) -> (model, tokenizer, config).

    A LoRA run gives its base with the adapters merged in (peft's merge_and_unload, in fp32, then cast
    to dtype), or with merge=False the peft model itself (fp32). An --fsdp run's shards are read from
    the DCP directory its ckpt.pt names.
    """
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise ModelError(f"no checkpoint at {path}; pass a train.py --out-dir or its ckpt.pt")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        cfg = ckpt["config"]
    except Exception as e:  # truncated or foreign file
        raise ModelError(f"checkpoint {path} is unreadable ({type(e).__name__}); pass another one") from None
    rank = cfg.get("lora_rank", 0)
    if "dcp" in ckpt:  # an --fsdp run: fp32 master weights, sharded
        model = load_model(cfg["model"], torch.device("cpu"), torch.float32, trainable=False)
        parallel.load(os.path.join(os.path.dirname(path), ckpt["dcp"]), model)
    elif rank:  # the adapters, on the fp32 base they were trained on
        model = add_lora(load_model(cfg["model"], torch.device("cpu"), torch.float32, trainable=False), rank,
                         cfg["lora_alpha"] or 2 * rank, cfg["lora_dropout"], cfg["lora_targets"])
        load_trainable_state(model, ckpt["model"])
        if not merge:
            return model, load_tokenizer(cfg["model"]), cfg
        model = model.merge_and_unload()
    else:
        model = load_model(cfg["model"], device, dtype, trainable=False)
        model.load_state_dict(ckpt["model"])
    return model.to(device, dtype), load_tokenizer(cfg["model"]), cfg


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="gsm8k", choices=sorted(TASKS))
    p.add_argument("--data-dir", default=None, help="local GSM8K dir (else $GSM8K_DIR, else download)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="hub id, local HF dir, .gguf file or smollm2-135m")
    src.add_argument("--ckpt", default=None, help="train.py out dir or ckpt.pt")
    p.add_argument("--split", default="test", choices=["train", "test"])
    p.add_argument("--limit", type=int, default=None, help="first N examples of the split (default: all)")
    p.add_argument("--n", type=int, default=1, help="samples per question; 1 = greedy")
    p.add_argument("--temperature", type=float, default=1.0, help="used when --n > 1")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="completions decoded together")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="weights for decoding; auto: bfloat16 where its matmuls are native, else float32")
    p.add_argument("--lean", default="auto", choices=["auto", "on", "off"],
                   help="lean.py's decode step for plain Llama/Qwen2 models; auto = on CPU when its check passes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="predictions jsonl (default: beside the ckpt, or ./predictions.jsonl)")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write --ckpt as a HF folder (weights in --dtype, LoRA merged) to DIR instead of evaluating")
    p.add_argument("--adapter", action="store_true", help="with --export: a LoRA run's adapters as a peft folder")
    args = p.parse_args()
    cli.check(p, args, {"limit": ">= 1", "n": ">= 1", "temperature": "> 0", "max_new_tokens": ">= 1",
                        "batch_size": ">= 1", "seed": ">= 0"},
              nullable=("limit", "model", "ckpt", "data_dir", "out", "export"))
    if args.export is not None:
        export(p, args)
        return
    out = args.out or (os.path.join(args.ckpt if os.path.isdir(args.ckpt) else os.path.dirname(args.ckpt),
                                    f"predictions_{args.task}_{args.split}.jsonl") if args.ckpt else "predictions.jsonl")
    try:  # before the evaluation, not after it: a bad path must not cost the run
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        open(out + ".tmp", "w").close()
    except OSError as e:
        p.error(f"--out {out} cannot be written ({e.strerror}); pass another path")
    try:
        device = resolve_device(args.device)
        dtype, note = resolve_dtype(args.dtype, device)
        check_dtype(device, dtype)
        if note:
            print(note)
        task = TASKS[args.task]
        examples = task.load(args.split, data_dir=args.data_dir)[:args.limit]
        if args.ckpt:
            model, tok, _ = load_checkpoint_model(args.ckpt, device, dtype)
        else:
            name = args.model or "smollm2-135m"
            model, tok = load_model(name, device, dtype, trainable=False), load_tokenizer(name)
    except (ModelError, DataError) as e:
        os.remove(out + ".tmp")
        p.error(str(e))
    try:
        use_lean, line = lean.select(args.lean, model, device)
    except ValueError as e:
        p.error(str(e))
    print(line)
    summary, records = evaluate(model, tok, task, examples, args.max_new_tokens, args.batch_size, args.n,
                                args.temperature, args.seed, dtype=dtype,
                                decoder=lean.LeanDecoder if use_lean else HFDecoder)
    with open(out + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(out + ".tmp", out)
    print(f"{args.task}/{args.split} {args.ckpt or args.model or 'smollm2-135m'}: " +
          " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()) +
          f" -> {out}")


def export(p, args):
    """eval.py --ckpt RUN --export DIR [--adapter]: the checkpoint as a folder transformers loads."""
    if not args.ckpt:
        p.error("--export needs --ckpt (a train.py run); a --model is already a HF model")
    if os.path.exists(args.export) and (not os.path.isdir(args.export) or os.listdir(args.export)):
        p.error(f"--export {args.export} exists and is not an empty directory; pass a new one")
    try:
        model, tok, cfg = load_checkpoint_model(args.ckpt, torch.device("cpu"), torch.float32, merge=False)
    except ModelError as e:
        p.error(str(e))
    if args.adapter and not cfg.get("lora_rank"):
        p.error(f"--adapter: {args.ckpt} is a full fine-tune, not a LoRA run; drop --adapter")
    name = "bfloat16" if args.dtype == "auto" else args.dtype  # a file format, not this machine's compute
    failed = checkpoint.export_hf(model, tok, args.export, DTYPES[name], adapter=args.adapter)
    if failed:
        sys.exit(f"error: {failed}")
    print(f"exported {args.ckpt} ({'adapter' if args.adapter else name}) to {args.export}")


if __name__ == "__main__":
    main()
