"""One GRPO step, on tensors: sample -> score -> advantages -> log-probs -> loss -> update.

`grpo_step(trainee, rewards, step)` does all of it for one generation batch (the trainee: the engine,
its update, the step's parameters and the prompts) and returns the batch and its metrics; the loop
around it (train/grpo.py) only reports, evaluates and saves. Everything the step needs from the config
is in `StepParams`, built once (`StepParams.of`, from the plan's `StepSpec`).

Deliberate choices, where TRL differs or is silent:
* one generation batch per step, consumed by num_iterations (μ) optimizer steps;
* old-policy log-probs exist only when μ > 1 (with μ = 1 the ratio is 1 by construction, and the loss
  uses the detached current log-probs); they are the sampler's own when that is exactly the right
  quantity (`old_logps_source`), else a no-grad pass;
* loss normalisers are right across micro-batches and ranks: dapo/cispo/vespo divide by the token
  count of the whole batch on every rank (num_items_in_batch), the per-batch means (grpo, bnpo,
  dr_grpo, luspo, sapo) are averaged over the micro-batches;
* every sampling seed derives from (seed, step, attempt, rank), so a resumed run draws exactly what an
  uninterrupted one would;
* DAPO dynamic sampling is bounded (max_resample_batches) and reports how many batches it drew.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from ..config.plan import StepSpec
from ..data import PromptSampler, columns_of, demonstration, render_prompt
from ..engine import PolicyEngine, truncates
from ..models import should_sync, sync_reference
from ..ops import (
    LOSS_TYPES,
    HeadStates,
    LossOutput,
    chunked_generalized_jsd,
    distillation_advantages,
    group_advantages,
    grpo_loss,
    loss_weight,
    sampling_weights,
)
from ..rewards import CallRules, score_completions
from ..rollout import SamplingParams
from . import distributed, optim
from .checkpoint import rng_state, set_rng_state


@dataclass(frozen=True)
class Batch:
    """One generation batch, B = P·G rows; rows p·G … p·G+G−1 share a prompt."""

    prompt_ids: torch.Tensor  # [B, Lp] left-padded
    prompt_mask: torch.Tensor  # [B, Lp] bool
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool (after mask_truncated_completions)
    advantages: torch.Tensor  # [B]
    sampling_logps: torch.Tensor  # [B, T] float32: log-probs of the sampled tokens as drawn
    prompts: list[str]  # [B]
    completions: list[str]  # [B]
    rewards: torch.Tensor  # [B]
    # [B, T] bool: the completion tokens attended to (multi-turn: the environment's too); None: the mask
    completion_attention: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        """The tensors on `device` (texts stay as they are; rewards stay on the host for metrics)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if f.name != "rewards" and isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


@dataclass(frozen=True)
class LossParams:
    """`ops.grpo_loss`'s semantic choices, as the config sets them (fields named as its arguments)."""

    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    importance_sampling_level: str
    top_entropy_quantile: float
    use_bias_correction_kl: bool
    max_completion_length: int

    @property
    def global_normaliser(self) -> bool:
        """Whether the loss divides by the whole batch's token count (else a mean per micro-batch)."""
        return LOSS_TYPES[self.loss_type].aggregation == "global_token_mean"


@dataclass(frozen=True)
class StepParams:
    """What one step needs: the config's step (`config.plan.StepSpec`: rewards, filters, clipping,
    reference sync...) with this rank's share of the prompts, the sampling and the loss's arguments."""

    spec: StepSpec
    prompts_per_rank: int  # P on this rank (prompts_per_step / world size): whole groups
    sampling: SamplingParams  # G, lengths, temperature, filters (the seed is set per step)
    loss: LossParams

    @classmethod
    def of(cls, spec: StepSpec, sampling: SamplingParams, world_size: int = 1) -> StepParams:
        """The config's step with its sampling and this rank's share."""
        return cls(
            spec=spec,
            prompts_per_rank=spec.prompts_per_step // world_size,
            sampling=sampling,
            loss=LossParams(**asdict(spec.loss), max_completion_length=sampling.max_completion_length),
        )


@dataclass(frozen=True)
class Update:
    """What applies gradients: the optimizer and its schedule."""

    optimizer: torch.optim.Optimizer
    scheduler: Any


@dataclass(frozen=True)
class StepResult:
    batch: Batch
    metrics: dict[str, Any]


# ----------------------------------------------------------------------------- 1. sample and score


def _pad_cat(tensors: Sequence[torch.Tensor], value: float | bool, left: bool) -> torch.Tensor:
    """Concatenate [n_i, L_i] tensors along rows, padding the width to the largest L."""
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1]), value)
        padded.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(padded, dim=0)


