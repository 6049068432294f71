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
