"""Drawing a step's batch: this rank's prompts, G completions of each, their rewards and advantages.

Every formula a resumed run must repeat exactly lives here once: the sampling seed of a step
(`step_seed`), which prompts a rank takes and how they are rendered (`step_prompts`), and how a
rollout becomes the batch (`batch.Batch.from_rollout`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config.plan import StepSpec
from ..data import PromptSampler, columns_of, render_prompt
from ..engine import Sampler
from ..ops import GroupAdvantages, decoupled_advantages, group_advantages
from ..rewards import CallRules, score_completions
from ..rewards.scoring import RewardScores, RunState
from ..rollout import Rollout
from . import distributed
from .batch import Batch, group_invariants, merge_groups
from .evaluation import length_by_correctness
from .trainee import StepParams


def step_seed(seed: int, step: int, attempt: int = 0, rank: int = 0) -> int:
    """The seed of every random draw of step `step` (its `attempt`-th generation batch on `rank`):
    from the run's seed and these alone, so a resumed run draws exactly what an uninterrupted one
    would. (The config bounds `seed` so that this stays below 2**64.)"""
    return seed * 1_000_003 + step * 101 + attempt + 7919 * rank


@dataclass(frozen=True)
class StepPrompts:
    """This rank's P prompts of one generation batch."""

    rows: list[dict[str, Any]]  # [P] the dataset rows
    texts: list[str]  # [P] as the policy reads them (chat template, tools)
    drawn: list[int]  # [P·world] the rows every rank drew (the curriculum's visits)
    is_correct: Callable[[str, dict[str, Any]], bool] | None = None  # the rows' answer check, if any

    def repeat(self, column: str, G: int) -> list[str]:
        """[B]: each row's `column`, G times in a row (rows p·G … p·G+G−1 share prompt p)."""
        return [r[column] for r in self.rows for _ in range(G)]


def step_prompts(
    prompts: PromptSampler, P: int, d: distributed.Dist, engine: Sampler, spec: StepSpec, tools: bool
) -> StepPrompts:
    """The sampler's next batch (every rank reads the same order), this rank's share of it, rendered
    (with the environment's tool schemas when `tools`)."""
    rows = prompts.next_batch()[d.rank * P : (d.rank + 1) * P]
    schemas = engine.environment.tool_schemas if tools and engine.environment is not None else None
    texts = [
        render_prompt(r[spec.prompt_column], engine.tokenizer, schemas, spec.chat_template_kwargs)
        for r in rows
    ]
    return StepPrompts(rows=rows, texts=texts, drawn=prompts.last_indices, is_correct=prompts.is_correct)