def merge_groups(parts: Sequence[tuple[Batch, list[int]]], G: int, pad_id: int) -> Batch:
    """The chosen groups of several generation batches, as one batch."""
    rows = [[g * G + i for g in groups for i in range(G)] for _, groups in parts]
    pick = [(b, r) for (b, _), r in zip(parts, rows, strict=True) if r]
    if len(pick) == 1 and pick[0][1] == list(range(len(pick[0][0].prompts))):
        return pick[0][0]  # one whole batch (no dynamic sampling): nothing to merge
    return Batch(
        prompt_ids=_pad_cat([b.prompt_ids[r] for b, r in pick], pad_id, left=True),
        prompt_mask=_pad_cat([b.prompt_mask[r] for b, r in pick], False, left=True),
        completion_ids=_pad_cat([b.completion_ids[r] for b, r in pick], pad_id, left=False),
        completion_mask=_pad_cat([b.completion_mask[r] for b, r in pick], False, left=False),
        advantages=torch.cat([b.advantages[r] for b, r in pick]),
        sampling_logps=_pad_cat([b.sampling_logps[r] for b, r in pick], 0.0, left=False),
        prompts=[b.prompts[i] for b, r in pick for i in r],
        completions=[b.completions[i] for b, r in pick for i in r],
        rewards=torch.cat([b.rewards[r] for b, r in pick]),
        completion_attention=None
        if pick[0][0].completion_attention is None
        else _pad_cat([b.completion_attention[r] for b, r in pick], False, left=False),
    )


