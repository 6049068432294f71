"""Bradley–Terry reward-model training, top to bottom.

One step: take `batch_size` preference pairs -> in micro-batches, score chosen and rejected
sequences in one forward pass each (stacked: 2n rows) -> `ops.bradley_terry_loss`, weighted by the
micro-batch's share of the pairs so the accumulated gradient is the batch mean -> clip -> AdamW ->
metrics, evaluation (pairwise accuracy, margins, a calibration table), checkpoints.
Optimizer, schedule, checkpoints, metrics and resume are the GRPO trainer's (train/common.py).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import RewardConfig, load_config, to_yaml
from ..data import (
    PromptSampler,
    collate_preferences,
    get_task,
    load_preferences,
    preference_pairs,
    pretokenize,
)
from ..models import build_reward_model, char_tokenizer, load_reward_model, reward_scores
from ..ops import bradley_terry_loss
from . import common, distributed

CALIBRATION_EDGES = (0.0, 0.5, 1.0, 2.0, 4.0, math.inf)  # buckets of |r_chosen − r_rejected|


@dataclass(frozen=True)
class RewardResult:
    output_dir: Path
    steps: int
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    stopped_by: str | None = None


def reward_model_and_tokenizer(cfg: RewardConfig, alphabet: str | None) -> tuple[Any, Any]:
    if cfg.model != "tiny":
        loaded = load_reward_model(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
        return loaded.model, loaded.tokenizer
    if alphabet is None:
        raise ValueError(
            "model='tiny' needs a built-in task (its alphabet makes the tokenizer); set task or model."
        )
    tokenizer = char_tokenizer(alphabet)
    model = build_reward_model(
        hidden_size=cfg.tiny_hidden_size,
        num_layers=cfg.tiny_num_layers,
        num_heads=cfg.tiny_num_heads,
        vocab_size=len(tokenizer),
        max_seq_len=min(cfg.max_length, 4096),
        seed=cfg.seed,
        intermediate_size=cfg.tiny_intermediate_size,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.to(getattr(torch, cfg.dtype)), tokenizer


@torch.no_grad()
def evaluate_reward_model(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    max_length: int,
    batch_size: int = 64,
    long_pairs: str = "truncate",
) -> dict[str, float]:
    """Pairwise accuracy (strict r_c > r_r), mean margin, mean chosen and rejected reward, and
    accuracy per bucket of |margin| (the calibration table: a calibrated model is right more
    often where it is more confident)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for start in range(0, len(rows), batch_size):
        batch = collate_preferences(tokenizer, rows[start : start + batch_size], max_length, long_pairs)  # type: ignore[arg-type]
        scores = reward_scores(model, batch.input_ids, batch.attention_mask).float()
        chosen.append(scores[: batch.num_pairs])
        rejected.append(scores[batch.num_pairs :])
    model.train(was_training)
    c, r = torch.cat(chosen), torch.cat(rejected)
    gap = c - r
    metrics = {
        "accuracy": (gap > 0).float().mean().item(),
        "margin": gap.mean().item(),
        "chosen_rewards": c.mean().item(),
        "rejected_rewards": r.mean().item(),
        "num_pairs": float(len(gap)),
    }
    for lo, hi in zip(CALIBRATION_EDGES[:-1], CALIBRATION_EDGES[1:], strict=True):
        inside = (gap.abs() >= lo) & (gap.abs() < hi)
        name = f"calibration/{lo:g}-{hi:g}"
        metrics[name + "/count"] = float(inside.sum())
        if inside.any():
            metrics[name + "/accuracy"] = (gap[inside] > 0).float().mean().item()
    return metrics


def reward_step(
    cfg: RewardConfig,
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    d: Any = None,
) -> dict[str, Any]:
    """One optimizer step over `rows`, accumulating micro-batches weighted by their pair counts."""
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, Any] = {"num_truncated": 0, "num_dropped": 0}
    kept = 0
    micro = [rows[s : s + cfg.micro_batch_size] for s in range(0, len(rows), cfg.micro_batch_size)]
    batches = [collate_preferences(tokenizer, m, cfg.max_length, cfg.long_pairs) for m in micro]
    total_pairs = sum(b.num_pairs for b in batches)
    for batch in batches:
        scores = reward_scores(model, batch.input_ids, batch.attention_mask)  # [2n]
        n = batch.num_pairs
        out = bradley_terry_loss(
            scores[:n],
            scores[n:],
            margin=batch.margin,
            center_rewards_coefficient=cfg.center_rewards_coefficient,
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
        | common.apply_update(model, optimizer, scheduler, totals["loss"], cfg.max_grad_norm, d)
        | {"num_pairs": kept}
    )


