"""The GRPO family of policy losses, from per-token log-probs to one scalar.

One call = four independent choices, each picked from a table (never an if-ladder on names):

1. importance weights   `IMPORTANCE_LEVELS`   log w = log π_θ/π_old per token, per sequence (GSPO),
                                               or GSPO-token (sequence value, per-token gradient)
2. surrogate            `SURROGATES`          clipped PPO ratio, CISPO, SAPO, VESPO
3. aggregation          `AGGREGATIONS`        how per-token losses [B, T] become a scalar
4. loss type            `LOSS_TYPES`          a named (surrogate, aggregation) pair: grpo, bnpo,
                                               dr_grpo, dapo, cispo, sapo, luspo, vespo

Order of operations (TRL 1.16 `GRPOTrainer._compute_loss`, EasyDeL `grpo_step`):

    r        = exp(log w)                                  [B, T] or [B, 1]
    kl       = k3(logps, ref) · (r if use_bias_correction_kl)
    ℓ        = surrogate(r, A, logps)                      [B, T] or [B, 1]
    ℓ        = ℓ · 1{A ≥ 0 or mean(log q − logps) ≤ δ_opm}  off_policy_mask_threshold δ_opm, when set
    ℓ        = ℓ · 1{H ≥ quantile(H, 1−q)}                 when top_entropy_quantile q < 1
    ℓ        = ℓ · ρ                                        sampling_weights ρ = π_old/q, when given
    ℓ        = ℓ + β·kl                                     KL on every valid token, after the entropy mask
    ℓ        = ℓ − c·H                                      entropy bonus (entropy_coef c), when c ≠ 0
    loss     = aggregation(ℓ, completion_mask)

Parity and deliberate deviations:
* `negative_advantage_clip="ppo"` (default) is TRL's and DI-engine's −min(r·A, clip(r)·A);
  `"easydel"` is EasyDeL's and Edifice's −A·min(r, clip(r)) for both signs of A
  (grpo-math.md §2.6.3).
* CISPO's clamped weight is detached, as in TRL and the CISPO paper. EasyDeL does not detach it,
  which adds a spurious −A·lp·∇r term to the gradient; grpokit does not reproduce that defect.
* An all-masked row contributes 0 (denominators clamp at 1). DI-engine divides by Σ weight
  unclamped and returns NaN; grpokit does not reproduce that defect.
* No normaliser divides by the gradient-accumulation count: the caller (the training loop)
  passes `num_items_in_batch` (dapo, cispo, vespo) or scales the loss itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch

from .kl import KLEstimator, kl_penalty
from .loss_types import LOSS_TYPES, POLICY_LOSS_TYPES, LossType, LossVariant  # noqa: F401 (re-exported)
from .masking import check_mask
from .outputs import LossOutput

ImportanceSamplingLevel = Literal["token", "sequence", "sequence_token"]
EntropyBonus = Literal["as_loss", "token_mean"]
NegativeAdvantageClip = Literal["ppo", "easydel"]


@dataclass(frozen=True)
class SurrogateParams:
    """Scalars the surrogates read; built once per call from `grpo_loss`'s keyword arguments."""

    epsilon_low: float
    epsilon_high: float
    delta: float | None
    negative_advantage_clip: str
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float


@dataclass(frozen=True)
class SurrogateInputs:
    ratio: torch.Tensor  # [B, T] or [B, 1] importance weight r, with gradient
    log_ratio: torch.Tensor  # [B, T] per-token log π_θ/π_old, with gradient
    advantages: torch.Tensor  # [B, 1] or [B, T]
    logps: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float 0/1


@dataclass(frozen=True)
class SurrogateOutput:
    per_token_loss: torch.Tensor  # [B, T] or [B, 1]
    # Indicators (or values) to report as masked means, TRL's `global_masked_mean`: name -> [B, T] | [B, 1]
    means: dict[str, torch.Tensor]
    # Per-sequence extrema of clip indicators: name -> ("min" | "max", indicator [B, T] | [B, 1])
    extrema: dict[str, tuple[str, torch.Tensor]]


