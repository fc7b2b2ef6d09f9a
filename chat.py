"""A chat template's token ids when a message's text holds a control token's string (a data file's question, an
environment's message): the template's own control tokens stay control tokens, every message's text is tokenized as
text. rollout.encode_prompts imports it only for such a message."""

import re


def template_ids(tokenizer, messages, tools, specials):
    """messages -> ids. Each message's text is a mark (U+E000, its index, U+E001) while the template runs, so every
    control token in the template's text is the template's own; the text between them (cut at `specials`, longest
    first) is tokenized piece by piece with special-token parsing off and the marks put back as the messages' text, as
    the tokenizer itself tokenizes the text between control tokens apart."""
    texts = [m.get("content") for m in messages]
    marked = [
        {**m, "content": f"\ue000{j}\ue001"} if isinstance(t, str) else m
        for j, (m, t) in enumerate(zip(messages, texts))
    ]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False, **tools)
    control = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    ids = []
    for i, piece in enumerate(re.split(f"({control})", text)):  # text, a control token, text, ...
        if i % 2:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            parts = re.split("\ue000(\\d+)\ue001", piece)  # text, a mark's index, text, ...
            piece = "".join(texts[int(x)] if k % 2 else x for k, x in enumerate(parts))
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids
