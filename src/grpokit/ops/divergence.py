"""Divergences between two full next-token distributions, for distillation over the whole vocabulary
(GKD, Agarwal et al. 2024), where the per-token reverse KL at the sampled token (`distillation_advantages`)
is not enough.

`generalized_jsd(student_logits, teacher_logits, beta)` per position, with P_S, P_T the softmax of the
logits (over `temperature`) and the mixture M = (1 − β)·P_S + β·P_T:

    β = 0      KL(P_T ‖ P_S)                              the forward KL (supervised distillation)
    β = 1      KL(P_S ‖ P_T)                              the reverse KL (mode seeking)
    else       β·KL(P_T ‖ M) + (1 − β)·KL(P_S ‖ M)        the generalised Jensen–Shannon divergence

As in TRL's GKDTrainer, β = 0 and β = 1 are the two KLs themselves (the generalised JSD itself tends to 0
at both ends). Computed in log space (the mixture by logsumexp) in float32 at least; never negative
beyond round-off; 0 when the two distributions agree.
"""

from __future__ import annotations

import math

import torch


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P ‖ Q) over the last dimension, from log-probabilities. [..., V] -> [...]"""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The generalised JSD between the student's and the teacher's next-token distributions at each
    position (module doc). [..., V] logits each -> [...] float32 (float64 for float64 inputs).
    Differentiable in both; the teacher's are usually detached by the caller."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must have one shape, got {tuple(student_logits.shape)} and "
            f"{tuple(teacher_logits.shape)}: the teacher must share the student's vocabulary."
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_s = torch.log_softmax(student_logits.to(dtype) / temperature, -1)  # [..., V]
    log_t = torch.log_softmax(teacher_logits.to(dtype) / temperature, -1)  # [..., V]
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    log_m = torch.logsumexp(
        torch.stack([log_s + math.log(1.0 - beta), log_t + math.log(beta)]), 0
    )  # [..., V]
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)
