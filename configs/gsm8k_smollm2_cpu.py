# GSM8K with the offline 135M model on CPU: what a short CPU run can do (README: results).
# python train.py --config configs/gsm8k_smollm2_cpu.py --data-dir ../shared/data/gsm8k
task = "gsm8k"
model = "smollm2-135m"
dtype = "auto"  # bf16 where the CPU has native bf16, else fp32
group_size = 8
prompts_per_step = 2
micro_batch = 16
max_new_tokens = 192
lr = 1e-5  # for 135M params; scale down with size (README: learning rates)
warmup_steps = 5
beta = 0.04
steps = 20  # minutes on a 2-core CPU
eval_every = 0  # eval once at the end (200 problems take minutes on CPU)
eval_n = 200
save_every = 10
out_dir = "out/gsm8k_smollm2_cpu"