# ----------------------------------------------------------------------------- importance weights


def _token_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w[b, t] = log π_θ/π_old at each token. [B, T]"""
    return log_ratio


def _sequence_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: log w[b] = Σ_t m·log_ratio / max(L_b, 1), the length-normalised sequence ratio. [B, 1]"""
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def _sequence_token_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token: value of the sequence weight, gradient of the token weight. [B, T]

    s[b, t] = sg(s[b]) · π_θ(y_t)/sg(π_θ(y_t))  (GSPO paper, eq. 13), in log space.
    """
    seq = _sequence_log_weights(log_ratio, mask).detach()  # [B, 1]
    return seq + log_ratio - log_ratio.detach()  # [B, T]


IMPORTANCE_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_weights,
    "sequence": _sequence_log_weights,
    "sequence_token": _sequence_token_log_weights,
}


# ----------------------------------------------------------------------------- surrogates


def _clipped_surrogate(x: SurrogateInputs, p: SurrogateParams) -> SurrogateOutput:
    """PPO clipped objective with asymmetric ε (DAPO clip-higher) and optional δ cap (INTELLECT-2).

    r2 = clip(r, 1−ε_low, 1+ε_high);  r_δ = min(r, δ) when δ is set
    ppo:      ℓ = −min(r_δ·A, r2·A)
    easydel:  ℓ = −where(A ≥ 0, min(r_δ·A, r2·A), max(r_δ·A, r2·A)) = −A·min(r_δ, r2)
    """
    ratio, adv = x.ratio, x.advantages
    clipped = torch.clamp(ratio, 1.0 - p.epsilon_low, 1.0 + p.epsilon_high)
    if p.delta is not None:
        ratio = torch.clamp(ratio, max=p.delta)
    loss1, loss2 = ratio * adv, clipped * adv
    surrogate = NEGATIVE_ADVANTAGE_CLIPS[p.negative_advantage_clip](loss1, loss2, adv)
    is_low = ((ratio < 1.0 - p.epsilon_low) & (adv < 0)).to(ratio.dtype)
    is_high = ((ratio > 1.0 + p.epsilon_high) & (adv > 0)).to(ratio.dtype)
    is_region = torch.maximum(is_low, is_high)
    return SurrogateOutput(
        per_token_loss=-surrogate,
        means={
            "clip_ratio/low_mean": is_low,
            "clip_ratio/high_mean": is_high,
            "clip_ratio/region_mean": is_region,
        },
        extrema={"clip_ratio/low_min": ("min", is_low), "clip_ratio/high_max": ("max", is_high)},
    )


def _cispo_surrogate(x: SurrogateInputs, p: SurrogateParams) -> SurrogateOutput:
    """CISPO (MiniMax-M1): ℓ = −sg(min(r, ε_high))·A·log π_θ. ε_high is an absolute cap here."""
    weight = torch.clamp(x.ratio, max=p.epsilon_high).detach()
    is_clipped = ((x.ratio > p.epsilon_high) & (x.advantages > 0)).to(x.ratio.dtype)
    return SurrogateOutput(
        per_token_loss=-weight * x.advantages * x.logps,
        means={"cispo_clip_ratio": is_clipped},
        extrema={},
    )


def _sapo_surrogate(x: SurrogateInputs, p: SurrogateParams) -> SurrogateOutput:
    """SAPO: a sigmoid gate replaces the hard clip. ℓ = −(4/τ)·σ(τ·(r − 1))·A,
    τ = sapo_temperature_pos where A > 0, sapo_temperature_neg elsewhere. At r = 1 the gradient is A·∇r."""
    tau = torch.where(
        x.advantages > 0,
        torch.full_like(x.advantages, p.sapo_temperature_pos),
        torch.full_like(x.advantages, p.sapo_temperature_neg),
    )
    gate = torch.sigmoid(tau * (x.ratio - 1.0)) * 4.0 / tau
    return SurrogateOutput(per_token_loss=-gate * x.advantages, means={}, extrema={})


def _vespo_surrogate(x: SurrogateInputs, p: SurrogateParams) -> SurrogateOutput:
    """VESPO: ℓ = −sg(φ(w))·A·log π_θ with the gamma weight φ(w) = exp(λ + k·log w − λ·w),
    w the *summed* sequence ratio (clamped in log space to [log 1e-8, 20]); k, λ by the sign of A.
    φ(1) = 1, so on-policy VESPO is REINFORCE with group advantages."""
    lower = math.log(1e-8)
    with torch.no_grad():
        seq_log_ratio = (torch.clamp(x.log_ratio, -20.0, 20.0) * x.mask).sum(-1, keepdim=True)  # [B, 1]
        log_w = torch.clamp(seq_log_ratio, lower, 20.0)  # [B, 1]
        adv = x.advantages if x.advantages.shape[-1] == 1 else x.advantages[:, :1]  # [B, 1]
        nonneg = adv >= 0
        k = torch.where(nonneg, torch.full_like(log_w, p.vespo_k_pos), torch.full_like(log_w, p.vespo_k_neg))
        lam = torch.where(
            nonneg, torch.full_like(log_w, p.vespo_lambda_pos), torch.full_like(log_w, p.vespo_lambda_neg)
        ).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return SurrogateOutput(
        per_token_loss=-phi * x.advantages * x.logps, means={"vespo/phi_seq_mean": phi}, extrema={}
    )


SURROGATES: dict[str, Callable[[SurrogateInputs, SurrogateParams], SurrogateOutput]] = {
    "clipped": _clipped_surrogate,
    "cispo": _cispo_surrogate,
    "sapo": _sapo_surrogate,
    "vespo": _vespo_surrogate,
}


def _ppo_pessimistic(loss1: torch.Tensor, loss2: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    return torch.min(loss1, loss2)


def _easydel_sign_aware(loss1: torch.Tensor, loss2: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    return torch.where(adv >= 0, torch.min(loss1, loss2), torch.max(loss1, loss2))


NEGATIVE_ADVANTAGE_CLIPS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ppo": _ppo_pessimistic,
    "easydel": _easydel_sign_aware,
}


# ----------------------------------------------------------------------------- aggregations


@dataclass(frozen=True)
class AggregationInputs:
    per_token_loss: torch.Tensor  # [B, T] or [B, 1] (broadcasts against mask)
    mask: torch.Tensor  # [B, T] float 0/1
    max_completion_length: int | None
    num_items_in_batch: torch.Tensor | float | None


def _sequence_mean(a: AggregationInputs) -> torch.Tensor:
    """grpo, sapo: mean over sequences of each sequence's token mean. (1/B)·Σ_b Σ_t ℓm / max(L_b, 1)"""
    return ((a.per_token_loss * a.mask).sum(-1) / a.mask.sum(-1).clamp(min=1.0)).mean()


