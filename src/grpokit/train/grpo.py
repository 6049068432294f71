"""The GRPO training loop, top to bottom.

Set-up: resolve the data and load or build the policy on its device (train/inputs.py), open the
batch source (train/batch_source.py: in process, or the asynchronous rollout), an optional supervised
warm start, then the policy engine, optimizer and step parameters (train/grpo_setup.py). Then, every
step (train/grpo_step.py): the batch (G completions for each of P prompts, scored, group-relative
advantages) -> old and reference log-probs -> μ optimizer steps; and here: report, warn, evaluate,
save. A run can stop at any step (SIGINT/SIGTERM) with a checkpoint, and resume exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from ..config import GRPOConfig, trl_names
from ..config.applied import Preset, applied
from ..config.plan import GRPOPlan, TraineeSpec, grpo_plan, loss_advice
from ..config.resume import resume_changes
from ..data import solution_column
from ..models import ModelShape, check_lora_targets, is_lora, memory_metrics, require_peft
from ..rewards.scoring import ScoringStopped
from . import distributed
from .async_rollout import check_rollout
from .batch_source import open_batch_source
from .checkpoint import SaveTo, list_checkpoints
from .events import Emit, EventKind
from .grpo_setup import (
    Hooks,
    build_trainee,
    check_gkd_answers,
    check_same_vocabulary,
    load_teacher,
    restore,
    save,
    teacher_refusal,
    teacher_shape,
    warm_start,
)
from .grpo_step import OutOfDeviceMemory, StepResult
from .hub_push import check_push, push_final
from .inputs import (
    RunData,
    UserInputs,
    check_context,
    check_step_prompts,
    evaluator,
    place_policy,
    precision_of,
    probe_engine,
    resolve_data,
    tiny_context,
)
from .memory_check import check_step_memory, fitted_micro_batch, longest_prompt
from .metrics import check_reporters, warn
from .run import (
    Run,
    RunResult,
    Starting,
    StopSignals,
    add_lora,
    check_known_characters,
    latest_checkpoint,
    policy_and_tokenizer,
    prepare_output_dir,
    seed_everything,
)
from .rundir import CHECKPOINT_PREFIX, claim_output_dir, exclusive_output_dir
from .step_failures import (
    evaluation_out_of_memory,
    forget_starting_evaluation,
    out_of_memory,
    refuse_destroyed_weights,
    step_within_memory,
)
from .step_watch import StepWatchers
from .threads import ThreadGovernor
from .trainee import BatchSource, Trainee

OnEvent = Callable[[str, int, dict[str, Any]], None]  # the caller's on_event
Compare = Callable[[Path], list[str]]  # a checkpoint's config.yaml -> what differs from this run's


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
    on_event: OnEvent | None = None,
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
    cfg = steps_of_epochs(cfg, train_rows, on_event)
    for line in loss_advice(cfg):  # TRL's warnings of a loss set-up that is likely not what was meant
        trl_names.say(line)
    plan = grpo_plan(cfg, preset, model_given=model is not None)  # resolved once: nothing below reads `cfg`
    given = UserInputs(model, tokenizer, train_rows, eval_rows, reward_funcs, is_correct, environment)
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


def steps_of_epochs(
    cfg: GRPOConfig, train_rows: Sequence[dict[str, Any]] | None, on_event: OnEvent | None
) -> GRPOConfig:
    """TRL's num_train_epochs counted as steps when max_steps is not set: ⌈epochs · prompts /
    prompts_per_step⌉ over the training rows given (the config unchanged otherwise; without rows the
    count is unknown before loading, so max_steps stands and a warning says so)."""
    if cfg.num_train_epochs is None or "max_steps" in cfg.model_fields_set:
        return cfg
    if train_rows is None:
        warn(
            on_event,
            0,
            f"num_train_epochs is counted over a train_dataset given in Python; this run "
            f"takes max_steps={cfg.max_steps}: set max_steps for the command line",
        )
        return cfg
    steps = max(1, math.ceil(cfg.num_train_epochs * len(train_rows) / cfg.prompts_per_step))
    return cfg.model_copy(update={"max_steps": steps})


def _train_grpo(
    plan: GRPOPlan, given: UserInputs, hooks: Hooks, on_event: OnEvent | None, compare: Compare
) -> TrainResult:
    ready = prepare_run(plan, given, hooks, on_event, compare)
    if isinstance(ready, TrainResult):  # stopped before step 1: nothing to checkpoint
        return ready
    return run_loop(ready, plan, hooks, on_event)


@dataclass(frozen=True)
class PreparedRun:
    """What the loop runs: the trainee, the data, the open run (metrics, checkpoints, evaluation) and
    this rank's place."""

    trainee: Trainee
    data: RunData
    run: Run
    d: distributed.Dist
    checkpoint: Callable[[int], None]  # saves the state after a step (grpo_setup.save)
    should_stop: Callable[[], bool] | None  # looked at while reward functions run


