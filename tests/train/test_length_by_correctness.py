"""Completion lengths split by correctness (issue 54): the metric, on hand-made tensors and in a run."""

import json
import math

import pytest
import torch

from grpokit.train.evaluation import length_by_correctness
from grpokit.train.grpo import train_grpo
from tests.train.helpers import tiny_config


def test_the_split_on_hand_computed_lengths():
    lengths = torch.tensor([3.0, 5.0, 7.0, 9.0])  # [B] tokens
    split = length_by_correctness(lengths, torch.tensor([True, False, True, False]))
    assert split["completions/correct_ratio"].item() == 0.5
    assert split["completions/correct_mean_length"].item() == 5.0  # (3 + 7) / 2
    assert split["completions/incorrect_mean_length"].item() == 7.0  # (5 + 9) / 2
    none_wrong = length_by_correctness(lengths, torch.ones(4, dtype=torch.bool))
    assert none_wrong["completions/correct_mean_length"].item() == 6.0
    assert math.isnan(none_wrong["completions/incorrect_mean_length"].item())  # no wrong completion: NaN


def has_one(completion, row):
    return "1" in completion


def has_one_reward(prompts, completions, **_):
    return [1.0 if "1" in c else 0.0 for c in completions]


@pytest.mark.slow  # a 4-step run with evaluations, about 4 s
def test_a_run_splits_its_lengths_by_the_answer_check_and_they_add_up(tmp_path):
    """With a reward that pays exactly what is_correct judges right, the share judged right is the
    reward; the two means weighted by their shares give the mean length, in training and evaluation."""
    cfg = tiny_config(tmp_path, max_steps=4, num_eval_prompts=16, eval_steps=2)
    train_grpo(cfg, reward_funcs=[has_one_reward], is_correct=has_one)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mixed = 0
    for row in rows:
        for prefix, share in (("", "completions/correct_ratio"), ("eval/", "eval/accuracy")):
            if share not in row:
                continue
            ratio = row[share]
            if prefix == "":
                assert ratio == pytest.approx(row["reward"], abs=1e-6)
            right = row.get(f"{prefix}completions/correct_mean_length")
            wrong = row.get(f"{prefix}completions/incorrect_mean_length")
            # (a mean of nothing: null in a step's row, absent from an evaluation's)
            assert (right is None) == (ratio == 0) and (wrong is None) == (ratio == 1)
            if 0 < ratio < 1:
                mixed += 1
                mean = ratio * right + (1 - ratio) * wrong
                assert mean == pytest.approx(row[f"{prefix}completions/mean_length"], rel=1e-5)
    assert mixed >= 3  # training steps and evaluations with right and wrong completions both
