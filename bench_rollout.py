"""
Benchmark rollout.py on CPU with SmolLM2-135M and print markdown tables for the README.

    python bench_rollout.py [--model smollm2-135m] [--threads 1] [--repeats 1] [--no-autocast]

1. Rollout tokens/s: 2 GSM8K test prompts (tasks.gsm8k_prompt) x G=8 = 16 completions x 128 new
   tokens, temperature 1, no top-k/top-p. (a) `rollout.sample` on bf16 weights (prefix reuse: each
   prompt prefilled once), with the lean step and, for comparison, with the HF forward;
   (b) HF `model.generate` on the same bf16 model (num_return_sequences=G, so it prefills all 16
   rows); (c) `rollout.sample` on fp32 weights with dtype=bf16, as train.py runs it (prefill under
   autocast, the lean step on weights cast once per rollout). Every row
   makes exactly 128 tokens: `sample` gets as its only stop id a special token that never occurs
   in these completions (checked), `generate` gets min_new_tokens = max_new_tokens. One short
   warm-up call per variant, then `--repeats` timed calls; the fastest is reported.
2. Peak memory of the log-prob pass on 16 rows x 300 tokens (prompt 172 + completion 128, only the
   completion scored, as in training): `rollout.token_logprobs` vs the naive
   `model(...).logits[:, -C-1:-1].float().log_softmax(-1).gather(...)`, in no_grad and with grad
   (forward + backward). Each variant runs in a fresh subprocess that loads the model, does a tiny
   warm-up pass (which also allocates the .grad buffers, so they are not in the increment), then
   resets the RSS high-water mark (/proc/self/clear_refs): peak = VmHWM at the end is the peak
   RSS during the measured pass, increment = peak - RSS just before it. (ru_maxrss is not used:
   after subprocess's vfork + exec it also holds the parent's RSS at spawn time.)
"""

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time

import torch
import transformers

import lean
import models
from rollout import HFDecoder, encode_prompts, left_pad, sample, token_logprobs

HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# args

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="smollm2-135m", help="alias, HF folder or hub id")
p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 keeps torch's default")
p.add_argument("--repeats", type=int, default=1, help="timed rollout calls per variant (1-3), after a warm-up")
# --- rollout
p.add_argument("--prompts", type=int, default=2)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=128)
p.add_argument("--data-dir", default=os.environ.get("GSM8K_DIR") or os.path.join(HERE, "..", "shared", "data", "gsm8k"),
               help="folder with GSM8K test.jsonl")
p.add_argument("--no-autocast", action="store_true", help="skip variant (c): fp32 weights, dtype=bf16")
# --- memory
p.add_argument("--mem-rows", type=int, default=16)
p.add_argument("--mem-prompt", type=int, default=172)
p.add_argument("--mem-completion", type=int, default=128)
p.add_argument("--mem-dtype", default="bfloat16", choices=list(models.DTYPES), help="weights for the log-prob pass")
p.add_argument("--skip-memory", action="store_true")
p.add_argument("--child", help=argparse.SUPPRESS)  # runs one memory variant and prints a JSON line
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
CPU = torch.device("cpu")


