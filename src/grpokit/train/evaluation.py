"""Held-out evaluation: greedy accuracy and mean reward, and optionally pass@k."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..data import columns_of, render_prompt
from ..models.device import Precision, model_device
from ..rewards import score_completions
from ..rollout import HFGenerateSampler, Rollout, Sampler, SamplingParams


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
    batch_size: int | None = None,
    precision: Precision | None = None,
) -> dict[str, float]:
    """Greedy completions of every row: `accuracy` (when the task defines correctness) and
    `reward`; with pass_at_k = k > 0, also `pass@k` from k sampled completions per prompt.
    batch_size: completions sampled per call (None: all at once); bounds evaluation's memory.
    The model samples where it is (prompts go to its device; completions, rewards and metrics come
    back to the host); precision: sampling runs under its autocast (a model stored wider than it
    computes), None: as the model is stored."""
    sampler: Sampler = (
        model_or_sampler
        if hasattr(model_or_sampler, "sample")
        else HFGenerateSampler(model_or_sampler, tokenizer)
    )
    if precision is not None:
        device = model_device(getattr(sampler, "model", model_or_sampler))
        sampler = _Autocast(sampler, lambda: precision.autocast(device))
    prompts = [render_prompt(r[prompt_column], tokenizer) for r in rows]
    greedy = SamplingParams(
        num_generations=1,
        max_completion_length=max_completion_length,
        temperature=0.0,
        max_prompt_length=max_prompt_length,
    )
    completions, completion_ids = _sample_in_chunks(sampler, prompts, greedy, batch_size)
    scores = score_completions(
        reward_funcs,
        prompts,
        completions,
        columns=columns_of(rows, prompt_column),
        on_error=on_reward_error,  # type: ignore[arg-type]
        completion_ids=completion_ids,
    )
    metrics = {
        "num_prompts": float(len(rows)),
        "reward": torch.nanmean(scores.rewards).item(),
        "completions/mean_length": sum(map(len, completion_ids)) / max(len(completion_ids), 1),
    }
    if is_correct is not None:
        right = sum(is_correct(c, r) for c, r in zip(completions, rows, strict=True))
        metrics["accuracy"] = right / len(rows)
        if pass_at_k > 0:
            sampled, _ = _sample_in_chunks(
                sampler,
                prompts,
                SamplingParams(
                    num_generations=pass_at_k,
                    max_completion_length=max_completion_length,
                    temperature=temperature or 1.0,
                    seed=seed,
                    max_prompt_length=max_prompt_length,
                ),
                batch_size,
            )
            hits = [is_correct(c, rows[i // pass_at_k]) for i, c in enumerate(sampled)]
            per_prompt = [any(hits[i * pass_at_k : (i + 1) * pass_at_k]) for i in range(len(rows))]
            metrics[f"pass@{pass_at_k}"] = sum(per_prompt) / len(rows)
    return metrics


class _Autocast:
    """A sampler whose every call runs in `context()` (autocast)."""

    def __init__(self, sampler: Sampler, context: Callable[[], Any]) -> None:
        self.sampler, self.context = sampler, context

    def sample(self, prompts: list[str], params: SamplingParams) -> Rollout:
        with self.context():
            return self.sampler.sample(prompts, params)


def _sample_in_chunks(
    sampler: Sampler, prompts: list[str], params: SamplingParams, batch_size: int | None
) -> tuple[list[str], list[list[int]]]:
    """Completions (text and kept token ids) of every prompt, sampling at most `batch_size`
    completions per call (whole groups: batch_size // G prompts, at least one)."""
    per_call = len(prompts) if batch_size is None else max(1, batch_size // params.num_generations)
    texts: list[str] = []
    ids: list[list[int]] = []
    for start in range(0, len(prompts), per_call):
        rollout = sampler.sample(prompts[start : start + per_call], params)
        texts.extend(rollout.completions)
        kept = zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ids.extend(row[mask].tolist() for row, mask in kept)
    return texts, ids
