"""Where a run's step batches come from: `open_batch_source` opens the run's `trainee.BatchSource`,
drawn in process (`InProcess`, here) or by the asynchronous rollout (max_staleness:
train/async_rollout.py). This file is the one place that looks at which; nothing else asks."""

from __future__ import annotations

from pathlib import Path

from ..config.plan import RolloutSpec
from ..config.specs import EngineSpec
from .async_rollout import AsyncRollout
from .checkpoint import rng_state
from .distill import draw_distillation_batch
from .distributed import Dist
from .draw import generate_and_score
from .inputs import RunData
from .trainee import BatchSource, DrawnBatch, RewardFuncs, StopCheck, Trainee


class InProcess(BatchSource):
    """The synchronous loop's source: each step draws its batch itself, with the policy it trains: the
    student's own completions, scored (`draw.generate_and_score`), or for a loss that learns from
    demonstrations, the step's choice (`distill.draw_distillation_batch`). Nothing to start, save or
    close."""

    def draw(self, step: int, trainee: Trainee, rewards: RewardFuncs, d: Dist, stop: StopCheck) -> DrawnBatch:
        if trainee.params.loss.variant.demonstrations:
            batch, metrics, on_policy = draw_distillation_batch(trainee, rewards, step, d, stop)
        else:
            engine, prompts, params = trainee.engine, trainee.prompts, trainee.params
            batch, metrics = generate_and_score(engine, prompts, rewards, params, step, d, stop)
            on_policy = True
        return DrawnBatch(batch, metrics, on_policy, rng_state())


def open_batch_source(
    spec: RolloutSpec,
    output_dir: Path,
    d: Dist,
    data: RunData,
    engine: EngineSpec,
    spawn: tuple[str, ...] | None,
) -> BatchSource:
    """The run's source: in process, or with max_staleness the asynchronous rollout, its worker
    processes spawned now when `spawn` (the modules they import first) is given: their imports then
    overlap the loading and warm start."""
    if spec.max_staleness is None:
        return InProcess()
    source = AsyncRollout(spec, output_dir, d, data, engine)
    if spawn is not None:
        source.spawn(spawn)
    return source
