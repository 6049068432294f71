"""Rewards -> group-relative advantages (the "GR" of GRPO).

    A[b] = (R[b] − mean_{group(b)} R) / (std + eps)         eps outside the square root (TRL, EasyDeL)
    A[b] = (R[b] − mean_{group(b)} R) / sqrt(var + eps)     eps inside (Edifice)

This module is the only place where the flat completion axis [B] is reshaped to [P, G] and back:
row b belongs to prompt b // G (the completions of a prompt are contiguous).

NaN rewards mean "unscorable" (TRL's convention): they are excluded from the group statistics and
get advantage 0. EasyDeL instead scores them 0 and includes them; to reproduce it, pass
`torch.nan_to_num(rewards, nan=0.0)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

RewardScale = Literal["group", "batch", "none"]
REWARD_SCALES: tuple[str, ...] = get_args(RewardScale)


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages and the statistics they were computed from, all [B]."""

    advantages: torch.Tensor  # [B] 0 for unscorable rows and zero-variance groups
    mean: torch.Tensor  # [B] mean reward of the row's group (NaN if the group has no scorable row)
    std: torch.Tensor  # [B] std used for scaling: group std, or batch std for scale="batch"
    is_std_zero: torch.Tensor  # [B] bool, std ≈ 0 (TRL's `frac_reward_zero_std` is its mean)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Weighted sum over reward functions, NaN-aware.

        R[b] = Σ_f w[f]·r[b, f] over the functions that scored row b;  NaN if none did.

    Args:
        rewards_per_func: [B, R] float, NaN where a function could not score a row.
        weights: [R].
    Returns:
        rewards [B].

    Parity: TRL `sum_then_normalize` (nansum, rows no function scored stay NaN). EasyDeL turns
    all-NaN rows into 0 (`jnp.nansum`); apply `nan_to_num` to the result to reproduce it.
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be [B, R], got shape {tuple(rewards_per_func.shape)}.")
    w = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if w.shape != (rewards_per_func.shape[1],):
        raise ValueError(
            f"weights has shape {tuple(w.shape)} but there are {rewards_per_func.shape[1]} reward functions; "
            "give one weight per function."
        )
    weighted = rewards_per_func * w  # [B, R]
    combined = weighted.nansum(dim=1)  # [B]
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [B]
    return combined.masked_fill(unscorable, float("nan"))


def _nan_std(x: torch.Tensor, dim: int | None, ddof: int, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """NaN-ignoring std along `dim` (all when None), keepdim; NaN when fewer than ddof+1 values."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    valid = ~torch.isnan(x)
    count = valid.sum(dim=dims, keepdim=True).to(x.dtype)
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    sq_dev = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    denom = count - ddof
    var = sq_dev.sum(dim=dims, keepdim=True) / denom.clamp(min=1.0)
    var = torch.where(denom > 0, var, torch.full_like(var, float("nan")))
    return torch.sqrt(var + eps) if eps_inside_sqrt else torch.sqrt(var)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: RewardScale = "group",
    std_ddof: int = 1,
    eps: float = 1e-4,
    eps_inside_sqrt: bool = False,
) -> GroupAdvantages:
    """Group-relative advantages of `rewards` [B] with groups of `group_size` contiguous rows.

        mean_g = nanmean of the group;   A = (R − mean_g) / (std + eps)   [eps_inside_sqrt: / sqrt(var + eps)]

    Args:
        rewards: [B] float, B = P·G, NaN = unscorable.
        group_size: G, completions per prompt.
        scale: "group" divides by the group's std, "batch" by the std of the whole batch (the
            mean stays per group), "none" does not divide (Dr. GRPO).
        std_ddof: 1 = Bessel-corrected std (TRL), 0 = population std (EasyDeL, Edifice).
        eps: added to the std (or to the variance when `eps_inside_sqrt`).
        eps_inside_sqrt: Edifice's `(r − μ)/sqrt(σ² + eps)` with eps=1e-8.
    Returns:
        GroupAdvantages with every field [B]. Unscorable rows, groups whose scorable rewards are
        all equal, and groups with too few scorable rows for the std (G=1 with ddof=1) get
        advantage exactly 0, never NaN.

    Parity: TRL `_generate_and_score_completions` (std_ddof=1, eps=1e-4); EasyDeL (std_ddof=0,
    eps=1e-4); Edifice `compute_advantages` (std_ddof=0, eps=1e-8, eps_inside_sqrt=True).
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"Unknown scale {scale!r}; valid values: {', '.join(REWARD_SCALES)}.")
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 (population) or 1 (Bessel), got {std_ddof}.")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be [B], got shape {tuple(rewards.shape)}; flatten [P, G] with .reshape(-1)."
        )
    if rewards.numel() == 0:
        raise ValueError("rewards is empty: a GRPO batch needs at least one group of completions.")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of {group_size}: "
            "the batch size must be a multiple of the number of generations per prompt."
        )
    grouped = rewards.reshape(-1, group_size)  # [P, G]
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # [P, 1]
    dim = None if scale == "batch" else 1  # std [1, 1] over the batch, else [P, 1] per group
    std = _nan_std(grouped, dim, std_ddof, eps if eps_inside_sqrt else 0.0, eps_inside_sqrt)
    std = std.expand_as(grouped)  # [P, G]
    centred = grouped - mean  # [P, G]
    if scale == "none":
        adv = centred
    elif eps_inside_sqrt:
        adv = centred / std
    else:
        adv = centred / (std + eps)
    # A group whose scorable rewards are all equal carries no signal: exactly 0, not ulp noise / eps.
    hi = torch.where(torch.isnan(grouped), -torch.inf, grouped).amax(dim=1, keepdim=True)  # [P, 1]
    lo = torch.where(torch.isnan(grouped), torch.inf, grouped).amin(dim=1, keepdim=True)  # [P, 1]
    adv = torch.where(hi == lo, torch.zeros_like(adv), adv)
    adv = torch.nan_to_num(adv, nan=0.0)  # unscorable rows; groups too small for the std
    zero_std = torch.isclose(std, torch.zeros_like(std))  # [P, G]
    return GroupAdvantages(
        advantages=adv.reshape(-1),  # [B]
        mean=mean.expand_as(grouped).reshape(-1),  # [B]
        std=std.reshape(-1),  # [B]
        is_std_zero=zero_std.reshape(-1),  # [B]
    )


