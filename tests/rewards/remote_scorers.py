"""Reward functions that tests/rewards/test_remote_rewards.py serves over HTTP (in a thread, or through
`grpokit serve-reward tests.rewards.remote_scorers:NAME` in a subprocess) and also calls directly."""

from __future__ import annotations

from typing import Any


def digit_match(
    prompts: list[Any], completions: list[Any], answer: list[Any], completion_ids: list[list[int]], **_: Any
) -> list[float | None]:
    """Partial credit that reads a column and the token ids: the share of the answer's characters the
    completion has in place, plus 0.001 per completion token; None for an empty completion."""
    scores: list[float | None] = []
    for completion, reference, ids in zip(completions, answer, completion_ids, strict=True):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        if not text:
            scores.append(None)
            continue
        reference = str(reference)
        hits = sum(a == b for a, b in zip(text, reference, strict=False))
        scores.append(hits / max(len(reference), 1) + 0.001 * len(ids))
    return scores