def _local_token_mean(a: AggregationInputs) -> torch.Tensor:
    """bnpo: token mean over this (micro-)batch. Σ ℓm / max(Σ m, 1)"""
    return (a.per_token_loss * a.mask).sum() / a.mask.sum().clamp(min=1.0)


def _constant_length(a: AggregationInputs) -> torch.Tensor:
    """dr_grpo: Σ ℓm / (B · L_max), L_max = max_completion_length (TRL) or the width T (EasyDeL)."""
    length = a.max_completion_length if a.max_completion_length is not None else a.mask.shape[1]
    return (a.per_token_loss * a.mask).sum() / (a.mask.shape[0] * length)


def _global_token_mean(a: AggregationInputs) -> torch.Tensor:
    """dapo, cispo, vespo: Σ ℓm / max(N, 1), N = num_items_in_batch (the token count of the whole
    batch the gradient step covers, across micro-batches and ranks) or this batch's count."""
    count = a.mask.sum() if a.num_items_in_batch is None else a.num_items_in_batch
    count = torch.as_tensor(count, dtype=a.mask.dtype, device=a.mask.device)
    return (a.per_token_loss * a.mask).sum() / count.clamp(min=1.0)


def _sequence_sum_mean(a: AggregationInputs) -> torch.Tensor:
    """luspo: mean over sequences of each sequence's token *sum*. (1/B)·Σ_b Σ_t ℓm"""
    return (a.per_token_loss * a.mask).sum(-1).mean()