@dataclass(frozen=True)
class Inputs:
    """What set-up found valid, before touching the output directory or the device."""

    data: RunData
    model: Any
    tokenizer: Any
    replacing: bool  # overwrite=true over an earlier run
    resume_from: Path | None
    prompt_tokens: int  # the longest prompt in tokens (memory_check.longest_prompt)


def prepare_run(
    plan: GRPOPlan, given: UserInputs, hooks: Hooks, on_event: OnEvent | None, compare: Compare
) -> PreparedRun | TrainResult:
    """Every input checked before any work, the output directory prepared, the policy on its device
    (warm-started), the engine, optimizer and teacher built, and the run opened (resumed, or its
    starting evaluation). -> the run, or the result of a stop signal that arrived first."""
    spec, control = plan.trainee, plan.run
    d = distributed.init(spec.placement.device)  # this rank's device: the config's, or cuda:LOCAL_RANK
    output_dir = Path(control.output_dir)
    inputs = check_inputs(plan, given, d, on_event, compare)
    prepare_output_dir(d, control, inputs.replacing, inputs.resume_from is not None)  # clear, config
    warm_starts = bool(plan.warm_start.schedule.steps) and inputs.resume_from is None
    preload = {type(x).__module__ for x in (inputs.model, inputs.tokenizer)}  # (what unpickling imports)
    spawn = tuple(preload) if spawns_early(d.device, warm_starts) else None
    source = open_batch_source(plan.rollout, output_dir, d, inputs.data, spec.engine, spawn)
    try:
        prepared = _prepare_policy_and_run(plan, inputs, d, hooks, source)
    except BaseException:
        source.close()
        raise
    if not isinstance(prepared, PreparedRun):  # stopped before step 1
        source.close()
    return prepared


def with_fitted_micro_batch(
    plan: GRPOPlan, model: Any, inputs: Inputs, d: distributed.Dist, emit: Emit
) -> TraineeSpec:
    """The trainee's spec, with the micro-batch the memory forecast fits when the config leaves
    micro_batch_size unset on a GPU (`memory_check.fitted_micro_batch`), said once."""
    spec = plan.trainee
    length = inputs.data.max_completion_length
    shapes = ModelShape.of(model), teacher_shape(plan)
    fitted = fitted_micro_batch(plan, *shapes, inputs.prompt_tokens, length, d.device, d.world_size)
    if fitted is None or fitted.micro_batch_size == spec.step.micro_batch_size:
        return spec
    warn(emit, 0, fitted.message)
    return replace(spec, step=replace(spec.step, micro_batch_size=fitted.micro_batch_size))


def spawns_early(device: Any, warm_starts: bool) -> bool:
    """Whether a batch source's processes (the rollout workers) start before the policy is placed and
    warm-started: their imports (seconds) then overlap that work, on the cores an accelerator leaves
    idle, or beside a set-up without a warm start (loading, mostly one thread). Not before a warm start
    on a CPU, whose threads use every core: the imports would only slow it (measured: a 2-core main
    job's warm start took 9 s longer); there the worker starts with the loop."""
    return device.type != "cpu" or not warm_starts


