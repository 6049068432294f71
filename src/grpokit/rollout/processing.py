"""The distribution a decode loop draws from, and the draw: shared by the dynamic loop
(`kv_sampler`) and the static-shape step (`static_decode`)."""

from __future__ import annotations

from typing import Any

import torch

# Candidates examined before falling back to a full sort of the vocabulary in `top_p_filter`.
_TOP_P_CANDIDATES = 64


def process_logits(
    logits: torch.Tensor,
    generated: torch.Tensor | None,
    params: Any,
    top_p_candidates: int | None = _TOP_P_CANDIDATES,
) -> torch.Tensor:
    """The distribution tokens are drawn from, as log-probabilities. [B, V] -> [B, V] float32

    Order as in transformers: repetition penalty (on raw logits, over prompt + generated ids),
    temperature, top-k, top-p, min-p. Greedy (temperature 0) keeps the untempered distribution.
    `params`: a `SamplingParams` or anything with its temperature, top_k, top_p, min_p and
    repetition_penalty. `top_p_candidates` None: top-p always sorts the vocabulary (no branch on the
    data, for a compiled step); both routes keep the same tokens (`top_p_filter`).
    """
    scores = logits.float()
    if params.repetition_penalty != 1.0 and generated is not None:
        seen = torch.gather(scores, 1, generated)  # [B, L]
        seen = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
        scores = scores.scatter(1, generated, seen)
    if params.temperature not in (0.0, 1.0):
        scores = scores / params.temperature
    if params.temperature > 0.0:
        if params.top_k:
            kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
            scores = scores.masked_fill(scores < kth, -torch.inf)
        if params.top_p < 1.0:
            V = scores.shape[-1]
            scores = top_p_filter(scores, params.top_p, V if top_p_candidates is None else top_p_candidates)
        if params.min_p:
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), -torch.inf)
    return torch.log_softmax(scores, dim=-1)


def top_p_filter(scores: torch.Tensor, top_p: float, candidates: int = _TOP_P_CANDIDATES) -> torch.Tensor:
    """Nucleus filtering: keep the most likely tokens whose preceding mass is at most top_p (the
    first always kept), set the rest to −inf. [B, V] -> [B, V]

    Usually the nucleus lies within the few most likely tokens, so the `candidates` best are taken
    with `topk` and the vocabulary is sorted only when they hold no more than top_p of the mass in
    some row. Every token beyond the candidates then has more than top_p before it and is dropped,
    so both routes keep exactly the same tokens.
    """
    V = scores.shape[-1]
    if candidates < V:
        values, order = torch.topk(scores, candidates, dim=-1)  # [B, c] in descending order
        probs = torch.exp(values - torch.logsumexp(scores, dim=-1, keepdim=True))  # [B, c] true probabilities
        if bool((probs.sum(-1) > top_p).all()):
            drop = probs.cumsum(-1) - probs > top_p  # mass of the strictly better tokens
            drop[:, 0] = False  # always keep the most likely token
            kept = torch.full_like(scores, -torch.inf)
            return kept.scatter(1, order, values.masked_fill(drop, -torch.inf))
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [B, V]
    probs = torch.softmax(sorted_scores, dim=-1)
    drop = probs.cumsum(-1) - probs > top_p  # [B, V] probability of the strictly better tokens
    drop[:, 0] = False
    return scores.scatter(1, order, sorted_scores.masked_fill(drop, -torch.inf))


def draw(logprobs: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: argmax, or inverse CDF with u ∈ (0, 1] (zero-probability tokens have
    zero-width intervals and can never be drawn). [B, V] -> [B]"""
    if greedy:
        return logprobs.argmax(-1)
    return inverse_cdf(logprobs, torch.rand(logprobs.shape[0], generator=generator, device=logprobs.device))


def inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds (1 − u)·total, for u ∈ [0, 1) per row. [B, V], [B] -> [B]"""
    cdf = logprobs.exp().cumsum(-1)  # [B, V]
    u = (1.0 - uniform)[:, None] * cdf[:, -1:]  # [B, 1] in (0, total]
    return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
