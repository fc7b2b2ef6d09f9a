# GSM8K with a python tool (envs.python: each call a sandboxed interpreter), Qwen2.5-1.5B-Instruct, one 80 GB GPU.
# python train.py --config configs/gsm8k_python_qwen15b_gpu.py
# an expectation until a GPU runs it: the recipe of configs/gsm8k_qwen05b_gpu.py with the tool
task = "gsm8k_python"  # the prompt shows one worked call; a call that ran earns 0.2 beside the answer (1.0)
model = "Qwen/Qwen2.5-1.5B-Instruct"  # its template writes <tool_call> json calls, which 1.5B writes reliably
device = "cuda"
dtype = "bfloat16"
group_size = 16
prompts_per_step = 32
micro_batch = 32
max_new_tokens = 512  # the model's tokens and the tool replies (<= 500 characters each) together
task_options = {"max_tool_calls": 2, "max_reply_tokens": 160}  # a program's output is shown up to 400 characters
temperature = 1.0
lr = 1e-6
warmup_steps = 10
weight_decay = 0.0
grad_clip = 1.0
beta = 0.04
kl_estimator = "k3"
mu = 1
loss_type = "grpo"
steps = 200
eval_every = 25
eval_n = 500
save_every = 25
out_dir = "out/gsm8k_python_qwen15b"
