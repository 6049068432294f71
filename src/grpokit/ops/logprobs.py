"""Per-token log-probabilities and entropies from logits, without a second [B, T, V] tensor.

The naive `log_softmax(logits).gather(ids)` materialises a full float32 copy of the logits (and
autograd keeps it). Here the vocabulary axis is reduced row-chunk by row-chunk: each chunk of rows
is upcast to the accumulation dtype, its logsumexp taken, the selected logit gathered, and the
chunk freed. A custom autograd function saves only the logits (no copy), the ids and one float
per row, and recomputes the softmax chunk by chunk in the backward pass, so the memory kept for
the backward pass is O(rows) beyond the logits themselves, for every input dtype.

Accumulation is float32 for float16/bfloat16/float32 logits and float64 for float64 logits; the
outputs have the accumulation dtype. (TRL returns the logits' dtype; keeping float32 for bf16
logits is the more precise choice, and EasyDeL does the same, grpo-math.md §2.5.)

Seed parity:
* DI-engine `naive_method`, `efficient_method`, `less_efficient_method` (log_prob_utils.py) all
  compute `log_softmax(logits)[index]`; `selective_log_softmax` is that value for every dtype,
  with the memory profile of the best of the three.
* EasyDeL `get_per_token_logps(_and_entropies)`: the shift `logits[:, Lp-1:-1]` scores
  `ids[:, Lp:]` (`completion_logps`), float32 output, no temperature (pass temperature=1.0).
* Edifice `compute_logprobs`: per-sequence masked sums (`sequence_logps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

# Elements of the accumulation dtype processed at once: 2**21 floats = 8 MiB in float32.
# Small enough that a few chunk-sized temporaries stay far below the logits' own size,
# large enough that the Python loop is negligible next to the arithmetic.
_CHUNK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class TokenLogps:
    """Log-probabilities of the chosen tokens and the entropies of the same distributions."""

    logps: torch.Tensor  # [...] log π(ids | context)
    entropy: torch.Tensor  # [...] H(π(· | context)), in nats


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(rows_per_sequence: int, n_sequences: int, vocab_size: int, chunk_elements: int):
    """Yield (b, start, stop): row ranges of at most `chunk_elements // V` rows, within one sequence."""
    step = max(1, chunk_elements // max(vocab_size, 1))
    for b in range(n_sequences):
        for start in range(0, rows_per_sequence, step):
            yield b, start, min(start + step, rows_per_sequence)


def _scaled_chunk(logits: torch.Tensor, b: int, start: int, stop: int, temperature: float) -> torch.Tensor:
    """Rows [start, stop) of sequence b of `logits` [S, N, V], upcast, divided by the temperature. [n, V]"""
    chunk = logits[b, start:stop].to(accumulation_dtype(logits.dtype))
    return chunk / temperature if temperature != 1.0 else chunk


class _ChunkedLogSoftmaxStats(torch.autograd.Function):
    """logps[s,n] = z[s,n,ids[s,n]] − logsumexp(z[s,n]) and H[s,n] = logsumexp(z[s,n]) − Σ_v p·z,
    with z = logits / temperature, processed in chunks of rows.

    Works on a 3-D view [S, N, V] so that a sliced (non-contiguous) [B, T, V] view of a larger
    logits tensor is never copied. Backward (z-space, then divided by the temperature):
      ∂logps/∂z[v] = 1{v = id} − p[v]
      ∂H/∂z[v]     = −p[v]·(log p[v] + H)
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,  # [S, N, V]
        ids: torch.Tensor,  # [S, N] int64
        temperature: float,
        with_entropy: bool,
        chunk_elements: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_seq, n_rows, vocab = logits.shape
        acc = accumulation_dtype(logits.dtype)
        logps = torch.empty(n_seq, n_rows, dtype=acc, device=logits.device)  # [S, N]
        lse = torch.empty(n_seq, n_rows, dtype=acc, device=logits.device)  # [S, N]
        entropy = torch.zeros((n_seq, n_rows) if with_entropy else (0,), dtype=acc, device=logits.device)
        for b, start, stop in _chunks(n_rows, n_seq, vocab, chunk_elements):
            z = _scaled_chunk(logits, b, start, stop, temperature)  # [n, V]
            chunk_lse = torch.logsumexp(z, dim=-1)  # [n]
            lse[b, start:stop] = chunk_lse
            logps[b, start:stop] = z.gather(-1, ids[b, start:stop, None]).squeeze(-1) - chunk_lse
            if with_entropy:
                log_probs = z - chunk_lse[:, None]  # [n, V]
                # −Σ p·log p rather than lse − Σ p·z: no cancellation between two large terms
                entropy[b, start:stop] = -(torch.exp(log_probs) * log_probs).sum(-1)
        ctx.save_for_backward(logits, ids, lse, entropy)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.chunk_elements = chunk_elements
        return logps, entropy

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logps: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, ids, lse, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature: float = ctx.temperature  # type: ignore[attr-defined]
        with_entropy: bool = ctx.with_entropy  # type: ignore[attr-defined]
        n_seq, n_rows, vocab = logits.shape
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)  # [S, N, V]
        for b, start, stop in _chunks(n_rows, n_seq, vocab, ctx.chunk_elements):  # type: ignore[attr-defined]
            z = _scaled_chunk(logits, b, start, stop, temperature)  # [n, V]
            log_probs = z - lse[b, start:stop, None]  # [n, V]
            probs = torch.exp(log_probs)  # [n, V]
            g_lp = grad_logps[b, start:stop, None]  # [n, 1]
            grad_z = -probs * g_lp  # [n, V]
            grad_z.scatter_add_(-1, ids[b, start:stop, None], g_lp)
            if with_entropy:
                g_h = grad_entropy[b, start:stop, None]  # [n, 1]
                grad_z -= probs * (log_probs + entropy[b, start:stop, None]) * g_h
            if temperature != 1.0:
                grad_z /= temperature
            grad_logits[b, start:stop] = grad_z
        return grad_logits, None, None, None, None


