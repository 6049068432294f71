"""Bradley–Terry reward-model training, top to bottom.

One step: take `batch_size` preference pairs -> in micro-batches, score chosen and rejected
sequences in one forward pass each (stacked: 2n rows) -> `ops.bradley_terry_loss`, weighted by the
micro-batch's share of the pairs so the accumulated gradient is the batch mean -> clip -> AdamW ->
metrics, evaluation (pairwise accuracy, margins, a calibration table), checkpoints; at the end,
reward_diagnostics.json (calibration, length bias, padding invariance: train/reward_diagnostics.py).
The model trains on the config's device (under torchrun, the rank's), its weights and AdamW state in
the master dtype, its forward passes under autocast in `dtype`, the loss in float32; metrics and
checkpoints are on the host. Optimizer and schedule (train/optim.py), checkpoints (train/checkpoint.py),
metrics (train/metrics.py) and the run around the loop (train/run.py) are the GRPO trainer's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import RewardConfig
from ..config.plan import ModelSpec, PairSpec, PairStep, RewardPlan, reward_plan
from ..config.resume import resume_changes
from ..data import (
    PreferenceBatch,
    PromptSampler,
    collate_preferences,
    data_alphabet,
    get_task,
    load_preferences,
    preference_pairs,
    pretokenize,
)
from ..models import (
    Precision,
    build_reward_model,
    char_tokenizer,
    enable_fast_matmul,
    load_reward_model,
    model_device,
    resolve_device,
    reward_scores,
)
from ..ops import bradley_terry_loss
from . import distributed
from .checkpoint import SaveTo, TrainingParts, restore_distributed, save_distributed
from .hub_push import check_push, push_final
from .metrics import check_reporters
from .optim import apply_update, make_optimizer, make_scheduler
from .reward_diagnostics import (
    DIAGNOSTICS_FILE,
    PADDING_SAMPLE,
    ScoredPairs,
    margin_buckets,
    padding_invariance,
    reward_diagnostics,
)
from .run import Run, RunResult, Starting, StopSignals, latest_checkpoint, prepare_output_dir, seed_everything
from .rundir import claim_output_dir, exclusive_output_dir
from .threads import ThreadGovernor


@dataclass(frozen=True)
class RewardResult(RunResult):
    """What `train_reward` returns."""


def reward_model_and_tokenizer(
    spec: ModelSpec, alphabet: str | None, max_length: int, dtype: torch.dtype | None = None
) -> tuple[Any, Any]:
    """The model `spec` names and its tokenizer, on the CPU, its weights in `dtype` (default:
    `spec.dtype`; training stores them in its master dtype); a tiny one holds `max_length` tokens."""
    dtype = dtype or getattr(torch, spec.dtype)
    if spec.name != "tiny":
        loaded = load_reward_model(
            spec.name, revision=spec.revision, dtype=dtype, trust_remote_code=spec.trust_remote_code
        )
        return loaded.model, loaded.tokenizer
    if alphabet is None:
        raise ValueError(
            "model='tiny' needs a built-in task or preference data (their characters make the tokenizer)"
        )
    tokenizer = char_tokenizer(alphabet)
    model = build_reward_model(
        **asdict(spec.tiny),  # its hidden_size, num_layers, num_heads and intermediate_size
        vocab_size=len(tokenizer),
        max_seq_len=min(max_length, 4096),
        seed=spec.seed,
    )  # char_tokenizer's pad id, 0, is the model's
    return model.to(dtype), tokenizer


def on_device(batch: PreferenceBatch, device: torch.device) -> PreferenceBatch:
    """The batch's tensors on `device` (its counts stay plain numbers)."""
    margin = None if batch.margin is None else batch.margin.to(device)
    return replace(
        batch,
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        margin=margin,
    )


