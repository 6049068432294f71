"""Every documented function of the seed systems, reproduced through grpokit (one test per seed
function, named after it). The loss golden vectors are in test_seed_vectors.py."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.ops import group_advantages

from . import seed_compat as compat

D = torch.float64


# ----------------------------------------------------------------------------- Edifice (Elixir/Nx)


def test_edifice_compute_advantages_rank_2_groups_along_axis_1():
    """Edifice grpo_test.exs: [[1,2,3,4],[10,20,30,40]] -> per-group mean ≈ 0, population std ≈ 1."""
    adv = compat.edifice_compute_advantages(torch.tensor([[1.0, 2, 3, 4], [10, 20, 30, 40]], dtype=D))
    assert adv.shape == (2, 4)
    torch.testing.assert_close(adv.mean(1), torch.zeros(2, dtype=D), rtol=0, atol=1e-12)
    torch.testing.assert_close(adv.std(1, unbiased=False), torch.ones(2, dtype=D), rtol=0, atol=1e-7)
    # hand: group 1 has σ² = 1.25, so A = (r − 2.5)/sqrt(1.25 + 1e-8)
    torch.testing.assert_close(adv[0], (torch.tensor([1.0, 2, 3, 4], dtype=D) - 2.5) / math.sqrt(1.25 + 1e-8))


def test_edifice_compute_advantages_rank_1_default_group_size_is_8():
    rewards = torch.arange(16, dtype=D)
    adv = compat.edifice_compute_advantages(rewards)
    expected = group_advantages(rewards, 8, std_ddof=0, eps=1e-8, eps_inside_sqrt=True).advantages
    torch.testing.assert_close(adv, expected)
    assert compat.edifice_compute_advantages(rewards[:8], group_size=4).shape == (8,)
    with pytest.raises(ValueError, match="multiple"):
        compat.edifice_compute_advantages(torch.arange(6, dtype=D))  # not divisible by 8


def test_edifice_compute_advantages_single_element_groups_are_zero():
    adv = compat.edifice_compute_advantages(torch.tensor([[3.0], [5.0]]))
    assert adv.shape == (2, 1) and torch.equal(adv, torch.zeros(2, 1))


def test_edifice_compute_logprobs_per_sequence_sums():
    """Constant logits over V = 10: each token scores −log 10, so 2 valid tokens sum to −2 log 10."""
    logits = torch.zeros(2, 3, 10, dtype=D)
    targets = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = compat.edifice_compute_logprobs(logits, targets, torch.tensor([[1, 1, 0], [1, 1, 1]]))
    torch.testing.assert_close(out, torch.tensor([-2 * math.log(10), -3 * math.log(10)], dtype=D))
    assert (compat.edifice_compute_logprobs(logits, targets) < 0).all()


def test_edifice_loss_without_clipping_is_minus_mean_a_logp():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=D, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=D)
    loss = compat.edifice_loss(lp, adv)
    assert loss.item() == pytest.approx(-(-1.0 + 2.0 - 0.25 - 6.0) / 4)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv / 4)
    # loss differs for ± advantages (grpo_test.exs)
    assert compat.edifice_loss(lp, -adv).item() != pytest.approx(loss.item())


def test_edifice_loss_with_clipping_uses_sign_aware_rule():
    """c = 0.2. Row 1 (A = 1, r = 1.5): surrogate min(1.5, 1.2)·A = 1.2.
    Row 2 (A = −1, r = 0.5): max(−0.5, −0.8) = −0.5. Loss −(1.2 − 0.5)/2."""
    lp = torch.tensor([math.log(1.5), math.log(0.5)], dtype=D)
    loss = compat.edifice_loss(
        lp, torch.tensor([1.0, -1.0], dtype=D), clip_range=0.2, old_log_probs=torch.zeros(2, dtype=D)
    )
    assert loss.item() == pytest.approx(-(1.2 - 0.5) / 2)
    with pytest.raises(ValueError, match="old_log_probs"):
        compat.edifice_loss(lp, torch.ones(2, dtype=D), clip_range=0.2)


def test_edifice_defaults():
    assert compat.default_group_size() == 8
    assert compat.recommended_defaults() == {
        "hidden_size": 512,
        "num_layers": 6,
        "num_heads": 8,
        "vocab_size": 32000,
        "group_size": 8,
    }


# ----------------------------------------------------------------------------- DI-engine


def test_di_engine_grpo_policy_error_on_random_logits():
    """DI-engine test_grpo_rlhf.py's set-up (B=4, S=8, V=1000, old = new + 0.1·N, ref = new + 0.2·N),
    with and without a weight mask; the value is checked against the formula, not only finiteness."""
    gen = torch.Generator().manual_seed(0)
    new = torch.randn(4, 8, 1000, generator=gen, dtype=D, requires_grad=True)
    old = new.detach() + 0.1 * torch.randn(4, 8, 1000, generator=gen, dtype=D)
    ref = new.detach() + 0.2 * torch.randn(4, 8, 1000, generator=gen, dtype=D)
    action = torch.randint(0, 1000, (4, 8), generator=gen)
    adv = torch.randn(4, generator=gen, dtype=D)
    for weight in (None, torch.ones(4, 8, dtype=D).index_fill_(1, torch.tensor([6, 7]), 0.0)):
        out = compat.di_engine_grpo_policy_error(new, old, ref, action, adv, weight, clip_ratio=0.2, beta=0.1)
        lp = torch.log_softmax(new, -1).gather(-1, action[..., None]).squeeze(-1)
        lo = torch.log_softmax(old, -1).gather(-1, action[..., None]).squeeze(-1)
        lr = torch.log_softmax(ref, -1).gather(-1, action[..., None]).squeeze(-1)
        r = torch.exp(lp - lo)
        per_token = -torch.min(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None]) + 0.1 * (
            torch.exp(lr - lp) - (lr - lp) - 1
        )
        w = torch.ones_like(per_token) if weight is None else weight
        expected = ((per_token * w).sum(1) / w.sum(1)).mean()
        torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-14)
        assert set(out.metrics) == {"approx_kl", "clipfrac"}
        out.loss.backward()
        assert new.grad is not None and torch.isfinite(new.grad).all()


def test_di_engine_all_masked_row_is_zero_not_nan():
    """DI divides by Σ weight unclamped (NaN for an all-zero row); grpokit's row contributes 0."""
    logits = torch.randn(2, 3, 5, dtype=D)
    weight = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=D)
    out = compat.di_engine_grpo_policy_error(
        logits, logits, logits, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=D), weight
    )
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(-0.5)  # row 0: −A·1 = −1, row 1: 0; mean over 2 rows


