"""
Accuracy of a model or a train.py checkpoint on a task's test split; curves of train.py runs.

    python eval.py --task gsm8k --model smollm2-135m --limit 200
    python eval.py --ckpt out/arith                         # a train.py run (its ckpt.pt) on its own task
    python eval.py --task rg:chain_sum --task-options "{'max_digits': 1}" --model smollm2-135m  # reasoning-gym
    python eval.py --task gsm8k --model X --n 8 --temperature 1.0   # sampled: pass@1, @2, @4, @8
    python eval.py --ckpt out/arith --export out/arith_hf    # a HF folder from a checkpoint; no eval
    python eval.py --plot out/a out/b --out curves.png      # runs' curves (matplotlib); --key kl, --smooth 1

Greedy by default (n=1): strict accuracy (the `#### N` / \\boxed{} final-answer line is right), flexible
accuracy (the last number is right), format rate; one jsonl line per prediction and a one-line summary.
With --n N the accuracies are means over the N samples, plus the unbiased pass@k (Chen et al. 2021) for
k = 1, 2, 4, ... N. A checkpoint may be a full fine-tune, a LoRA run (adapters merged) or an --fsdp run.
--plot: each run a train.py --out-dir (or its metrics.jsonl), labelled by its directory; --key (the reward by default)
as a running mean over --smooth steps, --eval-key (eval/strict_acc if logged) as points on a second panel.
"""

import argparse
import ast
import dataclasses
import importlib
import json
import math
import os
import sys

import torch
from tqdm import tqdm

import config
import run
from models import DTYPES, check_dtype, load_model, load_tokenizer, resolve_device, resolve_dtype
from rollout import Sampler, decode_dynamic, sample, stop_token_ids


def check_ranges(p, args, ranges):
    """A script's plain argparse flags (eval.py's, bench.py's) against `ranges` {name: range}: p.error in one line."""
    for a in p._actions:
        if a.dest in ranges and getattr(args, a.dest) is not None:
            decl = config.Decl(a.dest, a.type, True, a.default, config.Knob(ranges[a.dest]))
            if why := config.problem(decl, getattr(args, a.dest), a.option_strings[-1]):
                p.error(why)


