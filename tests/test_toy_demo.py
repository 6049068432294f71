"""End to end: every loss type, driven by the ops alone, learns the toy task (a sign or
normaliser error in any variant would stop it learning)."""

from __future__ import annotations

import pytest

from grpokit.ops import POLICY_LOSS_TYPES
from grpokit.train.toy_demo import ToyConfig, answers, run


@pytest.mark.parametrize("loss_type", list(POLICY_LOSS_TYPES))
def test_every_loss_type_learns_the_toy_task(loss_type):
    epsilon_high = 5.0 if loss_type == "cispo" else 0.28  # CISPO's cap is absolute (TRL recommends 5)
    result = run(ToyConfig(steps=40, loss_type=loss_type, epsilon_high=epsilon_high))
    assert result["accuracy_before"] == 0.0
    assert result["accuracy_after"] >= 0.9, result  # seed 0: 15 or 16 of the 16 prompts fully right


def test_metrics_reach_the_callback_with_trl_names():
    seen = {}
    run(ToyConfig(steps=2), lambda step, metrics: seen.update(metrics))
    assert {
        "reward",
        "frac_reward_zero_std",
        "loss",
        "kl",
        "clip_ratio/region_mean",
        "greedy_accuracy",
    } <= set(seen)


def test_answers_are_the_digits_of_the_formula():
    assert answers(3).tolist() == [[0, 0, 1, 1], [0, 0, 4, 8], [0, 0, 8, 5]]  # 11, 48, 85