def generate_and_score(
    engine: PolicyEngine,
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
    G, P = params.sampling.num_generations, params.prompts_per_rank
    informative: list[tuple[Batch, list[int]]] = []
    leftovers: list[tuple[Batch, list[int]]] = []
    metrics: dict[str, Any] = {}
    attempts = params.spec.max_resample_batches if params.spec.dynamic_sampling else 1
    seconds = {"timing/sampling": 0.0, "timing/scoring": 0.0}
    for attempt in range(attempts):
        began = time.perf_counter()
        rows = prompts.next_batch()[d.rank * P : (d.rank + 1) * P]  # every rank reads the same order
        drawn = prompts.last_indices  # [P·world] the rows of every rank (the curriculum's visits)
        tools = engine.environment.tool_schemas if engine.environment is not None else None
        spec = params.spec
        texts = [
            render_prompt(r[spec.prompt_column], engine.tokenizer, tools, spec.chat_template_kwargs)
            for r in rows
        ]
        seed = params.spec.seed * 1_000_003 + step * 101 + attempt + 7919 * d.rank
        # ends on the host: synced (multi-turn episodes start from their rows)
        rollout = engine.generate(texts, replace(params.sampling, seed=seed), rows=rows)
        sampled = time.perf_counter()
        seconds["timing/sampling"] += sampled - began
        mask = rollout.completion_mask  # [B, T]
        if params.spec.mask_truncated_completions:
            mask = mask & ~rollout.truncated[:, None]
        repeated = [r[spec.prompt_column] for r in rows for _ in range(G)]  # [B]: the rows' own prompts
        columns = columns_of(rows, params.spec.prompt_column, repeat=G)
        if rollout.env_rewards is not None:  # multi-turn: what the environment paid (None: nothing)
            columns["env_reward"] = [None if r != r else r for r in rollout.env_rewards.tolist()]
        scores = score_completions(
            reward_funcs,
            repeated,
            rollout.messages or rollout.completions,  # episodes through the chat template: their messages
            columns=columns,
            completion_ids=[
                ids[m].tolist()
                for ids, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
            ],
            weights=params.spec.reward_weights,
            rules=CallRules(params.spec.on_reward_error, params.spec.reward_timeout, should_stop),  # type: ignore[arg-type]
        )
        adv = group_advantages(scores.rewards, G, scale=params.spec.scale_rewards)
        if prompts.curriculum is not None:  # every batch drawn is a visit of its prompts, kept or not
            record_visits(prompts, drawn, scores.rewards, adv.is_std_zero, G, d)
        seconds["timing/scoring"] += time.perf_counter() - sampled
        batch = Batch(
            prompt_ids=rollout.prompt_ids,
            prompt_mask=rollout.prompt_mask,
            completion_ids=rollout.completion_ids,
            completion_mask=mask,
            advantages=adv.advantages,
            sampling_logps=rollout.sampling_logps,
            prompts=repeated,
            completions=rollout.completions,
            rewards=scores.rewards,
            completion_attention=rollout.completion_attention,
        )
        if attempt == 0:  # TRL's metric names, on the first (unfiltered) generation batch
            lengths = rollout.completion_mask.sum(-1).float()  # [B]
            scored = scores.rewards[~scores.rewards.isnan()]  # fewer than two: no spread (NaN)
            metrics |= (
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
        zero = adv.is_std_zero.reshape(-1, G)[:, 0].tolist()  # [B] -> [P, G] -> [P]
        informative.append((batch, [g for g in range(P) if not zero[g] or not params.spec.dynamic_sampling]))
        leftovers.append((batch, [g for g in range(P) if zero[g] and params.spec.dynamic_sampling]))
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


def learns_on_policy(spec: StepSpec, step: int) -> bool:
    """Whether step `step` learns from the student's own samples: always, but with loss_type=gkd only
    with probability lmbda, drawn from (seed, step) alone, so every rank and a resumed run agree."""
    if spec.loss.loss_type != "gkd":
        return True
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + step * 101 + 4_999)
    return bool(torch.rand((), generator=generator) < spec.lmbda)


def offpolicy_batch(trainee: Trainee, step: int, d: distributed.Dist) -> tuple[Batch, dict[str, Any]]:
    """loss_type=gkd's off-policy batch: this rank's P prompts of the step, each with one completion
    that the student did not write: the dataset's answer (answer_column, `rollout.Decoder.demonstrate`),
    or with seq_kd one sample of the teacher's (sequence-level KD, its sampling settings the student's).
    B = P rows, nothing scored (the rewards are NaN, the advantages 0). Its metrics hold no reward or
    completion figures, which would describe the dataset or the teacher rather than the student."""
    began = time.perf_counter()
    engine, params = trainee.engine, trainee.params
    P, spec = params.prompts_per_rank, params.spec
    rows = trainee.prompts.next_batch()[d.rank * P : (d.rank + 1) * P]  # every rank reads the same order
    texts = [
        render_prompt(r[spec.prompt_column], engine.tokenizer, None, spec.chat_template_kwargs) for r in rows
    ]
    if spec.seq_kd:
        assert trainee.teacher is not None
        seed = spec.seed * 1_000_003 + step * 101 + 7919 * d.rank  # as the student's draw of this step
        drawn = replace(params.sampling, num_generations=1, seed=seed)
        demo = trainee.teacher.generate(texts, drawn)  # [P, T] on the host
        answers = demo.completions
    else:
        answers = [demonstration(r, spec.answer_column, spec.answer_format) for r in rows]  # gsm8k: worked
        demo = engine.decoder.demonstrate(texts, answers, params.sampling)
    mask = demo.completion_mask  # [P, T]
    if spec.mask_truncated_completions:
        mask = mask & ~demo.truncated[:, None]
    batch = Batch(
        prompt_ids=demo.prompt_ids,
        prompt_mask=demo.prompt_mask,
        completion_ids=demo.completion_ids,
        completion_mask=mask,
        advantages=torch.zeros(P),
        sampling_logps=demo.sampling_logps,
        prompts=[r[spec.prompt_column] for r in rows],
        completions=answers,
        rewards=torch.full((P,), float("nan")),
    )
    metrics = {
        "num_generation_batches": 0,
        "num_truncated_prompts": demo.num_truncated_prompts,
        "timing/sampling": time.perf_counter() - began,
        "timing/scoring": 0.0,
    }
    return batch, metrics | group_invariants(batch, 1)


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


def group_invariants(batch: Batch, G: int) -> dict[str, float]:
    """What GRPO's groups must satisfy in the batch the update reads (issue 26), checked every step at
    no extra forward: `invariants/groups_intact` is 1.0 when each run of G rows holds one prompt (its
    text and its tokens), and `invariants/group_advantage_sum_max` is the largest |Σ advantages| of a
    group relative to the largest |advantage|: 0 to float32 round-off, as every scaling centres each
    group on its mean."""
    B = len(batch.prompts)
    same_text = all(batch.prompts[i] == batch.prompts[g] for g in range(0, B, G) for i in range(g, g + G))
    ids, mask = batch.prompt_ids.view(B // G, G, -1), batch.prompt_mask.view(B // G, G, -1)  # [P, G, Lp]
    same_ids = bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())
    advantages = batch.advantages.reshape(B // G, -1)  # [P, G] (or [P, G·T] per token)
    scale = max(float(advantages.abs().max()), 1.0)
    return {
        "invariants/groups_intact": float(same_text and same_ids),
        "invariants/group_advantage_sum_max": float(advantages.sum(-1).abs().max()) / scale,
    }


def episode_metrics(rollout: Any) -> dict[str, Any]:
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


# ----------------------------------------------------------------------------- 2. old and reference log-probs


def old_logps_source(engine: PolicyEngine, params: StepParams) -> str:
    """Where the old policy's log-probs come from:

    * "none": μ = 1, so the policy does not move within the step; the loss uses the detached current
      log-probs (ratio exactly 1 in value, the right gradient);
    * "rollout": the sampler's own log-probs of the tokens it drew. Exactly the right quantity when the
      decode loop computes what the training forward computes (`PolicyEngine.sampler_is_forward`: the
      lean Llama loop, one process, no dropout, float32 without autocast or TF32) and the drawn-from
      distribution is the loss's one: softmax(logits / temperature) with no top-k, top-p, min-p or
      repetition penalty reshaping it. Saves a forward pass over the batch;
    * "forward": a no-grad pass of the policy over the batch before the first update, otherwise
      (always with sampling_correction, which weighs exactly that difference).
    """
    if params.spec.num_iterations == 1 or params.loss.loss_type == "gkd":  # (gkd's loss has no ratio)
        return "none"
    if params.spec.sampling_correction != "none":
        return "forward"  # the correction compares the sampler's log-probs with the training forward's
    s = params.sampling
    unfiltered = not s.top_k and s.top_p == 1.0 and not s.min_p and s.repetition_penalty == 1.0
    if unfiltered and engine.sampler_is_forward:
        return "rollout"
    return "forward"


@dataclass(frozen=True)
class FrozenLogps:
    """What the loss compares the policy with, for one generation batch (None where not needed)."""

    old: torch.Tensor | None  # [B, T] log π_old; None when μ = 1 (the detached current log-probs)
    ref: torch.Tensor | None  # [B, T] log π_ref; None when beta = 0
    weights: torch.Tensor | None  # [B, T] or [B, 1] π_old/q (sampling_correction), else None
    teacher: torch.Tensor | None = None  # [B, T] log π_T of the sampled tokens (loss_type=opd), else None
    # loss_type=gkd: the teacher's last hidden states [B, T, H_T] and its head, on the policy's device
    teacher_states: HeadStates | None = None


def frozen_passes(
    engine: PolicyEngine, batch: Batch, params: StepParams, teacher: PolicyEngine | None = None
) -> tuple[FrozenLogps, dict[str, Any]]:
    """Old-policy log-probs (`old_logps_source`), reference log-probs, and with sampling_correction the
    importance weights π_old / q of the sampled tokens (which need π_old even when μ = 1). Returns them
    and the weights' metrics (TRL's names).

    Where the sampler cut its distribution (top-k, top-p, min-p), q is the cut distribution's log-prob
    of each token, so π_old in the weights is the same cut replayed on this forward's logits
    (`PolicyEngine.replayed_logps`): the weights then measure only how the sampler and the training
    forward differ, as they should, and are 1 where they agree. A full-vocabulary π_old over a cut q
    would scale every weight by the kept mass instead (trl#6789). The loss's own ratio π_θ / π_old
    stays on the full distribution, both sides alike."""
    source = old_logps_source(engine, params)
    correcting = params.spec.sampling_correction != "none"
    current = as_sampled = None
    if source == "forward" or correcting:  # π_old: the policy before updating
        micro = params.spec.micro_batch_size
        if truncates(params.sampling):
            replayed = engine.replayed_logps(batch, micro, params.sampling)
            current, as_sampled = replayed.policy, replayed.sampled
        else:
            current = as_sampled = engine.frozen_logps(batch, micro)
    old = batch.sampling_logps if source == "rollout" else current if source == "forward" else None
    ref = None
    if params.loss.beta != 0.0:
        ref = engine.frozen_logps(batch, params.spec.micro_batch_size, reference=True)
    weights, metrics = None, {}
    mask = batch.completion_mask
    if as_sampled is not None:  # the sampler's log-probs against the training forward's, as sampled
        metrics = mismatch_metrics(as_sampled, batch.sampling_logps, mask)
    if correcting:
        assert as_sampled is not None
        low, high = params.spec.sampling_correction_bounds
        weights = sampling_weights(
            as_sampled,
            batch.sampling_logps,
            mask,
            mode=params.spec.sampling_correction,
            clip_min=low,
            clip_max=high,
        )
        diff = (as_sampled - batch.sampling_logps)[mask]  # [N]: log π_old − log q of the counted tokens
        none = diff.new_tensor(float("nan"))  # no counted token: NaN, which rank averaging skips
        metrics |= {  # the ratios before bounds
            "sampling/importance_sampling_ratio/mean": diff.exp().mean() if diff.numel() else none,
            "sampling/importance_sampling_ratio/max": diff.exp().max() if diff.numel() else none,
        }
    teacher_logps = teacher_states = None
    if teacher is not None and params.loss.loss_type == "gkd":  # whole distributions: states and head
        on_teacher = batch.to(teacher.device)
        teacher_states = teacher.frozen_head_states(on_teacher, params.spec.micro_batch_size).to(
            engine.device
        )
    elif teacher is not None:  # loss_type=opd: the teacher's log-probs of the student's tokens
        on_teacher = batch.to(teacher.device)
        teacher_logps = teacher.frozen_logps(on_teacher, params.spec.micro_batch_size).to(engine.device)
    frozen = FrozenLogps(
        old=old, ref=ref, weights=weights, teacher=teacher_logps, teacher_states=teacher_states
    )
    return frozen, metrics


# |log π − log q| above this counts a token as mismatched (its ratio outside about [0.905, 1.105])
MISMATCH_NATS = 0.1


def mismatch_metrics(training: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """How far the sampler's log-probs q [B, T] are from the training forward's log π [B, T] of the same
    tokens (the quantity truncated importance sampling corrects): the mean and largest |log π − log q|
    over the counted tokens, and the share of them above MISMATCH_NATS. NaN with no counted token."""
    diff = (training.detach().float() - sampling.float())[mask].abs()  # [N]
    if not diff.numel():
        nan = float("nan")
        return {f"sampling/sampling_logp_difference/{k}": nan for k in ("mean", "max")} | {
            "sampling/logp_mismatch_share": nan
        }
    return {
        "sampling/sampling_logp_difference/mean": diff.mean(),
        "sampling/sampling_logp_difference/max": diff.max(),
        "sampling/logp_mismatch_share": (diff > MISMATCH_NATS).float().mean(),
    }


# ----------------------------------------------------------------------------- 3. update


class FirstLook:
    """What the first update of a step proves about itself from the log-probs it computes anyway (no
    extra forward; issue 26), as `invariants/*` and `sampling/*` metrics:

    * `invariants/first_ratio_max`: max |π_θ/π_old − 1| over the counted tokens, where old log-probs
      exist (μ > 1). The policy has not moved yet, so it is 1 to round-off: old log-probs from the
      rollout or from a forward of the same weights, either way;
    * `invariants/kl_at_start_max` (step 1 of a run, β ≠ 0): max |log π_θ − log π_ref|. The reference
      is the starting policy, so 0 to round-off; anything else is a stale or different reference;
    * the sampler/training mismatch (`mismatch_metrics`) when no frozen pass measured it and the sampler
      draws from the loss's own distribution (no top-k, top-p, min-p or repetition penalty)."""

    def __init__(self, frozen: FrozenLogps, step: int, mismatch: bool) -> None:
        self.frozen, self.mismatch = frozen, mismatch
        self.kl = step == 1 and frozen.ref is not None
        self.ratio: list[torch.Tensor] = []  # per micro-batch: max |ratio − 1| (0-d, on the device)
        self.gap: list[torch.Tensor] = []  # per micro-batch: max |log π_θ − log π_ref|
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (logps, q, mask)
        self.distill: list[torch.Tensor] = []  # per micro-batch: [Σ log π_S − log π_T, Σ log π_T, count]

    def add(self, logps: torch.Tensor, batch: Batch, rows: slice) -> None:
        """The micro-batch `rows`' training log-probs [b, T]."""
        logps, mask = logps.detach().float(), batch.completion_mask[rows]  # [b, T]
        if self.frozen.old is not None:
            excess = ((logps - self.frozen.old[rows]).exp() - 1.0).abs()  # [b, T]
            self.ratio.append(torch.where(mask, excess, 0.0).amax())
        if self.kl:
            assert self.frozen.ref is not None
            gap = (logps - self.frozen.ref[rows]).abs()  # [b, T]
            self.gap.append(torch.where(mask, gap, 0.0).amax())
        if self.mismatch:
            self.parts.append((logps, batch.sampling_logps[rows], mask))
        if self.frozen.teacher is not None:  # the reverse KL's sample and the teacher's log-prob, summed
            gap = (logps - self.frozen.teacher[rows])[mask]  # [n]
            self.distill.append(
                torch.stack([gap.sum(), self.frozen.teacher[rows][mask].sum(), gap.new_tensor(gap.numel())])
            )

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.ratio:
            out["invariants/first_ratio_max"] = torch.stack(self.ratio).max()
        if self.gap:
            out["invariants/kl_at_start_max"] = torch.stack(self.gap).max()
        if self.parts:
            logps, q, mask = (_pad_cat([p[i] for p in self.parts], 0, left=False) for i in range(3))
            out |= mismatch_metrics(logps, q, mask.bool())
        if self.distill:  # loss_type=opd: the student's reverse KL to the teacher, k1 at the sampled tokens
            gap, teacher, count = torch.stack(self.distill).sum(0)
            out["distill/kl"] = gap / count.clamp(min=1.0)
            out["distill/teacher_logps"] = teacher / count.clamp(min=1.0)
        return out


@dataclass(frozen=True)
class Iteration:
    """What one optimizer step of a step adds to the loss and reports: `look`, on the first update,
    what it proves (`FirstLook`, `invariants/loss_weight_error`); `entropy_coef`, target_entropy's
    bonus coefficient for this step."""

    look: FirstLook | None = None
    entropy_coef: float = 0.0


def policy_loss(
    engine: PolicyEngine,
    batch: Batch,
    rows: slice,
    frozen: FrozenLogps,
    params: StepParams,
    num_items: torch.Tensor,
    entropy_coef: float,
) -> tuple[LossOutput, torch.Tensor]:
    """The GRPO-family loss of the micro-batch `rows` (`ops.grpo_loss`), and the policy's log-probs of
    its tokens [b, T] (for the first update's checks)."""
    stats = engine.logps(batch, rows, entropy=True)  # [b, T]
    advantages = batch.advantages[rows]  # [b]
    if frozen.teacher is not None:  # loss_type=opd: the teacher's reverse KL joins them, per token
        student = stats.logps if frozen.old is None else frozen.old[rows]  # the policy that sampled
        advantages = distillation_advantages(
            advantages,
            student,
            frozen.teacher[rows],
            batch.completion_mask[rows],
            coef=params.spec.distill_coef,
        )  # [b, T]
    out = grpo_loss(
        stats.logps,
        advantages,
        batch.completion_mask[rows],
        old_logps=None if frozen.old is None else frozen.old[rows],
        ref_logps=None if frozen.ref is None else frozen.ref[rows],
        entropies=stats.entropy if entropy_coef else stats.entropy.detach(),  # the bonus's gradient
        sampling_weights=None if frozen.weights is None else frozen.weights[rows],
        num_items_in_batch=num_items,
        entropy_coef=entropy_coef,
        **asdict(params.loss),  # loss_type, beta, epsilon, ...: grpo_loss's own names
    )
    return out, stats.logps


def gkd_loss(
    engine: PolicyEngine,
    batch: Batch,
    rows: slice,
    teacher: HeadStates,
    beta: float,
    num_items: torch.Tensor,
) -> tuple[LossOutput, torch.Tensor]:
    """loss_type=gkd on the micro-batch `rows`: the generalised JSD (β = `beta`) between the student's
    and the teacher's next-token distributions at each counted completion token, at the sampling
    temperature, summed and divided by the count of counted tokens on every rank (`num_items`, as dapo
    normalises). Only the counted positions are formed, a chunk at a time
    (`ops.chunked_generalized_jsd`). Metrics: `distill/divergence` (the per-token divergence),
    `distill/kl` (log π_S − log π_T at the written token, as opd reports it),
    `distill/teacher_logps` and the student's `entropy`, means over the micro-batch's tokens. Also
    returns the student's log-probs of the written tokens [b, T] (0 elsewhere), for the first update's
    checks."""
    mask = batch.completion_mask[rows]  # [b, T]
    student = engine.head_states(batch, rows)  # [b, T, H] and the head (or [b, T, V] logits)
    divergence = chunked_generalized_jsd(
        student.at(mask),  # [n, H]: the counted positions only
        teacher.at(rows).at(mask),
        batch.completion_ids[rows][mask],  # [n]
        beta=beta,
        temperature=engine.temperature,
    )
    assert divergence.student_logps is not None and divergence.teacher_logps is not None
    assert divergence.student_entropy is not None
    loss = divergence.per_token.sum() / torch.as_tensor(num_items).clamp(min=1)
    count = mask.sum().clamp(min=1)
    gap = divergence.student_logps - divergence.teacher_logps  # [n]
    metrics = {
        "distill/divergence": divergence.per_token.detach().sum() / count,
        "distill/kl": gap.sum() / count,
        "distill/teacher_logps": divergence.teacher_logps.sum() / count,
        "entropy": divergence.student_entropy.sum() / count,  # (what entropy_collapse watches)
    }
    logps = torch.zeros(mask.shape, device=mask.device).masked_scatter(mask, divergence.student_logps.float())
    return LossOutput(loss=loss, metrics=metrics), logps


def optimizer_step(
    engine: PolicyEngine,
    update: Update,
    batch: Batch,
    frozen: FrozenLogps,
    params: StepParams,
    d: distributed.Dist,
    this: Iteration | None = None,
) -> dict[str, Any]:
    """One optimizer step over the whole batch, accumulating gradients over micro-batches; `this`:
    what is particular to this iteration of the step (`Iteration`)."""
    look, entropy_coef = (this.look, this.entropy_coef) if this is not None else (None, 0.0)
    B, micro = batch.completion_ids.shape[0], params.spec.micro_batch_size
    n_micro = -(-B // micro)  # (gkd's batch of dataset answers, P rows, may end in a shorter one)
    lp = params.loss
    num_items = distributed.all_reduce_sum(d, batch.completion_mask.sum())  # tokens on all ranks
    scale = distributed.loss_scale(d, global_normaliser=lp.global_normaliser)
    # each micro-batch's loss is weighted so: divided by the micro-batch count unless its normaliser
    # is already the whole batch's, and scaled to undo the averaging of gradients over ranks
    factor = (1.0 if lp.global_normaliser else 1.0 / n_micro) * scale
    update.optimizer.zero_grad(set_to_none=True)
    totals: dict[str, torch.Tensor] = {}
    weight = torch.zeros((), device=batch.completion_mask.device)  # the normaliser's weight in all
    for start in range(0, B, micro):
        rows = slice(start, start + micro)
        if frozen.teacher_states is not None:  # loss_type=gkd: the divergence to the teacher's distributions
            out, logps = gkd_loss(engine, batch, rows, frozen.teacher_states, params.spec.gkd_beta, num_items)
        else:
            out, logps = policy_loss(engine, batch, rows, frozen, params, num_items, entropy_coef)
        (out.loss * factor).backward()
        # the objective is the sum of what was back-propagated (before the rank scale); metrics are
        # micro-batch means, averaged; gkd's are token means, so weighed by the micro-batch's tokens
        # (its last micro-batch may be shorter)
        totals["loss"] = totals.get("loss", 0.0) + out.loss.detach() * factor / scale
        share = 1.0 / n_micro  # (not `weight`: the normaliser's total weight, below)
        if frozen.teacher_states is not None:
            share = batch.completion_mask[rows].sum().double() / batch.completion_mask.sum().clamp(min=1)
        for key, value in out.metrics.items():
            totals[key] = totals.get(key, 0.0) + value * share
        if look is not None:
            look.add(logps, batch, rows)
            weight = (
                weight
                + factor
                * loss_weight(
                    batch.completion_mask[rows],
                    loss_type=lp.loss_type,
                    max_completion_length=lp.max_completion_length,
                    num_items_in_batch=num_items,
                ).cpu()
            )
    if look is not None:
        totals |= look.metrics()
        totals["invariants/loss_weight_error"] = weight - whole_batch_weight(
            batch.completion_mask, lp, num_items
        )
    return totals | optim.apply_update(
        engine.train_module, update.optimizer, update.scheduler, totals["loss"], params.spec.max_grad_norm, d
    )


def whole_batch_weight(mask: torch.Tensor, lp: LossParams, num_items: torch.Tensor) -> torch.Tensor:
    """What the loss's normaliser gives this rank's tokens [B, T] when one process takes the whole
    batch in one micro-batch, as a share of the run's (so averaging over ranks gives the whole). A
    normaliser by the count of every rank's tokens gives them 1 in all: this rank's share is 1 (the
    average over ranks of 1 is 1) when any rank has a token. Means per row or per token of this rank's
    batch average over ranks as they are (ranks hold equal row counts). The loop's sum over micro-batches
    and ranks must equal it: `invariants/loss_weight_error` ≈ 0 whatever the split or world size."""
    if lp.global_normaliser:
        return (num_items > 0).float()
    return loss_weight(mask, loss_type=lp.loss_type, max_completion_length=lp.max_completion_length)


# ----------------------------------------------------------------------------- the step


def synced_clock(device: torch.device) -> float:
    """time.perf_counter() once the device has finished what was queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class EntropyControl:
    """target_entropy: the coefficient c ≥ 0 of an entropy bonus −c·H in the loss, moved after each
    step by `rate` × (target − the step's mean token entropy): it grows while the entropy is below the
    target and shrinks to 0 above it. Saved in every checkpoint (`state_dict`), so a resumed run goes on
    with the same c."""

    target: float
    rate: float
    coef: float = 0.0

    def update(self, entropy: float) -> None:
        self.coef = max(0.0, self.coef + self.rate * (self.target - entropy))

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])


@dataclass(frozen=True)
class Trainee:
    """What the loop trains with: the policy engine, what updates it, the step's parameters and the
    training prompts in order (and target_entropy's control, when set)."""

    engine: PolicyEngine
    update: Update
    params: StepParams
    prompts: PromptSampler
    entropy: EntropyControl | None = None
    teacher: PolicyEngine | None = None  # loss_type=opd: the teacher, scoring only


class OutOfDeviceMemory(RuntimeError):  # noqa: N818 - named as torch's OutOfMemoryError
    """The device ran out of memory during a step (torch.OutOfMemoryError), and how far the step got
    (`progress`: the phase, "sampling", "reference" for the frozen passes or "update"; the optimizer
    updates applied, 0 meaning the weights and optimizer are as after the step before; the scored batch
    once drawn, from which the step can be redone without sampling again)."""

    def __init__(self, message: str, progress: StepProgress) -> None:
        super().__init__(message)
        self.progress = progress

    @property
    def phase(self) -> str:
        return self.progress.phase

    @property
    def updates(self) -> int:
        return self.progress.updates


@dataclass
class StepProgress:
    """How far a step got (see OutOfDeviceMemory). `drawn`: the scored batch on the host, its metrics
    and the random state right after drawing it; given to `grpo_step`, the step starts from it."""

    phase: str = "sampling"
    updates: int = 0
    drawn: tuple[Batch, dict[str, Any], dict[str, Any]] | None = None


def grpo_step(
    trainee: Trainee,
    reward_funcs: Sequence[Callable[..., Any]],
    step: int,
    d: distributed.Dist | None = None,
    should_stop: Callable[[], bool] | None = None,
    redo: StepProgress | None = None,
) -> StepResult:
    """Sample G completions for each of P prompts, score them, group-relative advantages, then μ
    optimizer steps on the batch; the reference moves toward the policy when its sync is due.
    `should_stop` (a stop signal) is looked at while reward functions run: True abandons the step
    with `ScoringStopped`, the weights and optimizer untouched (scoring precedes every update).
    Running out of device memory raises `OutOfDeviceMemory` once the step's tensors are released;
    `redo` (its progress, with the scored batch) redoes that step from the batch, the random state
    put back as it was after drawing it (the prompt sampler is where the draw left it)."""
    progress = StepProgress(drawn=redo.drawn if redo is not None else None)
    if progress.drawn is not None:
        set_rng_state(progress.drawn[2])
    try:
        return _grpo_step(trainee, reward_funcs, step, d or distributed.Dist(), should_stop, progress)
    except torch.OutOfMemoryError as error:  # (raised below, once the frames holding tensors are gone)
        message = first_line(error)
        applying = _in_optimizer_step(error)
    trainee.update.optimizer.zero_grad(set_to_none=True)  # the micro-batches' partial gradients
    progress.updates += applying  # inside the optimizer's step the weights may be half updated
    raise OutOfDeviceMemory(message, progress)


def first_line(error: BaseException) -> str:
    """The first line of an out-of-memory error (torch adds lines of allocator advice after it)."""
    return (str(error).strip().splitlines() or ["out of memory"])[0]


def _in_optimizer_step(error: BaseException) -> bool:
    """Whether `error` was raised inside the optimizer's update (`optim.apply_update`)."""
    return any(
        frame.f_code.co_name == optim.apply_update.__name__
        for frame, _ in traceback.walk_tb(error.__traceback__)
    )


def _grpo_step(
    trainee: Trainee,
    reward_funcs: Sequence[Callable[..., Any]],
    step: int,
    d: distributed.Dist,
    should_stop: Callable[[], bool] | None,
    progress: StepProgress,
) -> StepResult:
    engine, update, params = trainee.engine, trainee.update, trainee.params
    if not engine.train_module.training:  # (a walk over every module: only when needed)
        engine.train_module.train()
    prompts = trainee.prompts
    on_policy = learns_on_policy(params.spec, step)  # (gkd: on the dataset's answers otherwise)
    if progress.drawn is not None:  # a redo: the batch already drawn and scored
        host_batch, metrics = progress.drawn[0], dict(progress.drawn[1])
    elif on_policy:
        host_batch, metrics = generate_and_score(engine, prompts, reward_funcs, params, step, d, should_stop)
    else:
        host_batch, metrics = offpolicy_batch(trainee, step, d)
    progress.drawn = (host_batch, dict(metrics), rng_state())
    if params.loss.loss_type == "gkd":
        metrics["distill/on_policy"] = float(on_policy)
    began = time.perf_counter()
    progress.phase = "reference"
    batch = host_batch.to(engine.device)
    frozen, correction_metrics = frozen_passes(engine, batch, params, trainee.teacher)
    metrics |= correction_metrics
    frozen_done = synced_clock(engine.device)
    skipped = rolled_back = 0.0
    s = params.sampling
    unfiltered = not truncates(s) and s.repetition_penalty == 1.0
    measured = "sampling/sampling_logp_difference/mean" in metrics  # by a frozen pass
    look = FirstLook(frozen, step, mismatch=unfiltered and not measured and on_policy)
    control = trainee.entropy
    coef = control.coef if control is not None else 0.0
    progress.phase = "update"
    for iteration in range(params.spec.num_iterations):
        this = Iteration(look if iteration == 0 else None, entropy_coef=coef)
        metrics |= optimizer_step(engine, update, batch, frozen, params, d, this)
        progress.updates += 1
        skipped += metrics["skipped_update"]
        rolled_back += metrics["update_rolled_back"]
    if control is not None:  # the same coefficient on every rank: from the ranks' mean entropy
        entropy = distributed.all_reduce_sum(d, torch.as_tensor(metrics["entropy"], dtype=torch.float32))
        control.update(float(entropy) / d.world_size)
        metrics |= {"entropy/coef": coef, "entropy/target": control.target}
    metrics["skipped_update"] = skipped  # updates of this step skipped (non-finite loss, or weights)
    metrics["update_rolled_back"] = rolled_back  # of which applied, found to destroy weights, undone
    # wall-clock seconds of each phase (a GPU is synchronised at the boundaries, so that queued work is
    # counted in its own phase); veRL's timing_s/* in TRL's slash style
    metrics["timing/reference"] = frozen_done - began  # old-policy and reference log-probs
    metrics["timing/update"] = synced_clock(engine.device) - frozen_done
    if (
        params.spec.reference_sync
        and engine.reference is not None
        and should_sync(step, params.spec.reference_sync[0])
    ):
        sync_reference(engine.reference, engine.module, params.spec.reference_sync[1])
    return StepResult(batch=host_batch, metrics=metrics)
