"""
torch.compile of the training forward: eager against the decoder compiled, interleaved on the same batches, and
whether compiling pays for the standard 80-step arith run (configs/arith_smollm2_cpu.py), compile time included.

    python bench_compile.py               # 6 rounds of widths 16, 32, 48; the 80-step projection
    python bench_compile.py --rounds 2    # fewer rounds (compiling alone takes minutes on a CPU)

The training pass as train.py runs it: rollout.token_logprobs with prompt sharing, forward and backward, on 2 arith
prompts x G=8 with completion widths bucketed to multiples of 16 (bounds recompiles), fp32 master weights with
autocast to --dtype. Each width's first compiled step includes its compile; the others give the compiled step time.
"""

import argparse
import random
import statistics
import time

import torch
from torch._dynamo.utils import counters

import rollout
from models import DTYPES, load_model, load_tokenizer, resolve_device, resolve_dtype
from rollout import stop_token_ids
from eval import check_ranges
from tasks import TASKS

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="smollm2-135m")
p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 where its matmuls are native")
p.add_argument("--rounds", type=int, default=6, help="rounds over the widths; each width compiles in the first")
args = p.parse_args()
check_ranges(p, args, {"rounds": ">= 1"})


def compile_bench(model_name, dtype, rounds, widths=(16, 32, 48), steps=80):
    """Forward+backward of token_logprobs (share=True, as train.py) on 2 arith prompts x G=8, completion widths
    bucketed to multiples of 16 (bounds recompiles), eager and compiled in turn on the same batch (drift hits both)."""
    dev, G, rng = resolve_device("auto"), 8, random.Random(0)
    gen = torch.Generator().manual_seed(0)
    tok, model = load_tokenizer(model_name), load_model(model_name, dev)  # fp32 master weights
    stop, task, decoder = stop_token_ids(tok, model), TASKS["arith"], model.get_decoder()
    examples, V = task.load("train"), model.config.vocab_size
    compiled = torch.compile(decoder.forward, dynamic=True)

    def batch(width):  # lengths 8..width (one row at width), random ids, a stop token ends each row that fits
        ids, mask = rollout.left_pad(
            rollout.encode_prompts(tok, [task.prompt(e) for e in rng.sample(examples, 2)]), stop[0]
        )  # (2, P)
        lens = [rng.randint(8, width) for _ in range(2 * G - 1)] + [width]
        comp = torch.randint(100, V, (2 * G, width), generator=gen)  # (16, width) no special token (< 100)
        for i, n in enumerate(lens[:-1]):
            comp[i, n - 1] = stop[0]
        cmask = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).long()  # (16, width) to the stop
        return torch.cat([ids.repeat_interleave(G, 0), comp.masked_fill(cmask == 0, stop[0])], 1), torch.cat(
            [mask.repeat_interleave(G, 0), cmask], 1
        )  # (16, P+width) each

    def step(fwd, ids, mask, width):  # -> (seconds, new graphs, logp)
        decoder.forward, g0, t = fwd, counters["stats"]["unique_graphs"], time.perf_counter()
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            logp, ent, _ = rollout.token_logprobs(model, ids, mask, width, with_entropy=True, share=True)
        (logp.sum() + 0.01 * ent.sum()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t, counters["stats"]["unique_graphs"] - g0, logp.detach()

    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    name = str(dtype).removeprefix("torch.")
    print(f"{cpu} | {dev} {name} autocast | {torch.get_num_threads()} threads | torch {torch.__version__}")
    model.train()
    eager = decoder.forward
    step(eager, *batch(16), 16)  # warm-up (oneDNN primitives), not timed
    rows = []  # (round, width, P, t_eager, t_compiled, new graphs, max |dlogp|)
    for r in range(rounds):
        for w in widths:
            ids, mask = batch(w)
            te, _, le = step(eager, ids, mask, w)
            print(f"round {r} width {w} P {ids.size(1) - w}: eager {te:.2f}s", end=" ", flush=True)
            tc, ng, lc = step(compiled, ids, mask, w)  # a kill here still leaves the eager times printed
            rows.append((r, w, ids.size(1) - w, te, tc, ng, (le - lc).abs().max().item()))
            print(f"compiled {tc:.2f}s new graphs {ng} max|dlogp| {rows[-1][6]:.3g}", flush=True)

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    te, tc = med([x[3] for x in rows]), med([x[4] for x in rows if not x[5]])  # compiled: steps that did not compile
    comp_s = sum(x[4] - med([y[4] for y in rows if y[1] == x[1] and not y[5]]) for x in rows if x[5])
    print(
        f"\ngraph breaks {sum(counters['graph_break'].values())} | recompiles (steps with new graphs) "
        f"{sum(1 for x in rows if x[5])} | unique graphs {counters['stats']['unique_graphs']}\n"
    )
    print("| width | eager s (median) | compiled s (median, no compile) | compile s (first steps - median) |")
    print("|---|---:|---:|---:|")
    for w in widths:
        e, c = med([x[3] for x in rows if x[1] == w]), med([x[4] for x in rows if x[1] == w and not x[5]])
        print(f"| {w} | {e:.2f} | {c:.2f} | {sum(x[4] - c for x in rows if x[1] == w and x[5]):.1f} |")
    print(
        f"\n{steps} steps, training pass: eager {steps} x {te:.2f} = {steps * te:.0f} s; compiled "
        f"{comp_s:.0f} + {steps} x {tc:.2f} = {comp_s + steps * tc:.0f} s ({te / tc:.2f}x per step). The reference "
        "pass (no grad) gains at most proportionally, and pays its own compile."
    )


compile_bench(args.model, resolve_dtype(args.dtype, resolve_device("auto"))[0], args.rounds)
