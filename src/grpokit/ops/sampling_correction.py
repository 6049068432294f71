"""Importance-sampling correction for a sampler that is not exactly the training policy.

The loss assumes completions were drawn from π_old, the training policy as it was at the start of the
step. When the drawing distribution q differs (top-k / top-p / min-p or a repetition penalty reshaped
it, or the decode loop's reduced-precision arithmetic differs from the training forward), each token's
policy term can be weighted by ρ = π_old / q, bounded so that a rare token cannot dominate (TRL's
vLLM importance-sampling correction, with its four modes):

    mode               ratio                                    outside [min, max]
    token_truncate     ρ_t = exp(log π_old − log q)   per token   clamped into the range
    token_mask         ρ_t                                         set to 0
    sequence_truncate  ρ = exp(Σ_t (log π_old − log q))  per row  clamped
    sequence_mask      ρ                                           set to 0

The weights are constants (no gradient): they multiply the policy term of the loss, not the KL term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from .masking import check_mask

SamplingCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass(frozen=True)
class _Mode:
    per_sequence: bool  # one ratio per row (the product of its tokens' ratios)
    mask: bool  # out-of-range ratios become 0 (else they are clamped into the range)


SAMPLING_CORRECTIONS: dict[str, _Mode] = {
    "token_truncate": _Mode(per_sequence=False, mask=False),
    "token_mask": _Mode(per_sequence=False, mask=True),
    "sequence_truncate": _Mode(per_sequence=True, mask=False),
    "sequence_mask": _Mode(per_sequence=True, mask=True),
}


def sampling_weights(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    mode: SamplingCorrection = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Importance weights π_old / q of the sampled tokens, bounded as `mode` says (module docstring).

    old_logps: [B, T] log π_old of the completion tokens (the training policy's forward pass).
    sampling_logps: [B, T] log q, as the sampler recorded them when drawing.
    completion_mask: [B, T] bool, True where the token counts; other positions contribute nothing.
    Returns [B, T] (token modes) or [B, 1] (sequence modes), detached, in old_logps' dtype.
    NaN sampling log-probs (unknown) count as a ratio of 1, as in TRL.
    """
    if mode not in SAMPLING_CORRECTIONS:
        raise ValueError(
            f"unknown sampling correction mode {mode!r}; valid: {', '.join(SAMPLING_CORRECTIONS)}."
        )
    if old_logps.shape != sampling_logps.shape:
        raise ValueError(
            f"old_logps {tuple(old_logps.shape)} and sampling_logps {tuple(sampling_logps.shape)} must have "
            "the same [B, T] shape."
        )
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"clip_min={clip_min} is above clip_max={clip_max}.")
    check_mask(completion_mask, old_logps.shape)
    spec = SAMPLING_CORRECTIONS[mode]
    with torch.no_grad():
        diff = (old_logps - sampling_logps.to(old_logps.dtype)).nan_to_num(nan=0.0)  # [B, T]
        diff = torch.where(completion_mask, diff, torch.zeros_like(diff))
        if spec.per_sequence:
            diff = diff.sum(-1, keepdim=True)  # [B, 1]
        ratio = torch.exp(diff)
        if spec.mask:
            low = -math.inf if clip_min is None else clip_min
            high = math.inf if clip_max is None else clip_max
            return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        if clip_min is None and clip_max is None:
            return ratio
        return ratio.clamp(min=clip_min, max=clip_max)


assert set(SAMPLING_CORRECTIONS) == set(get_args(SamplingCorrection))