def _prepare_policy_and_run(
    plan: GRPOPlan, inputs: Inputs, d: distributed.Dist, hooks: Hooks, source: BatchSource
) -> PreparedRun | TrainResult:
    spec, control, emit, stop = plan.trainee, plan.run, hooks.emit, hooks.stop
    output_dir = Path(control.output_dir)
    data, resume_from = inputs.data, inputs.resume_from
    model = place_policy(precision_of(spec.engine), inputs.model, d)  # on the device, master dtype
    # a supervised warm start (identical on every rank), unless resuming; its probe samples as training does
    if plan.warm_start.schedule.steps and resume_from is None:
        probe = probe_engine(spec.engine, model, inputs.tokenizer, data, d.device)
        warmed = warm_start(plan.warm_start, probe, data, d, hooks, output_dir)
        if warmed.stopped:
            return _stopped_early(emit, stop, output_dir, "warm start")
    if plan.lora is not None and not is_lora(model):  # LoRA on the warm-started weights: only the adapters
        model = add_lora(model, plan.lora)  # train (reference: off); a model given with them keeps its own
    source.prepare(model)  # (the rollout workers' copy of the policy: before FSDP2 shards it in place)
    spec = with_fitted_micro_batch(plan, model, inputs, d, emit)  # micro_batch_size unset, on a GPU
    trainee = build_trainee(spec, model, inputs.tokenizer, data, source, d)  # engine, optimizer
    if plan.teacher is not None:  # a loss with a teacher (opd, gkd): it scores the student's completions
        teacher = load_teacher(plan.teacher, inputs.tokenizer, spec.engine, d)
        if spec.step.loss.variant.teacher == "distributions":
            check_same_vocabulary(trainee.engine.module, teacher, plan.teacher.model.name)
        trainee = replace(trainee, teacher=teacher)
    if stop.signal is not None and resume_from is None:  # Ctrl-C while loading or warming up, before step 1
        return _stopped_early(emit, stop, output_dir, "set-up")
    strategy = spec.placement.strategy
    restore_from = lambda path: restore(trainee, strategy, d, path)  # noqa: E731
    # a stop signal abandons a reward function that is still running (one process only: under several,
    # the ranks would part mid-step; there the step finishes and the stop is honoured after it)
    should_stop = (lambda: stop.signal is not None) if d.world_size == 1 else None
    try:
        evaluate = evaluator(trainee.engine, data, plan.evaluation, should_stop)
        run = Run.open(control, d, emit, stop, Starting(resume_from, restore_from, evaluate), hooks.threads)
    except ScoringStopped:  # while scoring the starting policy's evaluation: nothing to save yet
        return _stopped_early(emit, stop, output_dir, "set-up")
    saves_to = SaveTo(output_dir, control.config_yaml, control.save_total_limit)
    checkpoint = partial(save, trainee, strategy, saves_to, d, run.eval_before)  # (step) -> checkpoint-<step>
    return PreparedRun(trainee, data, run, d, checkpoint, should_stop)


def check_inputs(
    plan: GRPOPlan, given: UserInputs, d: distributed.Dist, on_event: OnEvent | None, compare: Compare
) -> Inputs:
    """Everything that can be refused, refused before any work: the geometry, reporters, the output
    directory (claimed), the data, the model and its tokenizer, memory, the teacher, LoRA's targets,
    and the checkpoint to resume from. The policy is built here (seeded) but not yet placed."""
    spec, control = plan.trainee, plan.run
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
    replacing = claim_output_dir(Path(control.output_dir), resume=control.resume, overwrite=control.overwrite)
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
    prompt_tokens = longest_prompt(plan, tokenizer, data)
    check_step_memory(plan, model, prompt_tokens, data, d.device, d.world_size)  # sizes far beyond the device
    check_gkd_answers(spec.step, data)  # learning from demonstrations: an answer in every row
    check_rollout(plan.rollout, data, d.world_size, spec.step, Path(control.output_dir))  # max_staleness
    # what loading the teacher would refuse, from its tokenizer and config: before anything is cleared
    refusal = teacher_refusal(plan, tokenizer, ModelShape.of(model), teacher_shape(plan))
    if refusal is not None:
        raise ValueError(refusal)
    if plan.lora is not None and plan.lora.target_modules:
        check_lora_targets(model, list(plan.lora.target_modules))
    resume_from = latest_checkpoint(control, compare, d, on_event)  # resume=true: the newest intact one
    return Inputs(data, model, tokenizer, replacing, resume_from, prompt_tokens)