@torch.no_grad()
def score_pairs(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    max_length: int,
    batch_size: int = 64,
    long_pairs: str = "truncate",
    precision: Precision | None = None,
) -> ScoredPairs:
    """Every pair's chosen and rejected score (float32, on the host) and token lengths as scored. The
    model scores on its device, under `precision`'s autocast (None: as stored)."""
    was_training = model.training
    model.eval()
    device, precision = model_device(model), precision or Precision()
    scores, lengths, pairs = [], [], []
    for start in range(0, len(rows), batch_size):
        batch = collate_preferences(tokenizer, rows[start : start + batch_size], max_length, long_pairs)  # type: ignore[arg-type]
        lengths.append(batch.attention_mask.sum(-1))  # [2n] tokens scored per sequence
        batch = on_device(batch, device)
        with precision.autocast(device):
            scores.append(reward_scores(model, batch.input_ids, batch.attention_mask).float().cpu())  # [2n]
        pairs.append(batch.num_pairs)
    model.train(was_training)
    parts = list(zip(scores, lengths, pairs, strict=True))  # per batch: [2n] scores, [2n] lengths, n
    return ScoredPairs(
        chosen=torch.cat([s[:n] for s, _, n in parts]),  # [N]
        rejected=torch.cat([s[n:] for s, _, n in parts]),  # [N]
        chosen_lengths=torch.cat([length[:n] for _, length, n in parts]).long(),  # [N]
        rejected_lengths=torch.cat([length[n:] for _, length, n in parts]).long(),  # [N]
    )


def pair_metrics(scored: ScoredPairs) -> dict[str, float]:
    """Pairwise accuracy (strict r_c > r_r), mean margin, mean chosen and rejected reward, and
    accuracy per bucket of |margin| (the calibration table: a calibrated model is right more
    often where it is more confident)."""
    c, r, gap = scored.chosen, scored.rejected, scored.gap
    metrics = {
        "accuracy": (gap > 0).float().mean().item(),
        "margin": gap.mean().item(),
        "chosen_rewards": c.mean().item(),
        "rejected_rewards": r.mean().item(),
        "num_pairs": float(len(gap)),
    }
    for name, _, _, inside in margin_buckets(gap):
        metrics[f"calibration/{name}/count"] = float(inside.sum())
        if inside.any():
            metrics[f"calibration/{name}/accuracy"] = (gap[inside] > 0).float().mean().item()
    return metrics


def evaluate_reward_model(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    max_length: int,
    batch_size: int = 64,
    long_pairs: str = "truncate",
    precision: Precision | None = None,
) -> dict[str, float]:
    """`pair_metrics` of the pairs as `score_pairs` scores them."""
    return pair_metrics(
        score_pairs(
            model,
            tokenizer,
            rows,
            max_length=max_length,
            batch_size=batch_size,
            long_pairs=long_pairs,
            precision=precision,
        )
    )


