"""
The GPU check in one command: the decode sweep (captured against eager), the standard step against TRL at the same
micro-batch, the 0.5B recipe shape phase by phase, and the CUDA tests, each part under its own time limit, then one
dated table. No weights travel: every model is its shape with random weights (bench.py --random-init).

    python bench_gpu.py --model DIR --data-dir GSM8K_DIR     # DIR: SmolLM2-135M-Instruct's config and tokenizer
    python bench_gpu.py --model DIR --data-dir D --parts sweep,tests   # some parts only
    python bench_gpu.py --model DIR --data-dir D --parts sweep --rows 16 --budgets 8   # on a CPU: a smoke run

The sweep samples 2-64 GSM8K prompts x G=8 (16-512 rows) with rollout.sample under bf16 autocast and times the
decode loop alone (prefill, tokenization and decoding of the text left out): ms a step, generated tokens a second.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = ("sweep", "tests", "trl135m", "trl05b", "recipe")
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", required=True, help="a folder with SmolLM2-135M-Instruct's config and tokenizer")
p.add_argument("--data-dir", required=True, help="GSM8K's train.jsonl and test.jsonl")
p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
p.add_argument("--rows", default="16,64,256,512", help="the sweep's rows")
p.add_argument("--budgets", default="128,512", help="the sweep's new tokens")
p.add_argument("--eager-512", default="16,512", help="the rows whose 512-token budget is also decoded eagerly")
p.add_argument("--out", default=None, help="a JSON file for every figure")
args = p.parse_args()
parts = args.parts.split(",")
if not set(parts) <= set(PARTS):
    p.error(f"--parts {args.parts}: choose among {', '.join(PARTS)}")
figures = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")}


def save():
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


def sweep():
    """Each rows x budget, captured ("graph") and eager ("dynamic"): the decode loop's seconds, ms a step, tok/s."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import decode
    import rollout
    from models import load_tokenizer
    from tasks import TASKS

    tok = load_tokenizer(args.model)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU: a smoke run of this script (--rows 16)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)).to(device)  # fp32 master weights
    prompts = [TASKS["gsm8k"].prompt(e) for e in TASKS["gsm8k"].load("train", data_dir=args.data_dir)[:64]]
    timed = {}

    def sync():  # the device's queue drained, so that the host's clock times its work
        if device == "cuda":
            torch.cuda.synchronize()

    def timing(fn):  # the decode loop alone, synchronized on both sides
        def run(*a, **k):
            sync()
            start = time.perf_counter()
            out = fn(*a, **k)
            sync()
            timed["s"] = time.perf_counter() - start
            return out

        return run

    decode.DECODE = {k: timing(v) for k, v in decode.DECODE.items()}
    rows_list = [int(r) for r in args.rows.split(",")]
    for budget in [int(b) for b in args.budgets.split(",")]:
        for rows in rows_list:
            for mode in ("graph", "dynamic"):
                if mode == "dynamic" and budget > 128 and str(rows) not in args.eager_512.split(","):
                    continue
                kw = dict(stop_ids=[tok.eos_token_id], loop=decode.DECODE[mode], dtype=torch.bfloat16)
                rollout.sample(model, tok, prompts[: rows // 8], 8, max_new_tokens=8, **kw)  # warm-up, the probe
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                gen = torch.Generator().manual_seed(0)
                r = rollout.sample(model, tok, prompts[: rows // 8], 8, max_new_tokens=budget, generator=gen, **kw)
                steps, tokens = r.completion_ids.size(1), int(r.completion_mask.sum())
                row = dict(
                    mode=mode,
                    rows=rows,
                    budget=budget,
                    s=timed["s"],
                    ms_step=1000 * timed["s"] / steps,
                    tok_s=tokens / timed["s"],
                    gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
                )
                figures.setdefault("sweep", []).append(row)
                save()
                print(json.dumps(row), flush=True)


def bench(name, *extra, timeout=240):
    """bench.py in a subprocess: its printed table kept, its exit code."""
    cmd = [sys.executable, os.path.join(HERE, "bench.py"), "--model", args.model, "--data-dir", args.data_dir, *extra]
    start = time.time()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text, rc = out.stdout + out.stderr[-3000:], out.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode() + "\n[timed out]", "timeout"
    figures[name] = dict(cmd=" ".join(cmd[1:]), rc=rc, s=round(time.time() - start), out=text[-6000:])
    save()
    print(f"--- {name} (rc {rc}, {time.time() - start:.0f} s)\n{text[-2500:]}", flush=True)


def tests():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_decode.py"]
    try:
        out = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=200)
        text = out.stdout + out.stderr[-2000:]
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() + "\n[timed out]"
    figures["tests"] = text[-6000:]
    save()
    print(f"--- tests\n{text[-4000:]}", flush=True)


def part(name, fn, *a, **k):  # a part that fails is reported, and the others still run
    if name not in parts:
        return
    try:
        fn(*a, **k)
    except Exception:
        figures[name + "_error"] = traceback.format_exc()[-3000:]
        save()
        print(f"--- {name} failed\n{figures[name + '_error']}", flush=True)


recipe = ["--prompts-per-step", "64", "--max-new-tokens", "512", "--micro-batch", "16", "--steps", "2"]  # 0.5B config's
part("sweep", sweep)
part("tests", tests)
part("trl135m", bench, "trl135m", "--random-init", "same", "--vs-trl", "--steps", "3")
part("trl05b", bench, "trl05b", "--random-init", "qwen2.5-0.5b", "--vs-trl", "--steps", "3")
part("recipe", bench, "recipe", "--random-init", "qwen2.5-0.5b", *recipe, timeout=300)
print(
    f"\n{figures['date']} | {os.popen('nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null').read().strip()}"
)
print("| decode | rows | new tokens | loop s | ms a step | tok/s | GPU peak GiB |")
for r in figures.get("sweep", []):
    cells = [r["mode"], r["rows"], r["budget"], f"{r['s']:.2f}", f"{r['ms_step']:.2f}", f"{r['tok_s']:,.0f}"]
    print("| " + " | ".join(str(c) for c in cells) + f" | {r['gib']:.2f} |")
