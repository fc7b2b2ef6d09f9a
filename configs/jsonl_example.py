# your own data: a JSONL file, one {"question": ..., "answer": ...} object a line (file_task.py), on the offline model.
# python train.py --config configs/jsonl_example.py --data-dir my_data.jsonl  (or a folder of train.jsonl, test.jsonl)
task = "jsonl"
data_dir = "tests/file_task_sample.jsonl"  # 30 generated sums; a relative path is read from where you run train.py
task_options = {
    "prompt_field": "question",  # the fields of each line that hold the prompt and the answer
    "answer_field": "answer",
    "extract": "final",  # `#### N`, else `\boxed{}`; or "strict", "boxed", "last_number" (file_task.EXTRACTIONS)
    "test_percent": 10,  # a single file: questions held out by a hash of their text (a folder: its test.jsonl)
    "seed": 0,  # which questions the hash holds out
    "system": "Answer the question. End with a final line: #### <answer>\nExample:\nWhat is 3 + 4?\n#### 7",
}
model = "smollm2-135m"
group_size = 8  # G
prompts_per_step = 2  # 16 completions a step
micro_batch = 16
max_new_tokens = 48  # one-line answers; long rambles get cut and score 0
lr = 2e-5  # for 135M params, as configs/arith_smollm2_cpu.py
warmup_steps = 3
beta = 0.04
steps = 20  # a few minutes on a laptop-class CPU
eval_every = 0  # eval once at the end
eval_n = 200  # the whole test split, when it is smaller
out_dir = "out/jsonl_example"
