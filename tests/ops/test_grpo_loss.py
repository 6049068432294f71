"""grpo_loss: hand-computed cases, gradient checks, invariances, edge cases and the variant table."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from grpokit.ops import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    LOSS_TYPES,
    POLICY_LOSS_TYPES,
    SURROGATES,
    ImportanceSamplingLevel,
    LossType,
    grpo_loss,
    kl_penalty,
    loss_weight,
)
from tests.helpers import random_batch

ALL_LOSS_TYPES = POLICY_LOSS_TYPES  # grpo_loss's (gkd, a divergence, is refused: tested below)
ALL_LEVELS = typing.get_args(ImportanceSamplingLevel)
D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def single_token(loss_type: str, adv: float, ratio: float, **kw):
    """One completion of one token with π_θ/π_old = ratio. Returns (loss, dloss/dlogp)."""
    lp = t([[-1.0]]).requires_grad_()
    old = lp.detach() - math.log(ratio)
    out = grpo_loss(lp, t([adv]), torch.tensor([[True]]), old_logps=old, loss_type=loss_type, **kw)
    out.loss.backward()
    return out.loss.item(), lp.grad.item(), out.metrics


# ----------------------------------------------------------------------------- hand-computed


@pytest.mark.parametrize(
    ("rule", "ratio", "loss", "grad"),
    [
        # A = −1, ε = ε_high = 0.2 (grpo-math.md §2.6.3 [verified])
        ("ppo", 0.5, 0.8, 0.0),  # −min(−0.5, −0.8) = 0.8 from the clipped branch: frozen
        ("easydel", 0.5, 0.5, 0.5),  # −A·min(r, clip r) = 0.5; d/dlog π of r = r = 0.5
        ("ppo", 1.5, 1.5, 1.5),  # −min(−1.5, −1.2) = 1.5, unclipped: gradient r = 1.5
        ("easydel", 1.5, 1.2, 0.0),  # min(1.5, 1.2) = 1.2 from the clip: frozen
    ],
)
def test_negative_advantage_rules(rule, ratio, loss, grad):
    value, g, _ = single_token("grpo", -1.0, ratio, epsilon=0.2, negative_advantage_clip=rule)
    assert value == pytest.approx(loss, abs=1e-12)
    assert g == pytest.approx(grad, abs=1e-12)


def test_delta_caps_the_ratio_for_negative_advantages():
    """A = −1, r = 2, ε = 0.2: plain PPO loss −min(−2, −1.2) = 2 (gradient 2); with δ = 1.5 the
    ratio is capped: −min(−1.5, −1.2) = 1.5 and the cap has zero slope, so the gradient is 0."""
    assert single_token("grpo", -1.0, 2.0, epsilon=0.2)[:2] == pytest.approx((2.0, 2.0))
    assert single_token("grpo", -1.0, 2.0, epsilon=0.2, delta=1.5)[:2] == pytest.approx((1.5, 0.0))


def test_epsilon_high_clips_positive_advantages_asymmetrically():
    """A = +1, r = 1.25: ε_high = 0.2 clips (loss −1.2, frozen); ε_high = 0.28 does not (−1.25, grad −1.25)"""
    loss, grad, metrics = single_token("grpo", 1.0, 1.25, epsilon=0.2)
    assert (loss, grad) == pytest.approx((-1.2, 0.0))
    assert metrics["clip_ratio/high_mean"].item() == 1.0 and metrics["clip_ratio/low_mean"].item() == 0.0
    loss, grad, metrics = single_token("grpo", 1.0, 1.25, epsilon=0.2, epsilon_high=0.28)
    assert (loss, grad) == pytest.approx((-1.25, -1.25))
    assert metrics["clip_ratio/high_mean"].item() == 0.0


def test_on_policy_grpo_hand_computed():
    """A = [1, −1], lengths [2, 1], on-policy (r ≡ 1). Per-sequence means: −1 and +1 -> loss 0.
    d/dlp = −A_b / (L_b · B): row 0: −1/4 per token; row 1: +1/2; padding 0."""
    lp = t([[-0.5, -1.5], [-2.0, -9.0]]).requires_grad_()
    mask = torch.tensor([[True, True], [True, False]])
    out = grpo_loss(lp, t([1.0, -1.0]), mask, loss_type="grpo")
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.0, abs=1e-15)
    torch.testing.assert_close(lp.grad, t([[-0.25, -0.25], [0.5, 0.0]]))


def test_aggregations_hand_computed():
    """Per-token losses ℓ = −A (on-policy, β = 0): row 0 (A = 2, 3 tokens), row 1 (A = −1, 1 token), T = 4.
    masked sums: −6 and +1; N = 4 tokens, B = 2."""
    lp = t([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    adv = t([2.0, -1.0])
    expected = {
        "grpo": (-6 / 3 + 1 / 1) / 2,  # mean of per-sequence means
        "sapo": (-6 / 3 + 1 / 1) / 2 * 2,  # on-policy SAPO: −(4/τ)σ(0)A = −2A/τ, τ_pos = 1, τ_neg = 1.05
        "bnpo": (-6 + 1) / 4,
        "dapo": (-6 + 1) / 4,
        "dr_grpo": (-6 + 1) / (2 * 10),  # B · max_completion_length = 2 · 10
        "luspo": (-6 + 1) / 2,  # mean of per-sequence sums
        "cispo": (-6 * -1 + 1 * -1) / 4,  # −sg(min(1, ε_h))·A·lp with lp = −1
        "vespo": (-6 * -1 + 1 * -1) / 4,  # φ(1) = 1: −A·lp
    }
    for loss_type, value in expected.items():
        out = grpo_loss(lp, adv, mask, loss_type=loss_type, max_completion_length=10, epsilon_high=5.0)
        if loss_type == "sapo":
            value = (2 * -2 * 3 / 3 + 2 / 1.05 * 1) / 2  # row 0: −2·A = −4; row 1: −2·(−1)/1.05
        assert out.loss.item() == pytest.approx(value, abs=1e-12), loss_type


def test_dapo_divides_by_num_items_in_batch():
    lp = t([[-1.0, -1.0]])
    out = grpo_loss(lp, t([1.0]), torch.tensor([[True, True]]), loss_type="dapo", num_items_in_batch=8)
    assert out.loss.item() == pytest.approx(-2 / 8)


def test_dr_grpo_defaults_to_tensor_width():
    lp = t([[-1.0, -1.0, -1.0]])
    out = grpo_loss(lp, t([1.0]), torch.tensor([[True, False, False]]), loss_type="dr_grpo")
    assert out.loss.item() == pytest.approx(-1 / 3)  # EasyDeL's B · T


def test_on_policy_gradient_is_the_walkthroughs_coefficient(gen):
    """Seed 004 (the GRPO walkthrough): on-policy, the GRPO gradient per token is
    −(A + β(π_ref/π_θ − 1))/(|o_i|·G)·∇log π_θ with the plain k3 KL."""
    b = random_batch(gen, B=4, T=5)
    lp = b["lp"].clone().requires_grad_()
    beta = 0.04
    out = grpo_loss(
        lp, b["adv"], b["mask"], ref_logps=b["ref"], beta=beta, loss_type="grpo", use_bias_correction_kl=False
    )
    out.loss.backward()
    coefficient = b["adv"][:, None] + beta * (torch.exp(b["ref"] - b["lp"]) - 1)
    lengths = b["mask"].sum(-1, keepdim=True).to(D)
    expected = -coefficient * b["mask"] / lengths / 4
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=1e-15)


def test_bias_corrected_kl_is_k3_times_ratio(gen):
    b = random_batch(gen)
    base = dict(old_logps=b["old"], ref_logps=b["ref"], beta=0.1, loss_type="bnpo")
    with_bc = grpo_loss(b["lp"], b["adv"], b["mask"], **base)
    without = grpo_loss(b["lp"], b["adv"], b["mask"], use_bias_correction_kl=False, **base)
    kl = kl_penalty(b["lp"], b["ref"])
    ratio = torch.exp(b["lp"] - b["old"])
    m = b["mask"].to(D)
    torch.testing.assert_close(with_bc.metrics["kl"], (kl * ratio * m).sum() / m.sum())
    torch.testing.assert_close(without.metrics["kl"], (kl * m).sum() / m.sum())
    diff = with_bc.loss - without.loss
    torch.testing.assert_close(diff, 0.1 * (kl * (ratio - 1) * m).sum() / m.sum())


def test_gspo_token_has_sequence_value_and_token_gradient():
    """Token-level advantages A = [2, 0] on one 2-token sequence, log-ratios [0.1, −0.1] (s = 1).
    sequence:       loss = −s·mean(A) = −1;  ∂/∂lp_t = −s·mean(A)/2 = −0.5 for both tokens
    sequence_token: loss = −1 too;           ∂/∂lp_t = −s·A_t/2 = [−1, 0]"""
    mask = torch.tensor([[True, True]])
    adv = t([[2.0, 0.0]])
    grads = {}
    for level in ("sequence", "sequence_token"):
        lp = t([[-1.0, -2.0]]).requires_grad_()
        old = lp.detach() - t([[0.1, -0.1]])
        out = grpo_loss(lp, adv, mask, old_logps=old, loss_type="grpo", importance_sampling_level=level)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(-1.0)
        grads[level] = lp.grad
    torch.testing.assert_close(grads["sequence"], t([[-0.5, -0.5]]))
    torch.testing.assert_close(grads["sequence_token"], t([[-1.0, 0.0]]))


def test_top_entropy_mask_keeps_tokens_above_the_quantile():
    """Entropies [0.1, 0.5, 0.9, 0.3]: the 0.5-quantile (linear) is 0.4, so only tokens 1 and 2 keep
    their policy loss; the KL term stays on all four."""
    lp = t([[-1.0, -1.0, -1.0, -1.0]]).requires_grad_()
    mask = torch.tensor([[True, True, True, True]])
    out = grpo_loss(
        lp, t([1.0]), mask, entropies=t([[0.1, 0.5, 0.9, 0.3]]), top_entropy_quantile=0.5, loss_type="bnpo"
    )
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[0.0, -0.25, -0.25, 0.0]]))
    assert out.metrics["entropy"].item() == pytest.approx(0.45)


def test_cispo_and_vespo_gradients_treat_the_weight_as_a_constant(gen):
    """CISPO: ∂ℓ/∂lp = −sg(min(r, ε_h))·A·m/N. The weight's own dependence on lp is not
    differentiated (TRL; EasyDeL's missing detach is a defect). VESPO the same with φ(w)."""
    b = random_batch(gen)
    m = b["mask"].to(D)
    n = m.sum()
    r = torch.exp(b["lp"] - b["old"])
    for loss_type, weight in (("cispo", torch.clamp(r, max=1.1)), ("vespo", None)):
        lp = b["lp"].clone().requires_grad_()
        out = grpo_loss(lp, b["adv"], b["mask"], old_logps=b["old"], loss_type=loss_type, epsilon_high=1.1)
        out.loss.backward()
        if weight is None:  # VESPO's φ per sequence, from the summed log-ratio
            log_w = ((b["lp"] - b["old"]) * m).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
            k = torch.where(b["adv"][:, None] >= 0, 2.0, 3.0)
            lam = torch.where(b["adv"][:, None] >= 0, 3.0, 2.0)
            weight = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        torch.testing.assert_close(lp.grad, -weight * b["adv"][:, None] * m / n, rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- gradient checks

DIFFERENTIABLE = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo")


@pytest.mark.parametrize("loss_type", DIFFERENTIABLE)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck_float64(gen, loss_type, level):
    """Finite differences agree with autograd for every variant whose loss is a plain function of
    logps (CISPO and VESPO detach their weights by design, GSPO-token its value: checked above)."""
    b = random_batch(gen, B=3, T=4)

    def f(lp):
        return grpo_loss(
            lp,
            b["adv"],
            b["mask"],
            old_logps=b["old"],
            ref_logps=b["ref"],
            beta=0.04,
            loss_type=loss_type,
            importance_sampling_level=level,
            epsilon_high=0.28,
            max_completion_length=6,
        ).loss

    assert torch.autograd.gradcheck(f, (b["lp"].clone().requires_grad_(),))


# ----------------------------------------------------------------------------- invariances


def _loss_and_grad(lp, adv, mask, **kw):
    lp = lp.clone().requires_grad_()
    out = grpo_loss(lp, adv, mask, **kw)
    out.loss.backward()
    return out.loss.detach(), lp.grad


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_micro_batch_split_with_global_token_count_gives_the_same_gradient(gen, loss_type):
    """Σ over micro-batches of the gradients with num_items_in_batch = global N = full-batch gradient."""
    b = random_batch(gen, B=8, T=6)
    kw = dict(old_logps=None, ref_logps=b["ref"], beta=0.04, loss_type=loss_type, epsilon_high=5.0)
    n_global = b["mask"].sum()
    full_loss, full_grad = _loss_and_grad(b["lp"], b["adv"], b["mask"], num_items_in_batch=n_global, **kw)
    parts = [slice(0, 3), slice(3, 4), slice(4, 8)]
    total_loss, grads = 0.0, []
    for s in parts:
        kw_s = {**kw, "ref_logps": b["ref"][s]}
        loss, grad = _loss_and_grad(
            b["lp"][s], b["adv"][s], b["mask"][s], num_items_in_batch=n_global, **kw_s
        )
        total_loss += loss
        grads.append(grad)
    torch.testing.assert_close(total_loss, full_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "luspo", "sapo", "cispo", "vespo", "dr_grpo"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_padding_width_does_not_change_loss_or_gradient(gen, loss_type, level):
    """Extra masked columns holding garbage change nothing (dr_grpo with a fixed max_completion_length)."""
    b = random_batch(gen, B=5, T=4)
    pad = 3
    garbage = torch.randn(5, pad, generator=gen, dtype=D) * 50

    def widen(x):
        return torch.cat([x, garbage], dim=1)

    wide_mask = torch.cat([b["mask"], torch.zeros(5, pad, dtype=torch.bool)], dim=1)
    kw = dict(
        loss_type=loss_type,
        beta=0.04,
        importance_sampling_level=level,
        top_entropy_quantile=0.7,
        max_completion_length=9,
    )
    narrow = _loss_and_grad(
        b["lp"], b["adv"], b["mask"], old_logps=b["old"], ref_logps=b["ref"], entropies=b["entropies"], **kw
    )
    wide = _loss_and_grad(
        widen(b["lp"]),
        b["adv"],
        wide_mask,
        old_logps=widen(b["old"]),
        ref_logps=widen(b["ref"]),
        entropies=widen(b["entropies"]).abs(),
        **kw,
    )
    torch.testing.assert_close(wide[0], narrow[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(wide[1][:, :4], narrow[1], rtol=1e-12, atol=1e-15)
    assert torch.equal(wide[1][:, 4:], torch.zeros(5, pad, dtype=D))


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_all_masked_row_contributes_nothing_and_no_nan(gen, loss_type, level):
    b = random_batch(gen, B=4, T=5, empty_row=True)
    lp = b["lp"].clone().requires_grad_()
    out = grpo_loss(
        lp,
        b["adv"],
        b["mask"],
        old_logps=b["old"],
        ref_logps=b["ref"],
        entropies=b["entropies"],
        beta=0.04,
        loss_type=loss_type,
        importance_sampling_level=level,
        top_entropy_quantile=0.8,
    )
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(lp.grad).all() and torch.equal(lp.grad[0], torch.zeros(5, dtype=D))
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_all_masked_batch_gives_zero_loss():
    lp = t([[-1.0, -2.0]]).requires_grad_()
    out = grpo_loss(
        lp,
        t([1.0]),
        torch.tensor([[False, False]]),
        loss_type="dapo",
        entropies=t([[0.5, 0.5]]),
        top_entropy_quantile=0.5,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(1, 2, dtype=D))


def test_group_of_one_and_zero_advantages_give_zero_policy_loss(gen):
    b = random_batch(gen)
    out = grpo_loss(b["lp"], torch.zeros(6, dtype=D), b["mask"], old_logps=b["old"], loss_type="grpo")
    assert out.loss.item() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"loss_type": "ppo"},
            ValueError,
            "valid names: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo",
        ),
        ({"importance_sampling_level": "seq"}, ValueError, "token, sequence, sequence_token"),
        ({"negative_advantage_clip": "trl"}, ValueError, "ppo, easydel"),
        ({"beta": 0.1}, ValueError, "needs ref_logps"),
        ({"top_entropy_quantile": 0.5}, ValueError, "pass entropies"),
        ({"top_entropy_quantile": 0.0}, ValueError, r"in \(0, 1\]"),
        ({"max_completion_length": 0}, ValueError, "max_completion_length"),
        (
            {"kl_estimator": "k4", "beta": 0.1, "ref_logps": torch.zeros(2, 3, dtype=D)},
            ValueError,
            "k1, k2, k3",
        ),
        ({"old_logps": torch.zeros(2, 4, dtype=D)}, ValueError, "old_logps has shape"),
    ],
)
def test_bad_arguments_raise_named_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        grpo_loss(
            torch.zeros(2, 3, dtype=D), torch.zeros(2, dtype=D), torch.ones(2, 3, dtype=torch.bool), **kwargs
        )


def test_bad_shapes_and_mask_dtype():
    lp = torch.zeros(2, 3, dtype=D)
    with pytest.raises(ValueError, match="empty batch"):
        grpo_loss(torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"completion_mask must be a bool tensor.*\.bool\(\)"):
        grpo_loss(lp, torch.zeros(2, dtype=D), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages has shape"):
        grpo_loss(lp, torch.zeros(3, dtype=D), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"logps must be \[B, T\]"):
        grpo_loss(torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_inputs_are_never_modified(gen, loss_type):
    b = random_batch(gen)
    inputs = {k: (v.clone().requires_grad_() if k == "lp" else v.clone()) for k, v in b.items()}
    versions = {k: v._version for k, v in inputs.items()}
    out = grpo_loss(
        inputs["lp"],
        inputs["adv"],
        inputs["mask"],
        old_logps=inputs["old"],
        ref_logps=inputs["ref"],
        entropies=inputs["entropies"],
        beta=0.04,
        loss_type=loss_type,
        top_entropy_quantile=0.6,
    )
    out.loss.backward()
    for k, v in inputs.items():
        assert v._version == versions[k], k
        assert torch.equal(v.detach(), b[k]), k
    assert all(not m.requires_grad for m in out.metrics.values())


# ----------------------------------------------------------------------------- the table


def test_variant_table_covers_exactly_the_literals():
    assert set(LOSS_TYPES) == set(typing.get_args(LossType))
    assert set(IMPORTANCE_LEVELS) == set(ALL_LEVELS)
    for name, variant in LOSS_TYPES.items():
        assert variant.surrogate in SURROGATES or (name == "gkd" and variant.surrogate is None), name
        assert variant.aggregation in AGGREGATIONS, name
    assert {v.surrogate for v in LOSS_TYPES.values()} - {None} == set(SURROGATES)
    assert set(POLICY_LOSS_TYPES) == set(LOSS_TYPES) - {"gkd"}


def test_gkd_is_refused_by_the_policy_loss_and_normalised_by_the_whole_batch(gen):
    b = random_batch(gen)
    with pytest.raises(ValueError, match="no policy-gradient loss"):
        grpo_loss(b["lp"], b["adv"], b["mask"], loss_type="gkd")
    # its normaliser is the whole batch's token count, as dapo's
    for n in (None, 40.0):
        torch.testing.assert_close(
            loss_weight(b["mask"], loss_type="gkd", num_items_in_batch=n),
            loss_weight(b["mask"], loss_type="dapo", num_items_in_batch=n),
        )
    assert {v.aggregation for v in LOSS_TYPES.values()} == set(AGGREGATIONS)


def test_top_entropy_mask_pools_valid_tokens_only():
    """Valid entropies 0.2, 0.4, 0.6, 0.8, 1.0 (the padded 3.0 is no candidate and no pool member):
    keeping the top q=0.4 puts the threshold at the 0.6-quantile, 0.6 + 0.4·0.2 = 0.68 (linear), so
    0.8 and 1.0 are kept; q=1 keeps every valid token; q→0 keeps the highest only."""
    from grpokit.ops import top_entropy_mask

    h = t([[0.2, 0.4, 0.6], [0.8, 1.0, 3.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert top_entropy_mask(h, mask, 0.4).tolist() == [[False, False, False], [True, True, False]]
    assert top_entropy_mask(h, mask, 1.0).equal(mask)
    assert top_entropy_mask(h, mask, 1e-9).tolist() == [[False, False, False], [False, True, False]]
    assert not top_entropy_mask(h, torch.zeros_like(mask), 0.5).any()  # nothing valid: nothing kept


def test_off_policy_sequence_mask_drops_drifted_completions_with_negative_advantages():
    """Mean log q − log π over valid tokens: row 0 drifts 1.5 with A > 0 (kept), row 1 drifts 1.5 with
    A < 0 (dropped at δ = 1), row 2 drifts 0.5 with A < 0 (kept); row 3's NaN token (one the sampler
    could not score) counts as no drift: (2 + 0) / 2 = 1.0 ≤ δ, kept. A pad's gap is no evidence."""
    from grpokit.ops import off_policy_sequence_mask

    logps = t([[-1.0, -2.0], [-1.0, -2.0], [-0.5, -0.5], [-2.0, -1.0]])
    q = t([[0.0, -0.0], [0.0, -0.0], [0.0, 0.0], [0.0, float("nan")]])
    mask = torch.tensor([[True, True], [True, True], [True, True], [True, True]])
    adv = t([1.0, -1.0, -1.0, -1.0])
    kept = off_policy_sequence_mask(adv, logps, q, mask, 1.0)
    assert kept.shape == (4, 1) and kept.flatten().tolist() == [True, False, True, True]
    padded = torch.tensor([[True, False]])
    far = t([[-0.5, -1e4]])  # the pad's gap is no evidence
    assert off_policy_sequence_mask(t([-1.0]), far, t([[0.0, 0.0]]), padded, 1.0).item()


def test_grpo_loss_with_an_off_policy_mask_gives_no_gradient_to_a_dropped_completion():
    """bnpo over 2 rows of 2 tokens: A = (+1, −1); row 1 was sampled by a policy 2 nats above π_θ per
    token, so δ = 1 drops it: only row 0's tokens keep −A/N = −1/4; without the mask row 1 gets +1/4."""
    old = t([[-1.0, -1.0], [0.0, 0.0]])
    lp = t([[-1.0, -1.0], [-2.0, -2.0]]).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = grpo_loss(
        lp, t([1.0, -1.0]), mask, loss_type="bnpo", off_policy_mask_threshold=1.0, off_policy_logps=old
    )
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[-0.25, -0.25], [0.0, 0.0]]))
    lp.grad = None
    grpo_loss(lp, t([1.0, -1.0]), mask, loss_type="bnpo", off_policy_logps=old).loss.backward()
    torch.testing.assert_close(lp.grad, t([[-0.25, -0.25], [0.25, 0.25]]))
