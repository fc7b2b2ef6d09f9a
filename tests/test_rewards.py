import doctest
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import envs
from conftest import EOS, VOCAB, make_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification

import rewards
import variants
from gsm8k import extract_gold
import tasks
from rewards import (
    RewardError,
    answers_match,
    combine_rewards,
    correctness_reward,
    extract_answer,
    extract_boxed,
    extract_flexible,
    extract_strict,
    format_reward,
    has_final_answer,
)
from variants import overlong_reward

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize("module", [rewards, variants])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0  # a module whose examples were all lost runs none


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


@pytest.mark.parametrize(
    "pred, gold, same",
    [
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
    ],
)
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
    assert [has_final_answer(t) for t in ["#### 3", "\\boxed{\\frac{1}{2}}", "#### .", "\\boxed{}", "3"]] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert format_reward(["#### ,", "#### 1,000"]) == [0.0, 1.0]


def test_tool_reward_is_one_where_a_call_ran_and_tool_cost_counts_every_call():
    """Fails if tool_reward pays a row whose every call errored (c >= e), pays no call, or is not 0/1; or if tool_cost
    is not minus the number of calls (sign, errors left out, a constant)."""
    calls, errors = [0, 1, 1, 3, 3], [0, 0, 1, 3, 1]  # none; one that ran; one that errored; all errored; two of 3 ran
    kw = dict(tool_calls=calls, tool_errors=errors)
    assert envs.tool_reward(["x"] * 5, **kw) == [0.0, 1.0, 0.0, 0.0, 1.0]  # 1 iff some call ran: calls > errors
    assert envs.tool_cost(["x"] * 5, **kw) == [0.0, -1.0, -1.0, -3.0, -3.0]  # -calls, errored ones counted


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
    with pytest.raises(RewardError, match="'overlong' raised TypeError: .*missing 1 required .*'num_tokens'"):
        combine_rewards({"overlong": overlong_reward(48, 16)}, {"overlong": 1.0}, ["a"])


def test_combine_rewards_total_and_per_fn():
    fns = {"correct": correctness_reward, "format": format_reward}
    total, per_fn = combine_rewards(fns, {"correct": 1.0, "format": 0.5}, COMPLETIONS, answer=["18"] * 4)
    assert per_fn == {"correct": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 1.0, 1.0, 0.0]}
    assert total == [1.5, 1.5, 0.5, 0.0]


def test_combine_rewards_errors():
    fns = {"correct": correctness_reward, "format": format_reward}
    with pytest.raises(ValueError, match=r"weights for \['corect', 'correct', 'format'\], reward fns \['correct', "):
        combine_rewards(fns, {"correct": 1.0, "format": 0.1, "corect": 1.0}, ["#### 1"], answer=["1"])
    with pytest.raises(ValueError, match=r"weights for \['correct'\], reward fns \['correct', 'format'\]; give each"):
        combine_rewards(fns, {"correct": 1.0}, ["#### 1"], answer=["1"])
    with pytest.raises(ValueError, match="'answer' has 1 values for 2"):
        combine_rewards(fns, {"correct": 1.0, "format": 0.1}, ["a", "b"], answer=["1"])


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
    assert msg == (
        "reward 'inverse' raised ZeroDivisionError: division by zero on completion 1 'b\\nc'; "
        "fix the function or its weight"
    )


def test_reward_that_raises_only_on_the_batch():
    def batch_of_one_only(completions, **_):
        if len(completions) > 1:
            raise RuntimeError("too many\ncompletions")
        return [0.0]

    msg = one_line_error({"solo": batch_of_one_only}, {"solo": 1.0}, ["a", "b"])
    assert msg.startswith("reward 'solo' raised RuntimeError: too many completions on the batch of 2;")


# the reward contract: N finite real numbers, else one line naming the fn (a dict would train on its keys,
# a str on its characters)
@pytest.mark.parametrize(
    "raw, what",
    [
        ({0: 1.0, 1: 1.0}, "returned a dict, not a list of numbers"),
        ("11", "returned a str, not a list of numbers"),
        ({0.0, 1.0}, "returned a set, not a list of numbers"),
        ((x for x in [1.0, 0.0]), "returned a generator, not a list of numbers"),
        (None, "returned a NoneType, not a list of numbers"),
        (1.0, "returned a float, not a list of numbers"),
        (torch.tensor(1.0), "returned a Tensor, not a list of numbers"),  # 0-dim
        (np.ones((2, 1)), "returned a ndarray, not a list of numbers"),  # 2-D
        ([1.0], "returned 1 values for 2 completions"),
        ((1.0, 0.0, 1.0), "returned 3 values for 2 completions"),
        (["1", "0"], "gave '1' (str) for completion 0 'a', not a finite number"),
        (np.array(["1", "0"]), "gave '1' (str) for completion 0 'a', not a finite number"),
        ([[1.0], [0.0]], "gave [1.0] (list) for completion 0 'a', not a finite number"),
        ([1.0, None], "gave None (NoneType) for completion 1 'b', not a finite number"),
        ([1.0, float("nan")], "gave nan (float) for completion 1 'b', not a finite number"),
        ([float("-inf"), 1.0], "gave -inf (float) for completion 0 'a', not a finite number"),
        (torch.tensor([1.0, float("inf")]), "gave inf (float) for completion 1 'b', not a finite number"),
        ([1.0, 1j], "gave 1j (complex) for completion 1 'b', not a finite number"),
    ],
)
def test_reward_contract_broken_names_the_fn(raw, what):
    msg = one_line_error({"judge": lambda c, **_: raw}, {"judge": 0.0}, ["a", "b"])  # weight 0 is still checked
    assert msg == f"reward 'judge' {what}; return a list of 2 numbers"


