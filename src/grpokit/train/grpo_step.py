"""One GRPO step, on tensors: draw prompts -> generate and score -> advantages -> log-probs before the
update -> μ optimizer updates -> metrics, in `grpo_step`, top to bottom. Its pieces live beside it:
train/draw.py (prompts, generation, rewards, advantages), train/before_update.py (old, reference and
sampler log-probs), train/update.py (the loss and one optimizer step), train/distill.py (what a loss
with a teacher adds: its batches, the teacher's pass, the divergence loss). Everything the step needs
from the config is in `trainee.StepParams`, built once.

Deliberate choices, where TRL differs or is silent:
* one generation batch per step, consumed by num_iterations (μ) optimizer steps;
* old-policy log-probs exist only when μ > 1 (with μ = 1 the ratio is 1 by construction, and the loss
  uses the detached current log-probs); they are the sampler's own when that is exactly the right
  quantity (`before_update.old_logps_source`), else a no-grad pass;
* loss normalisers are right across micro-batches and ranks: dapo/cispo/vespo divide by the token
  count of the whole batch on every rank (num_items_in_batch), the per-batch means (grpo, bnpo,
  dr_grpo, luspo, sapo) are averaged over the micro-batches;
* every sampling seed derives from (seed, step, attempt, rank) (`draw.step_seed`), so a resumed run
  draws exactly what an uninterrupted one would;
* DAPO dynamic sampling is bounded (max_resample_batches) and reports how many batches it drew.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import PolicyEngine, truncates
from ..models import should_sync, sync_reference
from . import distributed
from .batch import Batch
from .before_update import logps_before_update
from .trainee import Phase, StepProgress, Trainee
from .update import FirstUpdateChecks, UpdateOptions, optimizer_step


@dataclass(frozen=True)
class StepResult:
    batch: Batch  # on the host
    metrics: dict[str, Any]


def grpo_step(
    trainee: Trainee,
    reward_funcs: Sequence[Callable[..., Any]],
    step: int,
    d: distributed.Dist,
    should_stop: Callable[[], bool] | None,
    progress: StepProgress,
) -> StepResult:
    """Step `step`: draw this rank's prompts, sample G completions of each, score them, group-relative
    advantages; the log-probs the loss compares with; μ optimizer steps on the batch; the reference
    moves toward the policy when its sync is due. `progress` records how far it got (a step redone
    after running out of memory starts from `progress.drawn`)."""
    engine, update, params = trainee.engine, trainee.update, trainee.params
    if not engine.train_module.training:  # (a walk over every module: only when needed)
        engine.train_module.train()
    # 1. prompts -> completions -> rewards -> advantages, on the host, from the run's batch source
    #    (train/batch_source.py: drawn here, or by the asynchronous rollout); scoring precedes every update
    if progress.drawn is None:
        progress.drawn = trainee.source.draw(step, trainee, reward_funcs, d, should_stop)
    drawn, metrics = progress.drawn, dict(progress.drawn.metrics)
    # 2. what the loss compares the policy with: old policy, reference, sampler weights, teacher
    began, progress.phase = time.perf_counter(), Phase.REFERENCE
    batch = drawn.batch.to(engine.device)
    before, before_metrics = logps_before_update(engine, batch, params, trainee.teacher)
    metrics |= before_metrics
    before_done = synced_clock(engine.device)
    # 3. μ optimizer steps on the batch; the first proves what it can about itself
    progress.phase = Phase.UPDATE
    s = params.sampling
    unfiltered = not truncates(s) and s.repetition_penalty == 1.0
    measured = "sampling/sampling_logp_difference/mean" in metrics  # by a pass before the update
    checks = FirstUpdateChecks(before, step, mismatch=unfiltered and not measured and drawn.on_policy)
    coef = trainee.entropy.applied if trainee.entropy is not None else 0.0
    skipped = rolled_back = 0.0
    for iteration in range(params.spec.num_iterations):
        this = UpdateOptions(checks if iteration == 0 else None, entropy_coef=coef, progress=progress)
        metrics |= optimizer_step(engine, update, batch, before, params, d, this)
        skipped += metrics["skipped_update"]
        rolled_back += metrics["update_rolled_back"]
    # 4. the step's figures; target_entropy's next coefficient; the reference's sync
    if trainee.entropy is not None:  # the same coefficient on every rank: from the ranks' mean entropy
        entropy = distributed.all_reduce_sum(d, torch.as_tensor(metrics["entropy"], dtype=torch.float32))
        trainee.entropy.update(float(entropy) / d.world_size)
        metrics |= {"entropy/coef": coef, "entropy/next_coef": trainee.entropy.coef}
        if trainee.entropy.spec.target is not None:
            metrics["entropy/target"] = trainee.entropy.spec.target
    metrics["skipped_update"] = skipped  # updates of this step skipped (non-finite loss, or weights)
    metrics["update_rolled_back"] = rolled_back  # of which applied, found to destroy weights, undone
    # wall-clock seconds of each phase (a GPU is synchronised at the boundaries, so that queued work is
    # counted in its own phase); veRL's timing_s/* in TRL's slash style
    metrics["timing/reference"] = before_done - began  # old-policy and reference log-probs
    metrics["timing/update"] = synced_clock(engine.device) - before_done
    if engine.compiled is not None:  # torch_compile: the graphs compiled so far (bounded by the buckets)
        metrics["compile/graphs"] = engine.compiled.graph_count
    sync_reference_if_due(engine, params.spec.reference_sync, step)
    return StepResult(batch=drawn.batch, metrics=metrics)


def sync_reference_if_due(engine: PolicyEngine, sync: tuple[int, float] | None, step: int) -> None:
    """sync_ref_model: every N steps the reference moves toward the policy (mixup α)."""
    if sync and engine.reference is not None and should_sync(step, sync[0]):
        sync_reference(engine.reference, engine.module, sync[1])


def synced_clock(device: torch.device) -> float:
    """time.perf_counter() once the device has finished what was queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ----------------------------------------------------------------------------- out of memory


class OutOfDeviceMemory(RuntimeError):  # noqa: N818 - named as torch's OutOfMemoryError
    """The device ran out of memory during a step (torch.OutOfMemoryError), and how far the step got
    (`progress`: the `Phase`, sampling, the passes before the update (reference) or the update; the
    optimizer updates applied, 0 meaning the weights and optimizer are as after the step before; the
    scored batch once drawn, from which the step can be redone without sampling again)."""

    def __init__(self, message: str, progress: StepProgress) -> None:
        super().__init__(message)
        self.progress = progress

    @property
    def phase(self) -> Phase:
        return self.progress.phase

    @property
    def updates(self) -> int:
        return self.progress.updates


def first_line(error: BaseException) -> str:
    """The first line of an out-of-memory error (torch adds lines of allocator advice after it)."""
    return (str(error).strip().splitlines() or ["out of memory"])[0]
