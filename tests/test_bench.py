"""bench.py --random-init: a model of the given shape with random weights over --model's tokenizer (a machine with no
weights at hand), made once in the cache, and a reward that keeps every group training on both sides."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
import toy
from toy import REPO, subprocess_env

BENCH = os.path.join(REPO, "bench.py")


def bench(*argv, cache):
    env = dict(subprocess_env(), GRPO_CACHE=str(cache))
    return subprocess.run([sys.executable, BENCH, *map(str, argv)], capture_output=True, text=True, env=env)


def test_an_unknown_shape_is_one_line_naming_the_choices(tmp_path):
    """Fails if a misspelt shape reaches the model load (a traceback) or the line does not say what to pass."""
    r = bench("--random-init", "qwen-0.5b", cache=tmp_path)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert "qwen-0.5b" in last and "same" in last and "qwen2.5-0.5b" in last


def test_random_init_keeps_the_shape_and_tokenizer_draws_new_weights_and_trains(gsm8k_dir, tmp_path):
    """The tiny model's own shape ('same') with random weights: its config's sizes and its tokenizer, other weights,
    the folder made once (a second run reuses it), and every step trains (the hash reward spreads in each group).
    Fails if the original weights are copied, the shape changes, the folder is remade each run, or the rows get the
    task's reward (0 for every row of a random model: no group would train)."""
    model_dir = str(tmp_path / "model")  # the tiny model with seed 1's weights: random_model draws with seed 0
    toy.make_model(seed=1).save_pretrained(model_dir)
    toy.make_tokenizer().save_pretrained(model_dir)
    argv = ["--model", model_dir, "--random-init", "same", "--data-dir", gsm8k_dir[0], "--steps", 2]
    argv += [
        "--prompts-per-step",
        1,
        "--group-size",
        4,
        "--micro-batch",
        4,
        "--max-new-tokens",
        6,
        "--dtype",
        "float32",
    ]
    cache = tmp_path / "cache"
    r = bench(*argv, cache=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    (made,) = os.listdir(cache / "random")  # nothing half-written beside it
    folder = cache / "random" / made
    want, got = (json.load(open(os.path.join(d, "config.json"))) for d in (model_dir, folder))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "tie_word_embeddings"):
        assert got[key] == want[key]
    assert os.path.isfile(folder / "tokenizer.json")
    old, new = (load_file(os.path.join(d, "model.safetensors")) for d in (model_dir, folder))
    name = "model.layers.0.mlp.up_proj.weight"
    assert old[name].shape == new[name].shape and not torch.equal(old[name], new[name])
    rewards = [float(line.split("reward ")[1].split()[0]) for line in r.stdout.splitlines() if "reward " in line]
    assert len(rewards) == 2 and min(rewards) > 0  # GSM8K's own reward gives a random model's rows 0
    stamp = os.path.getmtime(folder / "model.safetensors")
    assert bench(*argv, cache=cache).returncode == 0
    assert os.path.getmtime(folder / "model.safetensors") == stamp
