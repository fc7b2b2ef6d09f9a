"""Each TRL 1.16 option of the variants (issue: LUSPO, VESPO, GDPO, off-policy masking, the bias-corrected KL, adaptive
entropy, truncated sampling, steps_per_generation, is_cap_min) for one step of the arith task on the real SmolLM2-135M
(tiny settings): the run finishes, run.json holds the value, and the step's metrics are finite and carry the option's
own. The math is tested against independent computations in tests/test_variants.py and tests/test_truncation.py."""

import json
import math

import pytest

from toy import TRAIN, read_metrics, run_script

OPTIONS = {  # name -> (config lines, a metric the option logs or None)
    "luspo": ({"loss_type": "luspo", "importance_level": "sequence"}, None),
    "vespo": ({"loss_type": "vespo"}, None),
    "gdpo": ({"multi_objective_aggregation": "normalize_then_sum"}, None),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.0}, "off_policy_masked"),
    "bias_corrected_kl": ({"use_bias_correction_kl": True}, "kl"),
    "adaptive_entropy": ({"use_adaptive_entropy": True, "entropy_coef": 0.01}, "entropy_coef"),
    "truncated_sampling": ({"top_k": 20, "top_p": 0.9, "min_p": 0.05}, None),
    "steps_per_generation": ({"steps_per_generation": 2}, "update2/grad_norm"),
    "is_cap_min": ({"is_cap_min": 0.5}, "is_capped"),
}


@pytest.mark.real_model
@pytest.mark.parametrize("name", OPTIONS)
def test_one_step_of_each_option_on_arith_finishes(name, smol_tok, tmp_path):
    """Fails if an option cannot run a step of the shipped task on the shipped model (a shape, a device, a missing
    argument on the path a unit test does not take), is not saved in run.json, leaves a non-finite loss or gradient
    norm, or does not log what it says it logs."""
    config, metric = OPTIONS[name]
    argv = ["--task", "arith", "--model", "smollm2-135m", "--out-dir", tmp_path, "--steps", 1, "--group-size", 4]
    argv += ["--prompts-per-step", 2, "--micro-batch", 4, "--max-new-tokens", 12, "--eval-n", 0, "--dtype", "float32"]
    argv += ["--device", "cpu", "--lr", 1e-5]
    for key, value in config.items():
        argv += ["--config", f"{key}={value!r}"]
    run_script(TRAIN, argv)
    saved = json.loads((tmp_path / "run.json").read_text())
    assert {k: saved[k] for k in config} == config
    [row] = [r for r in read_metrics(str(tmp_path)) if "loss" in r]
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), row
    if metric is not None:
        assert row.get(metric) is not None and math.isfinite(row[metric]), (metric, row)
