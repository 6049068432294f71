"""The seed systems' documented functions, each expressed through the grpokit API (tests only).

Every function here is a thin composition of `grpokit.ops` with the seed's own defaults, so that
the golden tests can name the seed they reproduce and check that grpokit's arguments give its
numbers (the README's table "The seed systems, function by function" names each composition).
It lives with the tests, not in the package: nothing in grpokit needs the seeds' spellings. Where
a seed has a defect, the correct behaviour is implemented and the deviation is stated in the
docstring.
"""

from __future__ import annotations

import torch

from grpokit.ops import (
    LossOutput,
    LossType,
    TokenLogps,
    bradley_terry_loss,
    completion_logits,
    group_advantages,
    grpo_loss,
    sequence_logps,
    token_logps,
    token_logps_and_entropy,
)

# ----------------------------------------------------------------------------- DI-engine


def di_engine_grpo_policy_error(
    logit_new: torch.Tensor,
    logit_old: torch.Tensor,
    logit_ref: torch.Tensor,
    action: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    clip_ratio: float = 0.2,
    beta: float = 0.1,
) -> LossOutput:
    """DI-engine `ding.rl_utils.grpo.grpo_policy_error` (grpo-math.md §5.2).

        lp = log π(action) from each of the three logits   [B, S]
        ℓ  = −min(r·A, clip(r, 1±c)·A) + β·k3(lp, ref)
        loss = mean_b Σ_s ℓ·w / Σ_s w

    Args: logits [B, S, V]; action [B, S]; adv [B]; weight [B, S] of 0/1 (None = all ones).
    Returns: LossOutput with DI's two monitors as tensors: `approx_kl` = mean(old − lp) and
    `clipfrac` = mean(r ∉ [1−c, 1+c]), both over all B·S positions (unmasked, as DI computes them).

    Deviations: an all-zero weight row contributes 0 instead of NaN; the old and reference
    log-probs are treated as constants (DI lets gradients flow into `logit_old`/`logit_ref`);
    the three `log_prob_fn` choices give one value, so the memory-safe one is always used.
    """
    logps = token_logps(logit_new, action)  # [B, S]
    with torch.no_grad():
        old = token_logps(logit_old, action)  # [B, S]
        ref = token_logps(logit_ref, action)  # [B, S]
    mask = torch.ones_like(action, dtype=torch.bool) if weight is None else weight > 0  # [B, S]
    out = grpo_loss(
        logps,
        adv,
        mask,
        old_logps=old,
        ref_logps=ref,
        loss_type="grpo",
        beta=beta,
        epsilon=clip_ratio,
        use_bias_correction_kl=False,
    )
    with torch.no_grad():
        ratio = torch.exp(logps - old)
        metrics = {
            "approx_kl": (old - logps).mean(),
            "clipfrac": ((ratio > 1 + clip_ratio) | (ratio < 1 - clip_ratio)).to(logps.dtype).mean(),
        }
    return LossOutput(loss=out.loss, metrics=metrics)


# ----------------------------------------------------------------------------- Edifice


def default_group_size() -> int:
    """Edifice `GRPO.default_group_size/0`: G = 8 completions per prompt."""
    return 8


def recommended_defaults() -> dict[str, int]:
    """Edifice `GRPO.recommended_defaults/0`: the policy shape and group size it recommends."""
    return {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "vocab_size": 32000, "group_size": 8}


