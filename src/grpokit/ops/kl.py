"""Per-token estimators of KL(π_θ ‖ π_ref) from log-probs of tokens sampled from π_θ.

With d = ref_logps − logps = log(π_ref/π_θ) at the sampled token (Schulman, "Approximating KL
Divergence", 2020, http://joschu.net/blog/kl-approx.html):

    k1 = −d                 unbiased, high variance, can be negative
    k2 = d² / 2             biased, low variance, ≥ 0
    k3 = exp(d) − d − 1     unbiased, low variance, ≥ 0   (GRPO's choice: DeepSeekMath eq. 4)

Parity: k3 is what EasyDeL, TRL and DI-engine compute (grpo-math.md §7.9). It is evaluated as
expm1(d) − d, equal in exact arithmetic and free of the cancellation of exp(d) − 1 for small d.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def _k1(d: torch.Tensor) -> torch.Tensor:
    return -d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d**2


def _k3(d: torch.Tensor) -> torch.Tensor:
    return torch.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
assert set(KL_ESTIMATORS) == set(get_args(KLEstimator))


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    Args:
        logps: [B, T] log π_θ of the sampled tokens (differentiable).
        ref_logps: [B, T] log π_ref of the same tokens.
        estimator: "k1", "k2" or "k3".
    Returns:
        [B, T]. The gradient of k3 w.r.t. logps is 1 − π_ref/π_θ, which gives the
        walkthrough's gradient coefficient A + β(π_ref/π_θ − 1) once negated in the loss.
    """
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"Unknown KL estimator {estimator!r}; valid names: {', '.join(KL_ESTIMATORS)}."
        ) from None
    if logps.shape != ref_logps.shape:
        raise ValueError(
            f"logps {tuple(logps.shape)} and ref_logps {tuple(ref_logps.shape)} must have one shape."
        )
    return fn(ref_logps - logps)
