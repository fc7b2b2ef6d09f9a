# SmolLM2-135M-Instruct learns to call a calculator (envs.py) for 3-digit multiplication, offline on a CPU.
# python train.py --config configs/arith_tool_smollm2_cpu.py      (the same without the tool: --task arith_mul)
task = "arith_tool"  # "What is 482 * 937?": a 135M model cannot do it in its head
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
steps = 60
eval_every = 30  # before, halfway, after (200 held-out problems, greedy)
eval_n = 200
save_every = 20
log_completions = 10
out_dir = "out/arith_tool_smollm2_cpu"
# the signal to start from: the prompt shows one worked call as earlier chat turns (extra_tasks.tool_prompt), and a call
# that ran earns 0.2 (rewards.tool_reward) beside the right `#### N` (1.0) and the format (0.1): without it the format
# alone is learnt first and the calls die out (BENCHMARKS.md)
