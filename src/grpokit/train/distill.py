"""Distillation's part of a step (loss types with a teacher: opd, gkd, and gkd's seq_kd), plugged
into the same step as GRPO's (`grpo_step.grpo_step`): which batch a step learns from, what the
teacher says about it, and the divergence loss. Which piece applies is read from the loss table
(`ops.loss_types.LossVariant`: `teacher`, `demonstrations`), never from the loss type's name."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..config.plan import StepSpec
from ..data import demonstration
from ..engine import PolicyEngine
from ..ops import HeadStates, LossOutput, chunked_generalized_jsd
from . import distributed
from .batch import Batch, group_invariants
from .draw import generate_and_score, step_prompts, step_seed
from .trainee import StepParams, Trainee


def learns_on_policy(spec: StepSpec, step: int) -> bool:
    """Whether step `step` learns from the student's own samples: always, but with a loss that learns
    from demonstrations (gkd) only with probability lmbda, drawn from (seed, step) alone, so every
    rank and a resumed run agree."""
    if not spec.loss.variant.demonstrations:
        return True
    generator = torch.Generator().manual_seed(step_seed(spec.seed, step, attempt=4_999))
    return bool(torch.rand((), generator=generator) < spec.lmbda)


def draw_distillation_batch(
    trainee: Trainee,
    reward_funcs: Sequence[Callable[..., Any]],
    step: int,
    d: distributed.Dist,
    should_stop: Callable[[], bool] | None,
) -> tuple[Batch, dict[str, Any], bool]:
    """The batch of a step of a loss that learns from demonstrations: the student's own samples, scored
    (as GRPO draws them), or `demonstration_batch`; its metrics (`distill/on_policy`: which), and
    whether it is on-policy."""
    on_policy = learns_on_policy(trainee.params.spec, step)
    if on_policy:
        engine, prompts, params = trainee.engine, trainee.prompts, trainee.params
        batch, metrics = generate_and_score(engine, prompts, reward_funcs, params, step, d, should_stop)
    else:
        batch, metrics = demonstration_batch(trainee, step, d)
    return batch, metrics | {"distill/on_policy": float(on_policy)}, on_policy


def demonstration_batch(trainee: Trainee, step: int, d: distributed.Dist) -> tuple[Batch, dict[str, Any]]:
    """gkd's off-policy batch: this rank's P prompts of the step, each with one completion that the
    student did not write: the dataset's answer (answer_column, `rollout.Decoder.demonstrate`), or
    with seq_kd one sample of the teacher's (sequence-level KD, its sampling settings the student's).
    B = P rows, nothing scored (the rewards are NaN, the advantages 0). Its metrics hold no reward or
    completion figures, which would describe the dataset or the teacher rather than the student."""
    began = time.perf_counter()
    engine, params = trainee.engine, trainee.params
    P, spec = params.prompts_per_rank, params.spec
    drawn = step_prompts(trainee.prompts, P, d, engine, spec, tools=False)
    if spec.seq_kd:
        assert trainee.teacher is not None
        seed = step_seed(spec.seed, step, rank=d.rank)  # as the student's draw of this step
        demo = trainee.teacher.generate(drawn.texts, replace(params.sampling, num_generations=1, seed=seed))
        answers = demo.completions  # [P]
    else:  # gsm8k: worked solutions
        answers = [demonstration(r, spec.answer_column, spec.answer_format) for r in drawn.rows]
        demo = engine.decoder.demonstrate(drawn.texts, answers, params.sampling)
    batch = Batch.from_rollout(
        demo,
        mask_truncated=spec.mask_truncated_completions,
        advantages=torch.zeros(P),
        rewards=torch.full((P,), float("nan")),
        prompts=drawn.repeat(spec.prompt_column, 1),
        completions=answers,
    )
    metrics = {
        "num_generation_batches": 0,
        "num_truncated_prompts": demo.num_truncated_prompts,
        "timing/sampling": time.perf_counter() - began,
        "timing/scoring": 0.0,
    }
    return batch, metrics | group_invariants(batch, 1)


def teacher_pass(
    teacher: PolicyEngine | None, engine: PolicyEngine, batch: Batch, params: StepParams
) -> tuple[torch.Tensor | None, HeadStates | None]:
    """What the loss reads of the teacher (`LossVariant.teacher`), on the policy's device, no gradient:
    its log-probs of the batch's tokens [B, T] ("logps"), or its last hidden states and head over the
    batch ("distributions"). (None, None) without a teacher."""
    if teacher is None:
        return None, None
    on_teacher, micro = batch.to(teacher.device), params.spec.micro_batch_size
    if params.loss.variant.teacher == "distributions":
        return None, teacher.frozen_head_states(on_teacher, micro).to(engine.device)
    return teacher.frozen_logps(on_teacher, micro).to(engine.device), None


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