def diagnose(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    evaluated: tuple[ScoredPairs, dict[str, float]],
    *,
    max_length: int,
    long_pairs: str = "truncate",
    precision: Precision | None = None,
) -> dict[str, Any]:
    """reward_diagnostics.json's contents: from `evaluated`, the (scores, metrics) of an evaluation
    of `rows` by the model as it is now, plus a padding check on the first pairs' sequences."""
    sample = collate_preferences(tokenizer, rows[: PADDING_SAMPLE // 2], max_length, long_pairs)  # type: ignore[arg-type]
    sequences = [
        ids[mask].tolist() for ids, mask in zip(sample.input_ids, sample.attention_mask, strict=True)
    ]
    padding = padding_invariance(
        model, sequences, tokenizer.pad_token_id, max_length=max_length, precision=precision
    )
    return reward_diagnostics(*evaluated, padding)


def reward_step(
    spec: PairStep,
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    d: Any = None,
) -> dict[str, Any]:
    """One optimizer step over `rows`, accumulating micro-batches weighted by their pair counts. The
    batches go to the model's device; its forward passes run under autocast in `spec.dtype` (with
    wider master weights), the loss in float32."""
    optimizer.zero_grad(set_to_none=True)
    device, precision = model_device(model), Precision.of(spec.dtype, spec.master_weights)
    totals: dict[str, Any] = {"num_truncated": 0, "num_dropped": 0}
    kept = 0
    micro = [rows[s : s + spec.micro_batch_size] for s in range(0, len(rows), spec.micro_batch_size)]
    batches = [
        on_device(collate_preferences(tokenizer, m, spec.max_length, spec.long_pairs), device) for m in micro
    ]
    total_pairs = sum(b.num_pairs for b in batches)
    for batch in batches:
        with precision.autocast(device):
            scores = reward_scores(model, batch.input_ids, batch.attention_mask)  # [2n]
        scores = scores.float()  # the loss in float32 whatever the compute dtype
        n = batch.num_pairs
        out = bradley_terry_loss(
            scores[:n],
            scores[n:],
            margin=batch.margin,
            center_rewards_coefficient=spec.center_rewards_coefficient,
        )
        (out.loss * (n / total_pairs)).backward()
        totals["loss"] = totals.get("loss", 0.0) + out.loss.detach() * (n / total_pairs)
        for key, value in out.metrics.items():
            totals[key] = totals.get(key, 0.0) + value * (n / total_pairs)
        totals["num_truncated"] += batch.num_truncated
        totals["num_dropped"] += batch.num_dropped
        kept += n
    return (
        totals
        | apply_update(model, optimizer, scheduler, totals["loss"], spec.max_grad_norm, d)
        | {"num_pairs": kept}
    )


@dataclass
class HeldOut:
    """A run's evaluations of its held-out pairs: `evaluate` at the start and every eval_steps (the
    metrics, and calibration.json), `diagnose` once after the last step (reward_diagnostics.json).
    Every rank scores (the model may be sharded); files are written where `output_dir` is set (rank 0)."""

    model: Any
    tokenizer: Any
    pairs: list[dict[str, Any]]
    max_length: int
    batch_size: int
    precision: Precision
    output_dir: Path | None  # None: write nothing (ranks other than 0)
    latest: tuple[ScoredPairs, dict[str, float]] | None = None  # the last evaluation's scores, metrics

    def evaluate(self) -> dict[str, float]:
        return self.score()[1] if self.pairs else {}

    def score(self) -> tuple[ScoredPairs, dict[str, float]]:
        """Score the pairs, keep the scores as `latest`, write calibration.json; -> (scores, metrics)."""
        scored = score_pairs(
            self.model,
            self.tokenizer,
            self.pairs,
            max_length=self.max_length,
            batch_size=self.batch_size,
            precision=self.precision,
        )
        self.latest = (scored, pair_metrics(scored))
        if self.output_dir is not None:
            (self.output_dir / "calibration.json").write_text(json.dumps(self.latest[1], indent=1))
        return self.latest

    def diagnose(self, step: int) -> None:
        """After the last step: the final model's diagnostics. The latest evaluation is of it (the last
        step evaluates; with max_steps=0 the start did); a run resumed at its last step has evaluated
        nothing yet, so it scores now."""
        if not self.pairs:
            return
        found = diagnose(
            self.model,
            self.tokenizer,
            self.pairs,
            self.latest or self.score(),
            max_length=self.max_length,
            precision=self.precision,
        )
        if self.output_dir is not None:
            (self.output_dir / DIAGNOSTICS_FILE).write_text(json.dumps(found | {"step": step}, indent=1))


def evaluate_reward(plan: RewardPlan) -> dict[str, float]:
    """`grpokit eval-reward`: pairwise accuracy and calibration of the plan's model on its held-out pairs
    (the task's, or eval_dataset's), long pairs truncated."""
    _, eval_pairs, alphabet = preference_data(plan.pairs, [], None)
    if not eval_pairs:
        raise ValueError("no evaluation pairs: set task, or eval_dataset to a preference file.")
    model, tokenizer = reward_model_and_tokenizer(plan.model, alphabet, plan.step.max_length)
    device = resolve_device(plan.placement.device)
    enable_fast_matmul(device)  # TF32 matmuls on a GPU
    model = model.to(device)  # inference only: stored in the compute dtype, no autocast
    return evaluate_reward_model(
        model,
        tokenizer,
        eval_pairs,
        max_length=plan.step.max_length,
        batch_size=plan.step.micro_batch_size,
        long_pairs="truncate",
    )


def preference_data(
    spec: PairSpec, train_rows: Any, eval_rows: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """(training pairs, held-out pairs, the tiny model's alphabet): the rows given, else the task's
    built-in pairs or the dataset files the config names."""
    task = get_task(spec.task, seed=spec.seed, num_eval=spec.num_eval_pairs) if spec.task else None
    if train_rows is None:
        if task is None and spec.dataset is None:
            raise ValueError(
                "nothing to train on: set task or dataset in the config, or pass preference rows."
            )
        train_rows = (
            preference_pairs(task, task.train, seed=spec.seed, near_miss=spec.near_miss)
            if task
            else load_preferences(spec.dataset)
        )
    if eval_rows is None:
        eval_rows = (
            preference_pairs(task, task.eval, seed=spec.seed + 1, near_miss=spec.near_miss) if task else []
        )
        if task is None and spec.eval_dataset:
            eval_rows = load_preferences(spec.eval_dataset)
    train_rows, eval_rows = list(train_rows), list(eval_rows)[: spec.num_eval_pairs]
    if task is not None:
        return train_rows, eval_rows, task.alphabet
    if not (train_rows or eval_rows):  # (the caller says what is missing)
        return train_rows, eval_rows, None
    # model=tiny's characters: every prompt, chosen and rejected text
    rejected = data_alphabet(train_rows, eval_rows, prompt_column="rejected", answer_column="rejected")
    return train_rows, eval_rows, data_alphabet(train_rows, eval_rows, answer_column="chosen", extra=rejected)


def train_reward(
    cfg: RewardConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    train_rows: Sequence[dict[str, Any]] | None = None,
    eval_rows: Sequence[dict[str, Any]] | None = None,
    on_event: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> RewardResult:
    """Train a Bradley–Terry reward model as configured. The run holds `cfg.output_dir`
    exclusively until it returns or raises (rundir.py): a second run into it meanwhile is refused."""
    plan = reward_plan(cfg)  # the config, resolved once: nothing below reads `cfg`
    compare = lambda saved: resume_changes(cfg, saved)  # noqa: E731 - a checkpoint's config.yaml vs this
    d = distributed.init()
    placement = plan.placement
    with (
        exclusive_output_dir(d, Path(plan.run.output_dir)),
        ThreadGovernor.start(
            placement.num_threads, d.device if d.enabled else resolve_device(placement.device)
        ) as threads,
    ):
        return _train_reward(plan, d, threads, (model, tokenizer), (train_rows, eval_rows), on_event, compare)


def _train_reward(
    plan: RewardPlan,
    d: Any,
    threads: ThreadGovernor,
    given: tuple[Any, Any],
    rows_given: tuple[Sequence[dict[str, Any]] | None, Sequence[dict[str, Any]] | None],
    on_event: Callable[[str, int, dict[str, Any]], None] | None,
    compare: Callable[[Path], list[str]],
) -> RewardResult:
    """`train_reward` with its config resolved: `given` the (model, tokenizer) passed (or Nones),
    `rows_given` the (training, held-out) pairs passed (None: the plan's)."""
    control, spec, strategy = plan.run, plan.step, plan.placement.strategy
    emit = (on_event if d.is_main else None) or (lambda kind, step, data: None)  # rank 0 reports
    if plan.batch_size % d.world_size != 0:
        raise ValueError(f"batch_size={plan.batch_size} must be divisible by the world size {d.world_size}.")
    check_reporters(list(control.report_to))  # a missing tensorboard / wandb is said before any work
    check_push(control)  # push_to_hub while offline: said now, not after the run
    device = d.device if d.enabled else resolve_device(plan.placement.device)  # under torchrun, the rank's
    precision = Precision.of(spec.dtype, spec.master_weights)
    enable_fast_matmul(device)
    # ------------------------------------------------------------------ set-up
    output_dir = Path(control.output_dir)
    replacing = claim_output_dir(output_dir, resume=control.resume, overwrite=control.overwrite)
    train_pairs, eval_pairs, alphabet = preference_data(plan.pairs, *rows_given)
    seed_everything(plan.seed)
    model, tokenizer = given
    if model is None:
        model, tokenizer = reward_model_and_tokenizer(
            plan.model, alphabet, spec.max_length, dtype=precision.master
        )
    resume_from = latest_checkpoint(control, compare, d, on_event)  # resume=true: the newest intact one
    prepare_output_dir(d, control, replacing, resume_from is not None)  # input valid: clear, config
    if replacing and d.is_main:  # an earlier run's diagnostics are not this run's
        (output_dir / DIAGNOSTICS_FILE).unlink(missing_ok=True)
    model = distributed.wrap(d, model.to(device=device, dtype=precision.master), strategy)
    optimizer = make_optimizer(model.parameters(), plan.optimizer)
    scheduler = make_scheduler(optimizer, plan.optimizer)
    sampler = PromptSampler(pretokenize(tokenizer, train_pairs), plan.batch_size, seed=plan.seed)
    parts = TrainingParts(model, tokenizer, optimizer, scheduler, sampler)
    held_out = HeldOut(
        model,
        tokenizer,
        eval_pairs,
        spec.max_length,
        spec.micro_batch_size,
        precision,
        output_dir if d.is_main else None,
    )

    def restore(path: Path) -> tuple[int, dict[str, float]]:
        state = restore_distributed(d, strategy, path, parts)
        return int(state["step"]), {k: float(v) for k, v in state["eval_before"].items()}

    stop = StopSignals()  # SIGINT / SIGTERM are honoured from the first step on
    starting = Starting(resume_from, restore, held_out.evaluate)
    run = Run.open(control, d, emit, stop, starting, threads)
    return _reward_loop(plan, d, parts, run, held_out)


def _reward_loop(plan: RewardPlan, d: Any, parts: TrainingParts, run: Run, held_out: HeldOut) -> RewardResult:
    """The steps of a started reward-model run (`_train_reward`), then the final model's diagnostics
    and, if asked, its upload."""
    control, spec, strategy = plan.run, plan.step, plan.placement.strategy
    saves_to = SaveTo(Path(control.output_dir), control.config_yaml, control.save_total_limit)
    share = plan.batch_size // d.world_size  # pairs per rank and step

    def save(step: int) -> None:
        save_distributed(d, strategy, saves_to, step, parts, run.eval_before)

    step = run.start
    with run, run.stop:  # the signal handlers are restored, then the metrics writer closed
        for step in range(run.start + 1, control.max_steps + 1):
            began = time.perf_counter()
            parts.model.train()
            rows = parts.sampler.next_batch()[d.rank * share : (d.rank + 1) * share]  # this rank's pairs
            metrics = reward_step(
                spec, parts.model, parts.tokenizer, rows, parts.optimizer, parts.scheduler, d
            )
            metrics["step_time"] = time.perf_counter() - began
            metrics = distributed.mean_metrics(d, metrics)
            run.log(step, metrics)
            run.evaluate_if_due(step)
            if run.finish_step(step, metrics["skipped_update"] > 0, save):
                break
    if step == control.max_steps:  # finished, not stopped early: diagnose the final model
        held_out.diagnose(step)
    result = run.result(RewardResult, step)
    push_final(control, main=d.is_main, stopped=run.stop.signal is not None)  # the final model, if asked
    return result
