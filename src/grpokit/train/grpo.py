"""The GRPO training loop, top to bottom.

Set-up (train/grpo_setup.py): resolve the data, load or build the policy on its device, an optional
supervised warm start, then the policy engine, optimizer and step parameters. Then, every step
(train/grpo_step.py): sample G completions for each of P prompts -> score -> group-relative
advantages -> old and reference log-probs -> μ optimizer steps; and here: report, warn, evaluate,
save. A run can stop at any step (SIGINT/SIGTERM) with a checkpoint, and resume exactly.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import GRPOConfig
from ..config.applied import Preset, applied
from ..config.plan import GRPOPlan, RunControl, grpo_plan
from ..config.resume import resume_changes
from ..data import solution_column
from ..models import ModelShape, check_lora_targets, memory_metrics, release_cached_memory, require_peft
from ..rewards import reward_names
from ..rewards.scoring import ScoringStopped
from . import distributed
from .alerts import AlertWatch
from .checkpoint import SaveTo, list_checkpoints, rng_state, set_rng_state
from .events import EventKind
from .grpo_setup import (
    Given,
    Hooks,
    build_trainee,
    check_context,
    check_gkd_answers,
    check_same_vocabulary,
    check_step_prompts,
    evaluator,
    load_teacher,
    place_policy,
    precision_of,
    probe_engine,
    resolve_data,
    restore,
    save,
    teacher_refusal,
    teacher_shape,
    tiny_context,
    warm_start,
)
from .grpo_step import (
    OutOfDeviceMemory,
    StepParams,
    StepProgress,
    StepResult,
    Trainee,
    first_line,
    grpo_step,
)
from .hub_push import check_push, push_final
from .memory_check import check_step_memory
from .metrics import InvariantWatch, check_reporters, warn
from .optim import weights_finite
from .run import (
    Emit,
    Run,
    RunResult,
    Starting,
    StopSignals,
    TooManySkips,
    add_lora,
    check_known_characters,
    latest_checkpoint,
    policy_and_tokenizer,
    prepare_output_dir,
    seed_everything,
)
from .rundir import CHECKPOINT_PREFIX, claim_output_dir, exclusive_output_dir
from .threads import ThreadGovernor


@dataclass(frozen=True)
class TrainResult(RunResult):
    phase: str = "grpo"  # where it ended: "grpo", or before any checkpoint: "set-up", "warm start"


def _stopped_early(emit: Emit, stop: StopSignals, output_dir: Path, phase: str) -> TrainResult:
    """A signal arrived before the first GRPO step: nothing to checkpoint, the same command starts over."""
    signal = stop.signal or "a signal on another rank"
    emit(EventKind.STOPPED, 0, {"signal": signal, "phase": phase, "output_dir": str(output_dir)})
    return TrainResult(output_dir, 0, {}, {}, stopped_by=stop.signal or "SIGTERM", phase=phase)


def train_grpo(
    cfg: GRPOConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    reward_funcs: Sequence[Callable[..., Any]] | None = None,
    train_rows: Sequence[dict[str, Any]] | None = None,
    eval_rows: Sequence[dict[str, Any]] | None = None,
    is_correct: Callable[[str, dict[str, Any]], bool] | None = None,
    on_event: Callable[[str, int, dict[str, Any]], None] | None = None,
    environment: Any = None,
    preset: Preset | None = None,
) -> TrainResult:
    """Run GRPO as configured. Anything not given comes from the config (task, dataset, model).
    `environment`: an `envs.EnvironmentSpec` (multi-turn episodes), in place of the config's tools or
    environment. `preset`: the built-in preset `cfg` was loaded from (config.yaml names it).

    SIGINT and SIGTERM never cut a run short silently: during the warm start it stops after the
    current supervised step and says so (no checkpoint exists yet; the same command starts again);
    during GRPO it finishes the current update, saves a checkpoint and says how to resume.

    The run holds `cfg.output_dir` exclusively from its first look at it until it returns or raises
    (rundir.py): a second run into the same directory meanwhile is refused."""
    plan = grpo_plan(cfg, preset, model_given=model is not None)  # resolved once: nothing below reads `cfg`
    given = Given(model, tokenizer, train_rows, eval_rows, reward_funcs, is_correct, environment)
    values = applied(cfg, preset, model_given=model is not None).config  # what the run applies
    compare = lambda saved: resume_changes(values, saved)  # noqa: E731 - a checkpoint's config.yaml vs this
    placement = plan.trainee.placement
    d = distributed.init(placement.device)  # (joins the process group once; _train_grpo gets the same)
    with (
        StopSignals() as stop,
        exclusive_output_dir(d, Path(plan.run.output_dir)),
        ThreadGovernor.start(placement.num_threads, d.device) as threads,  # CPU threads, for the whole run
    ):
        emit: Emit = (on_event if d.is_main else None) or (lambda kind, step, data: None)  # rank 0 reports
        return _train_grpo(plan, given, Hooks(emit, stop, threads), on_event, compare)


def _train_grpo(  # noqa: C901 - the loop is deliberately one function that reads top to bottom
    plan: GRPOPlan,
    given: Given,
    hooks: Hooks,
    on_event: Callable[[str, int, dict[str, Any]], None] | None,
    compare: Callable[[Path], list[str]],
) -> TrainResult:
    # ------------------------------------------------------------------ set-up: validate before any work
    spec, control = plan.trainee, plan.run
    emit, stop, threads = hooks.emit, hooks.stop, hooks.threads
    # this rank's device: the config's, or cuda:LOCAL_RANK under torchrun
    d = distributed.init(spec.placement.device)
    prompts_per_step = spec.step.prompts_per_step
    if prompts_per_step % d.world_size != 0:
        raise ValueError(
            f"prompts_per_step={prompts_per_step} must be divisible by the world size {d.world_size}: "
            "each rank samples complete groups of its own prompts."
        )
    check_reporters(list(control.report_to))  # a missing tensorboard / wandb is said before any work
    check_push(control)  # push_to_hub while offline: said now, not after the run
    if plan.lora is not None:
        require_peft()
    output_dir = Path(control.output_dir)
    replacing = claim_output_dir(output_dir, resume=control.resume, overwrite=control.overwrite)
    data = resolve_data(plan.data, plan.episodes, plan.rewards, given, device=d.device)
    seed_everything(plan.seed)
    model, tokenizer = given.model, given.tokenizer
    if model is None:
        context = tiny_context(plan.data.prompt_column, data)  # (a model loaded from a directory has its own)
        model, tokenizer = policy_and_tokenizer(plan.model, data.alphabet, context)
    columns = plan.data.prompt_column, plan.data.answer_column
    check_context(columns[0], model, tokenizer, data)
    if data.environment is not None:  # a chat template that cannot continue episodes: said before any work
        data.environment.chat_turns(tokenizer)
    check_known_characters(  # a character tokenizer would read an unknown character as <unk>
        tokenizer,
        plan.model.name,
        [(data.train_source, data.train_rows), (data.eval_source, data.eval_rows)],
        [*columns, solution_column(columns[1])] if plan.warm_start.schedule.steps else [columns[0]],
    )
    check_step_prompts(prompts_per_step, data)  # enough rows for one step's distinct prompts
    check_step_memory(plan, model, tokenizer, data, d.device, d.world_size)  # sizes far beyond the device
    check_gkd_answers(spec.step, data)  # gkd's off-policy steps: an answer in every row
    # what loading the teacher would refuse, from its tokenizer and config: before anything is cleared
    refusal = teacher_refusal(plan, tokenizer, ModelShape.of(model), teacher_shape(plan))
    if refusal is not None:
        raise ValueError(refusal)
    if plan.lora is not None and plan.lora.target_modules:
        check_lora_targets(model, list(plan.lora.target_modules))
    resume_from = latest_checkpoint(control, compare, d, on_event)  # resume=true: the newest intact one
    prepare_output_dir(d, control, replacing, resume_from is not None)  # input valid: clear, config
    # ------------------------------------------------------------------ set-up: the policy
    model = place_policy(precision_of(spec.engine), model, d)  # on the device, weights in the master dtype
    # a supervised warm start (identical on every rank), unless resuming; its probe samples as training does
    if plan.warm_start.schedule.steps and resume_from is None:
        probe = probe_engine(spec.engine, model, tokenizer, data, d.device)
        warmed = warm_start(plan.warm_start, probe, data, d, hooks, output_dir)
        if warmed.stopped:
            return _stopped_early(emit, stop, output_dir, "warm start")
    if plan.lora is not None:  # LoRA on the warm-started weights: only the adapters train (reference: off)
        model = add_lora(model, plan.lora)
    trainee = build_trainee(spec, model, tokenizer, data, d)  # engine (reference, wrapping), optimizer
    if plan.teacher is not None:  # loss_type=opd or gkd: the teacher scores the student's completions
        teacher = load_teacher(plan.teacher, tokenizer, spec.engine, d)
        if spec.step.loss.loss_type == "gkd":
            check_same_vocabulary(trainee.engine.module, teacher, plan.teacher.model.name)
        trainee = replace(trainee, teacher=teacher)
    if stop.signal is not None and resume_from is None:  # Ctrl-C while loading or warming up, before step 1
        return _stopped_early(emit, stop, output_dir, "set-up")
    strategy = spec.placement.strategy
    saves_to = SaveTo(output_dir, control.config_yaml, control.save_total_limit)
    checkpoint = lambda s: save(trainee, strategy, saves_to, d, s, run.eval_before)  # noqa: E731
    restore_from = lambda path: restore(trainee, strategy, d, path)  # noqa: E731
    # a stop signal abandons a reward function that is still running (one process only: under several,
    # the ranks would part mid-step; there the step finishes and the stop is honoured after it)
    should_stop = (lambda: stop.signal is not None) if d.world_size == 1 else None
    try:
        evaluate = evaluator(trainee.engine, data, plan.evaluation, should_stop)
        run = Run.open(control, d, emit, stop, Starting(resume_from, restore_from, evaluate), threads)
    except ScoringStopped:  # while scoring the starting policy's evaluation: nothing to save yet
        return _stopped_early(emit, stop, output_dir, "set-up")

    # ------------------------------------------------------------------ the loop
    step, unscored = run.start, UnscoredWatch(data.reward_funcs)
    invariants = InvariantWatch(exact=trainee.engine.float32_exact, strict=control.strict_invariants)
    # zero spread starves GRPO's advantages, not dynamic sampling's (it drops such groups), OPD's (the
    # teacher's term differs token by token whatever the rewards) or GKD's (no rewards in its loss)
    learns_from_spread = not spec.step.dynamic_sampling and spec.step.loss.loss_type not in ("opd", "gkd")
    alerts = AlertWatch(control.alert_thresholds, watch_zero_spread=learns_from_spread)
    if d.is_main:  # (alerts.jsonl: rank 0's, as metrics.jsonl)
        alerts.resume(output_dir, run.start)
        if run.start == 0:
            alerts.evaluated(0, {f"eval/{k}": v for k, v in run.eval_before.items()})
    abandoned: ScoringStopped | OutOfDeviceMemory | None = None
    evaluation_oom: str | None = None
    with run:  # the metrics writer is closed however the loop ends
        for step in range(run.start + 1, control.max_steps + 1):
            began = time.perf_counter()
            # sample, score, advantages, old/reference log-probs, μ updates (train/grpo_step.py)
            out, trainee = fitted_step(trainee, data.reward_funcs, step, d, should_stop, control, on_event)
            if isinstance(out, Exception):  # a signal while a reward ran, or out of memory: dropped
                abandoned = out
                break
            seconds = time.perf_counter() - began
            tokens = out.batch.completion_mask.sum().item()
            metrics = out.metrics | {"step_time": seconds, "tokens_per_second": tokens / seconds}
            metrics |= memory_metrics(d.device)  # the GPU's peak so far (none on a CPU)
            metrics = distributed.mean_metrics(d, metrics)  # every rank takes part
            run.log(step, metrics)
            broken = invariants.update(step, metrics)  # every rank: a strict stop is every rank's
            if invariants.stop is not None and stop.signal is None:
                stop.signal = invariants.stop  # finish_step saves this step and stops
            fired = alerts.update(step, metrics) if d.is_main else []
            for message in unscored.update(metrics) + broken + [a.line() for a in fired] if d.is_main else []:
                warn(on_event, step, message)
            AlertWatch.write(output_dir, fired)
            if control.log_completions_steps and step % control.log_completions_steps == 0:
                batch = out.batch
                texts = {"prompts": batch.prompts, "completions": batch.completions}
                emit(EventKind.COMPLETIONS, step, texts | {"rewards": batch.rewards.tolist()})
            try:
                evaluated = run.evaluate_if_due(step)
            except ScoringStopped as stopped:  # the update is done: finish_step saves it and stops
                evaluated = None
                if d.is_main:
                    warn(on_event, step, f"evaluation at step {step} abandoned: {stopped}")
            except torch.OutOfMemoryError as error:  # the update is done: finish_step saves it and stops
                evaluated, evaluation_oom = None, first_line(error)
                stop.signal = stop.signal or "out of device memory in evaluation"
                release_cached_memory(d.device)
            if evaluated is not None and d.is_main:  # held-out accuracy against the reward: hacking
                fired = alerts.evaluated(step, evaluated)
                for alert in fired:
                    warn(on_event, step, alert.line())
                AlertWatch.write(output_dir, fired)
            # a checkpoint where due; a stop signal (on any rank) ends the run after it
            skipped = metrics["skipped_update"] > 0
            if skipped and run.skips + 1 >= control.max_consecutive_skips:  # the guard trips at this step
                refuse_destroyed_weights(trainee.engine.train_module, d, run.skips + 1, step)
            if run.finish_step(step, skipped, checkpoint):
                break
    if evaluation_oom is not None:  # after finish_step saved the step
        raise OutOfDeviceMemory(
            f"out of device memory in the evaluation after step {step} ({evaluation_oom}); "
            f"{CHECKPOINT_PREFIX}{step} holds the run: resume=true with a smaller micro_batch_size "
            "(evaluation samples that many rows a call) continues it",
            StepProgress(phase="evaluation"),
        )
    if isinstance(abandoned, OutOfDeviceMemory):
        raise out_of_memory(
            run, step, abandoned, checkpoint, trainee.params, plan.model.gradient_checkpointing
        )
    if abandoned is not None:
        return _abandoned(run, step, abandoned, on_event, checkpoint)
    result = run.result(TrainResult, step)
    push_final(control, main=d.is_main, stopped=run.stop.signal is not None)  # the final model, if asked
    return result


def _abandoned(
    run: Run,
    step: int,
    why: ScoringStopped,
    on_event: Callable[[str, int, dict[str, Any]], None] | None,
    checkpoint: Callable[[int], None],
) -> TrainResult:
    """A stop signal arrived while step `step`'s reward functions ran: the step is dropped (its
    completions were never used: the weights, optimizer, schedule and reference are those after step
    `step` − 1, and the loop has put back the RNG and prompt position of then), and that state is
    saved, so resume=true redoes step `step` exactly as an uninterrupted run does it. Before step 1
    of a fresh run there is nothing to save: the run directory is left as a stop during set-up leaves
    it, and the same command starts over."""
    output_dir, d, emit, stop = Path(run.output_dir), run.d, run.emit, run.stop
    if d.is_main:
        warn(on_event, step, f"step {step} abandoned: {why}")
    if step - 1 == 0:
        _forget_starting_evaluation(output_dir, d)
        return _stopped_early(emit, stop, output_dir, f"step {step}")
    if output_dir / f"{CHECKPOINT_PREFIX}{step - 1}" not in list_checkpoints(output_dir):
        checkpoint(step - 1)  # (one already there holds this very state)
    signal = stop.signal or "a signal on another rank"
    emit(EventKind.STOPPED, step - 1, {"signal": signal, "output_dir": str(output_dir)})
    return run.result(TrainResult, step - 1)


def _forget_starting_evaluation(output_dir: Path, d: distributed.Dist) -> None:
    """A run that stops before its first step has written only its starting evaluation, not worth a
    resume: removed, so that the same command starts over (an earlier run's files would refuse it)."""
    if d.is_main:
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(output_dir / "tensorboard", ignore_errors=True)


def fitted_step(
    trainee: Trainee,
    reward_funcs: Sequence[Callable[..., Any]],
    step: int,
    d: distributed.Dist,
    should_stop: Callable[[], bool] | None,
    control: RunControl,
    on_event: Callable[[str, int, dict[str, Any]], None] | None,
) -> tuple[StepResult | ScoringStopped | OutOfDeviceMemory, Trainee]:
    """Step `step` (`grpo_step`), and the trainee it ran with. A step abandoned (a stop signal while a
    reward function ran, or the device out of memory) has put back the RNG and prompt position of
    before it and returns its exception; with auto_find_batch_size, a step that ran out of memory in
    its reference pass or update before any of its updates is redone from the batch it drew and
    scored, with the micro-batch halved (to a divisor of the rows), until it fits or is 1 (one
    process: ranks could not agree on a redo)."""
    before = (rng_state(), trainee.prompts.state_dict())  # what the step drew from, beyond the weights
    redo = None
    while True:
        try:
            return grpo_step(trainee, reward_funcs, step, d, should_stop=should_stop, redo=redo), trainee
        except (ScoringStopped, OutOfDeviceMemory) as stopped:
            abandoned = stopped
        spec = trainee.params.spec
        smaller = smaller_micro_batch(trainee.params)
        if not (
            isinstance(abandoned, OutOfDeviceMemory)
            and control.auto_find_batch_size
            and abandoned.phase != "sampling"
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
        redo = abandoned.progress
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
    """The device ran out of memory in step `step`: the step is dropped as `_abandoned` drops one (the
    loop has put back the RNG and prompt position) and, when none of its updates had been applied and
    this is the only process, the state after step `step` − 1 is saved, so that resume=true with a
    setting that needs less memory redoes step `step`. -> the error to raise: one line naming the
    phase, what to change and where the run stands."""
    output_dir, d = Path(run.output_dir), run.d
    if oom.phase == "sampling":  # every row's KV cache and the decode step's [B, V] buffers
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
        _forget_starting_evaluation(output_dir, d)
        where = "no step had finished: the same command starts over"
    else:
        if output_dir / f"{CHECKPOINT_PREFIX}{step - 1}" not in saved:
            checkpoint(step - 1)
        where = f"{CHECKPOINT_PREFIX}{step - 1} holds the run up to step {step - 1}: resume=true continues it"
    phase = {"sampling": "sampling", "reference": "the reference pass", "update": "the update"}[oom.phase]
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


class UnscoredWatch:
    """Says, once per reward function and run, when a function scored none of a step's completions:
    every one None (or, with on_reward_error=unscorable, an error). Its mean is then NaN; it taught
    that step nothing, and as the only reward nothing was learned at all. Once per function: a
    function that cannot score some kind of data would say so every step."""

    def __init__(self, reward_funcs: Sequence[Callable[..., Any]]) -> None:
        self.names = reward_names(reward_funcs)  # as the step's metrics name them
        self.warned: set[str] = set()

    def update(self, metrics: dict[str, Any]) -> list[str]:
        messages = []
        for name in self.names:
            mean = metrics.get(f"rewards/{name}/mean")
            if name in self.warned or mean is None or float(mean) == float(mean):  # scored some row
                continue
            self.warned.add(name)
            effect = (
                "no completion had a reward, so the step learned nothing"
                if len(self.names) == 1
                else "it added nothing to the step's rewards"
            )
            messages.append(
                f"reward function {name!r} scored none of the step's completions (it returned None for every "
                f"one, or raised with on_reward_error=unscorable): {effect}. Return a float for the "
                "completions it can judge, None only for those it cannot. (Said once per function.)"
            )
        return messages
