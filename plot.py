"""
Curves from one or more train.py runs (matplotlib is an optional dependency).

    python plot.py out/arith_smollm2_cpu out/ablate_dr_grpo --out curves.png
    python plot.py out/a/metrics.jsonl --key kl --out kl.pdf

Each run is a train.py --out-dir (or its metrics.jsonl); its label is the directory name. --key (the
reward by default) is smoothed with a running mean over --smooth steps; --eval-key points are drawn as
markers on a second panel when the runs logged evals. A line torn by a kill mid-write is skipped.
"""

import argparse
import os
import sys

from run import check, read_jsonl, user_path

def fresh(path):
    """path, or where it exists path's stem with -1, -2, ...: what a tool writes by default replaces nothing."""
    stem, ext = os.path.splitext(path)
    return next(p for i in range(10**6) if not os.path.exists(p := f"{stem}-{i}{ext}" if i else path))

def read_metrics(path):
    """A run dir or its metrics.jsonl -> its rows (dicts with a step), sorted by step; ValueError if none."""
    path = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise ValueError(f"no metrics.jsonl at {path}; pass a train.py --out-dir")
    rows = [r for r in read_jsonl(path) if isinstance(r.get("step"), int)]  # blank and torn lines skipped
    if not rows:
        raise ValueError(f"{path} has no metrics rows (empty, or the run has not logged a step); nothing plotted")
    return sorted(rows, key=lambda r: r["step"])

def series(rows, key):
    """(steps, values) of the rows that logged `key`; null (a non-finite value in the run) is left out."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]

def running_mean(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=user_path, help="train.py out dirs or metrics.jsonl files")
    p.add_argument("--key", default="reward", help="metric of the first panel (e.g. reward/correct, kl)")
    p.add_argument("--eval-key", default=None, help="metric of the eval panel (default: eval/strict_acc if logged)")
    p.add_argument("--smooth", type=int, default=5, help="running-mean window in steps")
    p.add_argument("--out", type=user_path, help="the image; its extension picks the format (png, pdf, svg...); "
                   "default: curves.png, or a new name when that exists")
    p.add_argument("--title", default=None)
    args = p.parse_args()
    check(p, args, {"smooth": ">= 1"})
    paths = [os.path.abspath(r) for r in args.runs]
    if len(set(paths)) < len(paths):  # two curves of one run would hide each other
        p.error(f"{next(r for r in paths if paths.count(r) > 1)} is given twice; give each run once")
    args.out = args.out or fresh("curves.png")  # a default never replaces a file
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        sys.exit("error: plotting needs matplotlib: pip install matplotlib")
    formats = FigureCanvasAgg.get_supported_filetypes()  # what savefig can write, by extension
    if os.path.splitext(args.out)[1][1:].lower() not in formats:
        p.error(f"--out {args.out}: matplotlib writes only {' '.join('.' + f for f in sorted(formats))}")
    labels = [os.path.basename(os.path.abspath(r if os.path.isdir(r) else os.path.dirname(r))) for r in args.runs]
    labels = labels if len(set(labels)) == len(labels) else args.runs  # two runs named seed0: full paths
    try:
        runs = {label: read_metrics(r) for label, r in zip(labels, args.runs)}
    except ValueError as e:
        sys.exit(f"error: {e}")
    have = sorted({k for rows in runs.values() for r in rows for k, v in r.items()
                   if k != "step" and isinstance(v, (int, float))})
    eval_key = args.eval_key or ("eval/strict_acc" if "eval/strict_acc" in have else None)
    for flag, key in (("--key", args.key), ("--eval-key", eval_key)):
        if key is not None and key not in have:
            sys.exit(f"error: {flag} {key}: no run logged it; the runs have {', '.join(have) or 'no metric'}")
    fig, axes = plt.subplots(1, 2 if eval_key else 1, figsize=(11 if eval_key else 6, 4), squeeze=False)
    for name, rows in runs.items():
        steps, values = series(rows, args.key)
        line, = axes[0][0].plot(steps, running_mean(values, args.smooth), label=name)
        if eval_key and series(rows, eval_key)[0]:
            axes[0][1].plot(*series(rows, eval_key), marker="o", color=line.get_color(), label=name)
    axes[0][0].set(xlabel="step", ylabel=f"{args.key} (running mean, {args.smooth} steps)")
    if eval_key:
        axes[0][1].set(xlabel="step", ylabel=f"{eval_key} (held-out)")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(args.title or ", ".join(runs))
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        fig.savefig(args.out, dpi=110)
    except OSError as e:
        sys.exit(f"error: --out {args.out} cannot be written ({e.strerror or e}); pass another path")
    print(f"wrote {args.out}")

if __name__ == "__main__":
    main()
