import doctest

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

import rewards
from rewards import (answers_match, combine_rewards, correctness_reward, extract_answer,
                     extract_boxed, extract_flexible, extract_gold, extract_strict, format_reward,
                     has_final_answer, length_reward, reward_model_reward)


def test_docstring_examples():
    assert doctest.testmod(rewards).failed == 0

# -----------------------------------------------------------------------------
# extraction

def test_extract_gold():
    assert extract_gold("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18") == "18"
    assert extract_gold("big\n#### 1,234,567") == "1234567"
    assert extract_gold("she owes\n#### -5") == "-5"
    with pytest.raises(ValueError, match="####"):
        extract_gold("no final line here")


def test_extract_strict_is_lm_eval_strict_match():
    assert extract_strict("9 * 2 = 18\n#### 18") == "18"
    assert extract_strict("#### -3.5") == "-3.5"
    assert extract_strict("#### 1,000") == "1,000"
    assert extract_strict("The answer is 18.") is None
    assert extract_strict("####18") is None  # strict: lm-eval wants the space
    assert extract_strict("#### $18") is None  # and no `$`


def test_extract_strict_takes_first_line_when_model_runs_on():
    # a model that answers and then invents the next question: the first #### is its answer
    text = "16 - 3 - 4 = 9, 9 * 2 = 18\n#### 18\n\nQuestion: Tom has 3 apples...\n#### 3"
    assert extract_strict(text) == "18"
    assert correctness_reward([text], answer=["18"]) == [1.0]


def test_extract_boxed_nested_and_last():
    assert extract_boxed(r"so \boxed{18}.") == "18"
    assert extract_boxed(r"\boxed{\frac{3}{4}}") == r"\frac{3}{4}"
    assert extract_boxed(r"first \boxed{1} then \boxed{ {2} }") == "{2}"
    assert extract_boxed(r"truncated \boxed{\frac{3}{4}") is None
    assert extract_boxed("no box") is None


def test_extract_flexible_last_number():
    assert extract_flexible("3 + 4 = 7, so she pays $1,200.50.") == "$1,200.50"
    assert extract_flexible("the change is -3 dollars") == "-3"
    assert extract_flexible("So the answer is 72.") == "72"
    assert extract_flexible("no digits") is None


def test_extract_answer_prefers_strict_then_boxed():
    assert extract_answer("\\boxed{5}\n#### 6") == "6"
    assert extract_answer("so \\boxed{5}") == "5"
    assert extract_answer("the answer is 5") is None


@pytest.mark.parametrize("pred, gold, same", [
    ("72", "72", True),
    ("72.0", "72", True),
    ("72.", "72", True),
    ("$1,000", "1000", True),
    ("\\$1,000", "1000", True),
    (" 1 000 ", "1000", True),
    ("-5", "-5", True),
    ("3/4", "0.75", True),
    ("\\frac{3}{4}", "0.75", True),
    ("\\dfrac{3}{4}", "3/4", True),
    ("0.1", "1/10", True),
    ("71.99", "72", False),
    ("5", "-5", False),
    ("1/0", "1", False),
    ("abc", "abc", True),  # non-numbers compare as strings
    (None, "72", False),
    ("", "", False),
    (".", "0", False),
])
def test_answers_match(pred, gold, same):
    assert answers_match(pred, gold) is same

# -----------------------------------------------------------------------------
# reward fns

COMPLETIONS = ["9 * 2 = 18\n#### 18", "so \\boxed{18}", "#### 17", "The answer is 18."]


