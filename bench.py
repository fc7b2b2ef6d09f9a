"""
Benchmark one GRPO step of train.py, optionally side by side with TRL's GRPOTrainer.

    python bench.py                       # our loop: per-phase times, tokens/s, peak RSS
    python bench.py --vs-trl --rounds 3   # + TRL GRPOTrainer (pip install trl==1.16.0), in turn, median ratios
    python bench.py --vs-trl --trl-one-pass  # + TRL with all 16 completions in one pass, as a labelled extra row
    python bench.py --vs-trl --rev A --rev B  # ours from commits A and B (one row each) and TRL, in turn
    python bench.py --grid                # cost growth: group size 4/8/16, max new tokens 64/128/256
    python bench.py --random-init qwen2.5-0.5b  # a model of that shape with random weights (no weights to fetch)

Each phase alone: `python bench_profile.py` (the training pass; --sample: the sampling; --decode: one decode step
against its matmuls alone). torch.compile of the training forward: `python bench_compile.py`.

The standard configuration: SmolLM2-135M-Instruct, 2 GSM8K prompts x G=8 = 16 completions, both sides in
micro-batches of 4 (TRL: per_device_train_batch_size 4, gradient_accumulation_steps 4, so one generation of the 16
per optimizer step), 128 new tokens, temperature 1.0, beta=0.04 (reference model on), mu=1, lr 1e-6, fp32
master weights with bf16 autocast. Both sides train the same objective: k3 KL, no sampler correction on ours, and TRL's
use_bias_correction_kl=False (its default multiplies the KL term by the ratio, another KL gradient).
Each side runs in its own subprocess (peak RSS is that process's ru_maxrss); the first step is a
warm-up and the median of the others is reported.
"""

import argparse
import json
import os
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from config import user_path  # noqa: E402
from eval import check_ranges  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="smollm2-135m")
p.add_argument("--steps", type=int, default=4, help="steps per side; the first is a warm-up")
p.add_argument("--prompts-per-step", type=int, default=2)
p.add_argument("--group-size", type=int, default=8)
p.add_argument(
    "--micro-batch",
    type=int,
    default=4,
    help="both sides (TRL: per_device_train_batch_size, with "
    "gradient_accumulation_steps = completions / this): a micro-batch's activations are a step's peak "
    "memory; 4 rows run their prompt once, a group twice",
)
p.add_argument(
    "--trl-one-pass",
    action="store_true",
    help="with --vs-trl: also TRL with all completions in one "
    "pass (per_device_train_batch_size = completions), a labelled row beside, not in the ratios",
)
p.add_argument("--max-new-tokens", type=int, default=128)
p.add_argument("--beta", type=float, default=0.04)
p.add_argument("--lr", type=float, default=1e-6)
p.add_argument("--loss-type", default="grpo")
p.add_argument("--dtype", default="auto", help="both sides; auto: bfloat16 where its matmuls are native, else float32")
p.add_argument("--gradient-checkpointing", action="store_true", help="on both sides (TRL's own default is on)")
p.add_argument("--kl-estimator", default="k3", help="ours; k3 is what TRL computes")
p.add_argument(
    "--grid",
    action="store_true",
    help="ours at G = 4, 8, 16 and 64, 128, 256 new tokens (and TRL at two of them with --vs-trl)",
)
p.add_argument("--data-dir", default=None, type=user_path, help="GSM8K dir (else $GSM8K_DIR, else download)")
p.add_argument("--vs-trl", action="store_true", help="also run TRL's GRPOTrainer and print the ratios")
p.add_argument(
    "--rounds",
    type=int,
    default=1,
    help="with --vs-trl: run the two sides one after the other this many times and also print "
    "the median ratios (a VM's speed can drift within minutes)",
)
p.add_argument(
    "--ref-device",
    default=None,
    help="ours: the reference model's device (e.g. cpu: off the GPU; the "
    "GPU's peak memory is printed where there is one)",
)
p.add_argument(
    "--rev",
    action="extend",
    nargs="+",
    default=[],
    help="ours from this git revision (a `git archive` of it in a temporary folder) instead of the working tree; "
    "several (--rev A B, or --rev A --rev B): one row each, every revision and TRL in turn in each round",
)
p.add_argument(
    "--random-init",
    default=None,
    metavar="SHAPE",
    help="both sides: a model built from a config with random weights over --model's tokenizer (a GPU machine with "
    "no weights at hand): 'same' (--model's own config) or a larger model's shape: "
    "qwen2.5-0.5b, qwen2.5-1.5b. No answer is then right: a reward of the completion's hash keeps every group "
    "training, and completions run to --max-new-tokens",
)
p.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
p.add_argument("--src", default=HERE, help=argparse.SUPPRESS)
p.add_argument("--out", default=None, help=argparse.SUPPRESS)
args = p.parse_args()
if not args.child:  # every number's range; a flag of another mode is no flag here
    check_ranges(
        p,
        args,
        {
            "steps": ">= 2",
            "prompts_per_step": ">= 1",
            "group_size": ">= 2",
            "micro_batch": ">= 1",
            "max_new_tokens": ">= 1",
            "lr": "> 0",
            "rounds": ">= 1",
        },
    )
    if (args.rounds > 1 or args.trl_one_pass) and not args.vs_trl:
        p.error("--rounds and --trl-one-pass compare against TRL: add --vs-trl or drop them")
    if args.rev and args.grid:
        p.error("--rev picks the code of the step benchmark's rows: drop --grid with it")
