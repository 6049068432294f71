"""When a step cannot finish: redone with a smaller micro-batch (auto_find_batch_size), dropped after
running out of device memory (what to change, where the run stands), or refused when the skip guard
would save weights that are not finite."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config.plan import RunControl
from ..models import release_cached_memory
from ..rewards.scoring import ScoringStopped
from . import distributed
from .checkpoint import list_checkpoints, rng_state, set_rng_state
from .events import Emit as OnEvent
from .grpo_step import OutOfDeviceMemory, StepResult, first_line, grpo_step
from .metrics import warn
from .optim import weights_finite
from .run import Run, TooManySkips
from .rundir import CHECKPOINT_PREFIX
from .trainee import Phase, StepParams, StepProgress, Trainee


def forget_starting_evaluation(output_dir: Path, d: distributed.Dist) -> None:
    """A run that stops before its first step has written only its starting evaluation, not worth a
    resume: removed, so that the same command starts over (an earlier run's files would refuse it)."""
    if d.is_main:
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(output_dir / "tensorboard", ignore_errors=True)


def step_within_memory(
    trainee: Trainee,
    reward_funcs: Sequence[Callable[..., Any]],
    step: int,
    d: distributed.Dist,
    should_stop: Callable[[], bool] | None,
    control: RunControl,
    on_event: OnEvent | None,
) -> tuple[StepResult | ScoringStopped | OutOfDeviceMemory, Trainee]:
    """Step `step` (`grpo_step.grpo_step`), and the trainee it ran with. A step abandoned (a stop signal
    while a reward function ran: `ScoringStopped`, the weights and optimizer untouched; or the device
    out of memory: `OutOfDeviceMemory`, once the step's tensors are released) has put back the RNG and
    prompt position of before it and returns its exception; with auto_find_batch_size, a step that ran
    out of memory in its reference pass or update before any of its updates is redone from the batch it
    drew and scored (the RNG as right after drawing it), with the micro-batch halved (to a divisor of
    the rows), until it fits or is 1 (one process: ranks could not agree on a redo)."""
    before = (rng_state(), trainee.prompts.state_dict())  # what the step drew from, beyond the weights
    progress = StepProgress()
    while True:
        try:
            return grpo_step(trainee, reward_funcs, step, d, should_stop, progress), trainee
        except ScoringStopped as stopped:
            abandoned: ScoringStopped | OutOfDeviceMemory = stopped
        except torch.OutOfMemoryError as error:  # (said below, once the frames holding tensors are gone)
            abandoned = OutOfDeviceMemory(first_line(error), progress)
        if isinstance(abandoned, OutOfDeviceMemory):
            trainee.update.optimizer.zero_grad(set_to_none=True)  # the micro-batches' partial gradients
            if progress.phase == Phase.OPTIMIZER:  # inside the optimizer's step: maybe half updated
                progress.phase, progress.updates = Phase.UPDATE, progress.updates + 1
        spec = trainee.params.spec
        smaller = smaller_micro_batch(trainee.params)
        if not (
            isinstance(abandoned, OutOfDeviceMemory)
            and control.auto_find_batch_size
            and abandoned.phase != Phase.SAMPLING
            and abandoned.updates == 0
            and d.world_size == 1
            and smaller < spec.micro_batch_size
        ):
            set_rng_state(before[0])
            trainee.prompts.load_state_dict(before[1])
            return abandoned, trainee
        warn(
            on_event,
            step,
            f"out of device memory in step {step} at micro_batch_size={spec.micro_batch_size}: the step is "
            f"redone from the completions it drew, with micro_batch_size={smaller} (auto_find_batch_size)",
        )
        release_cached_memory(d.device)
        progress = StepProgress(drawn=progress.drawn)
        assert progress.drawn is not None  # (an update ran out of memory: the batch was drawn)
        set_rng_state(progress.drawn.rng)
        trainee = replace(
            trainee, params=replace(trainee.params, spec=replace(spec, micro_batch_size=smaller))
        )


def smaller_micro_batch(params: StepParams) -> int:
    """The largest micro-batch size up to half of `params`', dividing the rows of a step on this rank."""
    rows = params.prompts_per_rank * params.sampling.num_generations
    half = max(1, params.spec.micro_batch_size // 2)
    return max(k for k in range(1, half + 1) if rows % k == 0)


def out_of_memory(
    run: Run,
    step: int,
    oom: OutOfDeviceMemory,
    checkpoint: Callable[[int], None],
    params: StepParams,
    checkpointing: bool,
) -> OutOfDeviceMemory:
    """The device ran out of memory in step `step`: the step is dropped as `grpo.abandoned` drops one (the
    loop has put back the RNG and prompt position) and, when none of its updates had been applied and
    this is the only process, the state after step `step` − 1 is saved, so that resume=true with a
    setting that needs less memory redoes step `step`. -> the error to raise: one line naming the
    phase, what to change and where the run stands."""
    output_dir, d = Path(run.output_dir), run.d
    if oom.phase == Phase.SAMPLING:  # every row's KV cache and the decode step's [B, V] buffers
        rows = params.spec.prompts_per_step * params.sampling.num_generations
        change = (
            f"sampling holds all {rows} rows at once (prompts_per_step × num_generations) with "
            "max_completion_length tokens each: lower either (in a new run: both fix the batch geometry)"
        )
    else:
        micro, smaller = params.spec.micro_batch_size, smaller_micro_batch(params)  # as the step ran
        options = [f"micro_batch_size={smaller}"] if smaller < micro else []
        if not checkpointing:
            options.append("gradient_checkpointing=true")
        if options and not run.control.auto_find_batch_size and d.world_size == 1:
            options.append("auto_find_batch_size=true")
        change = (
            " or ".join(options) + " (each applies on resume)"
            if options
            else "a shorter max_completion_length, LoRA (use_peft=true) or more devices (strategy=fsdp), "
            "in a new run (they fix the run's shape)"
        )
        if run.control.auto_find_batch_size and d.world_size > 1:
            change += "; auto_find_batch_size redoes steps in one process only"
    saved = list_checkpoints(output_dir)
    if oom.updates or d.world_size > 1:  # weights moved in this step, or other ranks hold their part
        where = (
            f"{saved[-1].name} is the latest checkpoint: resume=true continues from it"
            if saved
            else "no checkpoint was saved yet: overwrite=true starts the run over"
        )
    elif step - 1 == 0:
        forget_starting_evaluation(output_dir, d)
        where = "no step had finished: the same command starts over"
    else:
        if output_dir / f"{CHECKPOINT_PREFIX}{step - 1}" not in saved:
            checkpoint(step - 1)
        where = f"{CHECKPOINT_PREFIX}{step - 1} holds the run up to step {step - 1}: resume=true continues it"
    phase = oom.phase.said
    return OutOfDeviceMemory(
        f"out of device memory in {phase} of step {step} ({oom}); set {change}. {where}. "
        "`grpokit doctor` forecasts a step's peak memory for a device (--gpu-memory).",
        oom.progress,
    )


def refuse_destroyed_weights(module: Any, d: distributed.Dist, skips: int, step: int) -> None:
    """Before the skip guard saves "the last good weights" and stops: if the weights are not finite
    (updates are rolled back when they would make them so, so they came in that way: from the model or
    checkpoint the run started from, or a diverged warm start), no checkpoint is written that would be
    named good; TooManySkips says so instead."""
    if not distributed.any_rank(d, not weights_finite(list(module.parameters()))):
        return
    raise TooManySkips(
        f"{skips} consecutive updates were skipped (the last at step {step}) and the policy's weights "
        "themselves are not finite, so no checkpoint holds good weights to stop at: they were not finite "
        "before these updates (the starting model or checkpoint, or the warm start, diverged). Start from "
        "a finite model or an earlier checkpoint (resume from one by deleting the later ones), or lower "
        "sft_learning_rate if the warm start diverged."
    )


def evaluation_out_of_memory(step: int, error: str) -> OutOfDeviceMemory:
    """The evaluation after step `step` ran out of device memory: the step was saved first."""
    return OutOfDeviceMemory(
        f"out of device memory in the evaluation after step {step} ({error}); "
        f"{CHECKPOINT_PREFIX}{step} holds the run: resume=true with a smaller micro_batch_size "
        "(evaluation samples that many rows a call) continues it",
        StepProgress(phase=Phase.EVALUATION),
    )
