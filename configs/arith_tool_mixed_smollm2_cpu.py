# When to call: the calculator on a mixed split, half one-digit products SmolLM2 does alone, half three-digit.
# python train.py --config configs/arith_tool_mixed_smollm2_cpu.py
task = "arith_tool_mixed"  # half "What is 7 * 8?" (done alone), half "What is 482 * 937?" (needs the tool)
model = "smollm2-135m"
dtype = "auto"
group_size = 8
prompts_per_step = 2
micro_batch = 16
max_new_tokens = 64  # a call, the tool's reply (~15 tokens, no loss on them) and the #### line
task_options = {"max_tool_calls": 2}  # extra_tasks.calculator's options
lr = 2e-5
warmup_steps = 5
lr_schedule = "cosine"
beta = 0.04
steps = 30
eval_every = 0  # BENCHMARKS.md: eval.py before and after, per difficulty from its predictions
eval_n = 200
save_every = 20
log_completions = 10
out_dir = "out/arith_tool_mixed_smollm2_cpu"
# the signal to start from: the prompt shows one worked call as earlier chat turns (extra_tasks.tool_prompt), and a call
# that ran earns 0.2 (rewards.tool_reward) beside the right `#### N` (1.0) and the format (0.1): without it the format
# alone is learnt first and the calls die out (BENCHMARKS.md)