def run_loop(ready: PreparedRun, plan: GRPOPlan, hooks: Hooks, on_event: OnEvent | None) -> TrainResult:
    """Steps run.start + 1 … max_steps: each step, then its figures logged and watched, evaluation
    where due, a checkpoint where due; a stop signal ends the run after its step is saved."""
    trainee, run, d, control = ready.trainee, ready.run, ready.d, plan.run
    spec, variant = trainee.params.spec, trainee.params.loss.variant
    watch = StepWatchers(
        run,
        on_event,
        ready.data.reward_funcs,
        exact=trainee.engine.float32_exact,
        learns_from_spread=variant.learns_from_spread_only and not spec.dynamic_sampling,
    )
    step, failed, steps = run.start, None, range(run.start + 1, control.max_steps + 1)
    with run, closing(trainee.source):  # the metrics writer closed, the source closed, however it ends
        trainee.source.start(trainee, steps, run.threads)
        for step in steps:
            began = time.perf_counter()
            # sample, score, advantages, log-probs before the update, μ updates (train/grpo_step.py)
            out, trainee = step_within_memory(
                trainee, ready.data.reward_funcs, step, d, ready.should_stop, control, on_event
            )
            if isinstance(out, Exception):  # a signal while a reward ran, or out of memory: dropped
                failed = out
                break
            trainee.source.after_step(step, trainee.engine.module)  # (async: version `step` published)
            metrics = step_figures(out, time.perf_counter() - began, d)  # every rank takes part
            run.log(step, metrics)
            watch.after_step(step, metrics, out.batch)
            watch.evaluate_if_due(step)
            # a checkpoint where due; a stop signal (on any rank) ends the run after it
            skipped = metrics["skipped_update"] > 0
            if skipped and run.skips + 1 >= control.max_consecutive_skips:  # the guard trips at this step
                refuse_destroyed_weights(trainee.engine.train_module, d, run.skips + 1, step)
            if run.finish_step(step, skipped, ready.checkpoint):
                break
    if watch.evaluation_oom is not None:  # after finish_step saved the step
        raise evaluation_out_of_memory(step, watch.evaluation_oom)
    if isinstance(failed, OutOfDeviceMemory):
        raise out_of_memory(
            run, step, failed, ready.checkpoint, trainee.params, plan.model.gradient_checkpointing
        )
    if failed is not None:
        return abandoned(run, step, failed, on_event, ready.checkpoint)
    result = run.result(TrainResult, step)
    push_final(control, main=d.is_main, stopped=run.stop.signal is not None)  # the final model, if asked
    return result


def step_figures(out: StepResult, seconds: float, d: distributed.Dist) -> dict[str, Any]:
    """The step's metrics with its wall-clock time, throughput and device memory, averaged over ranks."""
    tokens = out.batch.completion_mask.sum().item()
    metrics = out.metrics | {"step_time": seconds, "tokens_per_second": tokens / seconds}
    metrics |= memory_metrics(d.device)  # the GPU's peak so far (none on a CPU)
    return distributed.mean_metrics(d, metrics)


def abandoned(
    run: Run,
    step: int,
    why: ScoringStopped,
    on_event: OnEvent | None,
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
        forget_starting_evaluation(output_dir, d)
        return _stopped_early(emit, stop, output_dir, f"step {step}")
    if output_dir / f"{CHECKPOINT_PREFIX}{step - 1}" not in list_checkpoints(output_dir):
        checkpoint(step - 1)  # (one already there holds this very state)
    signal = stop.signal or "a signal on another rank"
    emit(EventKind.STOPPED, step - 1, {"signal": signal, "output_dir": str(output_dir)})
    return run.result(TrainResult, step - 1)
