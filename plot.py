"""Curves of train.py runs: `python eval.py --plot OUT_A OUT_B --out curves.png` (matplotlib, imported only here).
Each run a --out-dir (or its metrics.jsonl), labelled by its directory; --key (the reward by default) as a running mean
over --smooth steps, --eval-key (eval/strict_acc if logged) as points on a second panel."""

import os
import sys

import run


def read_metrics(path):
    """A run dir or its metrics.jsonl -> its rows (dicts with a step), sorted by step; ValueError if none."""
    path = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise ValueError(f"no metrics.jsonl at {path}; pass a train.py --out-dir")
    rows = [r for r in run.read_jsonl(path) if isinstance(r.get("step"), int)]  # blank and torn lines skipped
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


def plot(p, args, fresh):
    """eval.py --plot RUN...: the runs' curves, one line each (a run given twice would hide itself); fresh(path): a name
    that replaces no file."""
    paths = [os.path.abspath(r) for r in args.plot]
    if len(set(paths)) < len(paths):
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
    labels = [os.path.basename(os.path.abspath(r if os.path.isdir(r) else os.path.dirname(r))) for r in args.plot]
    labels = labels if len(set(labels)) == len(labels) else args.plot  # two runs named seed0: full paths
    try:
        runs = {label: read_metrics(r) for label, r in zip(labels, args.plot)}
    except ValueError as e:
        sys.exit(f"error: {e}")
    have = sorted(
        {k for rows in runs.values() for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    )
    eval_key = args.eval_key or ("eval/strict_acc" if "eval/strict_acc" in have else None)
    for flag, key in (("--key", args.key), ("--eval-key", eval_key)):
        if key is not None and key not in have:
            sys.exit(f"error: {flag} {key}: no run logged it; the runs have {', '.join(have) or 'no metric'}")
    fig, axes = plt.subplots(1, 2 if eval_key else 1, figsize=(11 if eval_key else 6, 4), squeeze=False)
    for name, rows in runs.items():
        steps, values = series(rows, args.key)
        (line,) = axes[0][0].plot(steps, running_mean(values, args.smooth), label=name)
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
