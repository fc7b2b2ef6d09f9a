"""A reward model as a reward fn: any AutoModelForSequenceClassification with one label scores question + completion.

rm = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1); rm_tok = AutoTokenizer...(name)
REWARDS["rm"] = reward_model(rm, rm_tok)  # rewards.REWARDS; then train.py --reward-weights rm=1.0
"""

import torch


def reward_model(model, tokenizer):
    """fn(completions, question) -> the model's score of each question + completion (num_labels=1)."""
    assert model.config.num_labels == 1, "a reward model gives one score: num_labels=1"
    if model.config.pad_token_id is None:  # its pooling finds each row's last token by this id
        pad = tokenizer.pad_token_id
        model.config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    pad, device = model.config.pad_token_id, model.device

    @torch.no_grad()
    def fn(completions, question, **_):  # any field of the task's examples can be asked for by name
        texts = [q + c for q, c in zip(question, completions)]  # a control token's string in them stays text
        ids = [tokenizer(t, split_special_tokens=True)["input_ids"] for t in texts]
        T = max(map(len, ids))  # padded on the right: a causal model never looks ahead at it
        input_ids = torch.tensor([x + [pad] * (T - len(x)) for x in ids], device=device)  # (N, T)
        mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids], device=device)  # (N, T)
        return model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().tolist()

    return fn
