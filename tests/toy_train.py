"""train.py with the toy task registered: `python tests/toy_train.py --task toy ...`, also under torchrun.

With TOY_DUMP_PARAMS=PREFIX set, each rank saves its final parameters to PREFIX.rank<R>.pt, so a test
can check that the ranks of a multi-process run end with the same weights.
"""

import os
import runpy
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the repo root

import torch  # noqa: E402

import scale  # noqa: E402
import toy  # noqa: E402
from tasks import TASKS  # noqa: E402

TASKS["toy"] = toy.TASK
TASKS["toy_tool"] = toy.TOOL_TASK  # the toy task with a stub tool (toy.WordTools)


def dump(g):  # a rank's final parameters, from train.py's globals
    params = {k: v.detach().cpu().clone() for k, v in g["policy"].state_dict().items()}
    torch.save(params, f"{os.environ['TOY_DUMP_PARAMS']}.rank{g['rank']}.pt")


def end(error=None):  # under torchrun train.py ends its process in scale.end, never returning here: dump first
    dump(sys._getframe(1).f_globals)
    real_end(error)


real_end = scale.end
if os.environ.get("TOY_DUMP_PARAMS"):
    scale.end = end
sys.argv[0] = os.path.join(toy.REPO, "train.py")
g = runpy.run_path(sys.argv[0], run_name="__main__")
if os.environ.get("TOY_DUMP_PARAMS"):
    dump(g)