SHAPES = {  # --random-init: the config fields that make --model's config another model's shape
    "same": {},
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
}
QWEN = dict(num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # and q/k/v biases: Qwen2's own
if args.random_init and args.random_init not in SHAPES:
    p.error(f"--random-init {args.random_init}: choose one of {', '.join(SHAPES)}")


def random_model(name, shape):
    """A folder with --model's tokenizer and a model of `shape` with random weights (seed 0), made once per shape in
    the cache; written beside and renamed, so a killed run leaves no half folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    from models import CACHE_DIR, load_tokenizer, resolve_model

    src = os.path.abspath(resolve_model(name))  # its tokenizer's folder, named and hashed: two folders, two entries
    out = os.path.join(CACHE_DIR, "random", f"{shape}-{os.path.basename(src)}-{zlib.crc32(src.encode()):08x}")
    if os.path.isdir(out):
        return out
    tok = load_tokenizer(name)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if SHAPES[shape]:
        cfg = Qwen2Config(**SHAPES[shape], **QWEN, **ids, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        cfg = AutoConfig.from_pretrained(resolve_model(name))
    torch.manual_seed(0)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{shape}-", dir=os.path.dirname(out))
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def bench_task():
    """The task both sides train on: GSM8K, with --random-init a reward of the completion's hash (spread in every
    group, so neither side skips a group's training)."""
    from tasks import TASKS

    task = TASKS["gsm8k"]
    if not args.random_init:
        return task

    def noise(completions, **_):
        return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]

    return task._replace(reward_fns={"noise": noise}, reward_weights={"noise": 1.0})


if args.random_init:
    args.model = random_model(args.model, args.random_init)
if args.dtype == "auto":  # resolved here, so that TRL's side runs in the same dtype as ours
    from models import resolve_device, resolve_dtype

    args.dtype = str(resolve_dtype("auto", resolve_device("auto"))[0]).removeprefix("torch.")
if (args.prompts_per_step * args.group_size) % args.micro_batch:
    p.error(f"--micro-batch {args.micro_batch} must divide the {args.prompts_per_step * args.group_size} completions")