def check_temperature(temperature: float) -> None:
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")


def _logps_and_entropy(
    logits: torch.Tensor, ids: torch.Tensor | None, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    check_temperature(temperature)
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary axis (shape [..., V]).")
    lead = logits.shape[:-1]
    if ids is None:
        ids = torch.zeros(lead, dtype=torch.long, device=logits.device)
    elif ids.shape != lead:
        raise ValueError(
            f"ids has shape {tuple(ids.shape)} but logits {tuple(logits.shape)} "
            f"need ids of shape {tuple(lead)}."
        )
    vocab = logits.shape[-1]
    try:  # merge all leading dims when the layout allows it without a copy: one [1, N, V] view
        view3 = logits.view(1, -1, vocab)  # [1, N, V]
    except RuntimeError:  # a sliced view such as logits[:, Lp-1:-1]: keep [S, N, V], still no copy
        view3 = logits if logits.dim() == 3 else logits.reshape(-1, *logits.shape[-2:])
    ids3 = ids.reshape(view3.shape[:-1]).long()  # [S, N]
    logps, entropy = _ChunkedLogSoftmaxStats.apply(
        view3, ids3, float(temperature), with_entropy, _CHUNK_ELEMENTS
    )
    return logps.reshape(lead), (entropy.reshape(lead) if with_entropy else entropy)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits, -1) gathered at `index`, without materialising the log-softmax.

    Args:
        logits: [..., V] any float dtype.
        index: [...] integer ids, same leading shape as `logits`.
    Returns:
        [...] float32 (float64 for float64 logits).

    Parity: DI-engine's three `log_prob_fn` methods and TRL's `selective_log_softmax`.
    """
    return _logps_and_entropy(logits, index, 1.0, with_entropy=False)[0]


def token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log π(ids | context) of logits already aligned with `ids`.

    Args:
        logits: [B, T, V] (any leading shape works), logits[b, t] scores ids[b, t].
        ids: [B, T] token ids.
        temperature: logits are divided by it first (TRL does this; EasyDeL, DI-engine and Edifice
            use 1.0, grpo-math.md §7.11).
    Returns:
        logps [B, T] float32 (float64 for float64 logits), differentiable w.r.t. `logits`.
    """
    return _logps_and_entropy(logits, ids, temperature, with_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits / temperature) along the last axis.

    Args:
        logits: [..., V].
    Returns:
        [...] float32 (float64 for float64 logits), differentiable w.r.t. `logits`.
    """
    return _logps_and_entropy(logits, None, temperature, with_entropy=True)[1]


def token_logps_and_entropy(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> TokenLogps:
    """`token_logps` and `entropy_from_logits` in one pass over the logits. [B, T] each."""
    logps, entropy = _logps_and_entropy(logits, ids, temperature, with_entropy=True)
    return TokenLogps(logps=logps, entropy=entropy)


def completion_logits(logits: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """The logits that score the completion: logits[:, Lp-1 : -1] scores ids[:, Lp:].

    Args:
        logits: [B, Lp+T, V] from a forward pass over prompt + completion.
        prompt_length: Lp, the (padded) prompt width.
    Returns:
        [B, T, V] view (no copy).
    """
    if not 1 <= prompt_length < logits.shape[1]:
        raise ValueError(
            f"prompt_length must be in [1, {logits.shape[1] - 1}] for logits of width {logits.shape[1]}, "
            f"got {prompt_length}."
        )
    return logits[:, prompt_length - 1 : -1]  # [B, T, V]


def completion_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, prompt_length: int, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probs of the completion part of `input_ids`, shifting by one internally.

    Args:
        logits: [B, Lp+T, V] over prompt + completion.
        input_ids: [B, Lp+T].
        prompt_length: Lp.
    Returns:
        [B, T] float32.

    Parity: EasyDeL `compute_per_token_logps` / `get_per_token_logps` (with temperature=1.0) and
    TRL's `logits[:, :-1][:, -T:]` slicing.
    """
    return token_logps(completion_logits(logits, prompt_length), input_ids[:, prompt_length:], temperature)


def sequence_logps(logps: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Σ_t logps[b, t] over the tokens that count. [B, T] -> [B].

    Parity: Edifice `compute_logprobs(logits, targets, mask)` is
    `sequence_logps(token_logps(logits, targets), mask)` (it does no shift either).
    """
    if completion_mask.dtype != torch.bool:
        raise TypeError(f"completion_mask must be bool, got {completion_mask.dtype}; use `.bool()`.")
    return (logps * completion_mask.to(logps.dtype)).sum(-1)