def pass_at_k(n, c, k):
    """Unbiased pass@k of one problem with c of n samples correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021,
    arXiv 2107.03374, eq. 1), as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials."""
    return 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    task,
    examples,
    *,
    max_new_tokens=256,
    batch_size=32,
    n=1,
    sampler=None,
    seed=0,
    progress=True,
    dtype=None,
    env=None,
    loop=decode_dynamic,
):
    """Score `examples` -> (summary, one record per example); n=1 is greedy, n>1 samples n completions each from
    `sampler` (mean accuracies, pass@k). dtype: sampling's compute dtype. progress: a bar on stderr. A task with an
    environment runs it (env: an envs.EnvDriver, else the task's): task.score reads the model's own words and the row's
    environment state, as the rewards do; each record keeps the trajectory; the states' means are env/ keys."""
    if task.env and env is None:
        env = task.env(tokenizer)
    if n == 1:
        sampler = Sampler(temperature=0.0)
    sampler = sampler or Sampler()
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    per_batch = max(1, batch_size // n)
    records, correct = [], []  # one record an example; how many of its n are right
    with tqdm(total=len(examples), desc="eval", unit="problem", disable=not progress, leave=False) as bar:
        for i in range(0, len(examples), per_batch):
            batch = examples[i : i + per_batch]
            r = sample(
                model,
                tokenizer,
                [task.prompt(ex) for ex in batch],
                n,
                max_new_tokens=max_new_tokens,
                stop_ids=stop_token_ids(tokenizer, model),
                sampler=sampler,
                generator=generator,
                dtype=dtype,
                env=env,
                examples=batch,
                loop=loop,
            )
            for j, ex in enumerate(batch):
                rows = range(j * n, (j + 1) * n)
                scores = [task.score(r.completions[k], ex, r.env_state[k]) for k in rows]
                correct.append(sum(bool(s["strict"]) for s in scores))
                record = {"question": ex["question"], "gold": ex["answer"], "completion": r.completions[j * n]}
                record.update(pred=scores[0]["pred"], correct=scores[0]["strict"], source=ex.get("source"))
                record.update({k: sum(s[k] for s in scores) / n for k in scores[0] if k != "pred"})  # strict, ...
                record["env"] = {k: sum(r.env_state[x][k] for x in rows) / n for k in r.env_state[j * n]}
                if n > 1:
                    record["completions"] = r.completions[j * n : (j + 1) * n]
                if env is not None:  # the conversation, replies included
                    record["trajectory"] = r.trajectories[j * n]
                records.append(record)
            bar.update(len(batch))
    m = max(len(records), 1)
    names = {"strict": "strict_acc", "flexible": "flexible_acc", "format": "format_rate", "score": "score"}
    summary = {"n_examples": len(records)}
    if records:  # accuracies, a partial-credit mean; the environments' states
        summary.update({names[k]: sum(x[k] for x in records) / m for k in records[0] if k in names})
        summary.update({f"env/{k}": sum(x["env"][k] for x in records) / m for k in records[0]["env"]})
    for source in sorted({x["source"] for x in records} - {None}):  # a mix: which task moved
        mine = [x["strict"] for x in records if x["source"] == source]
        summary[f"strict_acc/{source}"] = sum(mine) / len(mine)
    if n > 1:
        ks = sorted({2**j for j in range(n.bit_length())} | {n})  # 1, 2, 4, ... up to n, and n
        summary.update({f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / m for k in ks})
    return summary, records


def log_eval(model, tokenizer, task, examples, step, log, **sampling):
    """evaluate() during training: its summary printed and written to the run's MetricsLog as eval/* at `step`."""
    summary, _ = evaluate(model, tokenizer, task, examples, **sampling)
    tqdm.write(f"eval step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in summary.items()))
    log.write({"step": step, **{f"eval/{k}": v for k, v in summary.items()}})


def fresh(path):
    """path, or where it exists path's stem with -1, -2, ...: what a tool writes by default replaces nothing."""
    stem, ext = os.path.splitext(path)
    return next(p for i in range(10**6) if not os.path.exists(p := f"{stem}-{i}{ext}" if i else path))


def load_checkpoint_model(path, device, dtype, merge=True):
    """A train.py checkpoint (ckpt.pt or its run dir) -> (model, tokenizer, the run's flags). A LoRA run's
    adapters are merged into its fp32 base (merge=False: the peft model, fp32); an --fsdp run's DCP shards
    are read by this one process."""
    path, ckpt = run.load_checkpoint(path)  # ValueError in one line when missing, unreadable or unsafe
    cfg = ckpt["config"]
    cpu = torch.device("cpu")
    rank = cfg.get("lora_rank", 0)
    if "dcp" in ckpt:  # an --fsdp run: fp32 master weights, sharded
        import scale

        model = load_model(cfg["model"], cpu, torch.float32, trainable=False)
        scale.load_dcp(os.path.join(os.path.dirname(path), ckpt["dcp"]), model)
    elif rank:  # the adapters, on the fp32 base they were trained on
        import scale

        model = scale.add_lora(load_model(cfg["model"], cpu, torch.float32, trainable=False), rank, seed=cfg["seed"])
        scale.load_trainable_state(model, ckpt["model"])
        if not merge:
            return model, load_tokenizer(cfg["model"]), cfg
        model = model.merge_and_unload()
    else:
        model = load_model(cfg["model"], device, dtype, trainable=False)
        model.load_state_dict(ckpt["model"])
    return model.to(device, dtype), load_tokenizer(cfg["model"]), cfg


def dict_literal(text):  # --task-options' text -> a dict, or ValueError in one line
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"--task-options {text!r} is not a dict literal; pass e.g. \"{{'max_digits': 1}}\"")
    return value


def resolve_task(args):
    """--task's Task with --task-options; without --task a --ckpt run's task, data dir and task options (flags given
    still win), said in one first line; else gsm8k."""
    cfg = run.load_checkpoint(args.ckpt)[1]["config"] if args.ckpt else {}
    options = None
    if args.task_options is not None:
        options = dict_literal(args.task_options)
    if args.task is None and cfg.get("task"):
        args.task = cfg["task"]
        args.data_dir = args.data_dir or cfg.get("data_dir")
        if options is None:
            options = cfg.get("task_options", {})
        said = [f"task {args.task}", args.data_dir and f"data dir {args.data_dir}", options and "its options"]
        print(f"{', '.join(filter(None, said))} (from the run; --task to change)")
    args.task = args.task or "gsm8k"
    return importlib.import_module("extra_tasks").get(args.task, options)  # any task: tasks.py's and the others


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", help="tasks.py, extra_tasks.py, rg:NAME (default: a --ckpt run's task, else gsm8k)")
    p.add_argument(
        "--data-dir",
        type=config.user_path,
        help="GSM8K's dir (else $GSM8K_DIR, else download); jsonl's .jsonl file or dir",
    )
    p.add_argument("--task-options", help="the task's options (train.py's task_options), e.g. \"{'digits': 2}\"")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=config.user_path, help="hub id, local HF dir, .gguf file or smollm2-135m")
    src.add_argument("--ckpt", type=config.user_path, help="train.py out dir or ckpt.pt")
    p.add_argument("--split", default="test", choices=["train", "test"])
    p.add_argument("--limit", type=int, default=None, help="first N examples of the split (default: all)")
    p.add_argument("--n", type=int, default=1, help="samples per question; 1 = greedy")
    p.add_argument("--temperature", type=float, default=Sampler.temperature, help="used when --n > 1")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="completions decoded together")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *sorted(DTYPES)],
        help="weights for decoding; auto: bfloat16 where its matmuls are native, else float32",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=config.user_path,
        help="predictions jsonl (default: beside the ckpt, or ./predictions.jsonl; a new name when that exists)",
    )
    p.add_argument(
        "--export",
        type=config.user_path,
        metavar="DIR",
        help="write --ckpt as a HF folder (weights in --dtype, LoRA merged) to DIR instead of evaluating",
    )
    p.add_argument("--adapter", action="store_true", help="with --export: a LoRA run's adapters as a peft folder")
    p.add_argument(
        "--plot",
        nargs="+",
        type=config.user_path,
        metavar="RUN",
        help="draw these runs' curves to --out "
        "(default curves.png, or a new name when that exists) instead of evaluating",
    )
    p.add_argument("--key", default="reward", help="--plot: the first panel's metric (e.g. reward/correct, kl)")
    p.add_argument("--eval-key", default=None, help="--plot: the eval panel's (default: eval/strict_acc if logged)")
    p.add_argument("--smooth", type=int, default=5, help="--plot: running-mean window in steps")
    p.add_argument("--title", default=None, help="--plot: the figure's title")
    args = p.parse_args()
    check_ranges(
        p,
        args,
        {
            "limit": ">= 1",
            "n": ">= 1",
            "temperature": "> 0",
            "max_new_tokens": ">= 1",
            "batch_size": ">= 1",
            "seed": "[0, 9e18]",
            "smooth": ">= 1",
        },
    )
    given = {k for k, v in vars(args).items() if v != p.get_default(k)}
    plotting = {"key", "eval_key", "smooth", "title"}
    idle = sorted(given - {"plot", "out"} - plotting if args.plot else given & plotting)
    if idle:  # a flag of the other mode
        p.error(f"--{idle[0].replace('_', '-')} has no effect {'with' if args.plot else 'without'} --plot; drop it")
    if args.plot:
        import plot  # the curves: plot.py, imported only here

        return plot.plot(p, args, fresh)
    if args.adapter and args.export is None:
        p.error("--adapter writes a LoRA run's adapters with --export DIR; pass --export DIR or drop --adapter")
    if args.export is not None:
        return export(p, args, given)
    return predict(p, args, given)