def ours_child(out):
    """Run --src's train.py in this process; its metrics.jsonl gives the per-phase times."""
    sys.argv = (
        [
            "train.py",
            "--task",
            "gsm8k",
            "--model",
            args.model,
            "--steps",
            str(args.steps),
            "--prompts-per-step",
            str(args.prompts_per_step),
            "--group-size",
            str(args.group_size),
            "--micro-batch",
            str(args.micro_batch),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--temperature",
            "1.0",
            "--beta",
            str(args.beta),
            "--lr",
            str(args.lr),
            "--mu",
            "1",
            "--loss-type",
            args.loss_type,
            "--dtype",
            args.dtype,
            "--eval-n",
            "0",
            "--config",
            "save_every=0",
            "--config",
            "log_completions=0",
            "--config",
            "export=none",
            "--out-dir",
            out,
            "--kl-estimator",
            args.kl_estimator,
            "--is-mode",
            "none",
        ]
        + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])
        + (["--data-dir", args.data_dir] if args.data_dir else [])
        + (["--ref-device", args.ref_device] if args.ref_device else [])
    )
    sys.path.insert(0, args.src)  # train.py imports --src's modules: bench's own are dropped
    for name, module in list(sys.modules.items()):
        if os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == HERE:
            sys.modules.pop(name)
    import tasks

    tasks.TASKS["gsm8k"] = bench_task()
    runpy.run_path(os.path.join(args.src, "train.py"), run_name="__main__")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    keys = ("t_step", "t_generate", "t_reference", "t_train", "completion_len", "prompt_len", "loss")
    return [{k: r[k] for k in keys} for r in rows]


def trl_child(out):
    """TRL's GRPOTrainer at the same settings; a callback times each optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from models import load_tokenizer, resolve_model
    from rewards import REWARDS, combine_rewards

    task = bench_task()
    examples = task.load("train", data_dir=args.data_dir)[: args.steps * args.prompts_per_step]
    data = Dataset.from_list([{"prompt": task.prompt(ex), "answer": ex["answer"]} for ex in examples])

    def reward(completions, answer, **_):  # TRL passes chat completions as message lists
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        fns = {k: {**REWARDS, **task.reward_fns}[k] for k in task.reward_weights}  # what train.py scores it with
        return combine_rewards(fns, task.reward_weights, texts, answer=answer)[0]

    class Timer(TrainerCallback):
        rows, t0 = [], None

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, a, state, control, **kw):
            self.rows.append({"t_step": time.time() - self.t0})

    N = args.prompts_per_step * args.group_size  # one generation of N per optimizer step, trained in micro-batches
    cfg = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=N // args.micro_batch,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        beta=args.beta,
        learning_rate=args.lr,
        num_iterations=1,
        loss_type=args.loss_type,
        bf16=args.dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        lr_scheduler_type="constant",
        gradient_checkpointing=args.gradient_checkpointing,
        use_bias_correction_kl=False,
        shuffle_dataset=False,
    )
    # steps_per_generation defaults to gradient_accumulation_steps: the first micro-step of each optimizer step
    # generates all N, the Timer's step_begin..step_end spans that generation and the N/micro_batch micro-steps
    assert cfg.generation_batch_size == N and cfg.steps_per_generation == cfg.gradient_accumulation_steps, (
        f"TRL: {cfg.generation_batch_size} completions every {cfg.steps_per_generation} micro-steps, not {N} a step"
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=resolve_model(args.model),
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=load_tokenizer(args.model),
        callbacks=[timer],
    )
    trainer.train()
    lens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return [dict(r, completion_len=n) for r, n in zip(timer.rows, lens)]


if args.child:  # one side, in its own process, so its peak RSS is its own
    sys.path.insert(0, HERE)
    rows = (ours_child if args.child == "ours" else trl_child)(tempfile.mkdtemp())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux
    import torch

    gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None  # the policy's device
    json.dump({"rows": rows, "peak_rss_gib": peak, "gpu_peak_gib": gpu}, open(args.out, "w"))
    sys.exit(0)


def cpu_seconds():
    """(CPU seconds every process has used, from Linux's /proc/stat, else None; those of this process's children)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        v = [int(x) for x in open("/proc/stat").readline().split()[1:]]  # user nice system idle iowait ...
    except OSError:
        return None, ru.ru_utime + ru.ru_stime
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), ru.ru_utime + ru.ru_stime