# ----------------------------------------------------------------------------- EasyDeL


def test_easydel_get_per_token_logps_and_entropies_semantics():
    """Shift by one (logits[:, Lp−1:−1] scores ids[:, Lp:]), float32 out for bf16 logits, no temperature."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 17, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 17, (2, 6), generator=gen)
    out = compat.easydel_per_token_logps_and_entropies(logits, ids, prompt_length=2)
    assert out.logps.shape == (2, 4) and out.logps.dtype == torch.float32
    logp_full = torch.log_softmax(logits.float()[:, 1:-1], -1)
    torch.testing.assert_close(
        out.logps, logp_full.gather(-1, ids[:, 2:, None]).squeeze(-1), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(out.entropy, -(logp_full.exp() * logp_full).sum(-1), rtol=0, atol=1e-5)


def test_easydel_reward_loss_defaults_and_fixed_margin():
    """EasyDeL reward training_step: BT loss with centering 0.1 by default; margin per pair."""
    rc = torch.tensor([[2.0], [0.5], [-1.0]], dtype=D)
    rr = torch.tensor([[0.0], [1.0], [0.0]], dtype=D)
    m = torch.tensor([0.0, 1.0, 2.0], dtype=D)
    out = compat.easydel_reward_loss(rc, rr, margin=m)
    centering = 0.1 * ((rc + rr) ** 2).mean()
    assert out.loss.item() == pytest.approx(1.62564 + centering.item(), abs=5e-6)


def test_easydel_grpo_step_rejects_loss_types_it_does_not_have():
    with pytest.raises(ValueError, match="EasyDeL has loss types"):
        compat.easydel_grpo_step_loss(
            torch.zeros(1, 2),
            torch.zeros(1),
            torch.ones(1, 2, dtype=torch.bool),
            ref_logps=torch.zeros(1, 2),
            loss_type="sapo",
        )


def test_easydel_advantages_population_std():
    """EasyDeL: nanstd with ddof 0, eps 1e-4 outside; unscorable rows scored 0 (nan_to_num first)."""
    rewards = torch.tensor([0.0, float("nan"), 1.0, 1.0], dtype=D)
    adv = group_advantages(torch.nan_to_num(rewards, nan=0.0), 4, std_ddof=0).advantages
    expected = (torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=D) - 0.5) / (0.5 + 1e-4)
    torch.testing.assert_close(adv, expected)
