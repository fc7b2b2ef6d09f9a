"""Each knob is declared once, where it is used (`name: Annotated[type, Knob(...)] = default`: train.py's Knobs,
grpo.Objective, rollout.Sampler, a task's load or env); the flags, checks, config keys, run.json, --resume read it.
Not HfArgumentParser: it takes no ranges, live choice dicts, literal-only config files or --resume's classes."""

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re
import textwrap
import typing
from functools import partial
from typing import NamedTuple

# what --resume does with a knob's value, its class: the run's own value unless another is given, then
FIXED = "fixed by the run"  # that value is refused, in one line naming both
CHANGES = "may change on resume"  # that value is used
NEVER = "a setting of one call"  # never saved as the run's (--overwrite, --resume)


class DataError(ValueError):
    """A knob's value names data that cannot be used (--data-dir, a task's file): one line, exit code 2."""


class Knob(NamedTuple):
    check: object = None  # "> 0", "[0, 1)": a range; a dict or tuple: the choices; a re.Pattern a string fullmatches
    help: str = ""
    flag: bool = False  # a command-line flag; else a config key (a config file, or --config name=value)
    resume: str = CHANGES
    path: bool | str = False  # True: made absolute; "local": made absolute if it names a file or folder (else an id)


def flag(check=None, help="", **rest):  # a knob that is a command-line flag
    return Knob(check, help, True, **rest)


class Decl(NamedTuple):  # a knob as its line declares it
    name: str
    kind: type  # bool, int, float, str or dict
    nullable: bool  # declared `T | None`: None is a value
    default: object
    knob: Knob


def declared(*owners):
    """Dataclasses and functions -> {name: Decl} of their fields or keywords annotated with a Knob, in order."""
    decls = {}
    for owner in owners:
        hints = typing.get_type_hints(owner.func if isinstance(owner, partial) else owner, include_extras=True)
        if dataclasses.is_dataclass(owner):
            defaults = {f.name: f.default for f in dataclasses.fields(owner)}
        elif isinstance(owner, type):  # a class of declarations alone (train.py's Knobs)
            defaults = vars(owner)
        else:
            defaults = {k: p.default for k, p in inspect.signature(owner).parameters.items()}
        for name, hint in hints.items():
            knobs = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Knob)]
            if knobs:
                kinds = typing.get_args(hint.__origin__) or (hint.__origin__,)  # int | None -> (int, NoneType)
                kind = next(k for k in kinds if k is not type(None))
                decls[name] = Decl(name, kind, type(None) in kinds, defaults[name], knobs[0])
    return decls


KINDS = {
    bool: (lambda v: isinstance(v, bool), "True or False"),
    int: (lambda v: type(v) is int, "an integer"),
    float: (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    str: (lambda v: isinstance(v, str), "a string"),
    dict: (lambda v: isinstance(v, dict), "a dict literal, e.g. {'digits': 2}"),
}


def in_range(v, spec):  # spec: '> 0', '>= 1', '(0, 1]', '[0, 1)' ...
    if spec[0] in "([":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (lo < v if spec[0] == "(" else lo <= v) and (v < hi if spec[-1] == ")" else v <= hi)
    op, bound = spec.split()
    return v > float(bound) if op == ">" else v >= float(bound)


def problem(decl, value, where):
    """Why `value` does not fit its declaration, in one line that starts with `where`; None if it fits."""
    check = decl.knob.check
    if value is None:
        return None if decl.nullable else f"{where} needs a value, got None"
    if not KINDS[decl.kind][0](value):
        return f"{where} must be {KINDS[decl.kind][1]}, got {value!r}"
    if isinstance(check, (dict, tuple)) and value not in check:  # a dict: its keys when this runs, a fork's too
        return f"{where} {value!r}: choose from {', '.join(map(str, check))}"
    if isinstance(check, re.Pattern) and not check.fullmatch(value):
        return f"{where} must match {check.pattern}, got {value!r}"
    if decl.kind in (int, float) and not in_range(value, check or ">= 0"):
        return f"{where} must be {check or '>= 0'}, got {value!r}"
    return None


def user_path(path):  # a path as typed: ~ and $VARS expanded
    return os.path.expandvars(os.path.expanduser(path))


def flag_name(name):
    return "--" + name.replace("_", "-")


def where(decl):  # how a message names a knob: as the user sets it
    return flag_name(decl.name) if decl.knob.flag else f"config key {decl.name}"


def absolute(value, decl):
    """A path knob's value with ~ and $VARS expanded, absolute (a "local" one only if it names something on disk)."""
    if not decl.knob.path or not isinstance(value, str):
        return value
    path = user_path(value)
    if decl.knob.path == "local" and not os.path.exists(path):
        return value  # a hub id or an alias
    return os.path.realpath(path)


def parser(description, *owners):
    """An ArgumentParser with --config, then a flag for each flag knob of `owners` (a group each); .decls: all knobs."""
    fmt = type("Help", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {})
    p = argparse.ArgumentParser(description=description, formatter_class=fmt)
    p.add_argument("--config", action="append", default=[], help="a file of `name = value` lines, or name=value")
    p.decls = declared(*owners)
    for owner in owners:
        group = p.add_argument_group(owner.__doc__.split(".")[0])
        for d in declared(owner).values():
            if not d.knob.flag:
                continue
            if d.kind is bool:
                group.add_argument(flag_name(d.name), action="store_true", help=d.knob.help)
                continue
            choices = d.knob.check if isinstance(d.knob.check, (dict, tuple)) else None
            group.add_argument(flag_name(d.name), type=d.kind, default=d.default, choices=choices, help=d.knob.help)
    return p


def read_config(p, spec, decls):
    """A config file or inline `name=value` (a non-literal is a string) -> {name: value}; a mistake: one p.error."""
    path = user_path(spec)
    if "=" in spec and not os.path.isfile(path):
        name, _, text = (x.strip() for x in spec.partition("="))
        try:
            lines = [(name, ast.literal_eval(text), f"--config {spec}")]
        except (ValueError, SyntaxError):
            lines = [(name, text, f"--config {spec}")]
    else:
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), spec)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
            p.error(f"cannot read config {spec} ({type(e).__name__}); pass a file of `name = value` lines")
        lines = []
        for node in tree.body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                p.error(f"{spec}:{node.lineno}: only `name = value` lines are allowed")
            try:
                lines.append((node.targets[0].id, ast.literal_eval(node.value), f"{spec}:{node.lineno}"))
            except ValueError:
                p.error(f"{spec}:{node.lineno}: the value of '{node.targets[0].id}' must be a literal")
    for name, _, at in lines:
        if name not in decls:
            p.error(
                f"{at}: unknown key '{name}'; keys are the flags with _ for - (e.g. group_size) and the config keys"
            )
    return {name: value for name, value, _ in lines}