def _pairs(
    cfg: RewardConfig, train_rows: Any, eval_rows: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    task = get_task(cfg.task, seed=cfg.seed, num_eval=cfg.num_eval_pairs) if cfg.task else None
    if train_rows is None:
        if task is None and cfg.dataset is None:
            raise ValueError(
                "nothing to train on: set task or dataset in the config, or pass preference rows."
            )
        train_rows = (
            preference_pairs(task, task.train, seed=cfg.seed, near_miss=cfg.near_miss)
            if task
            else load_preferences(cfg.dataset)
        )
    if eval_rows is None:
        eval_rows = (
            preference_pairs(task, task.eval, seed=cfg.seed + 1, near_miss=cfg.near_miss) if task else []
        )
        if task is None and cfg.eval_dataset:
            eval_rows = load_preferences(cfg.eval_dataset)
    return list(train_rows), list(eval_rows)[: cfg.num_eval_pairs], task.alphabet if task else None


def train_reward(  # noqa: C901 - the loop is deliberately one function that reads top to bottom
    cfg: RewardConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    train_rows: Sequence[dict[str, Any]] | None = None,
    eval_rows: Sequence[dict[str, Any]] | None = None,
    on_event: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> RewardResult:
    d = distributed.init()
    emit = (on_event if d.is_main else None) or (lambda kind, step, data: None)  # rank 0 reports
    if cfg.batch_size % d.world_size != 0:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the world size {d.world_size}.")
    common.check_reporters(cfg.report_to)  # a missing tensorboard / wandb is said before any work
    # ------------------------------------------------------------------ set-up
    output_dir = Path(cfg.output_dir)
    replacing = common.claim_output_dir(output_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    train_pairs, eval_pairs, alphabet = _pairs(cfg, train_rows, eval_rows)
    common.seed_everything(cfg.seed)
    if model is None:
        model, tokenizer = reward_model_and_tokenizer(cfg, alphabet)
    distributed.barrier(d)  # every rank has checked the directory and its input before anything is deleted
    if d.is_main:
        if replacing:  # overwrite=true, and the input is valid: only now is the earlier run deleted
            common.clear_earlier_run(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(to_yaml(cfg))
    distributed.barrier(d)
    model = distributed.wrap(d, model, cfg.strategy)
    optimizer = common.make_optimizer(model.parameters(), cfg)
    scheduler = common.make_scheduler(optimizer, cfg, cfg.max_steps)
    sampler = PromptSampler(pretokenize(tokenizer, train_pairs), cfg.batch_size, seed=cfg.seed)
    share = cfg.batch_size // d.world_size  # pairs per rank and step

    def evaluate_now() -> dict[str, float]:
        if not eval_pairs:
            return {}
        metrics = evaluate_reward_model(
            model, tokenizer, eval_pairs, max_length=cfg.max_length, batch_size=cfg.micro_batch_size
        )
        if d.is_main:
            (output_dir / "calibration.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    checkpoints = common.list_checkpoints(output_dir) if cfg.resume else []

    def restore(path: Path) -> tuple[int, dict[str, float]]:
        state = common.restore_distributed(d, cfg.strategy, path, model, optimizer, scheduler, sampler)
        return int(state["step"]), {k: float(v) for k, v in state["eval_before"].items()}

    if checkpoints:
        load_config(RewardConfig, checkpoints[-1] / "config.yaml")  # a checkpoint's config is validated too
    start, eval_before, writer = common.begin(
        d, output_dir, checkpoints[-1] if checkpoints else None, restore, evaluate_now, emit, cfg
    )

    # ------------------------------------------------------------------ the loop
    stop, skips, step = common.StopSignals(), 0, start
    try:
        stop.__enter__()
        for step in range(start + 1, cfg.max_steps + 1):
            began = time.perf_counter()
            model.train()
            rows = sampler.next_batch()[d.rank * share : (d.rank + 1) * share]  # this rank's pairs
            metrics = reward_step(cfg, model, tokenizer, rows, optimizer, scheduler, d)
            metrics["step_time"] = time.perf_counter() - began
            metrics = distributed.mean_metrics(d, metrics)
            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                emit("step", step, writer.write(step, metrics))
            if step == cfg.max_steps or (cfg.eval_steps and step % cfg.eval_steps == 0):
                emit("eval", step, writer.write(step, evaluate_now(), prefix="eval/"))
            stopping = distributed.any_rank(d, stop.signal is not None)
            skipped = metrics["skipped_update"] > 0
            last_chance = skipped and skips + 1 >= cfg.max_consecutive_skips
            if (
                step == cfg.max_steps
                or (cfg.save_steps and step % cfg.save_steps == 0)
                or stopping
                or last_chance
            ):
                common.save_distributed(
                    d,
                    cfg.strategy,
                    output_dir,
                    step,
                    model,
                    tokenizer,
                    optimizer,
                    scheduler,
                    sampler,
                    eval_before,
                    to_yaml(cfg),
                    cfg.save_total_limit,
                )
            skips = common.skip_guard(skips, skipped, cfg.max_consecutive_skips, step)
            if stopping:
                emit(
                    "stopped",
                    step,
                    {"signal": stop.signal or "a signal on another rank", "output_dir": str(output_dir)},
                )
                break
    finally:
        stop.__exit__(None, None, None)
        writer.close()
    eval_after = {k[len("eval/") :]: v for k, v in writer.last_eval.items()} if writer.last_eval else {}
    return RewardResult(
        output_dir=output_dir,
        steps=step,
        stopped_by=stop.signal,
        eval_before=eval_before,
        eval_after=eval_after,
    )
