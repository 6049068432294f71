"""The decoupled PPO objective of asynchronous GRPO (AReaL): on a batch sampled by an older policy μ,
the ratio is clipped against the proximal policy π_prox (the weights before the update, one no-grad
pass) and each token is weighted by π_prox / μ. In grpokit it is `grpo_loss` with old_logps = log
π_prox and sampling_weights = `sampling_weights(log π_prox, log μ)` (train/before_update.py builds
exactly these when max_staleness and sampling_correction are set)."""

from __future__ import annotations

import math

import torch

from grpokit.ops import grpo_loss, sampling_weights

D = torch.float64


def _decoupled(logps, prox, mu, adv, mask, **options):
    weights = sampling_weights(prox, mu, mask, mode="token_truncate", clip_max=3.0)
    return grpo_loss(logps, adv, mask, old_logps=prox, sampling_weights=weights, loss_type="dapo", **options)


def test_a_two_token_case_by_hand_at_staleness_1():
    """π_θ = (0.5, 0.45), π_prox = (0.4, 0.5), μ = (0.25, 0.5), advantage +1, ε = 0.2:
    ratios π_θ/π_prox = (1.25, 0.9), clipped for a positive advantage to (1.2, 0.9); weights π_prox/μ =
    (1.6, 1.0); dapo's token mean: −(1.6·1.2 + 1.0·0.9)/2 = −1.41. The first token is clipped (no
    gradient); the second's gradient in log π_θ is −w·r/2 = −0.45."""
    logps = torch.tensor([[math.log(0.5), math.log(0.45)]], dtype=D, requires_grad=True)  # [1, 2]
    prox = torch.tensor([[math.log(0.4), math.log(0.5)]], dtype=D)
    mu = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=D)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = _decoupled(logps, prox, mu, torch.tensor([1.0], dtype=D), mask, epsilon=0.2)
    torch.testing.assert_close(out.loss, torch.tensor(-1.41, dtype=D), rtol=0, atol=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -0.45]], dtype=D), rtol=0, atol=1e-12)


def test_it_is_the_synchronous_loss_when_the_sampler_is_the_proximal_policy():
    """μ = π_prox = π_old: every weight is 1 and the loss, and its gradient, are the synchronous ones."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    old = torch.randn(B, T, generator=g, dtype=D) - 2.0
    logps = (old + 0.1 * torch.randn(B, T, generator=g, dtype=D)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) < 0.8
    decoupled = _decoupled(logps, old, old, adv, mask)
    (grad_decoupled,) = torch.autograd.grad(decoupled.loss, logps)
    sync = grpo_loss(logps, adv, mask, old_logps=old, loss_type="dapo")
    (grad_sync,) = torch.autograd.grad(sync.loss, logps)
    torch.testing.assert_close(decoupled.loss, sync.loss, rtol=0, atol=1e-15)
    torch.testing.assert_close(grad_decoupled, grad_sync, rtol=0, atol=1e-15)


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    B, T = 4, 3
    prox = torch.randn(B, T, generator=g, dtype=D) - 1.5
    mu = prox + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    # away from the clip edges, where the objective has no derivative
    logps = (prox + 0.05 * torch.randn(B, T, generator=g, dtype=D)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=D)
    mask = torch.ones(B, T, dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda lp: _decoupled(lp, prox, mu, adv, mask).loss, (logps,))