def edifice_compute_advantages(
    rewards: torch.Tensor, *, group_size: int | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """Edifice `GRPO.compute_advantages(rewards, opts)`: (r − μ)/sqrt(σ²_pop + eps), same shape out.

    [P, G] input: groups along axis 1 (`group_size` ignored, as in Edifice).
    [B] input: groups of `group_size`, default 8 (Edifice does not infer it).
    """
    if rewards.dim() == 2:
        size = rewards.shape[1]
    elif rewards.dim() == 1:
        size = default_group_size() if group_size is None else group_size
    else:
        raise ValueError(
            f"rewards must be [batch, group] or [batch·group], got shape {tuple(rewards.shape)}."
        )
    out = group_advantages(rewards.reshape(-1), size, std_ddof=0, eps=eps, eps_inside_sqrt=True)
    return out.advantages.reshape(rewards.shape)


def edifice_compute_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Edifice `GRPO.compute_logprobs(logits, targets, mask)`: per-sequence sums of token
    log-probs [B] (no shift: logits[b, t] scores targets[b, t])."""
    logps = token_logps(logits, targets)  # [B, T]
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.bool()
    return sequence_logps(logps, keep)


def edifice_loss(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float | None = None,
    old_log_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Edifice `GRPO.loss(log_probs, advantages, opts)` on per-sequence log-probs ([B] or [P, G]).

    No clipping:  −mean(A · log π)            (REINFORCE with group advantages)
    clip_range c: −mean(select(A ≥ 0, min(rA, r₂A), max(rA, r₂A))),  r₂ = clip(r, 1−c, 1+c)

    Through the API: each sequence is one "token" (T = 1). The unclipped value is CISPO on-policy
    with a weight cap ≥ 1 (weight sg(min(1, cap)) = 1, so ℓ = −A·log π); the clipped one is grpo
    with EasyDeL's negative-advantage rule.
    """
    lp = log_probs.reshape(-1, 1)  # [B, 1]
    adv = advantages.reshape(-1).to(lp.dtype)  # [B]
    mask = torch.ones_like(lp, dtype=torch.bool)  # [B, 1]
    if clip_range is None:
        return grpo_loss(lp, adv, mask, loss_type="cispo", epsilon_high=1.0).loss
    if old_log_probs is None:
        raise ValueError(
            "edifice_loss with clip_range needs old_log_probs (the sampling policy's log-probs)."
        )
    old = old_log_probs.reshape(-1, 1).to(lp.dtype)  # [B, 1]
    return grpo_loss(
        lp, adv, mask, old_logps=old, loss_type="grpo", epsilon=clip_range, negative_advantage_clip="easydel"
    ).loss


# ----------------------------------------------------------------------------- EasyDeL


def easydel_per_token_logps_and_entropies(
    logits: torch.Tensor, input_ids: torch.Tensor, prompt_length: int
) -> TokenLogps:
    """EasyDeL `get_per_token_logps_and_entropies` on logits [B, Lp+T, V]: shift by one, float32,
    no temperature (EasyDeL never divides by it). Returns logps and entropy [B, T]."""
    return token_logps_and_entropy(completion_logits(logits, prompt_length), input_ids[:, prompt_length:])


def easydel_grpo_step_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None,
    old_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    beta: float = 0.04,
    loss_type: LossType = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    top_entropy_quantile: float = 1.0,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> LossOutput:
    """The loss inside EasyDeL `grpo_step` (grpo-math.md §2.6.1), one minibatch, EasyDeL defaults.

    EasyDeL semantics kept: sign-aware clipping for negative advantages, plain k3 KL (no bias
    correction), dr_grpo normalised by the tensor width T, dapo/cispo by `num_items_in_batch`.
    Deviations: CISPO's weight is detached (EasyDeL's is not); gradient accumulation is left to
    the caller (EasyDeL's `minibatch_call` mis-pairs prompts and completions when K > 1 and
    divides dapo by K a second time, §2.6.4). `loss_type` is one of EasyDeL's five.
    """
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"):
        raise ValueError(f"EasyDeL has loss types grpo, bnpo, dr_grpo, dapo, cispo; got {loss_type!r}.")
    return grpo_loss(
        logps,
        advantages,
        completion_mask,
        old_logps=old_logps,
        ref_logps=ref_logps,
        entropies=entropies,
        loss_type=loss_type,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,  # type: ignore[arg-type]
        top_entropy_quantile=top_entropy_quantile,
        max_completion_length=None,
        num_items_in_batch=num_items_in_batch,
        use_bias_correction_kl=False,
        negative_advantage_clip="easydel",
    )


def easydel_reward_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = 0.1,
) -> LossOutput:
    """EasyDeL reward `training_step` / `evaluation_step` loss, with EasyDeL's centering default 0.1.

    Deviation: scores [B, 1] are squeezed to [B] before the margin is subtracted, so the loss is
    the per-pair one rather than EasyDeL's accidental [B, B] broadcast.
    """
    return bradley_terry_loss(
        chosen_rewards, rejected_rewards, margin=margin, center_rewards_coefficient=center_rewards_coefficient
    )
