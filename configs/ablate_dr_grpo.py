# Dr. GRPO (arXiv 2503.20783): no std scaling, sum / (G * max_len) aggregation.
# python train.py --config configs/arith_smollm2_cpu.py --config configs/ablate_dr_grpo.py
loss_type = "dr_grpo"
scale_rewards = "none"
out_dir = "out/ablate_dr_grpo"