def predict(p, args, given):
    """eval.py without --plot or --export: the task's split scored, the predictions written beside the run (--ckpt)
    or to --out, a one-line summary printed."""
    if "temperature" in given and args.n == 1:
        print("note: --temperature has no effect with --n 1 (greedy); pass --n > 1 to sample")
    if args.n > args.batch_size:
        print(f"note: --n {args.n} > --batch-size {args.batch_size}: each question's {args.n} samples decode together")
    run.exit_on_interrupt("no predictions written")
    tmp = None
    try:
        device = resolve_device(args.device)
        dtype, note = resolve_dtype(args.dtype, device)
        check_dtype(device, dtype)
        task = resolve_task(args)
        examples = task.load(args.split, data_dir=args.data_dir)[: args.limit]  # what must exist, before any write
        beside = (
            os.path.join(
                args.ckpt if os.path.isdir(args.ckpt) else os.path.dirname(args.ckpt),
                f"predictions_{args.task.replace(':', '-')}_{args.split}.jsonl",
            )
            if args.ckpt
            else "predictions.jsonl"
        )
        out = args.out or fresh(beside)  # a default never replaces a file
        if os.path.isdir(out):
            raise ValueError(
                f"--out {out} is a directory; pass a file path such as {os.path.join(out, 'predictions.jsonl')}"
            )
        folder = os.path.dirname(os.path.abspath(out))
        while not os.path.exists(folder):  # the nearest folder that is there: the rest would be made
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--out {out} cannot be written ({folder} is not a writable folder); pass another path")
        name = args.model or "smollm2-135m"
        if not args.ckpt:
            load_tokenizer(name)  # the model named is there (its weights load later)
        try:  # before the evaluation, not after it: a bad path must not cost the run
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            open(out + ".tmp", "w").close()
            os.remove(out + ".tmp")
        except OSError as e:
            raise ValueError(f"--out {out} cannot be written ({e.strerror}); pass another path") from None
        model, tok, cfg = (
            load_checkpoint_model(args.ckpt, device, dtype)
            if args.ckpt
            else (load_model(name, device, dtype, trainable=False), load_tokenizer(name), {})
        )
        env = task.env(tok) if task.env else None  # with the run's task_options, or --task-options
        fields = {f.name: cfg[f.name] for f in dataclasses.fields(Sampler) if f.name in cfg}  # the run's sampling
        sampler = Sampler(**{**fields, "temperature": args.temperature})
        loop = decode_dynamic  # on CUDA the decode step captured as a CUDA graph (decode.py), where its probe passes
        if device.type == "cuda":
            loop = importlib.import_module("decode").on_cuda
    except ValueError as e:  # ModelError, DataError, a bad checkpoint or path: what was named cannot be used
        p.error(str(e))
    try:
        if note:
            print(note)
        summary, records = evaluate(
            model,
            tok,
            task,
            examples,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            n=args.n,
            sampler=sampler,
            seed=args.seed,
            dtype=dtype,
            env=env,
            loop=loop,
        )
        print(
            f"{args.task}/{args.split} {args.ckpt or name}: "
            + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())
        )
        try:
            tmp = out + ".tmp"
            with open(tmp, "w") as f:  # written whole, then renamed: a kill leaves no half file
                f.writelines(json.dumps(r) + "\n" for r in records)
            os.replace(tmp, out)
        except OSError as e:  # a full disk: the summary above stands
            sys.exit(f"error: could not write the predictions to {out} ({e.strerror or e})")
        print(f"predictions -> {out}")
    finally:  # every way out, an interruption too: no temp file left behind
        run.remove(tmp)


