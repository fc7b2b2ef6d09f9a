"""
Flags from three places, later wins: argparse defaults, config files, the command line; and every value
checked for type and range before anything loads, so a mistake is one line, not a traceback or a run
that trains on something else than asked.

A config file holds `name = literal` lines (the flag names with _ for -), read as data with `ast`,
never run. `--resume DIR` (on the command line or in a config file) puts the checkpoint's own flags
under the config files and the command line.
"""

import ast
import math
import os

import torch


def load_config(p, path):
    """A config file -> dict of flag values; unknown keys, non-literals and bad choices are p.error."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        p.error(f"cannot read config {path}: {e}")
    cfg, actions = {}, {a.dest: a for a in p._actions}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            p.error(f"{path}:{node.lineno}: only `name = value` lines are allowed")
        name = node.targets[0].id
        if name not in actions or name in ("help", "config"):
            p.error(f"{path}:{node.lineno}: unknown key '{name}'; keys are the flags with _ for -, e.g. group_size")
        try:
            cfg[name] = ast.literal_eval(node.value)
        except ValueError:
            p.error(f"{path}:{node.lineno}: the value of '{name}' must be a literal")
    return cfg


def read_checkpoint_config(p, resume):
    """--resume DIR or FILE -> (path of the checkpoint, its saved flags); p.error when unreadable."""
    path = os.path.join(resume, "ckpt.pt") if os.path.isdir(resume) else resume
    try:
        cfg = torch.load(path, map_location="cpu", weights_only=False)["config"]
    except Exception as e:  # missing, truncated or foreign file
        p.error(f"--resume {resume}: no readable checkpoint at {path} ({type(e).__name__}); pass a run's --out-dir")
    return path, cfg


def parse(p, ranges, argv=None):
    """Parse with config files and --resume applied; check types, choices and `ranges` -> (args, ckpt path)."""
    nullable = {a.dest for a in p._actions if a.default is None}
    pre = p.parse_known_args(argv)[0]
    configs = [load_config(p, path) for path in pre.config]
    resume = pre.resume
    for cfg in configs:  # a config file may name the run to resume; the command line wins
        resume = cfg.get("resume", resume) if pre.resume is None else resume
    ckpt_path = None
    if resume:
        ckpt_path, saved = read_checkpoint_config(p, resume)
        known = {a.dest for a in p._actions}
        skip = ("resume", "overwrite", "out_dir")  # out_dir: where the checkpoint is now
        p.set_defaults(**{k: v for k, v in saved.items() if k in known and k not in skip},
                       out_dir=os.path.dirname(os.path.abspath(ckpt_path)))
    for cfg in configs:  # e.g. a base config, then an ablation that changes two lines of it
        p.set_defaults(**cfg)
    args = p.parse_args(argv)
    args.resume = resume
    check(p, args, ranges, nullable)
    return args, ckpt_path


def _in_range(v, spec):
    """spec: '> 0', '>= 1', '(0, 1]', '[0, 1)' ..."""
    if spec[0] in "([":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (lo < v if spec[0] == "(" else lo <= v) and (v < hi if spec[-1] == ")" else v <= hi)
    op, bound = spec.split()
    return {">": v > float(bound), ">=": v >= float(bound), "<": v < float(bound), "<=": v <= float(bound)}[op]


def check(p, args, ranges, nullable=()):
    """Every flag's value: its type (config files bypass argparse's conversion), its choices, its range."""
    for a in p._actions:
        if a.dest in ("help", "config") or not hasattr(args, a.dest):
            continue
        v, flag = getattr(args, a.dest), a.option_strings[-1]
        if v is None:
            if a.dest not in nullable:
                p.error(f"{flag} needs a value, got None")
            continue
        want = a.type or (bool if a.const is True or a.const is False else str)
        ok = isinstance(v, bool) if want is bool else \
            isinstance(v, int) and not isinstance(v, bool) if want is int else \
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) if want is float else \
            isinstance(v, str)
        if not ok:
            kind = {int: "an integer", float: "a finite number", bool: "True or False"}.get(want, "a string")
            p.error(f"{flag} must be {kind}, got {v!r}")
        if a.choices is not None and v not in a.choices:
            p.error(f"{flag} {v!r}: choose from {sorted(a.choices)}")
        if a.dest in ranges and not _in_range(v, ranges[a.dest]):
            p.error(f"{flag} must be {ranges[a.dest]}, got {v!r}")
