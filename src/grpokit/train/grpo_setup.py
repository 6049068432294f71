"""GRPO's own set-up, over the inputs (train/inputs.py): the policy engine, optimizer, step
parameters and batch source (`build_trainee`), the teacher of a distillation loss, the supervised warm
start, and the checkpoint's save and restore of a trainee. The loop that uses them is train/grpo.py;
one step is train/grpo_step.py. Each function takes the parts of the run's plan (`config.plan`) it
reads, never the whole config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config.plan import Evaluation, GRPOPlan, StepSpec, TeacherSpec, TraineeSpec, WarmStart
from ..data import CurriculumRule, DataError, PromptSampler, sft_rows
from ..engine import EngineSpec, PolicyEngine, Wrapping
from ..models import ModelShape, embedding_refusal, load_model_config, load_tokenizer, make_reference
from ..rollout import SamplingParams
from . import distributed
from .checkpoint import (
    CheckpointError,
    SaveTo,
    TrainingParts,
    restore_distributed,
    save_distributed,
    state_error,
)
from .evaluation import EvalTask, evaluate
from .events import EventKind
from .inputs import RunData, correctness_reward, precision_of
from .metrics import write_sft_metrics
from .optim import make_optimizer, make_scheduler
from .run import Emit, StopSignals, policy_and_tokenizer
from .sft import SFTHooks, SFTResult, run_sft
from .trainee import BatchSource, EntropyControl, StepParams, Trainee, Update


def check_gkd_answers(step: StepSpec, data: RunData) -> None:
    """loss_type=gkd with lmbda < 1 learns some steps from the dataset's answers: every training row
    needs one (answer_column). Refused before any work, naming the column and the fix."""
    # (seq_kd: the teacher writes the demonstrations)
    if not step.loss.variant.demonstrations or step.lmbda >= 1.0 or step.seq_kd:
        return
    column = step.answer_column
    missing = [i for i, row in enumerate(data.train_rows) if row.get(column) is None]
    if missing:
        have = ", ".join(sorted(data.train_rows[missing[0]])) or "none"
        raise DataError(
            f"loss_type=gkd with lmbda={step.lmbda:g} learns {1 - step.lmbda:.0%} of its steps from the "
            f"dataset's answers, but {data.train_source} row {missing[0]} has no {column!r} column "
            f"({len(missing)} rows lack it; its columns: {have}). Set answer_column to the column that "
            "holds the answers, seq_kd=true to learn from the teacher's samples instead, or lmbda=1 to learn "
            "from the student's samples only."
        )


def check_same_vocabulary(policy: torch.nn.Module, teacher: PolicyEngine, teacher_name: str) -> None:
    """loss_type=gkd compares whole next-token distributions: the two heads must have one row per token
    of the same vocabulary (tokenizers equal is checked on loading; heads may still be padded apart,
    as Qwen2.5's 0.5B–3B and 7B are), and the teacher's must be a plain linear head over its hidden
    states, so that its pass keeps [B, T, H] states and never [B, T, V] logits."""
    if not teacher.fused:
        raise ValueError(
            f"teacher_model={teacher_name!r} gives loss_type=gkd no hidden states and plain LM head to form "
            "its logits from in chunks (fused_logps=false, or a head that rescales its logits), so its pass "
            "would hold every position's whole distribution; use loss_type=opd, or fused_logps=true"
        )
    ours = policy.get_output_embeddings().weight.shape[0]
    theirs = teacher.module.get_output_embeddings().weight.shape[0]
    if ours != theirs:
        raise ValueError(
            f"teacher_model={teacher_name!r} scores {theirs} tokens and the policy {ours}: loss_type=gkd "
            "compares the two models' whole next-token distributions, so their output layers must be the "
            "same size; use loss_type=opd (it compares the written tokens only) or a teacher of that size"
        )


def sampling_params(sampling: SamplingParams, data: RunData) -> SamplingParams:
    """The plan's sampling with the data's lengths: how completions are drawn during training (the
    per-step seed is set by the step)."""
    return replace(
        sampling, max_completion_length=data.max_completion_length, max_prompt_length=data.max_prompt_length
    )


def curriculum_rule(step: StepSpec) -> CurriculumRule | None:
    """The prompt sampler's curriculum (data/curriculum.py), when the config turns it on."""
    return CurriculumRule(step.curriculum_patience, step.curriculum_revisit) if step.curriculum else None


def build_trainee(
    spec: TraineeSpec,
    model: Any,
    tokenizer: Any,
    data: RunData,
    source: BatchSource,
    d: distributed.Dist | None = None,
) -> Trainee:
    """The reference copy (beta ≠ 0), DDP/FSDP wrapping, the engine, AdamW and its schedule, with
    the run's batch source (train/batch_source.py). `model` is already placed (`place_policy`)."""
    d = d or distributed.Dist()
    placement = spec.placement
    precision = precision_of(spec.engine)
    reference = make_reference(model, spec.step.loss.beta)  # a plain copy, before any wrapping
    wrapped = distributed.wrap(
        d, model, placement.strategy, cpu_offload=placement.fsdp_cpu_offload, compute_dtype=precision.compute
    )
    sharded = d.enabled and placement.strategy == "fsdp"
    if reference is not None and sharded:
        reference = distributed.wrap(
            d,
            reference,
            "fsdp",
            cpu_offload=placement.fsdp_cpu_offload,
            trainable=False,
            compute_dtype=precision.compute,
        )
    # DDP wraps, FSDP2 shards in place: either way the whole forward runs. FSDP runs every rank's
    # forward passes in lockstep: the decode loop's early exit is collective
    lockstep = (lambda done: not distributed.any_rank(d, not done)) if sharded else None
    engine = PolicyEngine.create(
        distributed.unwrap(wrapped),
        tokenizer,
        spec.engine,
        device=d.device,
        reference=reference,
        wrapping=Wrapping(wrapped, lockstep) if d.enabled else None,
        environment=data.environment,
    )
    optimizer = make_optimizer(wrapped.parameters(), spec.optimizer)
    return Trainee(
        engine=engine,
        update=Update(optimizer, make_scheduler(optimizer, spec.optimizer)),
        params=StepParams.of(spec.step, sampling_params(spec.sampling, data), d.world_size),
        source=source,
        prompts=PromptSampler(
            data.train_rows,
            spec.step.prompts_per_step,
            seed=spec.step.seed,
            curriculum=curriculum_rule(spec.step),
            shuffle=spec.step.shuffle_dataset,
            is_correct=data.is_correct,
        ),
        entropy=None if spec.step.entropy is None else EntropyControl(spec.step.entropy),
    )


def teacher_tokenizer_refusal(name: str, tokenizer: Any, teacher_tokenizer: Any) -> str | None:
    """Why teacher `name` cannot teach a policy of `tokenizer` (its tokenizer differs: another
    vocabulary, or other eos or pad ids), in one line; None when it can."""
    mine, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    special = [
        (a, getattr(tokenizer, a), getattr(teacher_tokenizer, a)) for a in ("eos_token_id", "pad_token_id")
    ]
    different = [f"{what} {ours} vs {its}" for what, ours, its in special if ours != its]
    if mine == theirs and not different:
        return None
    detail = (
        f"vocabularies of {len(mine)} and {len(theirs)} tokens" if mine != theirs else ", ".join(different)
    )
    return (
        f"teacher_model={name!r} has another tokenizer than the policy ({detail}): on-policy "
        "distillation compares the two models' log-probs of the same token ids, so the teacher must "
        "share the policy's tokenizer; pick a teacher of the same family"
    )


def teacher_refusal(
    plan: GRPOPlan, tokenizer: Any, policy: ModelShape, teacher: ModelShape | None
) -> str | None:
    """What `train` would refuse in the teacher, found without loading its weights: another tokenizer,
    an embedding with fewer rows than its tokenizer has ids (no loss type can use it), or for
    loss_type=gkd an output layer of another size. None when it can teach (or there is none)."""
    if plan.teacher is None or teacher is None:
        return None
    spec = plan.teacher.model
    theirs = load_tokenizer(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    refusal = teacher_tokenizer_refusal(spec.name, tokenizer, theirs)
    if refusal is None:  # (config.vocab_size: its embedding's rows, as loading would find them)
        refusal = embedding_refusal(f"teacher_model={spec.name!r}", teacher.vocab_size, theirs)
    if (
        refusal is None
        and plan.trainee.step.loss.variant.teacher == "distributions"
        and teacher.vocab_size != policy.vocab_size
    ):
        # (both embed every id of the tokenizer here: opd, which scores the written tokens only, works)
        refusal = (
            f"teacher_model={spec.name!r}: its output layer scores {teacher.vocab_size} tokens and the "
            f"policy's {policy.vocab_size}: "
            "loss_type=gkd compares whole next-token distributions; use loss_type=opd or a teacher of "
            "that size"
        )
    return refusal


def teacher_shape(plan: GRPOPlan) -> ModelShape | None:
    """loss_type=opd or gkd: the teacher's shape from its config alone (not loading it);
    None without a teacher."""
    if plan.teacher is None:
        return None
    spec = plan.teacher.model
    config = load_model_config(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    return ModelShape.from_config(config)


def load_teacher(
    spec: TeacherSpec, tokenizer: Any, settings: EngineSpec, d: distributed.Dist
) -> PolicyEngine:
    """loss_type=opd's teacher: loaded as the policy is (a hub id or a directory), frozen, in the policy's
    precision, on `spec.device` or the policy's, behind an engine that only scores. A teacher whose
    tokenizer differs from the policy's is refused: on-policy distillation compares the two models'
    log-probs of the same token ids."""
    model, teacher_tokenizer = policy_and_tokenizer(spec.model, None, 0)
    refusal = teacher_tokenizer_refusal(spec.model.name, tokenizer, teacher_tokenizer)
    if refusal is not None:
        raise ValueError(refusal)
    device = torch.device(spec.device) if spec.device is not None else d.device
    model = model.to(device=device, dtype=precision_of(settings).master).eval()
    model.requires_grad_(False)
    return PolicyEngine.create(model, tokenizer, settings, device=device)


SFT_PROBE_ROWS, SFT_PROBE_EVERY = 256, 10


def warm_start_goal(
    spec: WarmStart, engine: PolicyEngine, data: RunData, probed: list[float]
) -> Callable[[int], bool] | None:
    """With sft_target_accuracy: every SFT_PROBE_EVERY steps, greedy accuracy of `engine` (over the
    model being warmed up) on the first SFT_PROBE_ROWS training prompts (never held-out ones),
    appended to `probed`; True once it reaches the target. Stopping at a measured accuracy, not a
    step count, makes GRPO start from the same place whatever the seed or the CPU's float round-off
    (a warm start's accuracy climbs steeply, so where a fixed step count lands is not reproducible
    across machines)."""
    target = spec.target_accuracy
    if target is None:
        return None
    if data.is_correct is None:
        raise ValueError(
            "sft_target_accuracy needs an exact accuracy to measure: use a built-in task, or rows with an "
            "answer column; or unset sft_target_accuracy to run sft_steps."
        )
    probe = EvalTask(
        data.train_rows[:SFT_PROBE_ROWS],
        reward_funcs=[correctness_reward(data.is_correct)],  # accuracy is all it needs
        is_correct=data.is_correct,
        max_prompt_length=data.max_prompt_length,
        max_completion_length=data.max_completion_length,
    )
    settings = Evaluation(prompt_column=spec.prompt_column, batch_size=spec.probe_batch_size)

    def done(step: int) -> bool:
        if step % SFT_PROBE_EVERY:
            return False
        metrics = evaluate(engine, probe, settings)
        engine.module.train()
        probed.append(metrics["accuracy"])
        return metrics["accuracy"] >= target

    return done


@dataclass(frozen=True)
class Hooks:
    """What a phase of a run reports to and is stopped by: `emit` (on_event on rank 0), the stop
    signals, and the CPU-thread governor (None: none)."""

    emit: Emit
    stop: StopSignals
    threads: Any = None


def warm_start(
    spec: WarmStart, engine: PolicyEngine, data: RunData, d: distributed.Dist, hooks: Hooks, output_dir: Path
) -> SFTResult:
    """The supervised warm start (sft_steps) of `engine`'s model, identical on every rank; its losses go
    to output_dir/sft_metrics.jsonl, and with sft_target_accuracy it ends once a probe of training
    prompts is solved (greedy, through `engine`)."""
    emit, stop, threads = hooks.emit, hooks.stop, hooks.threads
    emit(EventKind.SFT_START, 0, {})
    probed: list[float] = []
    goal = warm_start_goal(spec, engine, data, probed)

    def sft_step(step: int, loss: float) -> None:
        emit(EventKind.SFT_STEP, step, {"loss": loss})
        note = threads.tick() if threads is not None else None  # fewer CPU threads under load
        if note:
            emit(EventKind.WARNING, step, {"message": note})

    warm = run_sft(
        engine.module,
        engine.tokenizer,
        sft_rows(
            data.train_rows[: spec.examples],
            engine.tokenizer,
            spec.prompt_column,
            spec.answer_column,
            environment=data.environment,  # multi-turn: whole episodes, the policy's turns learned
            template_kwargs=data.chat_template_kwargs,
            answer_format=spec.answer_format,  # gsm8k: the worked solutions
        ),
        spec.schedule,
        SFTHooks(
            on_step=sft_step,
            should_stop=lambda: distributed.any_rank(d, stop.signal is not None),
            done=None if goal is None else lambda s: distributed.any_rank(d, goal(s)),  # ranks agree
        ),
        precision=engine.precision,
    )
    if d.is_main:
        write_sft_metrics(output_dir, warm.losses)
    if probed:
        emit(EventKind.SFT_DONE, len(warm.losses), {"probe_accuracy": probed[-1], "reached": warm.reached})
    return warm


def _parts(trainee: Trainee) -> TrainingParts:
    engine, update = trainee.engine, trainee.update
    return TrainingParts(
        engine.train_module,
        engine.tokenizer,
        update.optimizer,
        update.scheduler,
        trainee.prompts,
        engine.reference if trainee.params.spec.reference_sync is not None else None,
    )


def save(
    trainee: Trainee, strategy: str, to: SaveTo, d: distributed.Dist, eval_before: dict[str, float], step: int
) -> None:
    """checkpoint-<step>: weights, optimizer, schedule, data position, RNG, a synced reference, the
    entropy control and what the batch source holds (`BatchSource.state_dict`), with the run's
    starting evaluation. The loop holds it bound to all but `step` (`functools.partial`)."""
    engine = trainee.engine
    extra = trainee.source.state_dict(step)  # (the asynchronous rollout's batches in flight)
    if engine.reference is not None and trainee.params.spec.reference_sync is not None:
        extra["reference"] = distributed.full_state_dict(d, engine.reference)
    if trainee.entropy is not None:
        extra["entropy_control"] = trainee.entropy.state_dict()
    save_distributed(d, strategy, to, step, _parts(trainee), eval_before, extra)


def restore(
    trainee: Trainee, strategy: str, d: distributed.Dist, checkpoint: Path
) -> tuple[int, dict[str, float]]:
    """What `save` saved, from `checkpoint`: (step, eval_before)."""
    engine = trainee.engine
    state = restore_distributed(d, strategy, checkpoint, _parts(trainee))
    if engine.reference is not None and "reference" in state:
        distributed.unwrap(engine.reference).load_state_dict(state["reference"])  # (checked: its shapes)
    if trainee.entropy is not None and "entropy_control" in state:
        trainee.entropy.load_state_dict(state["entropy_control"])
    problem = trainee.source.load_state_dict(state, trainee)  # (checked against this run)
    if problem is not None:
        raise CheckpointError(state_error(checkpoint, problem))
    return int(state["step"]), {k: float(v) for k, v in state["eval_before"].items()}
