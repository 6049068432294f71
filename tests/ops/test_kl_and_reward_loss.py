"""kl_penalty estimators and bradley_terry_loss, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from grpokit.ops import bradley_terry_loss, kl_penalty

D = torch.float64


def test_kl_estimators_hand_computed():
    """d = ref − lp = log 2: k1 = −log 2, k2 = (log 2)²/2, k3 = 2 − log 2 − 1."""
    lp, ref = torch.tensor([[0.0]], dtype=D), torch.tensor([[math.log(2.0)]], dtype=D)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(-math.log(2.0))
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(math.log(2.0) ** 2 / 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(1.0 - math.log(2.0))


def test_k3_is_unbiased_for_the_true_kl():
    """E_{x~p}[k3] = KL(p‖q) for categorical p, q (exactly, by summing over the support)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=D)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=D)
    expected = (p * (p / q).log()).sum()
    estimate = (p * kl_penalty(p.log()[None], q.log()[None], "k3")[0]).sum()
    torch.testing.assert_close(estimate, expected)
    torch.testing.assert_close((p * kl_penalty(p.log()[None], q.log()[None], "k1")[0]).sum(), expected)


def test_k3_is_accurate_for_tiny_differences():
    """exp(d) − d − 1 loses every digit in float32 for d = 1e-4; expm1(d) − d keeps them (≈ d²/2)."""
    lp = torch.zeros(1, 1)
    ref = torch.full((1, 1), 1e-4)
    assert kl_penalty(lp, ref).item() == pytest.approx(5e-9, rel=1e-3)  # float32 expm1 rounding


def test_bradley_terry_hand_computed():
    """r_c = [2, 0.5, −1], r_r = [0, 1, 0], margin = [0, 1, 2]:
    TRL's per-pair loss: mean(−logσ([2, −1.5, −3])) = 1.62564 (grpo-math.md §3.2 [verified])."""
    rc, rr, m = (torch.tensor(v, dtype=D) for v in ([2.0, 0.5, -1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0]))
    out = bradley_terry_loss(rc, rr, margin=m)
    assert out.loss.item() == pytest.approx(1.62564, abs=5e-6)
    assert out.metrics["accuracy"].item() == pytest.approx(1 / 3)
    assert out.metrics["margin"].item() == pytest.approx((2 - 0.5 - 1) / 3)
    assert out.metrics["chosen_rewards"].item() == pytest.approx(0.5)
    assert out.metrics["rejected_rewards"].item() == pytest.approx(1 / 3)


def test_score_head_shape_never_broadcasts_against_the_margin():
    """[B, 1] scores (a score head's output) with a [B] margin: the per-pair loss, not EasyDeL's
    [B, B] average (1.43072 on the same input)."""
    rc = torch.tensor([[2.0], [0.5], [-1.0]], dtype=D)
    rr = torch.tensor([[0.0], [1.0], [0.0]], dtype=D)
    out = bradley_terry_loss(rc, rr, margin=torch.tensor([0.0, 1.0, 2.0], dtype=D))
    assert out.loss.item() == pytest.approx(1.62564, abs=5e-6)
    assert out.loss.item() != pytest.approx(1.43072, abs=1e-3)


def test_centering_term_and_gradient():
    rc = torch.tensor([1.0, 3.0], dtype=D, requires_grad=True)
    rr = torch.tensor([0.0, 1.0], dtype=D, requires_grad=True)
    out = bradley_terry_loss(rc, rr, center_rewards_coefficient=0.01)
    expected = -F.logsigmoid(torch.tensor([1.0, 2.0], dtype=D)).mean() + 0.01 * (1.0 + 16.0) / 2
    assert out.loss.item() == pytest.approx(expected.item())
    out.loss.backward()
    # ∂/∂r_c[b] = −σ(−gap_b)/B + c·2·(r_c + r_r)_b/B
    sig = torch.sigmoid(-torch.tensor([1.0, 2.0], dtype=D))
    torch.testing.assert_close(rc.grad, -sig / 2 + 0.01 * torch.tensor([1.0, 4.0], dtype=D))
    torch.testing.assert_close(rr.grad, sig / 2 + 0.01 * torch.tensor([1.0, 4.0], dtype=D))


def test_ties_count_as_wrong():
    out = bradley_terry_loss(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]))
    assert out.metrics["accuracy"].item() == 0.5


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((torch.zeros(3), torch.zeros(4)), {}, r"rejected_rewards has shape \(4,\)"),
        ((torch.zeros(3, 2), torch.zeros(3)), {}, "chosen_rewards has shape"),
        ((torch.zeros(3), torch.zeros(3)), {"margin": torch.zeros(3, 3)}, "margin has shape"),
        ((torch.zeros(0), torch.zeros(0)), {}, "empty batch"),
    ],
)
def test_bad_shapes_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bradley_terry_loss(*args, **kwargs)
