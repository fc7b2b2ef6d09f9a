"""The phases of bench.py's standard step, each alone. The training pass: its time under each attention
implementation, and the top operators by self CPU time. One rollout (2 GSM8K prompts x 8, 128 new tokens, seed 0) is
sampled once, then trained on as train.py does: micro-batches of 4 under bf16 autocast inside rollout.cast_once, prompt
sharing on, each micro-batch's log-probs and entropy, then its backward (no optimizer step: every pass sees the same
weights).

    python bench_profile.py                      # this checkout: sdpa, sdpa_math, eager in turn, then the profile
    python bench_profile.py --src DIR            # the rollout.py of another checkout (git archive REV | tar -x -C DIR)
    python bench_profile.py --sample             # the sampling of that rollout instead: its time, then its profile
    python bench_profile.py --decode             # one decode step of the 2 prompts x 8 against its matmuls alone
"""

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--src", default=os.path.dirname(os.path.abspath(__file__)), help="the checkout whose code runs")
p.add_argument("--data-dir", help="GSM8K dir (else $GSM8K_DIR, else downloaded once)")
p.add_argument("--rounds", type=int, default=3, help="timed passes per measurement (median)")
p.add_argument("--rows", type=int, default=12, help="profile rows printed")
p.add_argument("--sample", action="store_true", help="time and profile rollout.sample (the decode loop) instead")
p.add_argument("--decode", action="store_true", help="time one decode step beside its matmuls alone, interleaved")
args = p.parse_args()
if args.sample and args.decode:
    p.error("--sample and --decode each time one phase: give one of them")
sys.path.insert(0, os.path.abspath(args.src))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rollout  # noqa: E402
from models import load_model, load_tokenizer  # noqa: E402
from tasks import TASKS  # noqa: E402

torch.manual_seed(0)
task, tok = TASKS["gsm8k"], load_tokenizer("smollm2-135m")
model = load_model("smollm2-135m", torch.device("cpu")).train()
prompts = [task.prompt(e) for e in task.load("train", data_dir=args.data_dir)[:2]]
stops = rollout.stop_token_ids(tok, model)


def draw():
    return rollout.sample(
        model,
        tok,
        prompts,
        8,
        max_new_tokens=128,
        stop_ids=stops,
        dtype=torch.bfloat16,
        generator=torch.Generator().manual_seed(0),
    )


def decode_vs_gemm(rows, dtype=torch.bfloat16, n=15):
    """Print the median ms of one decode step (rollout.sample's call: the model on its KV cache of the two GSM8K
    prompts, left-padded, repeated to `rows`, under one autocast region) beside the median ms of its matmuls alone: a
    (rows, in) activation by every nn.Linear weight (lm_head included), weights cast once to the same dtype, and the
    same matmuls with each weight prepacked once for oneDNN (what a frozen compiled graph does; F.linear, which the
    model's nn.Linear calls, lays each weight out again per call). The three alternate, so the machine's drift hits
    all."""
    model.eval()
    ids, mask = rollout.left_pad(rollout.encode_prompts(tok, prompts), 0)  # (B, P)
    weights = [m.weight.detach().to(dtype) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print(
        f"\none decode step against its matmuls alone ({len(weights)} weights, {str(dtype).removeprefix('torch.')}, "
        f"prompts of {ids.size(1)} columns, median of {n})\n\n"
        "| rows | decode step ms | GEMM-only ms | ratio | GEMM-only, weights prepacked ms |\n|---:|---:|---:|---:|---:|"
    )
    r_ids, r_mask = (t.repeat_interleave(-(-rows // len(prompts)), 0)[:rows] for t in (ids, mask))  # (rows, P)
    pos, cache = (r_mask.cumsum(-1) - 1).clamp(min=0), rollout._Cache(config=model.config)  # sample()'s
    x = {w.size(1): torch.randn(rows, w.size(1), dtype=dtype) for w in weights}
    packed = []
    if torch.backends.mkldnn.is_available():  # a build without oneDNN prints "-" there
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    t_dec, t_mm, t_pack, tok_ = [], [], [], torch.full((rows, 1), 100)
    kw = rollout._cache_kwarg(model, cache)  # past_key_values, or cache from transformers 5.24
    with torch.no_grad(), rollout._autocast(model, dtype):  # as sample(): one region, weights cast once
        model(input_ids=r_ids, attention_mask=r_mask, position_ids=pos, **kw, use_cache=True)
        pos = pos[:, -1:]  # (rows, 1)
        for _ in range(n + 2):  # two warm-ups
            r_mask, pos = F.pad(r_mask, (0, 1), value=1), pos + 1  # (rows, P+1...), (rows, 1)
            t = time.perf_counter()
            model(input_ids=tok_, attention_mask=r_mask, position_ids=pos, **kw, use_cache=True)
            t_dec.append(time.perf_counter() - t)
            t = time.perf_counter()
            for w in weights:
                F.linear(x[w.size(1)], w)
            t_mm.append(time.perf_counter() - t)
            t = time.perf_counter()
            for w, w_packed in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(x[w.size(1)], w_packed, None, "none", [], "")
            t_pack.append(time.perf_counter() - t)
    d, m = (statistics.median(v[2:]) * 1e3 for v in (t_dec, t_mm))
    k = "-"
    if packed:
        k = f"{statistics.median(t_pack[2:]) * 1e3:.1f}"
    print(f"| {rows} | {d:.1f} | {m:.1f} | {d / m:.2f}x | {k} |", flush=True)


print(f"# {time.strftime('%Y-%m-%d')} | {torch.get_num_threads()} threads | {args.src}")
if args.decode:
    decode_vs_gemm(16)  # the standard step's 2 prompts x 8
    sys.exit()
r = draw()


def train_pass():
    once = getattr(rollout, "cast_once", None)  # absent in a checkout without it: autocast per micro-batch
    block = nullcontext()
    if once is not None:
        block = once(torch.device("cpu"))
    with block:
        for rows, ids, mask, c, *_ in rollout.micro_batches(r, 4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, entropy, _ = rollout.token_logprobs(model, ids, mask, c, with_entropy=True, share=True)
            (logp * r.completion_mask[rows, :c]).sum().backward()
    model.zero_grad(set_to_none=True)


def timed(work):
    work()  # warm-up
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


ATTENTION = {  # name -> (the model's attn_implementation, whether SDPA may pick its fused CPU kernel)
    "sdpa": ("sdpa", True),
    "sdpa_math": ("sdpa", False),
    "eager": ("eager", True),
}
lens = r.completion_mask.sum(1).float()
print(f"16 rows, completion lengths mean {lens.mean():.0f} max {lens.max():.0f}\n")
if args.sample:  # the same rollout each time (seed 0), the model's default attention
    print(f"rollout.sample: {timed(draw):.2f} s (median)")
    with torch.profiler.profile() as prof:
        draw()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    sys.exit()
print("| attention | training pass s (median) |\n|---|---:|")
for name, (impl, fused) in ATTENTION.items():
    model.set_attn_implementation(impl)
    torch.backends.cuda.enable_flash_sdp(fused)  # the same switch picks SDPA's CPU kernel
    print(f"| {name} | {timed(train_pass):.2f} |", flush=True)
model.set_attn_implementation("sdpa")
torch.backends.cuda.enable_flash_sdp(True)
with torch.profiler.profile() as prof:
    train_pass()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
