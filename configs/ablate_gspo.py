# GSPO (arXiv 2507.18071): sequence-level importance ratio with its small clip range.
importance_level = "sequence"
eps = 3e-4
eps_high = 4e-4
mu = 2  # the ratio is only != 1 when the batch is reused
out_dir = "out/ablate_gspo"
