"""Per-token log-probabilities (and entropies) straight from the last hidden state and the LM head,
never materialising the [B, T, V] logits.

The policy's forward pass normally ends with `logits = hidden @ weightᵀ` ([B, T, V]: 2.5 GB in
float32 at 4096 tokens and V = 152k), then a log-softmax, a gather, and in the backward pass a
gradient of the same size. Here rows (tokens) are processed a chunk at a time: the chunk's logits
are formed, reduced to a log-prob, a log-sum-exp and an entropy, and freed. Nothing of size V is
kept for the backward pass: it re-forms each chunk's logits from the saved hidden state and weight,
turns them into the gradient of the logits, and folds that into the gradients of `hidden` and
`weight` at once (grad_hidden = grad_z · W, grad_weight += grad_zᵀ · h). Peak memory beyond the
inputs and the weight's gradient is one chunk of logits and its temporaries.

Cost: one extra [n, H]×[H, V] product per chunk in the backward pass (8·N·V·H flops in all instead
of 6·N·V·H), bought back on CPUs by never allocating and touching multi-gigabyte tensors; see
benchmarks/linear_logps.py for the measured trade.

Accumulation is float32 (float64 for float64 inputs), whatever the inputs' dtype; the outputs have
the accumulation dtype, as in `token_logps`.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .logprobs import TokenLogps, accumulation_dtype, check_temperature

# Rows (tokens) per chunk: as many as make 2**22 logits (16 MiB of float32), but never fewer than
# min(H / 2, 512). Each chunk reads the whole [V, H] weight three times (forward, recompute,
# gradients): below about H / 2 rows the products are bound by that read; above it the chunk's
# logits outgrow the caches and every pass over them goes to memory. Measured forward + backward on
# 2 CPU cores: V = 152k, H = 896, 1024 tokens: 28 rows 9.3 s, 128 rows 5.8 s, 448 rows 4.6 s, 512
# rows 4.4-5.1 s; V = 32k, H = 256, 2144 tokens: 128 rows 0.62 s, 512 rows 0.79 s; V = 32k, H = 512:
# 256 rows 1.05 s, 512 rows 1.12 s.
_CHUNK_ELEMENTS = 1 << 22
_MAX_MIN_CHUNK_ROWS = 512


def chunk_rows(vocab: int, hidden: int) -> int:
    """The default rows per chunk for a [V, H] head (see above)."""
    return max(_CHUNK_ELEMENTS // vocab, min(hidden // 2, _MAX_MIN_CHUNK_ROWS), 1)


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, acc: torch.dtype
) -> torch.Tensor:
    """z = (h·Wᵀ + b) / temperature for a chunk of rows, in the accumulation dtype. [n, H] -> [n, V]"""
    z = (h @ weight.T).to(acc)  # [n, V] in the inputs' dtype (float32 accumulate inside the GEMM)
    if bias is not None:
        z += bias.to(acc)
    if temperature != 1.0:
        z /= temperature
    return z


class _LinearLogSoftmaxStats(torch.autograd.Function):
    """logps[n] = z[n, ids[n]] − lse(z[n]) and H[n] = −Σ_v p·log p with z = (h·Wᵀ + b) / temperature.

    Backward, per chunk, with p = softmax(z):
      ∂logps/∂z[v] = 1{v = id} − p[v]          ∂H/∂z[v] = −p[v]·(log p[v] + H)
      with g = grad_z / temperature:  grad_h = g·W,  grad_W = gᵀ·h,  grad_b = Σ_n g
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V] or None
        ids: torch.Tensor,  # [N] int64
        temperature: float,
        with_entropy: bool,
        chunk_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_rows = hidden.shape[0]
        acc = accumulation_dtype(hidden.dtype)
        logps = torch.empty(n_rows, dtype=acc, device=hidden.device)  # [N]
        lse = torch.empty(n_rows, dtype=acc, device=hidden.device)  # [N]
        entropy = torch.zeros(n_rows if with_entropy else 0, dtype=acc, device=hidden.device)  # [N] or [0]
        for start in range(0, n_rows, chunk_rows):
            stop = min(start + chunk_rows, n_rows)
            z = _chunk_logits(hidden[start:stop], weight, bias, temperature, acc)  # [n, V]
            picked = z.gather(-1, ids[start:stop, None]).squeeze(-1)  # [n]
            top = z.amax(-1, keepdim=True)  # [n, 1]
            z -= top  # z − max, in place: one [n, V] buffer in all on the logps-only path
            if with_entropy:  # H = log S − Σ e^(z−m)·(z−m) / S with S = Σ e^(z−m): no cancellation
                shifted = torch.exp(z)  # [n, V]
                total = shifted.sum(-1)  # [n]
                weighted = (shifted[:, None, :] @ z[:, :, None]).reshape(-1)  # [n] without a product buffer
                entropy[start:stop] = torch.log(total) - weighted / total
                del shifted
            else:
                total = z.exp_().sum(-1)  # [n]
            chunk_lse = top.squeeze(-1) + torch.log(total)  # [n]
            lse[start:stop] = chunk_lse
            logps[start:stop] = picked - chunk_lse
            del z
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        # an output nothing differentiates (the entropy, when only reported) gets None, not zeros: the
        # backward then skips the entropy's terms (four passes over every chunk's logits)
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.chunk_rows = chunk_rows
        return logps, entropy

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logps: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature: float = ctx.temperature  # type: ignore[attr-defined]
        with_entropy: bool = ctx.with_entropy  # type: ignore[attr-defined]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        acc = lse.dtype
        with_entropy = with_entropy and grad_entropy is not None
        if grad_logps is None:  # only the entropy is differentiated
            grad_logps = torch.zeros_like(lse)
        grad_h = (
            torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        )  # [N, H]
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None  # [V]
        n_rows = hidden.shape[0]
        for start in range(0, n_rows, ctx.chunk_rows):  # type: ignore[attr-defined]
            stop = min(start + ctx.chunk_rows, n_rows)  # type: ignore[attr-defined]
            h = hidden[start:stop]  # [n, H]
            z = _chunk_logits(h, weight, bias, temperature, acc)  # [n, V]
            z -= lse[start:stop, None]  # log p
            g_lp = grad_logps[start:stop, None].to(acc)  # [n, 1]
            if with_entropy:  # grad_z = −p·(g_lp + g_h·(log p + H)), then + g_lp at the chosen id
                probs = torch.exp(z)  # [n, V]
                g_h = grad_entropy[start:stop, None].to(acc)  # [n, 1]
                z += entropy[start:stop, None]
                z *= g_h
                z += g_lp
                z *= probs
                grad_z = z.neg_()
                del probs
            else:  # grad_z = −p·g_lp, in the logits' own buffer
                grad_z = z.exp_().mul_(-g_lp)  # [n, V]
            grad_z.scatter_add_(-1, ids[start:stop, None], g_lp)
            if temperature != 1.0:
                grad_z /= temperature
            grad_z = grad_z.to(hidden.dtype)
            if grad_h is not None:
                torch.mm(grad_z, weight, out=grad_h[start:stop])
            if grad_w is not None:
                grad_w.addmm_(grad_z.T.to(acc), h.to(acc))
            if grad_b is not None:
                grad_b += grad_z.sum(0).to(acc)
            del grad_z, z
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )


def linear_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | TokenLogps:
    """log softmax((hidden·Wᵀ + bias) / temperature) at `ids`, chunk by chunk, never forming [B, T, V].

    Args:
        hidden: [B, T, H] (any leading shape) last hidden states; hidden[b, t] scores ids[b, t]
            (shift before calling, as for `token_logps`).
        weight: [V, H] the LM head's weight (`model.get_output_embeddings().weight`).
        ids: [B, T] token ids.
        temperature: the logits are divided by it (TRL's sampling temperature; 1.0 in the seeds).
        bias: [V] the LM head's bias, if it has one.
        chunk_size: rows (tokens) per chunk; default: as many as make 16 MiB of float32 logits, and
            at least min(H / 2, 512) (so that reading the weight once per chunk is amortised).
        return_entropy: also return the entropy of each row's distribution.
    Returns:
        logps [B, T] (float32; float64 for float64 inputs), or TokenLogps(logps, entropy) with
        return_entropy. Differentiable with respect to `hidden`, `weight` and `bias`; equal to
        `token_logps(hidden @ weight.T + bias, ids, temperature)`.
    """
    check_temperature(temperature)
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(
            f"weight must be [V, H] with H = hidden's last size {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)}."
        )
    if ids.shape != hidden.shape[:-1]:
        raise ValueError(
            f"ids has shape {tuple(ids.shape)}; hidden {tuple(hidden.shape)} "
            f"needs {tuple(hidden.shape[:-1])}."
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]; a copy only for non-mergeable views
    rows = chunk_size or chunk_rows(*weight.shape)
    logps, entropy = _LinearLogSoftmaxStats.apply(
        flat, weight, bias, ids.reshape(-1).long(), float(temperature), return_entropy, rows
    )
    if return_entropy:
        return TokenLogps(logps=logps.reshape(lead), entropy=entropy.reshape(lead))
    return logps.reshape(lead)
