import doctest

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

import rewards
from rewards import (RewardError, answers_match, combine_rewards, correctness_reward, extract_answer,
                     extract_boxed, extract_flexible, extract_gold, extract_strict, format_reward,
                     has_final_answer, length_reward, overlong_reward, reward_model_reward)


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
    for empty in ("2 + 2 = 4\n#### ", "####\n", "#### ,"):
        with pytest.raises(ValueError, match="nothing after '####'"):
            extract_gold(empty)


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


def test_overlong_reward_dapo_eq13():
    fn = overlong_reward(48, 16)  # L_max = 48, L_cache = 16: free up to 48 - 16 = 32 tokens
    assert fn.__name__ == "overlong"
    # (32 - |y|) / 16 in (32, 48]: 33 -> -1/16, 40 -> -8/16, 48 -> -16/16; past 48 -> -1
    assert fn(["x"] * 7, num_tokens=[1, 32, 33, 40, 47, 48, 49]) == [0.0, 0.0, -0.0625, -0.5, -0.9375, -1.0, -1.0]
    assert overlong_reward(4, 4)(["a", "b"], num_tokens=[0, 3]) == [0.0, -0.75]  # buffer = max_len: -|y|/4


@pytest.mark.parametrize("max_len, buffer", [(0, 1), (48, 0), (48, -1), (16, 17)])
def test_overlong_reward_bad_args(max_len, buffer):
    with pytest.raises(ValueError, match="max_len >= 1 and 0 < buffer <= max_len"):
        overlong_reward(max_len, buffer)


def test_overlong_reward_needs_token_counts():
    with pytest.raises(ValueError, match="needs num_tokens"):
        overlong_reward(48, 16)(["a"])
    with pytest.raises(RewardError, match="'overlong' raised ValueError: overlong reward needs num_tokens"):
        combine_rewards({"overlong": overlong_reward(48, 16)}, {"overlong": 1.0}, ["a"])


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
    with pytest.raises(RewardError, match="'bad' returned 1 values for 2 completions; return one per"):
        combine_rewards({"bad": lambda c, **_: [0.0]}, {"bad": 1.0}, ["a", "b"])
    with pytest.raises(RewardError, match="'bad' returned a NoneType, not a list"):
        combine_rewards({"bad": lambda c, **_: None}, {"bad": 1.0}, ["a", "b"])
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


def one_line_error(fns, weights, completions, **fields):
    with pytest.raises(RewardError) as e:
        combine_rewards(fns, weights, completions, **fields)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_reward_that_raises_names_itself_and_the_completion():
    def inverse(completions, answer, **_):
        return [1 / int(a) for a in answer]
    fns = {"format": format_reward, "inverse": inverse}
    msg = one_line_error(fns, {"format": 0.1, "inverse": 1.0}, ["a", "b\nc", "d"], answer=["1", "0", "0"])
    # index 1 is the first that fails alone; its newline stays escaped
    assert msg == ("reward 'inverse' raised ZeroDivisionError: division by zero on completion 1 'b\\nc'; "
                   "fix the function or its weight")


def test_reward_that_raises_only_on_the_batch():
    def batch_of_one_only(completions, **_):
        if len(completions) > 1:
            raise RuntimeError("too many\ncompletions")
        return [0.0]
    msg = one_line_error({"solo": batch_of_one_only}, {"solo": 1.0}, ["a", "b"])
    assert msg.startswith("reward 'solo' raised RuntimeError: too many completions on the batch of 2;")


@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), (float("-inf"), "-inf"), ("abc", "'abc'"),
                                        (None, "None")])
def test_non_finite_reward_value_names_fn_index_and_completion(bad, shown):
    long = "line one\n" + "x" * 100
    msg = one_line_error({"judge": lambda c, **_: [1.0, bad]}, {"judge": 0.0}, ["ok", long])  # weight 0 still checked
    assert msg == (f"reward 'judge' gave {shown} for completion 1 {long[:60]!r}...; "
                   "return a finite number for every completion")


@pytest.mark.parametrize("w", [float("nan"), float("inf"), "x", None])
def test_non_finite_weight_names_it(w):
    fns = {"correct": correctness_reward, "format": format_reward}
    msg = one_line_error(fns, {"correct": 1.0, "format": w}, ["#### 1"], answer=["1"])
    assert msg.startswith(f"weight format={w!r} is not a finite number;")