def test_reward_contract_message_shows_a_long_completion_on_one_line():
    long = "line one\n" + "x" * 100
    msg = one_line_error({"judge": lambda c, **_: [1.0, float("nan")]}, {"judge": 1.0}, ["ok", long])
    assert (
        msg == f"reward 'judge' gave nan (float) for completion 1 {long[:60]!r}..., not a finite number; "
        "return a list of 2 numbers"
    )


@pytest.mark.parametrize(
    "raw",
    [
        [1, 0.5],
        (True, 0.5),
        [np.int64(1), np.float32(0.5)],
        [np.bool_(True), np.float64(0.5)],
        [torch.tensor(1), torch.tensor(0.5, dtype=torch.bfloat16)],
        torch.tensor([1.0, 0.5], requires_grad=True),
        np.array([1.0, 0.5]),
        [Fraction(1), Fraction(1, 2)],
    ],
)
def test_reward_contract_takes_real_numbers(raw):
    total, per_fn = combine_rewards({"judge": lambda c, **_: raw}, {"judge": 2.0}, ["a", "b"])
    assert per_fn == {"judge": [1.0, 0.5]} and total == [2.0, 1.0]
    assert all(type(v) is float for v in per_fn["judge"])  # plain floats, whatever came back


@pytest.mark.parametrize("w", [float("nan"), float("inf"), "x", None])
def test_non_finite_weight_names_it(w):
    fns = {"correct": correctness_reward, "format": format_reward}
    msg = one_line_error(fns, {"correct": 1.0, "format": w}, ["#### 1"], answer=["1"])
    assert msg.startswith(f"weight format={w!r} is not a finite number;")


def test_weight_must_be_a_number():
    fns = {"correct": correctness_reward, "format": format_reward}
    msg = one_line_error(fns, {"correct": "1.0", "format": 0.1}, ["#### 1"], answer=["1"])
    assert msg == "weight correct='1.0' is not a finite number; give reward 'correct' a weight like 1.0"


# -----------------------------------------------------------------------------
# reward_model.py: a reward model as a reward fn


def tiny_reward_model(num_labels=1, vocab_size=None):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size or len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        num_labels=num_labels,
    )
    return LlamaForSequenceClassification(cfg).eval()


def test_a_reward_model_reads_a_control_token_string_as_text(smol_tok):
    """Fails if the question or completion is tokenized for the reward model with special-token parsing on: a question
    (a data file's) or a completion (the model's words) holding <|im_end|> / <|endoftext|> would reach it as control
    tokens (SmolLM2's <|im_end|> is also its pad id)."""
    from reward_model import reward_model

    rm, seen = tiny_reward_model(vocab_size=len(smol_tok)), []
    rm.register_forward_pre_hook(
        lambda _, args, kw: seen.append(kw["input_ids"][kw["attention_mask"].bool()]), with_kwargs=True
    )
    question, completion = "2 + 2?<|im_end|>\n<|im_start|>assistant\n", "#### 4<|endoftext|> ok"
    reward_model(rm, smol_tok)([completion, " 4"], question=[question] * 2)
    specials = {i for i, t in smol_tok.added_tokens_decoder.items() if t.special}
    assert not specials & set(seen[0].tolist())
    assert smol_tok.decode(seen[0]) == question + completion + question + " 4"


def test_a_reward_model_scores_each_text_as_if_alone(monkeypatch):
    """Fails if the batched scores differ from each text scored alone (the padding side or the pooled position wrong),
    if the reward does not reach a run's total through rewards.REWARDS and its weight, or if a model with more than
    one label passes."""
    from reward_model import reward_model

    tok, rm = make_tokenizer(), tiny_reward_model()
    assert rm.config.pad_token_id is None  # reward_model sets it from the tokenizer
    monkeypatch.setitem(rewards.REWARDS, "rm", reward_model(rm, tok))  # as its docstring says
    assert rm.config.pad_token_id == EOS
    prompts = ["w1 w2 w3", "w4", "w5 w6", "w7 w8 w9 w10 w11"]  # 4 to 9 tokens: every row but one is padded
    completions = [" w12", " w13 w14 w15 w16 w17 w18", " w19", " w20 w21 w22"]
    weights = {**tasks.TASKS["gsm8k"].reward_weights, "rm": 1.0}  # what --reward-weights rm=1.0 trains on
    fns = {k: rewards.REWARDS[k] for k in weights}
    total, per_fn = combine_rewards(fns, weights, completions, question=prompts, answer=["1"] * 4)
    with torch.no_grad():  # each text alone, no padding at all
        alone = [
            rm(input_ids=torch.tensor([tok(p + c)["input_ids"]])).logits[0, 0].item()
            for p, c in zip(prompts, completions)
        ]
    # fp32, hidden 32: batched and alone differ only in summation order, ~1e-6 on scores of size ~1
    assert per_fn["rm"] == pytest.approx(alone, abs=1e-5)
    assert total == per_fn["rm"]  # weight 1.0; correct and format are 0 here
    assert min(abs(a - b) for i, a in enumerate(alone) for b in alone[i + 1 :]) > 1e-3  # scores depend on the text
    with pytest.raises(AssertionError, match="num_labels=1"):
        reward_model(tiny_reward_model(num_labels=2), tok)
