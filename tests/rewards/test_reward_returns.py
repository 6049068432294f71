"""What a reward function may return, as TRL takes it (issue 25, point 6.4): bools, numpy scalars,
and a numpy array or torch tensor as the whole return value; NaN and inf are still refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpokit.rewards import RewardFunctionError, score_completions


def _returning(value):
    def reward(prompts, completions, **_):
        return value

    return reward


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([True, False, True], [1.0, 0.0, 1.0]),
        ([np.float32(0.5), np.int64(2), np.bool_(False)], [0.5, 2.0, 0.0]),
        (np.array([0.25, -1.0, 3.0]), [0.25, -1.0, 3.0]),
        (np.array([True, False, False]), [1.0, 0.0, 0.0]),
        (torch.tensor([1.5, 0.0, -2.0]), [1.5, 0.0, -2.0]),
        (torch.tensor([True, True, False]), [1.0, 1.0, 0.0]),
        ([torch.tensor(0.5), torch.tensor([2.0]), 1], [0.5, 2.0, 1.0]),
    ],
)
def test_bools_numpy_and_tensors_are_scores(value, expected):
    scores = score_completions([_returning(value)], ["p"] * 3, ["a", "b", "c"])
    assert scores.rewards.tolist() == expected


@pytest.mark.parametrize(
    "value",
    [np.array([0.0, np.nan, 1.0]), torch.tensor([0.0, float("inf"), 1.0]), [0.0, np.float64("-inf"), 1.0]],
)
def test_nan_and_inf_are_still_refused_naming_the_row(value):
    with pytest.raises(RewardFunctionError, match=r"returned (nan|inf|-inf) for row 1 \(completion 'b'\)"):
        score_completions([_returning(value)], ["p"] * 3, ["a", "b", "c"])


def test_a_tensor_of_the_wrong_length_is_refused():
    with pytest.raises(RewardFunctionError, match="returned 2 values for 3 completions"):
        score_completions([_returning(torch.tensor([1.0, 2.0]))], ["p"] * 3, ["a", "b", "c"])


# ----------------------------------------------------------------------------- TRL's hooks


def test_functions_get_trls_trainer_state_log_metric_and_log_extra():
    """As TRL passes them: trainer_state (the steps done), log_metric (each name's values averaged into
    the step's metrics as logged/<name>) and log_extra (B values a column); a function that names none of
    them gets none, and the data's columns stay what they were."""
    from grpokit.rewards.scoring import CallRules, RunState, score_completions

    seen = {}

    def logs(prompts, completions, **kwargs):
        seen.update(kwargs)
        kwargs["log_metric"]("accuracy", 0.5)
        kwargs["log_metric"]("accuracy", 1.0)
        kwargs["log_extra"]("head", [c[:1] for c in completions])
        return [1.0] * len(completions)

    def plain(prompts, completions, answer):
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    scores = score_completions(
        [logs, plain],
        ["p", "q"],
        ["ab", "c"],
        columns={"answer": ["ab", "x"]},
        rules=CallRules(state=RunState(global_step=4)),
    )
    assert seen["trainer_state"].global_step == 4 and seen["answer"] == ["ab", "x"]
    assert scores.logged == {"accuracy": 0.75} and scores.extra == {"head": ["a", "c"]}
    assert scores.metrics()["logged/accuracy"].item() == 0.75
    assert scores.rewards.tolist() == [2.0, 1.0]
    seen.clear()
    score_completions([logs], ["p"], ["a"])
    assert seen["trainer_state"].global_step is None  # scoring outside a training step: no step


def test_a_row_no_function_scores_is_trls_warning_once_per_set_of_functions(caplog):
    from grpokit.rewards import scoring

    def nothing(prompts, completions, **_):
        return [None, 1.0]

    scoring._UNSCORABLE_SAID.clear()
    with caplog.at_level("WARNING", logger="grpokit.rewards"):
        first = score_completions([nothing], ["p", "q"], ["a", "b"])
        score_completions([nothing], ["p", "q"], ["a", "b"])
    said = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert len(said) == 1 and "'completions': 'a'" in said[0] and "1 of 2 rows unscorable" in said[0]
    assert torch.isnan(first.rewards[0]) and first.rewards[1].item() == 1.0