AGGREGATIONS: dict[str, Callable[[AggregationInputs], torch.Tensor]] = {
    "sequence_mean": _sequence_mean,
    "local_token_mean": _local_token_mean,
    "constant_length": _constant_length,
    "global_token_mean": _global_token_mean,
    "sequence_sum_mean": _sequence_sum_mean,
}


def loss_weight(
    completion_mask: torch.Tensor,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The total weight `loss_type`'s aggregation gives the counted tokens of `completion_mask` [B, T]:
    the aggregation of a per-token loss of 1 everywhere. A scalar; a token mean gives 1 (or the batch's
    share of `num_items_in_batch`), a sequence mean the share of rows with a token. The training loop
    adds it up over micro-batches and ranks to prove its normaliser (`invariants/loss_weight_error`)."""
    mask = completion_mask.to(torch.float32)  # [B, T]
    _lookup(LOSS_TYPES, loss_type, "loss_type")  # type: ignore[arg-type]
    aggregation = AGGREGATIONS[LOSS_TYPES[loss_type].aggregation]
    return aggregation(
        AggregationInputs(torch.ones_like(mask), mask, max_completion_length, num_items_in_batch)
    )


# ----------------------------------------------------------------------------- metrics


def _masked_metric_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's `global_masked_mean` on one process: per-sequence values ([B, 1]) average over rows,
    per-token values ([B, T]) over valid tokens."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.sum() / max(x.shape[0], 1)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _sequence_extremum(x: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """nanmin / nanmax over sequences of each sequence's masked mean (empty rows ignored)."""
    per_sequence_value = x.shape[-1] == 1 and mask.shape[-1] != 1
    per_seq = x.squeeze(-1) if per_sequence_value else (x * mask).sum(-1) / mask.sum(-1)  # [B], NaN if empty
    fill = torch.inf if kind == "min" else -torch.inf
    filled = torch.where(torch.isnan(per_seq), torch.full_like(per_seq, fill), per_seq)
    value = filled.min() if kind == "min" else filled.max()
    return torch.where(torch.isinf(value), torch.full_like(value, float("nan")), value)


def top_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """[B, T] in `mask`'s dtype: 1 where a valid token's entropy is ≥ the (1 − q) quantile of the valid
    tokens' entropies (q = top_entropy_quantile: the share kept; 0 keeps the highest only).

    Linear interpolation, as TRL's `get_high_entropy_mask` (torch.quantile at 1 − q) and EasyDeL
    (jnp.nanquantile). No valid token -> all zeros."""
    pool = torch.where(mask > 0, entropies, torch.full_like(entropies, float("nan"))).reshape(-1)
    threshold = torch.nanquantile(pool.to(torch.float64), 1.0 - quantile).to(entropies.dtype)
    return ((entropies * mask >= threshold) & (mask > 0)).to(mask.dtype)


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's `get_off_policy_mask`): [B, 1] in the mask's
    dtype, 0 for a completion with a negative advantage whose mean per-token KL estimate
    log q − log π_θ over its valid tokens exceeds `threshold`, 1 otherwise.

    advantages: [B] or [B, 1]; logps, sampling_logps: [B, T] (π_θ, and q the policy that sampled; a NaN
    of q, a token the sampler could not score, counts as no drift); completion_mask: [B, T]."""
    mask = completion_mask.to(logps.dtype)  # [B, T]
    drift = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)  # [B, T]
    mean_drift = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    adv = advantages.reshape(-1, 1)  # [B, 1]
    return ((adv >= 0) | (mean_drift <= threshold)).to(completion_mask.dtype)


# ----------------------------------------------------------------------------- the loss


@dataclass(frozen=True)
class PolicyTermFilters:
    """What multiplies the surrogate's per-token loss before the KL term joins it."""

    off_policy_mask_threshold: float | None
    top_entropy_quantile: float
    sampling_weights: torch.Tensor | None
    vespo: bool  # (which folds sampling weights in differently: refused with them)


def _kept_and_weighted(
    per_token_loss: torch.Tensor,
    filters: PolicyTermFilters,
    adv: torch.Tensor,
    logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    entropies: torch.Tensor | None,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The policy term [B, T] or [B, 1] with the off-policy sequence mask, the top-entropy mask and the
    sampler's importance weights applied, each when set."""
    if filters.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_sequence_mask(
            adv, logps, sampler_logps, mask, filters.off_policy_mask_threshold
        )  # [B, 1] of 0/1
    if filters.top_entropy_quantile < 1.0:
        assert entropies is not None
        per_token_loss = per_token_loss * top_entropy_mask(
            entropies.detach(), mask, filters.top_entropy_quantile
        )
    if filters.sampling_weights is not None:
        if filters.vespo:
            raise ValueError(
                "sampling_weights with loss_type='vespo' is not supported; use another loss_type."
            )
        per_token_loss = per_token_loss * filters.sampling_weights.detach().to(per_token_loss.dtype)
    return per_token_loss


# entropy_bonus -> the aggregation that averages the bonus's H [B, T] over the valid tokens
ENTROPY_BONUSES: dict[str, Callable[[LossVariant], str]] = {
    "as_loss": lambda variant: variant.aggregation,  # weighted as the loss weighs its tokens
    "token_mean": lambda variant: "global_token_mean" if variant.global_normaliser else "local_token_mean",
}


def _entropy_term(
    entropies: torch.Tensor | None, coef: float, aggregation: str, a: AggregationInputs
) -> torch.Tensor | float:
    """The mean H the bonus −c·H multiplies (0 when c = 0): the token entropies aggregated by
    `aggregation` over `a`'s mask (every aggregation is linear, so the loss of ℓ − c·H is this split)."""
    if coef == 0.0:
        return 0.0
    if entropies is None:
        raise ValueError("entropy_coef ≠ 0 needs the token entropies: pass entropies=[B, T].")
    return AGGREGATIONS[aggregation](replace(a, per_token_loss=entropies))


def _lookup(table: dict[str, object], name: str, what: str) -> None:
    if name not in table:
        raise ValueError(f"Unknown {what} {name!r}; valid names: {', '.join(table)}.")


def _check_loss_type(loss_type: str) -> None:
    """A known loss type that `grpo_loss` computes (gkd's loss is a divergence, computed elsewhere)."""
    _lookup(LOSS_TYPES, loss_type, "loss_type")  # type: ignore[arg-type]
    if LOSS_TYPES[loss_type].surrogate is None:
        raise ValueError(
            f"loss_type={loss_type!r} is no policy-gradient loss: its per-token loss is a divergence over "
            "whole distributions (ops.chunked_generalized_jsd), not a surrogate of log-probs."
        )


def _validate(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    others: dict[str, torch.Tensor | None],
) -> None:
    if logps.dim() != 2:
        raise ValueError(f"logps must be [B, T], got shape {tuple(logps.shape)}.")
    if logps.shape[0] == 0:
        raise ValueError("empty batch: logps has no rows; a loss needs at least one completion.")
    check_mask(completion_mask, logps.shape)
    if advantages.shape not in (logps.shape[:1], logps.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected [B]={tuple(logps.shape[:1])} "
            f"or [B, T]={tuple(logps.shape)}."
        )
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != logps.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logps.shape)} like logps."
            )