def export(p, args, given):
    """eval.py --ckpt RUN --export DIR [--adapter]: the checkpoint as a folder transformers loads."""
    if not args.ckpt:
        p.error("--export needs --ckpt (a train.py run); a --model is already a HF model")
    idle = sorted(given - {"ckpt", "export", "adapter", "dtype"})
    if idle:
        p.error(f"--export writes a checkpoint, it does not evaluate: drop --{' --'.join(idle).replace('_', '-')}")
    if os.path.exists(args.export) and (not os.path.isdir(args.export) or os.listdir(args.export)):
        p.error(f"--export {args.export} exists and is not an empty directory; pass a new one")
    run.exit_on_interrupt("nothing exported")
    try:
        model, tok, cfg = load_checkpoint_model(args.ckpt, torch.device("cpu"), torch.float32, merge=False)
    except ValueError as e:
        p.error(str(e))
    if args.adapter and not cfg.get("lora_rank"):
        p.error(f"--adapter: {args.ckpt} is a full fine-tune, not a LoRA run; drop --adapter")
    name = "bfloat16" if args.dtype == "auto" else args.dtype  # a file format, not this machine's compute
    from export import export_hf  # the folder's writing: export.py (train.py's export at the end uses it too)

    failed = export_hf(model, tok, args.export, DTYPES[name], adapter=args.adapter)
    if failed:
        sys.exit(f"error: {failed}")
    print(f"exported {args.ckpt} ({'adapter' if args.adapter else name}) to {args.export}")


if __name__ == "__main__":
    main()
