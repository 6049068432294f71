"""combine_rewards and group_advantages: hand-computed cases, the three reference conventions,
NaN (unscorable) rewards, degenerate groups."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.ops import combine_rewards, group_advantages

NAN = float("nan")


def test_hand_computed_two_groups_bessel():
    """Group 1 = [1, 2, 3]: mean 2, Bessel std 1 -> A = (r − 2)/(1 + 1e-4).
    Group 2 = [0, 0, 6]: mean 2, Bessel std sqrt((4+4+16)/2) = sqrt(12) -> A = (r − 2)/(sqrt(12) + 1e-4)."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0], dtype=torch.float64)
    out = group_advantages(rewards, 3)
    s = math.sqrt(12.0)
    expected = torch.tensor(
        [-1 / 1.0001, 0.0, 1 / 1.0001, -2 / (s + 1e-4), -2 / (s + 1e-4), 4 / (s + 1e-4)], dtype=torch.float64
    )
    torch.testing.assert_close(out.advantages, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.mean, torch.full((6,), 2.0, dtype=torch.float64))
    torch.testing.assert_close(out.std, torch.tensor([1.0, 1.0, 1.0, s, s, s], dtype=torch.float64))
    assert not out.is_std_zero.any()


@pytest.mark.parametrize(
    ("kwargs", "magnitude", "system"),
    [
        ({"std_ddof": 1}, 0.86587543, "TRL: Bessel std, eps outside"),
        ({"std_ddof": 0}, 0.99980004, "EasyDeL: population std, eps outside"),
        (
            {"std_ddof": 0, "eps": 1e-8, "eps_inside_sqrt": True},
            0.99999998,
            "Edifice: population, eps inside",
        ),
    ],
)
def test_reference_conventions_verified_values(kwargs, magnitude, system):
    """grpo-math.md §2.4 [verified]: rewards [0, 0, 1, 1], G = 4 under each system's convention."""
    out = group_advantages(torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64), 4, **kwargs)
    expected = torch.tensor([-magnitude, -magnitude, magnitude, magnitude], dtype=torch.float64)
    torch.testing.assert_close(
        out.advantages, expected, rtol=0, atol=5e-9, msg=system
    )  # values given to 8 digits


