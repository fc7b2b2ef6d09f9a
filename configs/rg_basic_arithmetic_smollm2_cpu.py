# reasoning-gym basic_arithmetic (2 one-digit terms, + - * /, negatives) scored by its own score_answer.
# pip install reasoning-gym==0.1.25; python train.py --config configs/rg_basic_arithmetic_smollm2_cpu.py
task = "rg:basic_arithmetic"
task_options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
model = "smollm2-135m"
group_size = 8  # G
prompts_per_step = 2  # 16 completions a step
micro_batch = 16
max_new_tokens = 48  # one-line answers; long rambles get cut and score 0
temperature = 0.7  # at 1.0 a 135M model rarely samples a right answer here: groups without spread teach nothing
lr = 2e-5  # for 135M params, as configs/arith_smollm2_cpu.py
warmup_steps = 3
lr_schedule = "cosine"
beta = 0.04
steps = 60  # ~10 s a step on 2 cores (1 thread)
eval_every = 30  # before, halfway, after (200 held-out questions, greedy)
eval_n = 200
save_every = 10
log_completions = 10
out_dir = "out/rg_basic_arithmetic_smollm2_cpu"
