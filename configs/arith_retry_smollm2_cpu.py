# arith with feedback (envs.FeedbackEnv): the same run as configs/arith_smollm2_cpu.py, at its token budget
# python train.py --config configs/arith_retry_smollm2_cpu.py
task = "arith_retry"  # arith with feedback: a wrong answer is told so and tried again
model = "smollm2-135m"
device = "auto"
dtype = "auto"  # bf16 autocast where the CPU has native bf16 (AVX-512/AMX), else fp32 (faster there)
group_size = 8  # G
prompts_per_step = 2  # 16 completions a step
micro_batch = 16
max_new_tokens = 48  # all attempts and the feedback together: the single-turn run's budget
task_options = {"max_attempts": 2}  # a first answer and one retry (extra_tasks.feedback's options)
temperature = 1.0
lr = 2e-5  # for 135M params; scale down with size (README: learning rates), e.g. 0.5B ~3e-6
warmup_steps = 5
lr_schedule = "cosine"  # to 10% by step 80: the policy settles once it has learned instead of drifting on
beta = 0.04  # the paper's KL; reference in bf16 on the same device
loss_type = "grpo"
steps = 40  # ~16 min on 1 thread (BENCHMARKS.md)
eval_every = 40  # before and after (200 held-out problems)
eval_n = 200
save_every = 20
log_completions = 10
out_dir = "out/arith_retry_smollm2_cpu"