def generate_and_score(
    engine: Sampler,
    prompts: PromptSampler,
    reward_funcs: Sequence[Callable[..., Any]],
    params: StepParams,
    step: int,
    d: distributed.Dist,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[Batch, dict[str, Any]]:
    """Sample, score and compute advantages, on the host; with dynamic sampling, keep drawing batches
    until P groups with differing rewards are collected (or the bound is hit, then fill with the rest).
    Reward functions run within `params.spec.reward_timeout`; `should_stop` returning True while one runs
    abandons the step (`rewards.scoring.ScoringStopped`), before anything has been updated."""
    spec, G, P = params.spec, params.sampling.num_generations, params.prompts_per_rank
    informative: list[tuple[Batch, list[int]]] = []
    leftovers: list[tuple[Batch, list[int]]] = []
    metrics: dict[str, Any] = {}
    attempts = spec.max_resample_batches if spec.dynamic_sampling else 1
    seconds = {"timing/sampling": 0.0, "timing/scoring": 0.0}
    for attempt in range(attempts):
        drawn, rollout, took = sample_rollout(engine, prompts, params, step, d, attempt)
        sampled = time.perf_counter()
        seconds["timing/sampling"] += took
        batch, zero, first = score_rollout(rollout, drawn, reward_funcs, spec, G, should_stop, step)
        if prompts.curriculum is not None:  # every batch drawn is a visit of its prompts, kept or not
            record_visits(prompts, drawn.drawn, batch.rewards, zero, G, d)
        seconds["timing/scoring"] += time.perf_counter() - sampled
        if attempt == 0:  # TRL's metric names, on the first (unfiltered) generation batch
            metrics |= first
        zero_groups = zero.reshape(-1, G)[:, 0].tolist()  # [B] -> [P, G] -> [P]
        informative.append((batch, [g for g in range(P) if not zero_groups[g] or not spec.dynamic_sampling]))
        leftovers.append((batch, [g for g in range(P) if zero_groups[g] and spec.dynamic_sampling]))
        enough = sum(len(g) for _, g in informative) >= P
        if not distributed.any_rank(d, not enough):  # all ranks draw the same number of batches
            break
    metrics["num_generation_batches"] = attempt + 1
    if prompts.curriculum is not None:  # the pools after this step's visits
        metrics |= prompts.curriculum.metrics()
    metrics |= seconds
    chosen, need = [], P
    for batch, groups in informative + leftovers:
        chosen.append((batch, groups[:need]))
        need -= len(chosen[-1][1])
    batch = merge_groups(chosen, G, engine.tokenizer.pad_token_id)
    return batch, metrics | group_invariants(batch, G)


def sample_rollout(
    engine: Sampler,
    prompts: PromptSampler,
    params: StepParams,
    step: int,
    d: distributed.Dist,
    attempt: int,
) -> tuple[StepPrompts, Rollout, float]:
    """Generation batch `attempt` of step `step`: this rank's prompts, G completions of each (ends on the
    host: synced; multi-turn episodes start from their rows), and the seconds it took."""
    began, spec = time.perf_counter(), params.spec
    drawn = step_prompts(prompts, params.prompts_per_rank, d, engine, spec, tools=True)
    sampling = replace(params.sampling, seed=step_seed(spec.seed, step, attempt, d.rank))
    rollout = engine.generate(drawn.texts, sampling, rows=drawn.rows)
    return drawn, rollout, time.perf_counter() - began


def scored_batch(
    drawn: StepPrompts,
    rollout: Rollout,
    sampling_s: float,
    reward_funcs: Sequence[Callable[..., Any]],
    params: StepParams,
    pad_token_id: int,
    step: int,
) -> tuple[Batch, dict[str, Any]]:
    """`generate_and_score`'s batch and metrics when one generation batch is the step's (no dynamic
    sampling, no curriculum: nothing about the next draw waits for these rewards), from a rollout
    sampled apart (`sample_rollout`): the rollout worker scores one batch while it samples the next."""
    began, G = time.perf_counter(), params.sampling.num_generations
    batch, _, metrics = score_rollout(rollout, drawn, reward_funcs, params.spec, G, None, step)
    metrics["num_generation_batches"] = 1
    metrics |= {"timing/sampling": sampling_s, "timing/scoring": time.perf_counter() - began}
    batch = merge_groups([(batch, list(range(len(drawn.rows))))], G, pad_token_id)
    return batch, metrics | group_invariants(batch, G)


def score_rollout(
    rollout: Rollout,
    drawn: StepPrompts,
    reward_funcs: Sequence[Callable[..., Any]],
    spec: StepSpec,
    G: int,
    should_stop: Callable[[], bool] | None,
    step: int,
) -> tuple[Batch, torch.Tensor, dict[str, Any]]:
    """The rollout scored by the reward functions, with group-relative advantages, as a batch; which
    rows' groups have zero spread [B] bool; and the batch's metrics (TRL's names). The functions get
    TRL's trainer_state: step − 1 steps done."""
    repeated = drawn.repeat(spec.prompt_column, G)  # [B]: the rows' own prompts
    columns = columns_of(drawn.rows, spec.prompt_column, repeat=G)
    if rollout.env_rewards is not None:  # multi-turn: what the environment paid (None: nothing)
        columns["env_reward"] = [None if r != r else r for r in rollout.env_rewards.tolist()]
    scores = score_completions(
        reward_funcs,
        repeated,
        rollout.messages or rollout.completions,  # episodes through the chat template: their messages
        columns=columns,
        completion_ids=[
            ids[m].tolist() for ids, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ],
        weights=spec.reward_weights,
        rules=CallRules(
            spec.on_reward_error,  # type: ignore[arg-type]
            spec.reward_timeout,
            should_stop,
            RunState(global_step=step - 1),  # TRL's trainer_state
        ),
    )
    adv = step_advantages(scores, G, spec)
    batch = Batch.from_rollout(
        rollout,
        mask_truncated=spec.mask_truncated_completions,
        advantages=adv.advantages,
        rewards=scores.rewards,
        prompts=repeated,
    )
    lengths = rollout.completion_mask.sum(-1).float()  # [B]
    scored = scores.rewards[~scores.rewards.isnan()]  # fewer than two: no spread (NaN)
    metrics = (
        {
            "reward": torch.nanmean(scores.rewards),
            "reward_std": scored.std() if scored.numel() > 1 else float("nan"),
            "frac_reward_zero_std": adv.is_std_zero.float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": rollout.truncated.float().mean(),
            "num_truncated_prompts": rollout.num_truncated_prompts,
            "reward_errors": scores.num_failed,
        }
        | scores.metrics()
        | episode_metrics(rollout)
    )
    if drawn.is_correct is not None:  # the rows' answers can be judged: lengths split by correctness
        metrics |= _lengths_judged(drawn, rollout, lengths, G)
    return batch, adv.is_std_zero, metrics


def _lengths_judged(drawn: StepPrompts, rollout: Rollout, lengths: torch.Tensor, G: int) -> dict[str, Any]:
    """`length_by_correctness` of the step's completions; none where the check cannot judge these rows
    (training rows without the answers it reads: gkd's seq_kd needs none)."""
    assert drawn.is_correct is not None
    rows = [row for row in drawn.rows for _ in range(G)]  # [B]
    try:
        judged = [bool(drawn.is_correct(c, r)) for c, r in zip(rollout.completions, rows, strict=True)]
    except (KeyError, TypeError, ValueError):  # a missing or malformed answer column: no split
        return {}
    return length_by_correctness(lengths, torch.tensor(judged, dtype=torch.bool))  # [B]


# multi_objective_aggregation -> the batch's advantages [B] from its scores
AGGREGATIONS: dict[str, Callable[[RewardScores, int, StepSpec], GroupAdvantages]] = {
    # the weighted sum (scores.rewards), normalised as scale_rewards says
    "sum_then_normalize": lambda scores, G, spec: group_advantages(
        scores.rewards, G, scale=spec.scale_rewards
    ),
    # GDPO: each function normalised within its groups, summed, the sum normalised over the batch
    "normalize_then_sum": lambda scores, G, spec: decoupled_advantages(
        scores.rewards_per_func, spec.reward_weights or [1.0] * len(scores.names), G
    ),
}


def step_advantages(scores: RewardScores, G: int, spec: StepSpec) -> GroupAdvantages:
    """The batch's advantages [B], as multi_objective_aggregation says (`AGGREGATIONS`)."""
    return AGGREGATIONS[spec.multi_objective_aggregation](scores, G, spec)


def record_visits(
    prompts: PromptSampler,
    drawn: list[int],
    rewards: torch.Tensor,
    zero: torch.Tensor,
    G: int,
    d: distributed.Dist,
) -> None:
    """The groups of one generation batch, every rank's, as visits of the sampler's curriculum: each rank
    scored its own P groups, and every rank keeps the same pools (its next batch is drawn from them)."""
    P = len(drawn) // d.world_size  # groups on this rank
    groups = torch.zeros(len(drawn), G + 1)  # [P·world, G+1]: the G rewards, then the zero-spread flag
    mine = slice(d.rank * P, (d.rank + 1) * P)
    groups[mine, :G] = rewards.reshape(P, G)  # [B] -> [P, G]
    groups[mine, G] = zero.reshape(P, G)[:, 0].float()
    if d.enabled:  # each row is filled on one rank, zeros elsewhere: the sum gathers them
        groups = distributed.all_reduce_sum(d, groups.to(d.device)).cpu()
    prompts.record(drawn, groups[:, :G].tolist(), (groups[:, G] > 0).tolist())


def episode_metrics(rollout: Rollout) -> dict[str, Any]:
    """Multi-turn: turns per episode, the environment's reward, and its counts per episode (env/...)."""
    if rollout.num_turns is None:
        return {}
    B = rollout.num_turns.shape[0]
    # the same keys on every rank (averaged in one collective): env/reward is NaN where nothing was
    # paid, which the average skips; an environment's own counts in sorted order
    metrics: dict[str, Any] = {"env/turns": rollout.num_turns.float().mean()}
    paid = rollout.env_rewards
    metrics["env/reward"] = (
        torch.nanmean(paid) if paid is not None and not paid.isnan().all() else float("nan")
    )
    for name in sorted(rollout.env_metrics):
        metrics[f"env/{name}"] = rollout.env_metrics[name] / B  # per episode
    return metrics
