"""The GRPO training loop, top to bottom.

Set-up (train/grpo_setup.py): resolve the data, load or build the policy on its device, an optional
supervised warm start, then the policy engine, optimizer and step parameters. Then, every step
(train/grpo_step.py): sample G completions for each of P prompts -> score -> group-relative
advantages -> old and reference log-probs -> μ optimizer steps; and here: report, warn, evaluate,
save. A run can stop at any step (SIGINT/SIGTERM) with a checkpoint, and resume exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import GRPOConfig
from ..models import check_lora_targets, require_peft
from . import distributed
from .checkpoint import claim_output_dir
from .grpo_setup import (
    build_trainee,
    check_context,
    evaluator,
    place_policy,
    resolve_data,
    restore,
    save,
    warm_start,
)
from .grpo_step import grpo_step
from .metrics import ZeroSpreadWatch, check_reporters, warn
from .run import (
    Emit,
    Run,
    RunResult,
    StopSignals,
    check_known_characters,
    latest_checkpoint,
    lora_from_config,
    policy_and_tokenizer,
    prepare_output_dir,
    seed_everything,
)


@dataclass(frozen=True)
class TrainResult(RunResult):
    phase: str = "grpo"  # where it ended: "grpo", or before any checkpoint: "set-up", "warm start"


def _stopped_early(emit: Emit, stop: StopSignals, output_dir: Path, phase: str) -> TrainResult:
    """A signal arrived before the first GRPO step: nothing to checkpoint, the same command starts over."""
    signal = stop.signal or "a signal on another rank"
    emit("stopped", 0, {"signal": signal, "phase": phase, "output_dir": str(output_dir)})
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
) -> TrainResult:
    """Run GRPO as configured. Anything not given comes from the config (task, dataset, model).
    `environment`: an `envs.EnvironmentSpec` (multi-turn episodes), in place of the config's tools or
    environment.

    SIGINT and SIGTERM never cut a run short silently: during the warm start it stops after the
    current supervised step and says so (no checkpoint exists yet; the same command starts again);
    during GRPO it finishes the current update, saves a checkpoint and says how to resume."""
    with StopSignals() as stop:
        return _train_grpo(
            cfg,
            stop,
            model,
            tokenizer,
            reward_funcs,
            train_rows,
            eval_rows,
            is_correct,
            on_event,
            environment,
        )


def _train_grpo(  # noqa: C901 - the loop is deliberately one function that reads top to bottom
    cfg: GRPOConfig,
    stop: StopSignals,
    model: Any,
    tokenizer: Any,
    reward_funcs: Sequence[Callable[..., Any]] | None,
    train_rows: Sequence[dict[str, Any]] | None,
    eval_rows: Sequence[dict[str, Any]] | None,
    is_correct: Callable[[str, dict[str, Any]], bool] | None,
    on_event: Callable[[str, int, dict[str, Any]], None] | None,
    environment: Any,
) -> TrainResult:
    # ------------------------------------------------------------------ set-up: validate before any work
    d = distributed.init(cfg.device)  # this rank's device: the config's, or cuda:LOCAL_RANK under torchrun
    emit: Emit = (on_event if d.is_main else None) or (lambda kind, step, data: None)  # rank 0 reports
    if cfg.prompts_per_step % d.world_size != 0:
        raise ValueError(
            f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {d.world_size}: "
            "each rank samples complete groups of its own prompts."
        )
    check_reporters(cfg.report_to)  # a missing tensorboard / wandb is said before any work
    if cfg.use_peft:
        require_peft()
    output_dir = Path(cfg.output_dir)
    replacing = claim_output_dir(output_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    data = resolve_data(
        cfg, train_rows, eval_rows, reward_funcs, is_correct, device=d.device, environment=environment
    )
    seed_everything(cfg.seed)
    if model is None:
        max_len = 4 * ((data.max_prompt_length or 64) + data.max_completion_length)
        model, tokenizer = policy_and_tokenizer(cfg, data.alphabet, max_len)
    check_context(cfg, model, tokenizer, data)
    check_known_characters(  # a character tokenizer would read an unknown character as <unk>
        tokenizer,
        cfg.model,
        [(data.train_source, data.train_rows), (data.eval_source, data.eval_rows)],
        [cfg.prompt_column, cfg.answer_column] if cfg.sft_steps else [cfg.prompt_column],
    )
    if cfg.use_peft and cfg.lora_target_modules:
        check_lora_targets(model, cfg.lora_target_modules)
    prepare_output_dir(d, cfg, replacing)  # every rank's input is valid: clear an earlier run, config.yaml
    resume_from = latest_checkpoint(cfg)  # resume=true: the newest checkpoint (its config validated)
    # ------------------------------------------------------------------ set-up: the policy
    model = place_policy(cfg, model, d)  # on the device, weights in the master dtype
    # a supervised warm start (identical on every rank), unless resuming
    warmed = cfg.sft_steps and resume_from is None and warm_start(cfg, model, tokenizer, data, d, stop, emit)
    if warmed and warmed.stopped:
        return _stopped_early(emit, stop, output_dir, "warm start")
    if cfg.use_peft:  # LoRA on the warm-started weights: only the adapters train (reference: adapters off)
        model = lora_from_config(cfg, model)
    trainee = build_trainee(cfg, model, tokenizer, data, d)  # engine (reference, wrapping), optimizer
    if stop.signal is not None and resume_from is None:  # Ctrl-C while loading or warming up, before step 1
        return _stopped_early(emit, stop, output_dir, "set-up")
    restore_from = lambda path: restore(cfg, trainee, d, path)  # noqa: E731
    run = Run.open(cfg, d, emit, stop, resume_from, restore_from, evaluator(cfg, trainee, data))

    # ------------------------------------------------------------------ the loop
    step, zero_spread = run.start, ZeroSpreadWatch()
    with run:  # the metrics writer is closed however the loop ends
        for step in range(run.start + 1, cfg.max_steps + 1):
            began = time.perf_counter()
            # sample, score, advantages, old/reference log-probs, μ updates (train/grpo_step.py)
            out = grpo_step(
                trainee.engine, trainee.update, trainee.prompts, data.reward_funcs, trainee.params, step, d
            )
            seconds = time.perf_counter() - began
            tokens = out.batch.completion_mask.sum().item()
            metrics = out.metrics | {"step_time": seconds, "tokens_per_second": tokens / seconds}
            metrics = distributed.mean_metrics(d, metrics)  # every rank takes part
            run.log(step, metrics)
            cannot_learn = not cfg.dynamic_sampling and zero_spread.update(
                float(metrics["frac_reward_zero_std"]), float(metrics["reward"])
            )
            if cannot_learn and d.is_main:
                warn(on_event, step, cannot_learn)
            if cfg.log_completions_steps and step % cfg.log_completions_steps == 0:
                batch = out.batch
                texts = {"prompts": batch.prompts, "completions": batch.completions}
                emit("completions", step, texts | {"rewards": batch.rewards.tolist()})
            run.evaluate_if_due(step)
            # a checkpoint where due; a stop signal (on any rank) ends the run after it
            skipped = metrics["skipped_update"] > 0
            if run.finish_step(step, skipped, lambda s: save(cfg, trainee, d, s, run.eval_before)):
                break
    return run.result(TrainResult, step)
