"""
The run's metrics: one JSON line per step (and per eval) in OUT_DIR/metrics.jsonl, always; the same
keys to TensorBoard or Weights & Biases with --log-to. Rank 0 alone writes.

A value that is not finite is written as null: JSON has no NaN, and a reader must be able to parse the
file of a run that went wrong.
"""

import importlib.util
import json
import math
import os

TRACKERS = ("none", "tensorboard", "wandb")
INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb"}


def check_tracker(name):
    """None, or the one-line reason the tracker cannot be used (its package is missing)."""
    if name != "none" and importlib.util.find_spec(name) is None:
        return f"--log-to {name} needs the package {name}: {INSTALL[name]}"
    return None


class MetricsLog:
    """metrics.jsonl (+ a tracker). On resume, lines logged after the checkpoint's step are dropped first,
    so the file reads as one uninterrupted run."""

    def __init__(self, out_dir, tracker="none", config=None, resume_step=0):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        self.file = open(self.path, "a")
        self.tb = self.wandb = None
        if tracker == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=resume_step or None)
        elif tracker == "wandb":  # WANDB_MODE=offline keeps it on this machine
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-mini"), config=config,
                                    dir=out_dir, name=os.path.basename(os.path.abspath(out_dir)), resume="allow")

    def write(self, row):
        row = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class DriftWatch:
    """A run drifting away: the mean KL to the reference, or the p99 gap between the sampling and the
    training log-probs, above its limit several steps in a row. The limits are far above a healthy run's."""
    LIMITS = {"kl": (1.0, "reference"), "dlogp_p99": (1.0, "sampler")}

    def __init__(self, steps=3):
        self.steps, self.count = steps, dict.fromkeys(self.LIMITS, 0)

    def update(self, row):
        """One step's metrics -> the warning lines to print (one when a streak reaches `steps`)."""
        lines = []
        for k, (limit, who) in self.LIMITS.items():
            self.count[k] = self.count[k] + 1 if (row.get(k) or 0) > limit else 0
            if self.count[k] == self.steps:
                lines.append(f"{k} > {limit} for {self.steps} steps: the policy is far from the {who}; lower --lr")
        return lines
