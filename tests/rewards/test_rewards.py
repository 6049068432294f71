"""Built-in rewards on hand-written completions, and the checks on user reward functions."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.rewards import (
    CallRules,
    RewardFunctionError,
    exact_answer,
    format_tags,
    length_penalty,
    math_answer,
    overlong_penalty,
    score_completions,
)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("42", "42", 1.0),
        ("the answer is 42", "42", 1.0),
        ("<think>6*7</think><answer>42</answer>", "42", 1.0),
        ("<answer> 42 </answer> and more text 7", "42", 1.0),
        ("41", "42", 0.0),
        ("", "42", 0.0),
        ("42", None, None),  # no reference: cannot score
    ],
)
def test_exact_answer(completion, answer, expected):
    assert exact_answer([""], [completion], answer=[answer]) == [expected]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so x = \\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
        ("first 3 then 12", "12", 1.0),
        ("total: 1,234", "1234", 1.0),
        ("-7", "-7.0", 1.0),
        ("\\boxed{5} but later 6", "5", 1.0),  # boxed wins over a later number
        ("13", "12", 0.0),
        ("no number here", "12", 0.0),
        ("12", "twelve", None),  # a reference that is no number cannot be checked
    ],
)
def test_math_answer(completion, answer, expected):
    assert math_answer([""], [completion], answer=[answer]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("  <think>multi\nline</think>\n<answer>b</answer>\n", 1.0),
        ("<answer>b</answer><think>a</think>", 0.0),
        ("<think>a</think>", 0.0),
        ("x <think>a</think><answer>b</answer>", 0.0),
    ],
)
def test_format_tags(completion, expected):
    assert format_tags([""], [completion]) == [expected]


def test_overlong_penalty_is_dapos_piecewise_linear():
    """L_max = 10, cache 4: 0 up to 6 tokens, then −(L − 6)/4, −1 beyond 10."""
    fn = overlong_penalty(10, 4)
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 11)]
    assert fn([""] * 6, [""] * 6, completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="completion_ids"):
        fn([""], [""])


def test_length_penalty():
    assert length_penalty(8, coefficient=0.5)([""] * 2, ["", ""], completion_ids=[[1] * 4, []]) == [
        -0.25,
        0.0,
    ]


def test_score_combines_with_weights_and_nan():
    def half(prompts, completions, **_):
        return [0.5 if c else None for c in completions]

    scores = score_completions(
        [exact_answer, half],
        ["p"] * 3,
        ["42", "", "7"],
        columns={"answer": ["42", "1", "7"]},
        weights=[1.0, 2.0],
    )
    assert scores.names == ["exact_answer", "half"]
    assert torch.equal(
        torch.isnan(scores.rewards_per_func), torch.tensor([[False, False], [False, True], [False, False]])
    )
    assert scores.rewards.tolist() == [2.0, 0.0, 2.0]
    metrics = scores.metrics()
    assert metrics["rewards/exact_answer/mean"].item() == pytest.approx(2 / 3)
    assert (
        metrics["rewards/half/mean"].item() == 0.5 and math.isnan(metrics["rewards/half/std"].item()) is False
    )


def test_functions_without_kwargs_get_only_what_they_name():
    def strict(completions):
        return [float(len(c)) for c in completions]

    scores = score_completions([strict], ["p", "q"], ["ab", "c"], columns={"answer": ["x", "y"]})
    assert scores.rewards.tolist() == [2.0, 1.0]


def _raises_on_seven(prompts, completions, **_):
    return [1.0 / (7 - int(c)) for c in completions]


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (_raises_on_seven, r"reward function '_raises_on_seven' raised on row 1 \(completion '7'\)"),
        (lambda prompts, completions, **_: [1.0], r"returned 1 values for 3 completions"),
        (lambda prompts, completions, **_: [1.0, "yes", 0.0], r"returned 'yes' \(str\) for row 1"),
        (lambda prompts, completions, **_: [1.0, float("nan"), 0.0], r"returned nan for row 1.*None"),
        (lambda prompts, completions, **_: [1.0, 0.0, float("inf")], r"returned inf for row 2"),
        (lambda prompts, completions, **_: 3.0, r"returned a float for 3 completions"),
    ],
)
def test_bad_reward_functions_get_a_named_error(fn, match):
    with pytest.raises(RewardFunctionError, match=match):
        score_completions([fn], ["p"] * 3, ["1", "7", "2"])


def test_failures_can_be_scored_unscorable_and_counted():
    scores = score_completions(
        [_raises_on_seven], ["p"] * 3, ["1", "7", "2"], rules=CallRules(on_error="unscorable")
    )
    assert scores.num_failed == 1
    assert math.isnan(scores.rewards[1].item()) and scores.rewards[0].item() == pytest.approx(1 / 6)


def test_argument_mismatches():
    with pytest.raises(ValueError, match="no reward functions"):
        score_completions([], ["p"], ["c"])
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        score_completions([format_tags], ["p"], ["c"], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
        score_completions([exact_answer], ["p", "q"], ["c", "d"], columns={"answer": ["x"]})
    with pytest.raises(RewardFunctionError, match="needs an 'answer' column"):
        score_completions([exact_answer], ["p"], ["c"])


def test_reward_model_function_scores_in_eval_mode_without_grad(tiny_policy):
    """Scores equal the model's logit on prompt + completion + EOS scored alone (no padding), in
    eval mode and with no gradient, whatever the batch it is scored in."""
    from grpokit.models import build_reward_model
    from grpokit.rewards import RewardModelFunction

    _, tok = tiny_policy
    model = build_reward_model(
        hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tok), max_seq_len=32, seed=0
    )
    model.train()
    fn = RewardModelFunction(model, tok, batch_size=2)
    scores = fn(["1+1=", "22+22=", "3+3="], ["2", "44", "7"])
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    alone = torch.tensor([tok("3+3=7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
    with torch.no_grad():
        assert scores[2] == pytest.approx(model(input_ids=alone).logits[0, 0].item(), abs=1e-5)
