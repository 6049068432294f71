"""Adaptive entropy control (issue 27, point 3): `target_entropy` adds an entropy bonus −c·H whose
coefficient follows the gap between the target and the step's mean token entropy. The bonus is exact
in the loss (hand-computed, with its gradient), the controller moves as specified, a run that would
otherwise collapse is held within a band, and resume carries the coefficient bitwise."""

from __future__ import annotations

import random

import pytest
import torch

from grpokit.config.plan import EntropySpec
from grpokit.ops import grpo_loss
from grpokit.train.grpo import train_grpo
from grpokit.train.trainee import EntropyControl
from tests.helpers import read_steps
from tests.train.helpers import tiny_config, weights


def test_the_bonus_is_minus_c_times_the_aggregated_entropy_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([0.5, -1.0, 0.25])
    entropies = torch.rand(3, 4, generator=g).requires_grad_()
    for loss_type in ("grpo", "dapo"):
        plain = grpo_loss(logps, advantages, mask, entropies=entropies.detach(), loss_type=loss_type).loss
        out = grpo_loss(logps, advantages, mask, entropies=entropies, loss_type=loss_type, entropy_coef=0.3)
        m = mask.float()
        # grpo: the mean over rows of each row's token mean; dapo: the batch's token mean
        weight = (m / m.sum(-1, keepdim=True)) / 3 if loss_type == "grpo" else m / m.sum()
        expected = plain - 0.3 * (weight * entropies.detach()).sum()
        assert abs(out.loss.item() - expected.item()) <= 1e-6
        (grad,) = torch.autograd.grad(out.loss, entropies)
        torch.testing.assert_close(grad, -0.3 * weight, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="needs the token entropies"):
        grpo_loss(logps, advantages, mask, entropy_coef=0.3)


def target(coef: float = 0.0) -> EntropyControl:
    return EntropyControl(EntropySpec("target", 0.0, 1.5, 0.3, (0.0, float("inf")), "as_loss"), coef)


def test_the_coefficient_follows_the_gap_and_never_goes_below_zero():
    control = target()
    control.update(0.5)  # 1 nat below: up by 0.3
    assert control.coef == pytest.approx(0.3, abs=1e-12)
    control.update(1.0)
    assert control.coef == pytest.approx(0.45, abs=1e-12)
    control.update(3.5)  # 2 nats above: down by 0.6, clamped at 0
    assert control.coef == 0.0
    again = target()
    again.load_state_dict(target(coef=0.7).state_dict())
    assert again.coef == 0.7 and again.applied == 0.7


def test_trls_adaptive_rule_steps_within_its_bounds_and_acts_only_at_or_below_the_target():
    """use_adaptive_entropy (Skywork-OR1, TRL 1.16): c ± delta in [min, max], up while the step's
    entropy ≤ target; the bonus is applied only while the last measured entropy ≤ target (none before
    the first step). entropy_coef alone is a fixed c, always applied."""
    control = EntropyControl(EntropySpec("stepped", 0.01, 0.5, 0.005, (0.0, 0.02), "token_mean"))
    assert control.coef == 0.01 and control.applied == 0.0  # nothing measured yet
    control.update(0.4)  # at or below the target: up, and applied from the next step
    assert control.coef == pytest.approx(0.015) and control.applied == pytest.approx(0.015)
    control.update(0.5)
    assert control.coef == pytest.approx(0.02)
    control.update(0.2)
    assert control.coef == pytest.approx(0.02)  # the ceiling
    control.update(0.9)  # above: down, and not applied
    assert control.coef == pytest.approx(0.015) and control.applied == 0.0
    resumed = EntropyControl(control.spec)
    resumed.load_state_dict(control.state_dict())
    assert (resumed.coef, resumed.last_entropy, resumed.applied) == (control.coef, 0.9, 0.0)
    fixed = EntropyControl(EntropySpec("fixed", 0.1, None, 0.0, (0.1, 0.1), "token_mean"))
    fixed.update(3.0)
    assert fixed.coef == 0.1 == fixed.applied


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo"])
def test_trls_bonus_is_the_mean_token_entropy_whatever_the_loss_type(loss_type):
    """entropy_bonus="token_mean": loss = policy_loss − c·(Σ H·m / Σ m) for every loss type (TRL's
    documented objective; a loss that divides by num_items_in_batch divides the bonus by it too)."""
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    entropies = torch.rand(3, 4, generator=g, dtype=torch.float64)
    out = grpo_loss(
        logps, torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64), mask, entropies=entropies,
        loss_type=loss_type, entropy_coef=0.5, entropy_bonus="token_mean",
    )  # fmt: skip
    mean_h = (entropies * mask).sum() / mask.sum()
    assert (out.metrics["policy_loss"] - out.loss).item() == pytest.approx(0.5 * mean_h.item(), abs=1e-12)


def _noise_run(tmp_path, name, **overrides):
    rng = random.Random(0)  # a reward no policy can learn: the updates only drive it deterministic

    def noise_reward(prompts, completions, **_):
        return [rng.random() for _ in completions]

    cfg = tiny_config(tmp_path, output_dir=str(tmp_path / name), max_steps=30, learning_rate=0.1, **overrides)
    result = train_grpo(cfg, reward_funcs=[noise_reward])
    return read_steps(result.output_dir)


def test_a_run_that_would_collapse_is_held_near_its_target(tmp_path):
    free = _noise_run(tmp_path, "free")
    held = _noise_run(tmp_path, "held", target_entropy=1.5)
    start = free[0]["entropy"]  # 2.77 nats: the uniform policy over the alphabet
    # over seeds 1, 2, 3, 7, 11, the last 10 of 30 steps: free 0.0-0.44 nats, held 1.0-2.7 (an integral
    # controller overshoots the target on the way back)
    free_late, held_late = [r["entropy"] for r in free[-10:]], [r["entropy"] for r in held[-10:]]
    assert sum(free_late) / 10 < 0.2 * start
    assert min(held_late) > 0.5 and sum(held_late) / 10 > 1.0
    assert all(r["entropy/target"] == 1.5 and r["entropy/coef"] >= 0.0 for r in held)
    assert max(r["entropy/coef"] for r in held) > 0.1  # the bonus did the holding
    assert "entropy/coef" not in free[0]


def test_resume_carries_the_coefficient_bitwise(tmp_path):
    # the task's reward is 0 for a random policy, so only the bonus moves it: a target above the uniform
    # policy's 2.77 nats makes the coefficient grow every step
    common = dict(target_entropy=3.0, entropy_coef_lr=1.0, save_steps=2, learning_rate=0.1)
    straight = tiny_config(tmp_path, output_dir=str(tmp_path / "straight"), max_steps=4, **common)
    train_grpo(straight)
    stopped = tiny_config(tmp_path, output_dir=str(tmp_path / "stopped"), max_steps=2, **common)
    train_grpo(stopped)
    resumed = tiny_config(tmp_path, output_dir=str(tmp_path / "stopped"), max_steps=4, resume=True, **common)
    train_grpo(resumed)
    rows = {name: read_steps(tmp_path / name) for name in ("straight", "stopped")}
    assert [r["entropy/coef"] for r in rows["stopped"]] == [r["entropy/coef"] for r in rows["straight"]]
    assert rows["straight"][-1]["entropy/coef"] > 0.0  # the coefficient moved before the checkpoint
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "stopped")  # their last: checkpoint-4
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