def _check_options(
    beta: float,
    ref_logps: torch.Tensor | None,
    top_entropy_quantile: float,
    entropies: torch.Tensor | None,
    max_completion_length: int | None,
) -> None:
    if beta != 0.0 and ref_logps is None:
        raise ValueError(
            f"beta={beta} needs ref_logps (the reference policy's log-probs); pass them or set beta=0."
        )
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}.")
    if top_entropy_quantile < 1.0 and entropies is None:
        raise ValueError("top_entropy_quantile < 1 needs the token entropies: pass entropies=[B, T].")
    if max_completion_length is not None and max_completion_length < 1:
        raise ValueError(f"max_completion_length must be ≥ 1, got {max_completion_length}.")


def grpo_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
    loss_type: LossType = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    top_entropy_quantile: float = 1.0,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    use_bias_correction_kl: bool = True,
    negative_advantage_clip: NegativeAdvantageClip = "ppo",
    kl_estimator: KLEstimator = "k3",
    entropy_coef: float = 0.0,
    entropy_bonus: EntropyBonus = "as_loss",
    off_policy_mask_threshold: float | None = None,
    off_policy_logps: torch.Tensor | None = None,
) -> LossOutput:
    """GRPO-family policy loss of one (micro-)batch. Names and defaults follow TRL 1.16's GRPOConfig.

    Args:
        logps: [B, T] log π_θ of the completion tokens, differentiable.
        advantages: [B] (or [B, T]) advantages, e.g. `group_advantages(...).advantages`.
        completion_mask: [B, T] bool, True where the token counts.
        old_logps: [B, T] log π_old (the policy that sampled). None = on-policy: π_old = sg(π_θ),
            so r = 1 with gradient ∇log π_θ (TRL's detach trick).
        ref_logps: [B, T] log π_ref; required when beta ≠ 0.
        entropies: [B, T] token entropies; required for top_entropy_quantile < 1, and reported
            as the `entropy` metric when given.
        sampling_weights: [B, T] or [B, 1] constant importance weights π_old / q for completions drawn
            from a distribution q other than π_old (`ops.sampling_weights`); they multiply the policy
            term, not the KL term (TRL's vLLM importance-sampling correction). Not with vespo, whose
            weights would fold them in differently.
        loss_type: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo (see LOSS_TYPES).
        beta: KL coefficient.
        epsilon: lower clip ε_low. epsilon_high: upper clip ε_high (None = epsilon); for cispo
            the absolute cap on the weight. delta: cap r at δ (two-sided clipping), None = off.
        importance_sampling_level: "token", "sequence" (GSPO) or "sequence_token" (GSPO-token).
        top_entropy_quantile: q; keep only the policy loss of tokens in the top-q entropy (1 = all).
        max_completion_length: dr_grpo's constant L_max (None = T, EasyDeL's choice).
        num_items_in_batch: token count dapo/cispo/vespo divide by (None = this batch's Σ mask);
            pass the global count when the batch is split into micro-batches or across ranks.
        sapo_temperature_pos/neg, vespo_k_pos/lambda_pos/k_neg/lambda_neg: SAPO and VESPO shapes.
        use_bias_correction_kl: multiply the KL term by r (TRL 1.16 default: True).
        negative_advantage_clip: "ppo" (TRL, DI-engine) or "easydel" (EasyDeL, Edifice).
        kl_estimator: k1, k2 or k3 (k3 everywhere in the seeds and TRL).
        entropy_coef: c; an entropy bonus −c·H on every valid token; needs differentiable `entropies`.
        entropy_bonus: how H is averaged (`ENTROPY_BONUSES`): "as_loss", by the loss type's own
            aggregation (so its weight does not depend on the micro-batch split); "token_mean", TRL's,
            the mean per-token entropy for every loss type (over num_items_in_batch with a loss that
            divides by it, else over this micro-batch's tokens, as TRL's per micro-batch).
        off_policy_mask_threshold: δ; drop the policy term of a completion with a negative advantage
            whose mean log q − log π_θ exceeds δ (DeepSeek-V3.2's off-policy sequence mask, TRL's
            name; `off_policy_sequence_mask`). None = off. off_policy_logps: [B, T] log q of the policy
            that sampled (None = old_logps, or π_θ's own when on-policy, as TRL without vLLM).
    Returns:
        LossOutput(loss [], metrics) with TRL's metric names: `kl` (beta ≠ 0), `entropy`
        (entropies given), `policy_loss` (the loss without the entropy bonus, when entropy_coef ≠ 0),
        `clip_ratio/{low_mean,high_mean,region_mean,low_min,high_max}` (clipped surrogates),
        `cispo_clip_ratio`, `vespo/phi_seq_mean`.
    """
    _check_loss_type(loss_type)
    _lookup(IMPORTANCE_LEVELS, importance_sampling_level, "importance_sampling_level")  # type: ignore[arg-type]
    _lookup(NEGATIVE_ADVANTAGE_CLIPS, negative_advantage_clip, "negative_advantage_clip")  # type: ignore[arg-type]
    _lookup(ENTROPY_BONUSES, entropy_bonus, "entropy_bonus")  # type: ignore[arg-type]
    _validate(
        logps,
        advantages,
        completion_mask,
        {
            "old_logps": old_logps,
            "ref_logps": ref_logps,
            "entropies": entropies,
            "off_policy_logps": off_policy_logps,
        },
    )
    _check_options(beta, ref_logps, top_entropy_quantile, entropies, max_completion_length)

    variant = LOSS_TYPES[loss_type]
    mask = completion_mask.to(logps.dtype)  # [B, T] 0/1
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    adv = adv.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old  # [B, T]
    ratio = torch.exp(IMPORTANCE_LEVELS[importance_sampling_level](log_ratio, mask))  # [B, T] or [B, 1]

    params = SurrogateParams(
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        delta=delta,
        negative_advantage_clip=negative_advantage_clip,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    assert variant.surrogate is not None  # (gkd was refused above)
    surrogate = SURROGATES[variant.surrogate](SurrogateInputs(ratio, log_ratio, adv, logps, mask), params)
    per_token_loss = surrogate.per_token_loss  # [B, T] or [B, 1]
    per_token_loss = _kept_and_weighted(
        per_token_loss,
        PolicyTermFilters(
            off_policy_mask_threshold, top_entropy_quantile, sampling_weights, loss_type == "vespo"
        ),
        adv,
        logps,
        old if off_policy_logps is None else off_policy_logps,
        entropies,
        mask,
    )
    per_token_kl = None
    if beta != 0.0:
        assert ref_logps is not None
        per_token_kl = kl_penalty(logps, ref_logps, kl_estimator)  # [B, T]
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
        per_token_loss = per_token_loss + beta * per_token_kl
    policy = AGGREGATIONS[variant.aggregation](
        AggregationInputs(per_token_loss, mask, max_completion_length, num_items_in_batch)
    )
    loss = policy - entropy_coef * _entropy_term(
        entropies, entropy_coef, ENTROPY_BONUSES[entropy_bonus](variant),
        AggregationInputs(mask, mask, max_completion_length, num_items_in_batch),
    )  # fmt: skip

    metrics: dict[str, torch.Tensor] = {"policy_loss": policy} if entropy_coef != 0.0 else {}
    with torch.no_grad():
        if per_token_kl is not None:
            metrics["kl"] = _masked_metric_mean(per_token_kl, mask)
        if entropies is not None:
            metrics["entropy"] = _masked_metric_mean(entropies, mask)
        for name, value in surrogate.means.items():
            metrics[name] = _masked_metric_mean(value, mask)
        for name, (kind, value) in surrogate.extrema.items():
            metrics[name] = _sequence_extremum(value, mask, kind)
    return LossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})


assert set(LOSS_TYPES) == set(get_args(LossType))
assert set(IMPORTANCE_LEVELS) == set(get_args(ImportanceSamplingLevel))
assert set(ENTROPY_BONUSES) == set(get_args(EntropyBonus))
assert set(NEGATIVE_ADVANTAGE_CLIPS) == set(get_args(NegativeAdvantageClip))