def parse(p, load_checkpoint, argv=None):
    """p's knobs (defaults < run's checkpoint < configs < flags), checked -> (args, ckpt or None, names off default)."""
    decls = p.decls
    keys = ", ".join(f"{k}={d.default!r}" for k, d in decls.items() if not d.knob.flag)
    p.epilog = textwrap.fill(f"config keys (--config FILE or --config name=value), with their defaults: {keys}", 100)
    pre = p.parse_known_args(argv)[0]
    configs = [read_config(p, c, decls) for c in pre.config]
    resume = pre.resume or next((c["resume"] for c in reversed(configs) if c.get("resume")), None)
    values = {k: d.default for k, d in decls.items()}
    ckpt = saved = None
    if resume:
        resume = absolute(resume, decls["resume"])
        try:
            ckpt_path, ckpt = load_checkpoint(resume)
        except ValueError as e:
            p.error(f"--resume: {e}")
        saved = ckpt["config"]
        values.update({k: v for k, v in saved.items() if k in decls and decls[k].knob.resume != NEVER})
        run_dir, name = os.path.split(os.path.realpath(ckpt_path))  # a resume writes there, and only there
        if name != "ckpt.pt" or not os.path.isfile(os.path.join(run_dir, "run.json")):
            p.error(f"--resume {resume}: not a run's ckpt.pt (beside its run.json); pass the run's --out-dir")
        values["out_dir"] = saved["out_dir"] = run_dir  # the run's own directory, wherever it was moved
    for c in configs:  # a base config, then an ablation that changes two lines of it
        values.update(c)
    p.set_defaults(**{k: v for k, v in values.items() if decls[k].knob.flag})
    args = p.parse_args(argv)
    vars(args).update({k: values[k] for k, d in decls.items() if not d.knob.flag}, resume=resume)
    for k, d in decls.items():
        if why := problem(d, getattr(args, k), where(d)):
            p.error(why)
        setattr(args, k, absolute(getattr(args, k), d))
    if resume:
        if args.overwrite:
            p.error("--resume continues a run and --overwrite replaces one: pass one of them")
        if args.steps <= ckpt["step"]:
            p.error(f"--resume {resume}: the checkpoint is at step {ckpt['step']}; pass --steps > {ckpt['step']}")
        for k, d in decls.items():
            if d.knob.resume == FIXED and k in saved and absolute(saved[k], d) != getattr(args, k):  # paths: the places
                p.error(
                    f"--resume {resume}: the run was trained with {where(d)} {saved[k]!r}, not {getattr(args, k)!r}; "
                    f"{where(d)} is {FIXED}: drop that value or start a new --out-dir"
                )
    return args, ckpt, {k for k, d in decls.items() if getattr(args, k) != d.default}


def bind(owners, options, what):
    """Options checked against the knobs `owners` (a load, an env) declare -> {owner: its options}; else ValueError."""
    decls = {owner: declared(owner) for owner in owners}
    known = {k: d for ds in decls.values() for k, d in ds.items()}
    for key, value in options.items():
        if key not in known:
            listing = ", ".join(f"{k}={d.default!r}" for k, d in known.items()) or "no options"
            raise ValueError(f"task_options {key!r}: {what} takes {listing}")
        if why := problem(known[key], value, f"task_options {key!r}"):
            raise ValueError(why)
    return {owner: {k: v for k, v in options.items() if k in ds} for owner, ds in decls.items()}
