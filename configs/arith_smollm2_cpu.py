# the offline CPU run: SmolLM2-135M-Instruct (GGUF from PyPI) learns to end with "#### N" on arith.
# python train.py --config configs/arith_smollm2_cpu.py
task = "arith"
model = "smollm2-135m"
device = "auto"
dtype = "bfloat16"        # autocast; sampling runs in bf16 (faster decoding)
group_size = 8            # G
prompts_per_step = 2      # 16 completions a step
micro_batch = 16
max_new_tokens = 48       # answers are one line; long rambles get cut and score 0
temperature = 1.0
lr = 3e-5                 # a 135M model and a format to learn in 80 steps: far above the paper's 1e-6
warmup_steps = 5
beta = 0.04               # the paper's KL; reference in bf16 on the same device
loss_type = "grpo"
steps = 80                # ~10 min of training on a 2-core CPU (measured: README)
eval_every = 40           # before, halfway, after (200 held-out problems)
eval_n = 200
save_every = 20
log_completions = 10
out_dir = "out/arith_smollm2_cpu"
