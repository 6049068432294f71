"""Held-out evaluation: greedy accuracy and mean reward, and optionally pass@k."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config.plan import Evaluation
from ..data import columns_of, render_prompt
from ..engine import PolicyEngine
from ..rewards import CallRules, score_completions
from ..rollout import Rollout, SamplingParams


@dataclass(frozen=True)
class EvalTask:
    """What is evaluated and how it is judged: the rows, the reward functions and their weights (mean
    `reward`, as training combines them; None: 1 each), the correctness check (`accuracy`, pass@k;
    None: neither) and the lengths completions are drawn at."""

    rows: Sequence[dict[str, Any]]
    reward_funcs: Sequence[Callable[..., Any]]
    is_correct: Callable[[str, dict[str, Any]], bool] | None
    max_prompt_length: int | None = None
    max_completion_length: int = 256
    reward_weights: Sequence[float] | None = None


def evaluate(
    engine: PolicyEngine,
    task: EvalTask,
    settings: Evaluation | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Greedy completions of every row: `accuracy` (when the task defines correctness) and
    `reward`; with settings.pass_at_k = k > 0, also `pass@k` from k sampled completions per prompt.
    settings.batch_size: completions sampled per call (None: all at once); bounds evaluation's memory.
    The engine samples as training does (its device, precision and decode loop; completions, rewards
    and metrics come back to the host); with an environment (`engine.environment`) completions are
    multi-turn episodes, each started from its row. settings.reward_timeout and `should_stop`: as
    `score_completions`' CallRules (the training step's rules for reward functions)."""
    settings = settings or Evaluation()  # defaults: greedy only, all rows in one call
    rows, is_correct = task.rows, task.is_correct
    greedy = greedy_completions(engine, task, settings, should_stop)
    prompts, sampled, scores = greedy.prompts, greedy.sampled, greedy.scores
    completions, completion_ids = sampled.texts, sampled.ids
    episodic = engine.environment is not None
    max_prompt_length, max_completion_length = task.max_prompt_length, task.max_completion_length
    batch_size, pass_at_k = settings.batch_size, settings.pass_at_k
    metrics = {
        "num_prompts": float(len(rows)),
        "reward": torch.nanmean(scores.rewards).item(),
        "completions/mean_length": sum(map(len, completion_ids)) / max(len(completion_ids), 1),
    }
    if len(scores.names) > 1:  # each function's mean, as training reports it (rewards/<name>/mean)
        metrics |= {k: v.item() for k, v in scores.metrics().items() if k.endswith("/mean")}
    if episodic:
        metrics["turns"] = sum(sampled.turns) / max(len(sampled.turns), 1)
    if is_correct is not None:
        judged = [bool(is_correct(c, r)) for c, r in zip(completions, rows, strict=True)]
        metrics["accuracy"] = sum(judged) / len(rows)
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float32)  # [N]
        split = length_by_correctness(lengths, torch.tensor(judged, dtype=torch.bool))
        # (a length of no completion, NaN, is left out: NaN equals nothing, not even another evaluation's)
        metrics |= {k: v.item() for k, v in split.items() if k != "completions/correct_ratio" and v == v}
        if pass_at_k > 0:
            drawn = _sample_in_chunks(
                engine,
                prompts,
                SamplingParams(
                    num_generations=pass_at_k,
                    max_completion_length=max_completion_length,
                    temperature=settings.temperature or 1.0,
                    seed=settings.seed,
                    max_prompt_length=max_prompt_length,
                ),
                batch_size,
                list(rows) if episodic else None,
            )
            hits = [is_correct(c, rows[i // pass_at_k]) for i, c in enumerate(drawn.texts)]
            per_prompt = [any(hits[i * pass_at_k : (i + 1) * pass_at_k]) for i in range(len(rows))]
            metrics[f"pass@{pass_at_k}"] = sum(per_prompt) / len(rows)
    return metrics


def length_by_correctness(lengths: torch.Tensor, correct: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mean length of the right and of the wrong completions (NaN where there are none), and the
    share that are right. lengths [B] tokens, correct [B] bool."""
    return {  # (the mean of no element is NaN)
        "completions/correct_ratio": correct.float().mean(),
        "completions/correct_mean_length": lengths[correct].mean(),
        "completions/incorrect_mean_length": lengths[~correct].mean(),
    }


@dataclass(frozen=True)
class _Sampled:
    texts: list[str]  # completions (multi-turn: whole transcripts)
    ids: list[list[int]]  # the policy's kept token ids of each
    env_rewards: list[float | None]  # multi-turn: what each episode's environment paid
    turns: list[int]  # multi-turn: policy turns of each episode
    messages: list[list[dict[str, str]]]  # episodes through the chat template: each one's messages


def _sample_in_chunks(
    engine: PolicyEngine,
    prompts: list[str],
    params: SamplingParams,
    batch_size: int | None,
    rows: list[dict[str, Any]] | None = None,
) -> _Sampled:
    """Completions of every prompt, sampling at most `batch_size` completions per call (whole groups:
    batch_size // G prompts, at least one); with rows, episodes started from them."""
    per_call = len(prompts) if batch_size is None else max(1, batch_size // params.num_generations)
    out = _Sampled([], [], [], [], [])
    for start in range(0, len(prompts), per_call):
        chunk = slice(start, start + per_call)
        rollout: Rollout = engine.generate(prompts[chunk], params, None if rows is None else rows[chunk])
        out.texts.extend(rollout.completions)
        kept = zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        out.ids.extend(row[mask].tolist() for row, mask in kept)
        if rollout.env_rewards is not None:
            out.env_rewards.extend(None if r != r else r for r in rollout.env_rewards.tolist())
        if rollout.num_turns is not None:
            out.turns.extend(rollout.num_turns.tolist())
        if rollout.messages is not None:
            out.messages.extend(rollout.messages)
    return out


@dataclass(frozen=True)
class Greedy:
    """The greedy completions of a task's rows, scored (what evaluation and the report's samples show)."""

    prompts: list[str]  # [N] as the policy read them (chat template, tools)
    sampled: _Sampled
    scores: Any  # rewards.Scores: the combined reward of each row, and each function's


def greedy_completions(
    engine: PolicyEngine,
    task: EvalTask,
    settings: Evaluation,
    should_stop: Callable[[], bool] | None = None,
) -> Greedy:
    """One greedy completion of each row of `task` (multi-turn episodes with an environment), scored by
    its reward functions under settings' rules (`evaluate`'s first half)."""
    rows = task.rows
    environment = engine.environment
    episodic = environment is not None
    tools = environment.tool_schemas if episodic else None
    kwargs = settings.chat_template_kwargs
    prompts = [render_prompt(r[settings.prompt_column], engine.tokenizer, tools, kwargs) for r in rows]
    greedy = SamplingParams(
        num_generations=1,
        max_completion_length=task.max_completion_length,
        temperature=0.0,
        max_prompt_length=task.max_prompt_length,
    )
    sampled = _sample_in_chunks(
        engine, prompts, greedy, settings.batch_size, list(rows) if episodic else None
    )
    completions, completion_ids = sampled.texts, sampled.ids
    columns = columns_of(rows, settings.prompt_column)
    if episodic:
        columns["env_reward"] = sampled.env_rewards
    scores = score_completions(
        task.reward_funcs,
        [r[settings.prompt_column] for r in rows],  # the rows' own prompts (text or conversations)
        sampled.messages or completions,  # episodes through the chat template: their messages
        columns=columns,
        completion_ids=completion_ids,
        weights=task.reward_weights,
        rules=CallRules(settings.on_reward_error, settings.reward_timeout, should_stop),  # type: ignore[arg-type]
    )
    return Greedy(prompts, sampled, scores)
