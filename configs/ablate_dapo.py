# DAPO (arXiv 2503.14476): token-level loss over the batch, clip-higher, no KL, no loss on truncated.
loss_type = "dapo"
eps = 0.2
eps_high = 0.28
beta = 0.0
mask_truncated = True
out_dir = "out/ablate_dapo"
