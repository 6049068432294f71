"""The log-probs a step's loss compares the policy with, taken before its first update: the old
policy's, the reference's, the sampler's importance weights, and the teacher's (no gradient)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..engine import PolicyEngine, truncates
from ..ops import HeadStates, sampling_weights
from .batch import Batch
from .distill import teacher_pass
from .trainee import StepParams


def old_logps_source(engine: PolicyEngine, params: StepParams) -> str:
    """Where the old policy's log-probs come from:

    * "none": μ = 1, so the policy does not move within the step; the loss uses the detached current
      log-probs (ratio exactly 1 in value, the right gradient); also a loss without a ratio;
    * "rollout": the sampler's own log-probs of the tokens it drew. Exactly the right quantity when the
      decode loop computes what the training forward computes (`PolicyEngine.sampler_is_forward`: the
      lean Llama loop, one process, no dropout, float32 without autocast or TF32) and the drawn-from
      distribution is the loss's one: softmax(logits / temperature) with no top-k, top-p, min-p or
      repetition penalty reshaping it. Saves a forward pass over the batch;
    * "forward": a no-grad pass of the policy over the batch before the first update, otherwise
      (always with sampling_correction, which weighs exactly that difference).
    """
    if params.spec.num_iterations == 1 or not params.loss.variant.has_ratio:
        return "none"
    if params.spec.sampling_correction != "none":
        return "forward"  # the correction compares the sampler's log-probs with the training forward's
    s = params.sampling
    unfiltered = not s.top_k and s.top_p == 1.0 and not s.min_p and s.repetition_penalty == 1.0
    return "rollout" if unfiltered and engine.sampler_is_forward else "forward"


def weights_in_update(params: StepParams, source: str) -> bool:
    """sampling_correction's weights π_old / q come from the update's own forward (detached) when the
    batch gets one optimizer step (source "none": that forward's policy is π_old) and the sampler drew
    from the full distribution; otherwise from a pass before the update (a cut replayed there)."""
    correcting = params.spec.sampling_correction != "none"
    return correcting and source == "none" and not truncates(params.sampling)


@dataclass(frozen=True)
class LogpsBeforeUpdate:
    """What the loss compares the policy with, for one generation batch (None where not needed)."""

    old: torch.Tensor | None  # [B, T] log π_old; None when μ = 1 (the detached current log-probs)
    ref: torch.Tensor | None  # [B, T] log π_ref; None when beta = 0
    weights: torch.Tensor | None  # [B, T] or [B, 1] π_old/q (sampling_correction), else None
    teacher: torch.Tensor | None = None  # [B, T] log π_T of the sampled tokens (teacher: logps), else None
    # teacher: distributions (gkd): the teacher's last hidden states [B, T, H_T] and its head, on the
    # policy's device
    teacher_states: HeadStates | None = None
    # sampling_correction with one optimizer step on the batch (num_iterations = 1) and no cut of the
    # sampler's distribution: π_old is the policy the update's own forward computes, so the weights come
    # from that forward's log-probs, detached (`weights_in_update`), and no pass before it is needed
    weights_in_update: bool = False


def logps_before_update(
    engine: PolicyEngine, batch: Batch, params: StepParams, teacher: PolicyEngine | None = None
) -> tuple[LogpsBeforeUpdate, dict[str, Any]]:
    """Old-policy log-probs (`old_logps_source`), reference log-probs, with sampling_correction the
    importance weights π_old / q of the sampled tokens (which need π_old even when μ = 1), and the
    teacher's signal (`distill.teacher_pass`). Returns them and the weights' metrics (TRL's names).

    Where the sampler cut its distribution (top-k, top-p, min-p), q is the cut distribution's log-prob
    of each token, so π_old in the weights is the same cut replayed on this forward's logits
    (`PolicyEngine.replayed_logps`): the weights then measure only how the sampler and the training
    forward differ, as they should, and are 1 where they agree. A full-vocabulary π_old over a cut q
    would scale every weight by the kept mass instead (trl#6789). The loss's own ratio π_θ / π_old
    stays on the full distribution, both sides alike."""
    source = old_logps_source(engine, params)
    correcting = params.spec.sampling_correction != "none"
    in_update = weights_in_update(params, source)
    current = as_sampled = None
    if source == "forward" or (correcting and not in_update):  # π_old: the policy before updating
        micro = params.spec.micro_batch_size
        if truncates(params.sampling):
            replayed = engine.replayed_logps(batch, micro, params.sampling)
            current, as_sampled = replayed.policy, replayed.sampled
        else:
            current = as_sampled = engine.frozen_logps(batch, micro)
    old = batch.sampling_logps if source == "rollout" else current if source == "forward" else None
    ref = None
    if params.loss.beta != 0.0:
        ref = engine.frozen_logps(batch, params.spec.micro_batch_size, reference=True)
    weights, metrics = None, {}
    if as_sampled is not None:  # the sampler's log-probs against the training forward's, as sampled
        metrics = mismatch_metrics(as_sampled, batch.sampling_logps, batch.completion_mask)
    if correcting and not in_update:
        assert as_sampled is not None
        weights, correction = importance_weights(as_sampled, batch, params)
        metrics |= correction
    teacher_logps, teacher_states = teacher_pass(teacher, engine, batch, params)
    before = LogpsBeforeUpdate(
        old=old,
        ref=ref,
        weights=weights,
        teacher=teacher_logps,
        teacher_states=teacher_states,
        weights_in_update=in_update,
    )
    return before, metrics


def importance_weights(
    as_sampled: torch.Tensor, batch: Batch, params: StepParams
) -> tuple[torch.Tensor, dict[str, Any]]:
    """sampling_correction's weights π_old / q [B, T] (or [B, 1]) within their bounds (`bounded_weights`),
    and the ratios' mean and largest value before the bounds."""
    mask = batch.completion_mask
    weights = bounded_weights(as_sampled, batch.sampling_logps, mask, params)
    return weights, ratio_metrics(as_sampled, batch.sampling_logps, mask)


def bounded_weights(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, params: StepParams
) -> torch.Tensor:
    """The weights π_old / q [b, T] (or [b, 1]) of sampling_correction's mode within its bounds, from
    log π_old and log q [b, T] of the sampled tokens (mask [b, T] bool)."""
    low, high = params.spec.sampling_correction_bounds
    mode = params.spec.sampling_correction
    return sampling_weights(old, sampling, mask, mode=mode, clip_min=low, clip_max=high)


def ratio_metrics(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """The importance ratios π_old / q [B, T] before their bounds: mean and largest over the counted
    tokens (NaN with none, which rank averaging skips)."""
    diff = (old - sampling)[mask]  # [N]: log π_old − log q of the counted tokens
    none = diff.new_tensor(float("nan"))
    return {
        "sampling/importance_sampling_ratio/mean": diff.exp().mean() if diff.numel() else none,
        "sampling/importance_sampling_ratio/max": diff.exp().max() if diff.numel() else none,
    }


# |log π − log q| above this counts a token as mismatched (its ratio outside about [0.905, 1.105])
MISMATCH_NATS = 0.1


def mismatch_metrics(training: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """How far the sampler's log-probs q [B, T] are from the training forward's log π [B, T] of the same
    tokens (the quantity truncated importance sampling corrects): the mean and largest |log π − log q|
    over the counted tokens, and the share of them above MISMATCH_NATS. NaN with no counted token."""
    diff = (training.detach().float() - sampling.float())[mask].abs()  # [N]
    if not diff.numel():
        nan = float("nan")
        return {f"sampling/sampling_logp_difference/{k}": nan for k in ("mean", "max")} | {
            "sampling/logp_mismatch_share": nan
        }
    return {
        "sampling/sampling_logp_difference/mean": diff.mean(),
        "sampling/sampling_logp_difference/max": diff.max(),
        "sampling/logp_mismatch_share": (diff > MISMATCH_NATS).float().mean(),
    }
