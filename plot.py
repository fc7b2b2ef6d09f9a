"""
Reward-vs-step curves from one or more train.py runs (matplotlib is an optional dependency).

    python plot.py out/arith_smollm2_cpu out/ablate_dr_grpo --out curves.png
    python plot.py out/a/metrics.jsonl --key eval/strict_acc

Each run is a train.py --out-dir (or its metrics.jsonl); its label is the directory name.
The reward curve is smoothed with a running mean over --smooth steps; eval points are drawn as
markers on a second panel when the runs logged any.
"""

import argparse
import json
import os
import sys


def read_metrics(path):
    """metrics.jsonl -> (train rows, eval rows), each a list of dicts sorted by step."""
    path = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl at {path}; pass a train.py --out-dir")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    train = sorted((r for r in rows if "reward" in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if any(k.startswith("eval/") for k in r)), key=lambda r: r["step"])
    return train, evals


def running_mean(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="train.py out dirs or metrics.jsonl files")
    p.add_argument("--key", default="reward", help="train metric to plot (e.g. reward/correct, kl)")
    p.add_argument("--eval-key", default="eval/strict_acc")
    p.add_argument("--smooth", type=int, default=5, help="running-mean window in steps")
    p.add_argument("--out", default="curves.png")
    p.add_argument("--title", default=None)
    args = p.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plotting needs matplotlib: pip install matplotlib")
    try:
        runs = {os.path.basename(os.path.normpath(r if os.path.isdir(r) else os.path.dirname(r))): read_metrics(r)
                for r in args.runs}
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    has_eval = any(ev for _, ev in runs.values())
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(11 if has_eval else 6, 4), squeeze=False)
    for name, (train, evals) in runs.items():
        kept = [r for r in train if r.get(args.key) is not None]  # null: a non-finite value in the run
        line, = axes[0][0].plot([r["step"] for r in kept], running_mean([r[args.key] for r in kept], args.smooth),
                                label=name)
        if has_eval:
            pts = [(r["step"], r[args.eval_key]) for r in evals if r.get(args.eval_key) is not None]
            axes[0][1].plot(*zip(*pts), marker="o", color=line.get_color(), label=name) if pts else None
    axes[0][0].set(xlabel="step", ylabel=f"{args.key} (running mean, {args.smooth} steps)")
    if has_eval:
        axes[0][1].set(xlabel="step", ylabel=f"{args.eval_key} (held-out)", ylim=(0, 1))
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(args.title or ", ".join(runs))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
