# SAPO (arXiv 2511.20347): a soft sigmoid gate on the ratio instead of the hard clip; per-sequence mean as grpo.
loss_type = "sapo"
sapo_temperature_pos = 1.0  # the gate's temperature for A > 0 (the paper's and TRL's)
sapo_temperature_neg = 1.05  # for A <= 0: its gradient decays faster off-policy
mu = 2  # the ratio is only != 1 when the batch is reused; at mu = 1 the gradient is grpo's
out_dir = "out/ablate_sapo"
