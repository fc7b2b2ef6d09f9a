# no KL term: no reference model is loaded at all (saves its memory and forward pass).
beta = 0.0
out_dir = "out/ablate_beta0"