def decoupled_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    group_size: int,
    *,
    std_ddof: int = 1,
    eps: float = 1e-4,
) -> GroupAdvantages:
    """GDPO's advantages (group reward-decoupled normalisation; TRL's
    multi_objective_aggregation="normalize_then_sum"): each reward function normalised within each
    group, the weighted sum, then that sum normalised over the batch.

        r̂[b, f] = (r[b, f] − mean_g r[·, f]) / (std_g r[·, f] + eps)
        S[b] = Σ_f w[f]·r̂[b, f] (a term NaN, a score alone in its group, adds 0; NaN when no
               function scored row b)
        A[b] = (S[b] − mean S) / (std S + eps)

    Args:
        rewards_per_func: [B, R], NaN where a function could not score a row; B = P·G.
        weights: [R]. group_size: G. std_ddof, eps: as `group_advantages` (TRL: 1, 1e-4).
    Returns:
        GroupAdvantages [B]: mean and std are the batch's (of S), is_std_zero where that std is ≈ 0;
        unscorable rows get advantage 0. Parity: TRL 1.16 `_generate_and_score_completions`.
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % group_size:
        raise ValueError(
            f"rewards_per_func must be [B, R] with B a multiple of {group_size}, "
            f"got shape {tuple(rewards_per_func.shape)}."
        )
    B, R = rewards_per_func.shape
    grouped = rewards_per_func.reshape(-1, group_size, R)  # [P, G, R]
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)  # [P, 1, R]
    std_k = _nan_std(grouped, 1, std_ddof, 0.0, False) if group_size > 1 else torch.zeros_like(mean_k)
    normalised = ((grouped - mean_k) / (std_k + eps)).reshape(B, R)  # [B, R]
    w = torch.as_tensor(weights, dtype=normalised.dtype, device=normalised.device)  # [R]
    if w.shape != (R,):
        raise ValueError(f"weights has shape {tuple(w.shape)} for {R} reward functions; give one each.")
    summed = (normalised * w).nansum(dim=1)  # [B]: a score its group cannot normalise (alone) adds 0
    summed = summed.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))  # unscorable
    mean = torch.nanmean(summed).expand(B)  # [B]
    std = (_nan_std(summed, None, std_ddof, 0.0, False) if B > 1 else torch.zeros(1)).reshape(()).expand(B)
    adv = torch.nan_to_num((summed - mean) / (std + eps), nan=0.0)  # [B]
    return GroupAdvantages(
        advantages=adv, mean=mean, std=std, is_std_zero=torch.isclose(std, torch.zeros_like(std))
    )


def distillation_advantages(
    advantages: torch.Tensor,
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    coef: float,
) -> torch.Tensor:
    """On-policy distillation's per-token advantages: A[b, t] = A_group[b] + λ·(log π_T(y_t) − log π_S(y_t))
    on the counted tokens, 0 elsewhere. [B] or [B, T] advantages, [B, T] log-probs -> [B, T]

    λ·(log π_T − log π_S) is the negative of the per-token reverse KL's sample, KL(π_S ‖ π_T) estimated
    at the sampled token: the policy gradient with it as the advantage descends that reverse KL
    (on-policy distillation, Agarwal et al. 2024; Thinking Machines 2025). The student's log-probs are
    those of the policy that sampled (no gradient flows through the advantage)."""
    base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # [B, 1] or [B, T]
    dtype = torch.promote_types(teacher_logps.dtype, torch.float32)  # float32 at least (float64 kept)
    gap = teacher_logps.detach().to(dtype) - student_logps.detach().to(dtype)  # [B, T]
    per_token = base.to(dtype) + coef * gap  # [B, T]
    return torch.where(completion_mask, per_token, torch.zeros_like(per_token))
