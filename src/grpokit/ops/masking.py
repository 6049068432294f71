"""Masked reductions. One mask convention: `mask` is bool, True where the element counts.

Every denominator is clamped at 1, so an all-masked row or batch reduces to 0, never NaN
(TRL and EasyDeL clamp the same way; DI-engine does not, see grpo-math.md §5.2).
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask over `dim` (all elements when None). `x` broadcasts against `mask`."""
    weighted = x * mask.to(x.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask / max(Σ mask, 1) over `dim` (all elements when None)."""
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def check_mask(completion_mask: torch.Tensor, shape: torch.Size, name: str = "completion_mask") -> None:
    """Raise a clear error unless `completion_mask` is a bool tensor of `shape`."""
    if completion_mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor (True where the token counts), got dtype {completion_mask.dtype}; "
            f"convert it with `{name}.bool()`."
        )
    if completion_mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(completion_mask.shape)}, expected {tuple(shape)}.")
