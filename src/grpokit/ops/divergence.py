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
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

# Logits per chunk of positions: 2**24 (64 MiB of float32 per model). A chunk holds about ten such
# buffers at once (both models' logits, their log-softmaxes, the mixture, the products), so 0.7 GB at
# V = 152k (110 positions). Each chunk also reads both heads' weights: for two Qwen2.5-0.5B-sized heads in
# bfloat16, 0.54 GB, about 0.16 ms at an H100's 3.35 TB/s, so about 25 ms per pass over 16k tokens
# (counted, not measured); the chunk's products take a third of that.
CHUNK_LOGITS = 1 << 24


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


@dataclass(frozen=True)
class HeadStates:
    """Where one model's next-token logits at N positions come from: its last hidden states [N, H] and
    its LM head (`weight` [V, H], `bias` [V] or None), the logits formed a chunk of positions at a time;
    or, with no `weight`, the logits [N, V] themselves."""

    states: torch.Tensor  # [N, H], or [N, V] logits when weight is None
    weight: torch.Tensor | None = None  # [V, H]
    bias: torch.Tensor | None = None  # [V]

    def to(self, device: torch.device) -> HeadStates:
        """The same on `device` (the states, the weight and the bias)."""
        moved = [None if t is None else t.to(device) for t in (self.states, self.weight, self.bias)]
        return HeadStates(*moved)  # type: ignore[arg-type]

    def at(self, index: Any) -> HeadStates:
        """The states at `index` (a slice of rows, a bool mask of positions...), the same head."""
        return HeadStates(self.states[index], self.weight, self.bias)

    def logits(self, rows: slice) -> torch.Tensor:
        """[n, V] logits of the positions `rows`, in the head's dtype (float32 comes after)."""
        states = self.states[rows]
        if self.weight is None:
            return states
        return torch.nn.functional.linear(states.to(self.weight.dtype), self.weight, self.bias)


@dataclass(frozen=True)
class Divergence:
    """`chunked_generalized_jsd`'s result at N positions: the divergence, differentiable in the
    student, and (with `ids`) both models' detached log-probs of the token at each position."""

    per_token: torch.Tensor  # [N] float32 (float64 for float64 inputs)
    student_logps: torch.Tensor | None = None  # [N] log π_S(ids), detached; None without ids
    teacher_logps: torch.Tensor | None = None  # [N] log π_T(ids), detached
    student_entropy: torch.Tensor | None = None  # [N] the student's entropy, detached; None without ids


def _chunk_divergence(
    rows: slice,
    student: HeadStates,
    teacher: HeadStates,
    ids: torch.Tensor | None,
    beta: float,
    temperature: float,
) -> tuple[torch.Tensor, ...]:
    """The positions `rows`: the divergence [n] and, with ids, the two log-probs of ids[rows] and the
    student's entropy [n]."""
    z_student, z_teacher = student.logits(rows), teacher.logits(rows)  # [n, V] each
    divergence = generalized_jsd(z_student, z_teacher, beta=beta, temperature=temperature)  # [n]
    if ids is None:
        return (divergence,)
    at = ids[rows, None]  # [n, 1]
    with torch.no_grad():
        log_s, log_t = (
            torch.log_softmax(z.to(divergence.dtype) / temperature, -1) for z in (z_student, z_teacher)
        )
        entropy = -(log_s.exp() * log_s).sum(-1)  # [n]
        return (divergence, log_s.gather(-1, at).squeeze(-1), log_t.gather(-1, at).squeeze(-1), entropy)


def chunked_generalized_jsd(
    student: HeadStates,
    teacher: HeadStates,
    ids: torch.Tensor | None = None,
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
) -> Divergence:
    """`generalized_jsd` at N positions from two models' hidden states and heads (GKD's loss), a chunk
    of positions at a time: no [N, V] logits beyond one chunk of each model, in the forward or in the
    backward pass, which re-forms each chunk's logits from the saved hidden states and weights
    (activation checkpointing per chunk). The teacher's are usually detached; gradients reach the
    student's states and head. `ids` [N]: the token at each position, whose two log-probs come back
    too (detached, from the same chunks). `chunk_rows`: positions per chunk (default: 2**24 logits)."""
    N = student.states.shape[0]
    if teacher.states.shape[0] != N:
        raise ValueError(f"{N} student positions against {teacher.states.shape[0]} of the teacher.")
    vocab = student.weight.shape[0] if student.weight is not None else student.states.shape[-1]
    rows = chunk_rows or max(1, CHUNK_LOGITS // max(vocab, 1))
    differentiable = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (student.states, student.weight, student.bias)
    )
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, N, rows):
        chunk = (slice(start, min(start + rows, N)), student, teacher, ids, beta, temperature)
        if differentiable:  # the chunk's logits are formed again in the backward pass, not kept
            parts.append(checkpoint(_chunk_divergence, *chunk, use_reentrant=False))
        else:
            parts.append(_chunk_divergence(*chunk))
    if not parts:  # no position: empty results of the accumulation dtype
        dtype = torch.promote_types(student.states.dtype, torch.float32)
        empty = student.states.new_zeros(0, dtype=dtype)
        per_token = empty
        if differentiable:  # still in the graph, each input's gradient 0: a backward (and DDP's) goes on
            inputs = [
                t for t in (student.states, student.weight, student.bias) if t is not None and t.requires_grad
            ]
            per_token = (sum(t.sum() for t in inputs) * 0).to(dtype).expand(0)  # [0]
        return Divergence(per_token) if ids is None else Divergence(per_token, empty, empty, empty)
    joined = [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]  # [N] each
    return Divergence(*joined)