def test_correctness_and_format_rewards():
    answer = ["18"] * 4
    assert correctness_reward(COMPLETIONS, answer=answer, prompt=["p"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert format_reward(COMPLETIONS, answer=answer) == [1.0, 1.0, 1.0, 0.0]


def test_format_needs_a_number_on_the_line():
    assert [has_final_answer(t) for t in ["#### 3", "\\boxed{\\frac{1}{2}}", "#### .", "\\boxed{}", "3"]] == \
        [True, True, False, False, False]
    assert format_reward(["#### ,", "#### 1,000"]) == [0.0, 1.0]


def test_length_reward_chars_or_tokens():
    fn = length_reward(5)
    assert fn(["abc", "abcde", "abcdefgh"], answer=["1"] * 3) == [-2.0, 0.0, -3.0]
    assert fn(["abc", "abcde"], num_tokens=[5, 1]) == [0.0, -4.0]  # tokens win when given


def test_combine_rewards_total_and_per_fn():
    fns = {"correct": correctness_reward, "format": format_reward}
    total, per_fn = combine_rewards(fns, {"correct": 1.0, "format": 0.5}, COMPLETIONS, answer=["18"] * 4)
    assert per_fn == {"correct": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 1.0, 1.0, 0.0]}
    assert total == [1.5, 1.5, 0.5, 0.0]


def test_combine_rewards_errors():
    fns = {"correct": correctness_reward, "format": format_reward}
    with pytest.raises(ValueError, match=r"valid names: \['correct', 'format'\]"):
        combine_rewards(fns, {"correct": 1.0, "format": 0.1, "corect": 1.0}, ["#### 1"], answer=["1"])
    with pytest.raises(ValueError, match="no weight"):
        combine_rewards(fns, {"correct": 1.0}, ["#### 1"], answer=["1"])
    with pytest.raises(ValueError, match="'bad' returned 1 values for 2"):
        combine_rewards({"bad": lambda c, **_: [0.0]}, {"bad": 1.0}, ["a", "b"])
    with pytest.raises(ValueError, match="'answer' has 1 values for 2"):
        combine_rewards(fns, {"correct": 1.0, "format": 0.1}, ["a", "b"], answer=["1"])

# -----------------------------------------------------------------------------
# reward model wrapper, on a tiny random model and an in-process word-level tokenizer

WORDS = ["<unk>", "<eos>", "<pad>", "the", "answer", "is", "18", "17", "####", "q", ":", "what", "two", "plus"]


def tiny_reward_model(pad_token=None):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                        pad_token=pad_token)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1)
    return LlamaForSequenceClassification(config), tokenizer


PROMPTS = ["q : what is two plus two ?", "q : what", "q :", "q : two", "q : two plus"]
ANSWERS = [" the answer is 18", " #### 17", " the answer is the answer is 18 #### 18", " 18", " is"]


@torch.no_grad()
def one_by_one(model, tokenizer, prompts, completions):
    scores = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([tokenizer(p + c)["input_ids"]])  # (1, T), no padding at all
        scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


def test_reward_model_batched_equals_one_by_one():
    model, tokenizer = tiny_reward_model()  # no pad token: the wrapper falls back to eos
    fn = reward_model_reward(model, tokenizer, batch_size=3)
    assert model.config.pad_token_id == tokenizer.eos_token_id
    batched = fn(ANSWERS, prompt=PROMPTS, answer=["18"] * 5)
    assert batched == pytest.approx(one_by_one(model, tokenizer, PROMPTS, ANSWERS), abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) == 5  # the scores really depend on the text


def test_reward_model_ignores_tokenizer_padding_side():
    model, tokenizer = tiny_reward_model(pad_token="<pad>")
    tokenizer.padding_side = "left"  # a generation setting; must not leak into scoring
    fn = reward_model_reward(model, tokenizer, batch_size=5)
    assert model.config.pad_token_id == WORDS.index("<pad>")
    assert fn(ANSWERS, prompt=PROMPTS) == pytest.approx(one_by_one(model, tokenizer, PROMPTS, ANSWERS), abs=1e-5)


def test_reward_model_chat_messages_prompt():
    model, tokenizer = tiny_reward_model()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    fn = reward_model_reward(model, tokenizer, batch_size=2)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    as_text = [f"user : {p} " for p in PROMPTS]
    completions = [f"{a} " for a in ANSWERS]
    expected = one_by_one(model, tokenizer, [t + "assistant : " for t in as_text], completions)
    assert fn(completions, prompt=messages) == pytest.approx(expected, abs=1e-5)


def test_reward_model_needs_one_label():
    model, tokenizer = tiny_reward_model()
    model.config.num_labels = 2
    with pytest.raises(ValueError, match="num_labels=1"):
        reward_model_reward(model, tokenizer)
