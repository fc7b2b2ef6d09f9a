"""A toy task and a tiny model for end-to-end tests of train.py and eval.py (no network, CPU, seconds).

The real tasks give a tiny random model zero reward, hence zero advantages and zero gradients: a test
of the loop would pass whatever the loop did. The toy task's reward is dense instead: a completion is
a string of words w0..w39 and it earns the fraction of its words with an even index, so every group
has spread and every step trains.
"""

import os

import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tasks import Task

SPECIALS = ["<|endoftext|>", "<bos>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = [f"w{i}" for i in range(40)]
VOCAB = {t: i for i, t in enumerate(SPECIALS + ["system", "user", "assistant"] + WORDS)}  # 48 tokens
EOS, BOS = VOCAB["<|im_end|>"], VOCAB["<bos>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def make_tokenizer():
    """Whitespace word-level tokenizer, pad == eos (as SmolLM2), a ChatML-like template."""
    tk = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<bos>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(seed=0, init_std=0.1):
    """2-layer Llama, hidden 32, tied embeddings; init_std above HF's 0.02 so outputs depend on the prompt."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return LlamaForCausalLM(cfg).eval()


def save_tiny(path):
    """Write the tiny model and tokenizer as an ordinary local HF folder; returns the path."""
    make_model().save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


# -----------------------------------------------------------------------------
# the toy task: "w3 w8" -> answer "even" / "odd" (the parity of the sum of the two indices)


def _index(word):
    return int(word[1:]) if word in VOCAB and word.startswith("w") else None


def load(split, data_dir=None):
    offset = 0 if split == "train" else 1
    examples = []
    for i in range(16):
        a, b = (3 * i + offset) % 40, (7 * i + 2 * offset) % 40
        examples.append({"question": f"w{a} w{b}", "answer": "even" if (a + b) % 2 == 0 else "odd"})
    return examples


def prompt(example):
    return [{"role": "user", "content": example["question"]}]


def frac_even(completions, **_):
    """Dense reward: the fraction of a completion's words that are w<even>."""
    out = []
    for c in completions:
        words = c.split()
        out.append(sum(1 for w in words if _index(w) is not None and _index(w) % 2 == 0) / max(len(words), 1))
    return out


def first_parity(completions, answer, **_):
    """1.0 where the first word's parity is the example's answer."""
    return [float(score(c, {"answer": a})["strict"]) for c, a in zip(completions, answer)]


def parity(word):
    return "even" if _index(word) % 2 == 0 else "odd"


def score(completion, example, state=None):
    words = [w for w in completion.split() if _index(w) is not None]
    pred = parity(words[0]) if words else None
    return {
        "pred": pred,
        "strict": pred == example["answer"],
        "flexible": any(parity(w) == example["answer"] for w in words),
        "format": pred is not None,
    }


TASK = Task(load, prompt, {"even": frac_even, "first": first_parity}, {"even": 1.0, "first": 0.5}, score)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
# running train.py / eval.py in this process (fast: no interpreter start) or in a fresh one

TRAIN, EVAL = os.path.join(REPO, "train.py"), os.path.join(REPO, "eval.py")
TOY_TRAIN = os.path.join(REPO, "tests", "toy_train.py")
TIMING = {"t_generate", "t_reference", "t_train", "t_step", "gen_tok_s"}  # the wall-clock metrics


def run_script(path, argv):
    """`python path argv...` in-process with the toy task registered; returns the script's globals.

    A user mistake surfaces as SystemExit (argparse's p.error, or sys.exit); anything else is a
    traceback a user would have seen. One thread, like the subprocess runs (OMP_NUM_THREADS=1).
    """
    import runpy
    import signal
    import sys
    from tasks import TASKS

    old_argv, threads, added = sys.argv, torch.get_num_threads(), "toy" not in TASKS
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the script sets its own
    TASKS["toy"] = TASK
    sys.argv = [os.path.basename(path), *map(str, argv)]
    torch.set_num_threads(1)
    try:
        g = runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = old_argv
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)
        import run  # a process releases its out dir's lock when it ends; an in-process run when it returns

        while run.HELD:
            run.HELD.pop().close()
        if added:
            del TASKS["toy"]  # other tests check the registry holds exactly the real tasks
    if g.get("log") is not None:
        g["log"].close()
    return g


def error_of(path, argv, capsys):
    """(exit code, last stderr line) of a script that must end in SystemExit; no traceback."""
    import pytest

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_script(path, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    code = e.value.code
    return (1, code) if isinstance(code, str) else (code, err.strip().splitlines()[-1])


def train_args(model_dir, out_dir, *extra, steps=2):
    """The tiny run: 2 prompts x G=4, micro-batch 4, 12 new tokens, fp32, no eval, the HF export at the end."""
    return [
        "--task",
        "toy",
        "--model",
        model_dir,
        "--out-dir",
        out_dir,
        "--steps",
        steps,
        "--group-size",
        4,
        "--prompts-per-step",
        2,
        "--micro-batch",
        4,
        "--max-new-tokens",
        12,
        "--eval-n",
        0,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--lr",
        1e-3,
        "--config",
        "log_completions=1",
        "--config",
        "export=model",
        *extra,
    ]


def subprocess_env():
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def torchrun(args, timeout=300, **env):
    """`torchrun --nproc_per_node=2 tests/toy_train.py args` (gloo, CPU) -> CompletedProcess. The rendezvous on port 0
    takes a free port, so runs side by side do not collide. A 2-step run takes ~15 s on one loaded core; past
    `timeout` the agent gets SIGTERM, which it passes on to its workers (they run in sessions of their own: killing
    the agent alone would leave them running and holding the output pipes), and the test fails saying so."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        TOY_TRAIN,
        *map(str, args),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**subprocess_env(), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        raise AssertionError(
            f"torchrun did not finish in {timeout} s (a loaded machine?); stderr: {err[-2000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_same_training(want, got):
    """Weights after AdamW steps that summed the same fp32 gradients in different orders (another number of processes,
    FSDP's reduce-scatter), so the gradients differ in their last bits. AdamW's update lr * m / (sqrt(v) + 1e-8) keeps
    that relative error (~1e-7) for an element whose gradient is well above 1e-8: those agree to under 1e-6 after a
    few steps of lr 1e-3 (measured <= 5.2e-7). An element whose gradient is itself rounding noise near 1e-8 can move
    anywhere in [-lr, lr] a step; any two AdamW runs differ by at most ~2 lr a step there, so a bound on its size
    would assert nothing. Their count is bounded instead: at most 4 elements past 1e-6 (measured: none in this
    suite's four comparisons; 2 of 20k in an earlier measurement). Fails if the gradients are not averaged over the
    ranks (most elements then differ by ~lr), or if more than a handful of elements are left out of the average (a
    bucket's tail)."""
    assert want.keys() <= got.keys()
    diff = torch.cat([(want[k] - got[k]).abs().flatten() for k in want])
    far = int((diff > 1e-6).sum())
    assert far <= 4, f"{far} of {diff.numel()} elements differ by > 1e-6 (the largest by {diff.max().item():.2e})"


def read_metrics(out_dir):
    import json

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def fail(error):
    """Raise `error`, or for a signal number deliver that signal to this process, as Ctrl-C or a kill does: its
    handler runs here, in whatever the script was doing."""
    import signal
    import time

    if not isinstance(error, signal.Signals):
        raise error
    os.kill(os.getpid(), error)
    time.sleep(5)  # the handler runs (and exits) long before this returns
    raise AssertionError(f"{error.name} was not handled")


def save_that_fails(error, fraction):
    """A torch.save that writes the first checkpoint whole, then only `fraction` of the next one's bytes
    before failing with `error` (a signal, a full disk: see fail), with the calls' paths in .calls."""
    import io

    real_save, calls = torch.save, []

    def save(obj, path, *a, **kw):
        calls.append(str(path))
        if len(calls) == 1:
            return real_save(obj, path, *a, **kw)
        buf = io.BytesIO()
        real_save(obj, buf)
        with open(path, "wb") as f:
            f.write(buf.getvalue()[: int(len(buf.getvalue()) * fraction)])
        fail(error)

    save.calls = calls
    return save


# -----------------------------------------------------------------------------
# the toy task with tools: a stub of tools.ToolEnv on word tokens (real tag parsing needs a real tokenizer)


class WordTools:
    """envs.Tools' place on a word-level tokenizer (EnvDriver's `make`): a row's own word in `calls` is a call, one in
    `errors` a call answered with an error; the reply is the text `reply` (replies: {word: its own reply} for more
    calls), framed by the chat template; past max_calls a call gets an error reply too (and counts as one)."""

    turn_chars = None  # any word may be a call

    def __init__(self, max_calls=4, calls=("w5",), errors=("w7",), reply="w2", replies=None):
        self.max_calls, self.calls, self.errors, self.reply = max_calls, set(calls), set(errors), reply
        self.replies = replies or {}
        self.calls |= set(self.replies)

    def __call__(self):
        return WordToolEnv(self)


class WordToolEnv:
    def __init__(self, spec):
        self.spec = spec

    def reset(self, example):
        self.calls, self.errors = 0, 0

    def ends_turn(self, text, stopped):
        words = text.split()
        return not stopped and bool(words) and words[-1] in self.spec.calls | self.spec.errors

    def turn(self, text, stopped):
        word = text.split()[-1]
        error = word in self.spec.errors or self.calls >= self.spec.max_calls
        self.calls, self.errors = self.calls + 1, self.errors + error
        return self.spec.replies.get(word, self.spec.reply), False

    def state(self):
        return {"tool_calls": self.calls, "tool_errors": self.errors, "called": float(self.calls > 0)}


def word_tools(tokenizer, *, max_tool_calls=4, max_reply_tokens=64):
    import envs

    return envs.EnvDriver(WordTools(max_tool_calls), tokenizer, max_reply_tokens)


# the toy task, its rows calling WordToolEnv on w5 (w7: an error); TASKS["toy_tool"] in toy_train.py
TOOL_TASK = TASK._replace(env=word_tools)
