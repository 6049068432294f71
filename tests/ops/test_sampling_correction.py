"""`ops.sampling_weights`: TRL's four importance-sampling modes, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.ops import SAMPLING_CORRECTIONS, grpo_loss, sampling_weights

D = torch.float64
# two rows of three tokens; row 1's last token is padding. log π_old − log q per token:
DIFF = torch.tensor([[0.5, -1.0, 2.0], [0.1, 0.3, 9.0]], dtype=D)
MASK = torch.tensor([[True, True, True], [True, True, False]])
SAMPLED = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.2, -3.0]], dtype=D)  # log q
OLD = SAMPLED + DIFF  # log π_old


def test_token_truncate_clamps_each_tokens_ratio():
    w = sampling_weights(OLD, SAMPLED, MASK, mode="token_truncate", clip_min=0.5, clip_max=3.0)
    expected = torch.tensor(
        [[math.exp(0.5), 0.5, 3.0], [math.exp(0.1), math.exp(0.3), 1.0]], dtype=D
    )  # e^-1 = 0.37 -> 0.5; e^2 = 7.4 -> 3; the padding token's difference counts as 0: ratio 1
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)


def test_token_mask_zeroes_out_of_range_ratios():
    w = sampling_weights(OLD, SAMPLED, MASK, mode="token_mask", clip_min=0.5, clip_max=3.0)
    expected = torch.tensor([[math.exp(0.5), 0.0, 0.0], [math.exp(0.1), math.exp(0.3), 1.0]], dtype=D)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)


def test_sequence_modes_take_one_ratio_per_row_from_the_counted_tokens():
    # row 0: Σ = 1.5 -> e^1.5 = 4.48 (over 3.0); row 1: Σ = 0.4 (the padding's 9.0 does not count)
    truncated = sampling_weights(OLD, SAMPLED, MASK, mode="sequence_truncate", clip_max=3.0)
    torch.testing.assert_close(truncated, torch.tensor([[3.0], [math.exp(0.4)]], dtype=D), rtol=1e-12, atol=0)
    masked = sampling_weights(OLD, SAMPLED, MASK, mode="sequence_mask", clip_max=3.0)
    torch.testing.assert_close(masked, torch.tensor([[0.0], [math.exp(0.4)]], dtype=D), rtol=1e-12, atol=0)
    unbounded = sampling_weights(OLD, SAMPLED, MASK, mode="sequence_truncate", clip_max=None)
    torch.testing.assert_close(unbounded[0, 0], torch.tensor(math.exp(1.5), dtype=D), rtol=1e-12, atol=0)


def test_unknown_sampling_log_probs_count_as_ratio_one_and_no_gradient_flows():
    sampled = SAMPLED.clone()
    sampled[0, 1] = float("nan")
    old = OLD.clone().requires_grad_()
    w = sampling_weights(old, sampled, MASK, mode="token_truncate", clip_max=None)
    assert w[0, 1] == 1.0 and not w.requires_grad
    assert torch.equal(sampled[0, 1].isnan(), torch.tensor(True))  # the input is not modified


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="valid: token_truncate"):
        sampling_weights(OLD, SAMPLED, MASK, mode="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same"):
        sampling_weights(OLD, SAMPLED[:, :2], MASK)
    with pytest.raises(ValueError, match="clip_min"):
        sampling_weights(OLD, SAMPLED, MASK, clip_min=4.0, clip_max=3.0)
    with pytest.raises(TypeError, match="bool"):
        sampling_weights(OLD, SAMPLED, MASK.long())
    assert set(SAMPLING_CORRECTIONS) == {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}


def test_grpo_loss_weights_the_policy_term_only():
    """dapo by hand: Σ w·(−r·A) / N with r = 1 on-policy, plus β·KL unweighted; w = 1 changes nothing."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.2, -3.0]], dtype=D, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=D)
    w = torch.tensor([[2.0, 0.0, 1.0], [0.5, 1.0, 7.0]], dtype=D)
    out = grpo_loss(lp, adv, MASK, sampling_weights=w, loss_type="dapo")
    expected = -(2.0 * 1 + 0.0 * 1 + 1.0 * 1 + 0.5 * -2 + 1.0 * -2) / 5  # the padding token is not counted
    torch.testing.assert_close(out.loss, torch.tensor(expected, dtype=D), rtol=1e-12, atol=0)
    out.loss.backward()  # ∂/∂lp of −w·A·r with r = exp(lp − sg(lp)): −w·A / N
    torch.testing.assert_close(lp.grad, -(w * adv[:, None] * MASK) / 5, rtol=1e-12, atol=0)
    ref = lp.detach() - 0.3
    ones = grpo_loss(lp, adv, MASK, ref_logps=ref, beta=0.1, sampling_weights=torch.ones(2, 3, dtype=D))
    plain = grpo_loss(lp, adv, MASK, ref_logps=ref, beta=0.1)
    torch.testing.assert_close(ones.loss, plain.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="vespo"):
        grpo_loss(lp, adv, MASK, sampling_weights=w, loss_type="vespo")
