"""The distribution the decode loop draws from, the draw, and its record: one `draw_and_record`,
called by the eager step and compiled into the static one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# Candidates examined before falling back to a full sort of the vocabulary in `top_p_filter`.
_TOP_P_CANDIDATES = 64
# A CUDA graph is warmed up by running the static step twice, which may happen at the last token: a
# tape has that many columns beyond T, written only with padding and never read.
HEADROOM = 2


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
    drop = blocked_cumsum(probs) - probs > top_p  # [B, V] probability of the strictly better tokens
    drop[:, 0] = False
    return scores.scatter(1, order, sorted_scores.masked_fill(drop, -torch.inf))


def blocked_cumsum(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """`x.cumsum(-1)` computed as scans within blocks of `block` plus the blocks' running totals, so
    that no scan runs over a whole vocabulary row (see `inverse_cdf`). [B, V] -> [B, V]"""
    B, V = x.shape
    if block >= V:
        return x.cumsum(-1)
    blocks = torch.nn.functional.pad(x, (0, -V % block)).view(B, -1, block)  # [B, C, block]
    inner = blocks.cumsum(-1)  # [B, C, block]
    offsets = inner[:, :, -1].cumsum(-1) - inner[:, :, -1]  # [B, C] the mass of the earlier blocks
    return (inner + offsets[:, :, None]).view(B, -1)[:, :V]


def inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The token whose CDF interval holds (1 − u)·total, for u ∈ [0, 1) per row. [B, V], [B] -> [B]

    In two levels, so that no scan runs over the whole vocabulary (Inductor splits a long scan over
    few rows, and its CUDA code generation for that split fails in torch 2.11): the CDF of the
    vocabulary's blocks of `block` tokens picks a block, then the CDF inside that block picks the
    token. A token of probability 0 is never drawn: the target is clamped into the chosen block's
    mass, whose first token reaching it has positive probability.
    """
    B, V = logprobs.shape
    probs = logprobs.exp()  # [B, V]
    if block >= V:  # one block: a plain scan (a small vocabulary's draw pays no extra kernels)
        cdf = probs.cumsum(-1)  # [B, V]
        u = (1.0 - uniform)[:, None] * cdf[:, -1:]  # [B, 1] in (0, total]
        return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=V - 1)
    padded = torch.nn.functional.pad(probs, (0, -V % block))  # [B, C·block], zeros at the end
    blocks = padded.view(B, -1, block)  # [B, C, block]
    C = blocks.shape[1]
    outer = blocks.sum(-1).cumsum(-1)  # [B, C]
    u = (1.0 - uniform)[:, None] * outer[:, -1:]  # [B, 1] in (0, total]
    chosen = torch.searchsorted(outer, u).clamp(max=C - 1)  # [B, 1]
    before = torch.where(chosen > 0, outer.gather(1, (chosen - 1).clamp(min=0)), 0.0)  # [B, 1]
    inner = blocks.gather(1, chosen[:, :, None].expand(B, 1, block)).squeeze(1).cumsum(-1)  # [B, block]
    target = torch.minimum(u - before, inner[:, -1:])  # [B, 1] within the block's mass
    token = chosen * block + torch.searchsorted(inner, target).clamp(max=block - 1)  # [B, 1]
    return token.squeeze(-1).clamp(max=V - 1)


@dataclass(frozen=True)
class DrawParams:
    """The sampling distribution, fixed for a compiled step. Hashable: one compiled step per value."""

    temperature: float
    top_k: int | None
    top_p: float
    min_p: float | None
    repetition_penalty: float
    pad_token_id: int
    eos_token_ids: tuple[int, ...]

    # the fields a SamplingParams gives, by the same names
    PROCESSING: ClassVar[tuple[str, ...]] = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


@dataclass
class Rows:
    """Each decoding row's state (by slot: the static step compacts slots)."""

    ids: torch.Tensor  # [b, S] long: what the repetition penalty reads (prompt, fed tokens)
    finished: torch.Tensor  # [b] bool: not writing (ended its turn, or its episode)
    row: torch.Tensor  # [b] long: the output row the slot writes to
    column: torch.Tensor  # [b] long: where the row's next token goes in the tape


@dataclass
class Tape:
    """What was drawn, by output row: the transcript after the prompt. W = T + HEADROOM columns (a row
    that has stopped writes padding one past its last token, never read)."""

    tokens: torch.Tensor  # [B, W] long, the pad id where nothing was drawn
    logps: torch.Tensor  # [B, W] float32: log-prob of each drawn token under the processed distribution
    trained: torch.Tensor  # [B, W] bool: the policy drew it
    eos: torch.Tensor  # [E] long: the ids that end a turn
    limit: torch.Tensor  # [1] long: T, the columns a transcript may fill

    @classmethod
    def empty(cls, B: int, T: int, p: DrawParams, device: Any) -> Tape:
        W = T + HEADROOM
        return cls(
            tokens=torch.full((B, W), p.pad_token_id, dtype=torch.long, device=device),
            logps=torch.zeros(B, W, dtype=torch.float32, device=device),
            trained=torch.zeros(B, W, dtype=torch.bool, device=device),
            eos=torch.tensor(p.eos_token_ids, device=device),
            limit=torch.full((1,), T, dtype=torch.long, device=device),
        )


def draw_and_record(
    logits: torch.Tensor, p: DrawParams, rows: Rows, u: torch.Tensor | None, tape: Tape
) -> torch.Tensor:
    """Draw each row's next token from `logits` [b, V] (u [b]: its uniform number; None: greedy), write
    it and its log-probability at the row's column, advance writing rows and mark those that drew an
    end-of-sequence token or filled the tape finished (in place). -> tokens [b] (padding for rows that
    were not writing)"""
    # the static step (u from a buffer) sorts for top-p without a branch on the data
    candidates = None if torch.compiler.is_compiling() else _TOP_P_CANDIDATES
    logprobs = process_logits(logits, rows.ids if p.repetition_penalty != 1.0 else None, p, candidates)
    token = logprobs.argmax(-1) if p.temperature == 0.0 else inverse_cdf(logprobs, u)  # [b]
    writing = ~rows.finished
    token = torch.where(writing, token, p.pad_token_id)
    logp = torch.where(writing, logprobs.gather(-1, token[:, None]).squeeze(-1), 0.0)  # [b]
    at = (rows.row, rows.column)  # (output row, column)
    tape.tokens.index_put_(at, token)
    tape.logps.index_put_(at, logp)
    tape.trained.index_put_(at, writing)
    rows.column.add_(writing.long())
    rows.finished.logical_or_(torch.isin(token, tape.eos) | (rows.column >= tape.limit))
    return token
