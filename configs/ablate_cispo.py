# CISPO (MiniMax-M1, arXiv 2506.13585): a clipped, detached IS weight times log pi; clipped tokens keep a gradient.
loss_type = "cispo"  # token-level over the batch, as dapo (TRL)
cispo_cap = 5.0  # the weight's upper bound, TRL's epsilon_high for cispo (ScaleRL's eps_max)
mu = 2  # the ratio is only != 1 when the batch is reused; at mu = 1 the cap never binds
out_dir = "out/ablate_cispo"