def run_side(name, src=HERE, **over):
    """One side in a fresh process -> (medians of the timed steps, peak RSS GiB, all rows, the other processes'
    load meanwhile in busy cores: another job on a shared machine slows a side, see it here)."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in over.items()]
    cmd = (
        [sys.executable, __file__, "--child", name, "--out", out, "--src", src]
        + [a for a in sys.argv[1:] if a not in ("--vs-trl", "--grid")]
        + flags
    )
    (all0, own0), t0 = cpu_seconds(), time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if name == "trl" else None)
    (all1, own1), wall = cpu_seconds(), time.time() - t0
    others = None if all0 is None else max(0.0, (all1 - all0) - (own1 - own0)) / wall
    res = json.load(open(out))
    timed = res["rows"][1:] or res["rows"]  # drop the warm-up step
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    if res.get("gpu_peak_gib") is not None:
        print(f"{name}: the GPU's peak memory {res['gpu_peak_gib']:.2f} GiB (--ref-device {args.ref_device})")
    return med, res["peak_rss_gib"], res["rows"], others


def checkout(rev):
    """A git revision of this repository as files in a temporary folder -> (its short id, the folder)."""
    git = ["git", "-C", HERE]
    sha = subprocess.run(
        [*git, "rev-parse", "--short", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True
    )
    if sha.returncode:
        p.error(f"--rev {rev}: not a commit of {HERE} (git log --oneline lists them)")
    folder = tempfile.mkdtemp(prefix=f"bench-{sha.stdout.strip()}-")
    files = subprocess.run([*git, "archive", sha.stdout.strip()], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=files, check=True)
    return sha.stdout.strip(), folder


def matmul_gflops(dtype, n=10):
    """The machine's matmul speed in `dtype` (GFLOP/s), median of n: on a CPU SmolLM2's MLP shape, 2048 x 576 by
    576 x 1536; on a GPU 8192 x 8192 by 8192 x 8192, its ceiling (a shape that small only times a kernel launch)."""
    import torch

    gpu = torch.cuda.is_available()
    m, k, c = (8192, 8192, 8192) if gpu else (2048, 576, 1536)
    a = torch.randn(m, k, dtype=dtype, device="cuda" if gpu else "cpu")
    b = torch.randn(k, c, dtype=dtype, device=a.device)
    times = []
    for _ in range(n + 2):
        t = time.perf_counter()
        a @ b
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * m * k * c / statistics.median(times[2:]) / 1e9


def step_flops(cfg, prompts, G, p, c, micro_batch=None):
    """Matmul FLOPs of one step by phase, from the model's shapes: B prompts of p tokens, G completions of c
    tokens each. Forward: 2 * (layer weights + head) per token + attention 4 * L * H * context; the prompt runs
    once per group in every pass (the head only at its last token); training = forward + backward (2x) + the
    head once more (its chunks are checkpointed)."""
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = H * cfg.num_key_value_heads // cfg.num_attention_heads
    layers = 2 * L * (2 * H * H + 2 * H * kv + 3 * H * cfg.intermediate_size)  # per token
    head, attn = 2 * H * V, lambda ctx: 4 * L * H * ctx
    prompt = prompts * p * (layers + attn(p / 2))  # each prompt once (sampling)
    runs = max(1, G // (micro_batch or G))  # log-prob passes: once per micro-batch holding the prompt
    completion = prompts * G * c * (layers + attn(p + c / 2))
    fwd = prompt * runs + completion + prompts * G * c * head
    return {
        "t_generate": prompt + completion + prompts * (1 + G * c) * head,
        "t_reference": fwd,
        "t_train": 3 * fwd + prompts * G * c * head,
    }


cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
import torch  # noqa: E402 (only for the machine line)

if torch.cuda.is_available():
    cpu = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), host {cpu}"

print(
    f"# {time.strftime('%Y-%m-%d')} | {cpu} | {os.cpu_count()} cores, torch {torch.__version__}, "
    f"{torch.get_num_threads()} threads | {args.model}, {args.prompts_per_step}x{args.group_size} completions, "
    f"{args.max_new_tokens} new tokens, beta {args.beta}, {args.dtype} autocast, "
    f"{args.steps - 1} timed steps"
)


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


if args.grid:  # cost growth, one side at a time: G at 128 tokens, then tokens at G = 8
    points = [dict(group_size=g, max_new_tokens=128) for g in (4, 8, 16)] + [
        dict(group_size=8, max_new_tokens=t) for t in (64, 256)
    ]
    trl_points = [dict(group_size=4, max_new_tokens=128), dict(group_size=8, max_new_tokens=128)]
    print("\n| side | G | max new tokens | step s | generate s | train s | mean completion len | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|")
    sides = [("ours", points)]
    if args.vs_trl:
        sides.append(("trl", trl_points))
    for side, pts in sides:
        for pt in pts:
            med, peak, _, _ = run_side(side, **pt)
            print(
                f"| {side} | {pt['group_size']} | {pt['max_new_tokens']} | {fmt(med['t_step'])} | "
                f"{fmt(med.get('t_generate'))} | {fmt(med.get('t_train'))} | {med['completion_len']:.0f} | "
                f"{peak:.2f} |",
                flush=True,
            )
    sys.exit(0)

ours = [(f"ours @ {sha}", folder) for sha, folder in map(checkout, args.rev)] or [("ours", HERE)]
ratios = {name: [] for name, _ in ours}  # (step time, peak RSS, per-token step time) ours / TRL, one per round
for rnd in range(args.rounds):  # more than 1 only with --vs-trl
    results = {f"{name}, micro-batch {args.micro_batch}": run_side("ours", src) for name, src in ours}
    if args.vs_trl:
        trl = results[f"TRL, micro-batch {args.micro_batch}"] = run_side("trl")
    if args.vs_trl and args.trl_one_pass:  # TRL's own default batch shape, beside: not in the ratios
        N = args.prompts_per_step * args.group_size
        results[f"TRL, one pass of {N} (not the same micro-batch)"] = run_side("trl", micro_batch=N)
    print(f"\n{time.strftime('%H:%M UTC', time.gmtime())}, round {rnd + 1}")
    print(
        "\n| side | step s | generate s | reference s | train s | gen tok/s | mean completion len | peak RSS GiB "
        "| other processes' load (cores) |\n|---|---|---|---|---|---|---|---|---|"
    )
    for name, (med, peak, _, others) in results.items():
        n_tok = med["completion_len"] * args.prompts_per_step * args.group_size
        g = med.get("t_generate")
        print(
            f"| {name} | {fmt(med['t_step'])} | {fmt(g)} | {fmt(med.get('t_reference'))} | "
            f"{fmt(med.get('t_train'))} | {fmt(g and n_tok / g, '.0f')} | {med['completion_len']:.0f} | {peak:.2f} "
            f"| {fmt(others, '.2f')} |"
        )
    from transformers import AutoConfig  # noqa: E402
    from models import resolve_model  # noqa: E402

    peak = matmul_gflops(getattr(torch, args.dtype))
    print(f"\nours against a FLOP estimate ({args.dtype} matmul: {peak:.0f} GFLOP/s on this machine)\n")
    print("| side | phase | estimated GFLOP | at the matmul rate s | measured s | share of the matmul rate |")
    print("|---|---|---:|---:|---:|---:|")
    for name, _ in ours:
        med = results[f"{name}, micro-batch {args.micro_batch}"][0]
        flops = step_flops(
            AutoConfig.from_pretrained(resolve_model(args.model)),
            args.prompts_per_step,
            args.group_size,
            med["prompt_len"],
            med["completion_len"],
            args.micro_batch,
        )
        for k, f in flops.items():
            print(
                f"| {name} | {k[2:]} | {f / 1e9:.0f} | {f / 1e9 / peak:.1f} | {med[k]:.1f} "
                f"| {f / 1e9 / peak / med[k]:.0%} |"
            )
    if args.vs_trl:  # the same micro-batch on both sides
        for name, _ in ours:
            (o, po, _, _), (t, pt, _, _) = results[f"{name}, micro-batch {args.micro_batch}"], trl
            ratios[name].append(
                (
                    o["t_step"] / t["t_step"],
                    po / pt,
                    (o["t_step"] / o["completion_len"]) / (t["t_step"] / t["completion_len"]),
                )
            )
            print(
                f"\n{name} / TRL at micro-batch {args.micro_batch} on both sides: "
                "step time {:.2f}x, peak RSS {:.2f}x, per-token step time {:.2f}x".format(*ratios[name][-1])
            )
if args.rounds > 1:
    for name, rs in ratios.items():
        print(
            f"\n{name}, median over {len(rs)} rounds, micro-batch {args.micro_batch} on both sides: "
            "step time {:.2f}x, peak RSS {:.2f}x, per-token step time {:.2f}x".format(
                *(statistics.median(r[i] for r in rs) for i in range(3))
            )
        )
