# token-level mean over the micro-batch instead of the paper's per-sequence mean.
loss_type = "bnpo"
out_dir = "out/ablate_bnpo"