def proc_mib(field):
    """VmRSS (current) or VmHWM (peak since start or since the last clear_refs) of this process."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024

# -----------------------------------------------------------------------------
# memory child: one variant per fresh process, so its peak RSS is that variant's own

def logprob_pass(model, impl, mode, N, P, C):
    """One log-prob pass of `impl` (ours|naive) on random ids (N, P+C); backward too when mode == grad."""
    ids = torch.randint(100, model.config.vocab_size, (N, P + C), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.set_grad_enabled(mode == "grad"):
        if impl == "ours":
            logp = token_logprobs(model, ids, mask, C)[0]  # (N, C)
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P+C)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # (N, P+C, V)
            logp = logits[:, -C - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)  # (N, C)
        if mode == "grad":
            logp.sum().backward()


if args.child:
    impl, mode = args.child.split("-")  # ours|naive - nograd|grad
    model = models.load_model(args.model, CPU, models.DTYPES[args.mem_dtype], trainable=mode == "grad")
    logprob_pass(model, impl, mode, 2, 8, 8)  # the first pass pages in weights and kernels (~200 MiB, once)
    gc.collect()
    # loading peaks at ~1 GiB: reset the high-water mark (Linux >= 4.0) so VmHWM below is the
    # peak of the measured pass alone
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = proc_mib("VmRSS")
    t0 = time.time()
    logprob_pass(model, impl, mode, args.mem_rows, args.mem_prompt, args.mem_completion)
    # not ru_maxrss: it is max(VmHWM, the parent's RSS when it spawned us), vfork + exec carry that over
    print(json.dumps({"base": base, "peak": proc_mib("VmHWM"), "seconds": time.time() - t0}))
    sys.exit(0)

# -----------------------------------------------------------------------------
# setup

cpu_name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.processor())
print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
print(f"cpu: {cpu_name}, {os.cpu_count()} logical cores, load average {os.getloadavg()[0]:.1f} at start")
print(f"torch {torch.__version__}, transformers {transformers.__version__}, torch.get_num_threads() = "
      f"{torch.get_num_threads()}")

tok = models.load_tokenizer(args.model)
try:
    from tasks import gsm8k_prompt, load_gsm8k
    prompts = [gsm8k_prompt(ex) for ex in load_gsm8k("test", args.data_dir)[:args.prompts]]
except Exception as e:  # a benchmark still runs without the data: any question of similar length
    print(f"GSM8K not loaded ({e}); using a fixed question")
    prompts = [[{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
                 "half as many clips in May. How many clips did Natalia sell altogether in April and May?"}]] * args.prompts
G, T = args.group_size, args.max_new_tokens
N = args.prompts * G
# a special token a chat model never writes in a math answer: no row stops, all make T tokens
never = tok.convert_tokens_to_ids("<empty_output>")
never = never if never is not None and never != tok.unk_token_id else len(tok) - 1
prompt_lens = [len(x) for x in encode_prompts(tok, prompts)]
print(f"rollout: {args.prompts} prompts (lengths {prompt_lens}) x G={G} = {N} rows x {T} new tokens; "
      f"stop_ids=[{never}] ({tok.convert_ids_to_tokens(never)!r}, never sampled) so every row makes {T} tokens")


def timed(fn, repeats):
    """Warm up once on a short call, then the best of `repeats` full calls: (seconds, last result)."""
    fn(8)
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.time()
        out = fn(T)
        best = min(best, time.time() - t0)
    return best, out


def ours(model, dtype=None, use_lean=True):
    decoder = lean.LeanDecoder if use_lean else HFDecoder  # HFDecoder: the model's forward and its DynamicCache

    def run(new_tokens):
        r = sample(model, tok, prompts, G, new_tokens, [never], temperature=1.0,
                   generator=torch.Generator().manual_seed(0), dtype=dtype, decoder=decoder)
        if new_tokens == T:
            assert r.completion_ids.shape == (N, T) and bool(r.truncated.all()), "a row stopped early"
        return r
    return run


def hf(model):
    ids, mask = left_pad(encode_prompts(tok, prompts), tok.pad_token_id)  # (B, P) the same tokens as ours

    def run(new_tokens):
        torch.manual_seed(0)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                             num_return_sequences=G, pad_token_id=tok.pad_token_id, use_cache=True)  # (N, P+T)
        assert out.shape == (N, ids.size(1) + new_tokens)
        return out
    return run

# -----------------------------------------------------------------------------
# 1. rollout throughput

rows = []
bf16 = models.load_model(args.model, CPU, torch.bfloat16, trainable=False)
for name, fn in [("`rollout.sample`, bf16 weights (`lean` step)", ours(bf16)),
                 ("`rollout.sample`, bf16 weights, HF forward per step", ours(bf16, use_lean=False)),
                 ("HF `generate`, bf16 weights", hf(bf16))]:
    sec, _ = timed(fn, args.repeats)
    rows.append((name, sec))
    print(f"  {name}: {sec:.1f} s", flush=True)
if not args.no_autocast:
    fp32 = models.load_model(args.model, CPU, torch.float32, trainable=False)
    sec, _ = timed(ours(fp32, dtype=torch.bfloat16), args.repeats)
    rows.append(("`rollout.sample`, fp32 weights, `dtype=bf16` (cast once per rollout: train.py)", sec))
    print(f"  {rows[-1][0]}: {sec:.1f} s", flush=True)

print(f"\n### Rollout: {N} completions x {T} new tokens, best of {args.repeats} after a warm-up\n")
print("| sampler | seconds | tokens/s |")
print("|---|---:|---:|")
for name, sec in rows:
    print(f"| {name} | {sec:.1f} | {N * T / sec:.0f} |")

# -----------------------------------------------------------------------------
# 2. peak memory of the log-prob pass, one fresh process per variant

if not args.skip_memory:
    R, Pm, Cm = args.mem_rows, args.mem_prompt, args.mem_completion
    print(f"\n### Log-prob pass: {R} rows x {Pm + Cm} tokens (prompt {Pm} + completion {Cm} scored), "
          f"{args.mem_dtype} weights, peak RSS per fresh process\n")
    print("| log-probs | grad | peak RSS (MiB) | increment over loaded model (MiB) | seconds |")
    print("|---|---|---:|---:|---:|")
    for variant in ["ours-nograd", "naive-nograd", "ours-grad", "naive-grad"]:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--model", args.model,
               "--threads", str(torch.get_num_threads()), "--mem-rows", str(R), "--mem-prompt", str(Pm),
               "--mem-completion", str(Cm), "--mem-dtype", args.mem_dtype]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
        if res.returncode:
            print(f"| {variant} | failed: {res.stderr.strip().splitlines()[-1][:120]} | | | |")
            continue
        m = json.loads(res.stdout.strip().splitlines()[-1])
        impl, mode = variant.split("-")
        label = "`token_logprobs` (chunked head)" if impl == "ours" else "naive full-vocab `log_softmax`"
        print(f"| {label} | {'fwd+bwd' if mode == 'grad' else 'no_grad'} | {m['peak']:.0f} | "
              f"{m['peak'] - m['base']:.0f} | {m['seconds']:.1f} |", flush=True)