def test_matches_trl_formula_on_random_groups(gen):
    """TRL 1.16 `_generate_and_score_completions` (sum_then_normalize, scale group/batch/none),
    reproduced with TRL's own `nanstd`."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    rpf = torch.randn(24, 3, generator=gen, dtype=torch.float64)
    rpf[torch.rand(24, 3, generator=gen) < 0.2] = NAN
    rpf[5] = NAN  # a row no function could score
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    G = 4
    # TRL, verbatim in substance (grpo_trainer.py, sum_then_normalize branch)
    unscorable = torch.isnan(rpf).all(dim=1)
    rewards = (rpf * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = NAN
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    for scale in ("group", "batch", "none"):
        if scale == "batch":
            std = nanstd(rewards).expand_as(rewards)
        else:
            std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + 1e-4)
        adv = torch.nan_to_num(adv, nan=0.0)
        ours = group_advantages(combine_rewards(rpf, weights), G, scale=scale)
        # TRL's nanstd computes its Bessel factor count/(count−1) from int64 counts, which true-divides
        # to float32: its std carries a ~1e-8 relative error even in float64 (ours is exact, see
        # test_hand_computed_two_groups_bessel). 1e-7 covers that and nothing else.
        torch.testing.assert_close(ours.advantages, adv, rtol=1e-7, atol=1e-12, msg=scale)
        torch.testing.assert_close(ours.is_std_zero, torch.isclose(std, torch.zeros_like(std)), msg=scale)


def test_nan_rewards_are_excluded_and_get_zero_advantage():
    """Group [1, NaN, 3, 5]: statistics over {1, 3, 5} (mean 3, Bessel std 2); the NaN row gets 0."""
    out = group_advantages(torch.tensor([1.0, NAN, 3.0, 5.0], dtype=torch.float64), 4)
    expected = torch.tensor([-2 / 2.0001, 0.0, 0.0, 2 / 2.0001], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.mean[0], torch.tensor(3.0, dtype=torch.float64))


def test_zero_std_group_gives_exact_zero_and_is_flagged():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.0, 1.0, 0.0, 1.0], dtype=torch.float32)
    out = group_advantages(rewards, 4)
    assert torch.equal(out.advantages[:4], torch.zeros(4))  # exactly 0, not ulp noise / eps
    assert out.is_std_zero.tolist() == [True] * 4 + [False] * 4
    assert torch.isfinite(out.advantages).all()


@pytest.mark.parametrize("ddof", [0, 1])
def test_group_of_one_gives_zero_never_nan(ddof):
    out = group_advantages(torch.tensor([3.0, -1.0, 7.0]), 1, std_ddof=ddof)
    assert torch.equal(out.advantages, torch.zeros(3))


def test_all_nan_group_gives_zero():
    out = group_advantages(torch.tensor([NAN, NAN, 1.0, 2.0]), 2)
    assert torch.isfinite(out.advantages).all()
    assert out.advantages[:2].tolist() == [0.0, 0.0]


def test_batch_scale_keeps_group_mean_but_batch_std():
    """scale='batch': A = (r − group mean)/(std of all rewards + eps) (TRL and EasyDeL)."""
    rewards = torch.tensor([0.0, 2.0, 10.0, 14.0], dtype=torch.float64)
    batch_std = torch.std(rewards)  # Bessel
    out = group_advantages(rewards, 2, scale="batch")
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=torch.float64) / (batch_std + 1e-4)
    torch.testing.assert_close(out.advantages, expected, rtol=1e-12, atol=0)


def test_scale_none_is_mean_centring_only():
    out = group_advantages(torch.tensor([0.0, 2.0, 10.0, 14.0], dtype=torch.float64), 2, scale="none")
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=torch.float64))


def test_combine_rewards_weighted_nansum():
    rpf = torch.tensor([[1.0, 2.0], [NAN, 4.0], [NAN, NAN]])
    out = combine_rewards(rpf, [0.5, 2.0])
    assert out[:2].tolist() == [4.5, 8.0]
    assert math.isnan(out[2].item())


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: group_advantages(torch.zeros(0), 4), ValueError, "empty"),
        (lambda: group_advantages(torch.zeros(6), 4), ValueError, "multiple of the number of generations"),
        (lambda: group_advantages(torch.zeros(2, 4), 4), ValueError, r"must be \[B\]"),
        (lambda: group_advantages(torch.zeros(4), 4, scale="global"), ValueError, "group, batch, none"),
        (lambda: group_advantages(torch.zeros(4), 4, std_ddof=2), ValueError, "std_ddof"),
        (lambda: combine_rewards(torch.zeros(4, 2), [1.0]), ValueError, "one weight per function"),
        (lambda: combine_rewards(torch.zeros(4), [1.0]), ValueError, r"\[B, R\]"),
    ],
)
def test_bad_input_raises_named_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_inputs_are_not_modified():
    rewards = torch.tensor([1.0, NAN, 3.0, 3.0])
    before = rewards.clone()
    group_advantages(rewards, 2)
    assert torch.equal(torch.nan_to_num(rewards, nan=-1.0), torch.nan_to_num(before, nan=-1.0))


def test_decoupled_advantages_are_gdpos_written_out():
    """GDPO (TRL's normalize_then_sum), computed here with Python's statistics row by row: each function
    normalised within each group (sample std, eps 1e-4 outside), the weighted sum, that sum normalised
    over the batch; a row no function scored gets 0 and stays out of the batch's statistics."""
    import statistics

    from grpokit.ops import decoupled_advantages

    nan = float("nan")
    table = [[1.0, 0.0], [0.0, 0.0], [2.0, 1.0], [0.0, 3.0], [5.0, nan], [nan, nan]]  # [B=6, R=2], G=2
    weights, G, eps = [1.0, 0.5], 2, 1e-4
    summed = []
    for b, row in enumerate(table):
        group = table[b - b % G : b - b % G + G]
        parts = []
        for f, value in enumerate(row):
            column = [r[f] for r in group if r[f] == r[f]]
            if value == value:
                std = statistics.stdev(column) if len(column) > 1 else nan
                parts.append(weights[f] * (value - statistics.fmean(column)) / (std + eps))
        summed.append(sum(p for p in parts if p == p) if parts else nan)
    scored = [x for x in summed if x == x]
    mean, std = statistics.fmean(scored), statistics.stdev(scored)
    expected = [(x - mean) / (std + eps) if x == x else 0.0 for x in summed]
    got = decoupled_advantages(torch.tensor(table, dtype=torch.float64), weights, G)
    torch.testing.assert_close(
        got.advantages, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert got.std[0].item() == pytest.approx(std) and not got.is_std_zero.any()
