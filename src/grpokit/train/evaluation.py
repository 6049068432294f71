"""Held-out evaluation: greedy accuracy and mean reward, and optionally pass@k."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..data import columns_of, render_prompt
from ..rewards import score_completions
from ..rollout import HFGenerateSampler, Sampler, SamplingParams


def evaluate(
    model_or_sampler: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    reward_funcs: Sequence[Callable[..., Any]],
    is_correct: Callable[[str, dict[str, Any]], bool] | None,
    prompt_column: str = "prompt",
    max_prompt_length: int | None = None,
    max_completion_length: int = 256,
    pass_at_k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    on_reward_error: str = "raise",
) -> dict[str, float]:
    """Greedy completions of every row: `accuracy` (when the task defines correctness) and
    `reward`; with pass_at_k = k > 0, also `pass@k` from k sampled completions per prompt."""
    sampler: Sampler = (
        model_or_sampler
        if hasattr(model_or_sampler, "sample")
        else HFGenerateSampler(model_or_sampler, tokenizer)
    )
    prompts = [render_prompt(r[prompt_column], tokenizer) for r in rows]
    greedy = SamplingParams(
        num_generations=1,
        max_completion_length=max_completion_length,
        temperature=0.0,
        max_prompt_length=max_prompt_length,
    )
    rollout = sampler.sample(prompts, greedy)
    scores = score_completions(
        reward_funcs,
        prompts,
        rollout.completions,
        columns=columns_of(rows, prompt_column),
        on_error=on_reward_error,  # type: ignore[arg-type]
        completion_ids=[
            ids[m].tolist() for ids, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ],
    )
    metrics = {
        "num_prompts": float(len(rows)),
        "reward": torch.nanmean(scores.rewards).item(),
        "completions/mean_length": rollout.completion_mask.sum(-1).float().mean().item(),
    }
    if is_correct is not None:
        metrics["accuracy"] = sum(
            is_correct(c, r) for c, r in zip(rollout.completions, rows, strict=True)
        ) / len(rows)
        if pass_at_k > 0:
            sampled = sampler.sample(
                prompts,
                SamplingParams(
                    num_generations=pass_at_k,
                    max_completion_length=max_completion_length,
                    temperature=temperature or 1.0,
                    seed=seed,
                    max_prompt_length=max_prompt_length,
                ),
            )
            hits = [is_correct(c, rows[i // pass_at_k]) for i, c in enumerate(sampled.completions)]
            per_prompt = [any(hits[i * pass_at_k : (i + 1) * pass_at_k]) for i in range(len(rows))]
            metrics[f"pass@{pass_at_k}"] = sum(per_prompt) / len(rows)
    return metrics
