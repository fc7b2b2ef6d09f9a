"""--ref-device: the reference model on its own device (e.g. offloaded to the CPU while the policy trains on a GPU).

No second device here, so the reference goes to "cpu:0": a device train.py cannot take for the policy's own
("cpu"), which sends it down every path of a reference placed apart (its own dtype, its passes and their autocast
on its side, only results travelling, the full KL's head on the policy's side). The policy runs bf16 autocast;
the reference's device is made to lack native bf16, so it computes in fp32: the two differ where it shows."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import TRAIN, read_metrics, run_script, train_args  # noqa: E402

import models  # noqa: E402


@pytest.fixture
def apart(monkeypatch):
    """Loads record (model, dtype of its weights); the reference's decoder layers record whether autocast was on
    and the dtype their input arrived in. cpu:0 lacks native bf16, the policy's cpu has it."""
    seen = {"loads": [], "ref_calls": []}
    real_load = models.load_model

    def load_model(name, device, dtype=torch.float32, trainable=True, matmul_dtype=None):
        model = real_load(name, device, dtype, trainable, matmul_dtype)
        seen["loads"].append((trainable, str(device), {p.dtype for p in model.parameters()}))
        if not trainable:  # the reference
            for layer in model.get_decoder().layers:
                layer.register_forward_pre_hook(
                    lambda m, a, k: seen["ref_calls"].append(
                        (torch.is_autocast_enabled("cpu"), (a[0] if a else k["hidden_states"]).dtype)
                    ),
                    with_kwargs=True,
                )
        return model

    monkeypatch.setattr(models, "load_model", load_model)
    real_native = models.native
    monkeypatch.setattr(models, "native", lambda d, dtype: str(d) != "cpu:0" and real_native(d, dtype))
    monkeypatch.setattr(models, "check_dtype", lambda *a: None)  # bf16 runs on any CPU (emulated, slower)
    return seen


def test_the_reference_apart_runs_in_its_own_dtype_and_only_its_results_travel(model_dir, tmp_path, apart, capsys):
    g = run_script(TRAIN, train_args(model_dir, str(tmp_path), "--dtype", "bfloat16", "--ref-device", "cpu:0", steps=2))
    assert "note: the reference on cpu:0 computes in fp32 (no native torch.bfloat16)" in capsys.readouterr().out
    (_, policy_device, policy_dtypes), (_, ref_device, ref_dtypes) = apart["loads"]
    assert (policy_device, ref_device) == ("cpu", "cpu:0")
    assert policy_dtypes == {torch.float32} and ref_dtypes == {torch.float32}  # no bf16 matmul weights there
    # every reference pass (the probe, then one per micro-batch and step) ran without autocast, in fp32
    assert apart["ref_calls"] and set(apart["ref_calls"]) == {(False, torch.float32)}
    assert g["ref_logp"].shape == g["r"].completion_ids.shape  # (N, C): what travels back
    rows = read_metrics(str(tmp_path))
    # the same weights in two numerics: a KL above 0 at step 1, but of the size of bf16's rounding (~1e-2 in a
    # log-prob: k3 ~ x^2 / 2 ~ 1e-4 a token), far below a policy that moved
    assert 0 < rows[0]["kl"] < 1e-2


def test_the_same_device_keeps_the_policys_dtype_and_a_zero_kl(model_dir, tmp_path, apart):
    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--dtype", "bfloat16", "--ref-device", "cpu", steps=1))
    (_, _, policy_dtypes), (_, ref_device, ref_dtypes) = apart["loads"]
    assert ref_device == "cpu" and ref_dtypes == {torch.float32, torch.bfloat16}  # matmul weights as autocast's
    assert set(apart["ref_calls"]) == {(True, torch.float32)}  # the residual stream in fp32, matmuls in bf16
    assert read_metrics(str(tmp_path))[0]["kl"] == 0.0


def test_an_fp16_policy_gets_an_fp32_reference_where_fp16_is_emulated(model_dir, tmp_path, apart, monkeypatch, capsys):
    """--dtype float16 with the reference on a device with native bf16 but emulated fp16 (an EPYC CPU): the
    reference computes in fp32 and one line says so. Fails if the reference's dtype is judged by bf16's support
    (fp16 kept there: emulated matmuls, several times slower than fp32)."""
    monkeypatch.setattr(models, "native", lambda d, dtype: not (str(d) == "cpu:0" and dtype == torch.float16))
    run_script(TRAIN, train_args(model_dir, str(tmp_path), "--dtype", "float16", "--ref-device", "cpu:0", steps=1))
    assert "reference on cpu:0 computes in fp32" in capsys.readouterr().out
    (_, policy_device, _), (_, ref_device, ref_dtypes) = apart["loads"]
    assert (policy_device, ref_device) == ("cpu", "cpu:0") and ref_dtypes == {torch.float32}
    assert apart["ref_calls"] and set(apart["ref_calls"]) == {(False, torch.float32)}


def test_the_full_kl_runs_the_reference_head_on_the_policys_side(model_dir, tmp_path, apart):
    """--ref-device cpu:0 with the full KL and ref_sync_every=1: hidden states travel, the head is a copy on the
    policy's side, and the reference is the policy again after each step. fp32 on both sides, so the KL of every
    step (each one's reference synced to the policy it samples from) is exactly 0. Fails if the sync skips the
    reference's head copy or a step, or the two sides compute in other numerics."""
    g = run_script(
        TRAIN,
        train_args(
            model_dir,
            str(tmp_path),
            "--ref-device",
            "cpu:0",
            "--kl-estimator",
            "full",
            "--config",
            "ref_sync_every=1",
            steps=2,
        ),
    )
    ref, policy = g["ref"], g["policy"]
    head = ref.get_output_embeddings()
    assert head.weight is not ref.get_input_embeddings().weight  # a copy for the policy's side: no longer tied
    H = policy.config.hidden_size
    assert [tuple(h.shape)[-1] for h in g["ref_hidden"]] == [H] * len(
        g["ref_hidden"]
    )  # hidden states travel, not logits
    # ref_sync_every: the reference (and its head) became the policy after each step, on the reference's side
    for name, p in policy.named_parameters():
        torch.testing.assert_close(ref.get_parameter(name), p.detach(), rtol=0, atol=0, msg=name)
    torch.testing.assert_close(head.weight, policy.get_output_embeddings().weight.detach(), rtol=0, atol=0)
    rows = read_metrics(str(tmp_path))
    assert [r["kl"] for r in rows] == [0.0, 0.0] and [r["kl_max"] for r in rows] == [0.0, 0.0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--lora-rank", 4],
            "--lora-rank: the reference is the base (adapters off); it takes no ref_sync_every, no --ref-device",
        ),
        (["--ref-device", "nope"], "device 'nope' is not usable here"),
    ],
)
def test_what_the_reference_device_does_not_take_is_one_line(model_dir, tmp_path, capsys, extra, message):
    argv = train_args(model_dir, str(tmp_path / "run"), "--ref-device", "cpu", *extra)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_script(TRAIN, argv)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and message in line and not os.path.exists(tmp_path / "run"), line
