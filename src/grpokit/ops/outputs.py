"""Small named results returned by the `ops` functions (never positional tuples)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LossOutput:
    """A differentiable scalar loss and its detached metrics.

    `metrics` maps TRL's metric names (``kl``, ``entropy``, ``clip_ratio/low_mean`` ...) to 0-dim
    detached tensors. A metric that does not apply to the call is absent, never a dummy value; the
    logging layer is the one place that turns them into Python floats.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
