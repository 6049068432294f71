"""What a run reports: `metrics.jsonl` and the `report_to` destinations (TensorBoard, Weights & Biases),
the warm start's losses, and the warnings a loop gives the user (a run that cannot learn)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .events import Emit, EventKind
from .run_files import MetricsRow, read_jsonl


def _reporter(name: str, report_to: Sequence[str]) -> Any:
    """What a `report_to` destination writes with (TensorBoard's SummaryWriter, the wandb module), or
    one line naming the fix."""
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError as error:
        from ..config import ConfigError

        rest = ", ".join(n for n in report_to if n != name)
        raise ConfigError(
            f"report_to includes {name} but it cannot be imported ({error}): install it with "
            f"`pip install {name}`, or leave it out with report_to=[{rest}]."
        ) from None


def check_reporters(report_to: Sequence[str]) -> None:
    """Before any work: every destination in `report_to` can be written to (else one clear line)."""
    for name in report_to:
        _reporter(name, report_to)


def wandb_settings(output_dir: Path) -> dict[str, Any]:
    """wandb.init's arguments, offline-safe: offline unless the user set WANDB_MODE or has an API key
    (WANDB_API_KEY), so a run never waits on a network login; project from WANDB_PROJECT."""
    online_allowed = "WANDB_MODE" in os.environ or bool(os.environ.get("WANDB_API_KEY"))
    return {
        "project": os.environ.get("WANDB_PROJECT") or "grpokit",
        "name": output_dir.resolve().name,
        "dir": str(output_dir),
        "mode": None if online_allowed else "offline",
    }


@dataclass
class MetricsWriter:
    """Metrics to `metrics.jsonl` (one JSON object per step, always), and to each destination in
    `report_to`: TensorBoard (output_dir/tensorboard) and Weights & Biases (output_dir/wandb, with
    `config`, the resolved run config)."""

    output_dir: Path
    report_to: Sequence[str] = ()
    config: dict[str, Any] | None = None
    start_step: int = 0  # a resumed run: TensorBoard events after this step are the dead attempt's
    tensorboard: Any = None
    wandb: Any = None  # the wandb run
    last_eval: dict[str, Any] = field(default_factory=dict)  # the last row written with prefix "eval/"
    _file: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_reporters(self.report_to)  # before anything is opened
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = (self.output_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if "tensorboard" in self.report_to:
            summary_writer = _reporter("tensorboard", self.report_to)
            self.tensorboard = summary_writer(
                str(self.output_dir / "tensorboard"),
                purge_step=self.start_step + 1 if self.start_step else None,
            )
        if "wandb" in self.report_to:
            wandb = _reporter("wandb", self.report_to)
            self.wandb = wandb.init(config=self.config, **wandb_settings(self.output_dir))

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
        row = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            number = value.item() if isinstance(value, torch.Tensor) else value
            row[prefix + key] = None if isinstance(number, float) and not math.isfinite(number) else number
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if prefix == "eval/":
            self.last_eval = row
        scalars = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step=step)
        return row

    def close(self) -> None:
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


class NullWriter:
    """MetricsWriter's interface for ranks other than 0: nothing is written."""

    last_eval: dict[str, Any] = {}

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        row = {"step": step} | {
            prefix + k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()
        }
        if prefix == "eval/":
            self.last_eval = row
        return row

    def close(self) -> None:
        pass


def truncate_metrics_after(output_dir: Path, step: int) -> None:
    """On resume: drop metric rows written after the checkpoint (they will be written again), and
    a last line torn by a crash mid-write. The rows are read through their schema (run_files.py): a
    damaged line elsewhere is a RunFileError naming it, and the file is left as it is.

    The kept rows go to a temporary file beside metrics.jsonl, fsynced, which then replaces it in one
    rename: a crash or a full disk at any moment leaves either the old file or the new one, whole,
    never a file cut short (rewriting in place lost every row after the point the write reached)."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = [json.dumps(row) for row in read_jsonl(path, MetricsRow) if row["step"] <= step]
    replace_file(path, "".join(line + "\n" for line in kept))


def replace_file(path: Path, text: str) -> None:
    """`path` holding `text`, written to a temporary file beside it (`.NAME.tmp-PID`, which a killed
    run's successor clears: rundir.clear_staging), fsynced, then renamed over it: a crash or a full
    disk at any moment leaves either the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # same directory: the rename is atomic
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the new rows on disk before the rename makes them the file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself on disk
    finally:
        os.close(directory)


def warn(on_event: Emit | None, step: int, message: str) -> None:
    """A warning for the user: to the progress display when there is one, else to the `grpokit` logger."""
    if on_event is not None:
        on_event(EventKind.WARNING, step, {"message": message})
    else:
        logging.getLogger("grpokit").warning("step %d: %s", step, message)


def write_sft_metrics(output_dir: Path, losses: list[float]) -> None:
    """The warm start's loss per step, for the report (`sft_metrics.jsonl`, one row per step)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = (json.dumps({"sft_step": i + 1, "sft/loss": loss}) for i, loss in enumerate(losses))
    (output_dir / "sft_metrics.jsonl").write_text("".join(row + "\n" for row in rows))


@dataclass
class ZeroSpreadWatch:
    """Says once when a run cannot learn: GRPO's advantage is zero in a group whose G rewards all
    agree, so when most groups agree for `patience` steps in a row, no gradient reaches the policy.
    Re-arms once the share falls back."""

    patience: int = 10
    threshold: float = 0.5  # "most groups"
    _run: int = 0
    _warned: bool = False

    def update(self, frac_zero_std: float, reward: float) -> str | None:
        self._run = self._run + 1 if frac_zero_std > self.threshold else 0
        if self._run == 0:
            self._warned = False
        if self._run < self.patience or self._warned:
            return None
        self._warned = True
        head = f"{100 * frac_zero_std:.0f}% of groups have had zero reward spread for {self._run} steps"
        if reward >= 0.95:
            return (
                f"{head}: the policy already solves almost every prompt, so there is little left to learn "
                "from them. Use harder prompts, or stop here."
            )
        cause = (
            "almost every completion scores 0"
            if reward < 0.05
            else "the G completions of a prompt score alike"
        )
        return (
            f"{head} ({cause}): GRPO's advantages are then zero and the policy barely moves. Fixes: "
            "a supervised warm start (sft_steps), a higher temperature, more completions per prompt "
            "(num_generations), an easier curriculum or a reward with partial credit, or "
            "dynamic_sampling=true."
        )


@dataclass(frozen=True)
class Invariant:
    """What a step must satisfy: broken when `deviation(value)` exceeds `bound` (float32 compute, no
    autocast or TF32), or `mixed_bound` (bf16/fp16 autocast or TF32: 8 or 10 mantissa bits over
    logits of a few tens put round-off near 0.1 nats in the worst token)."""

    deviation: Callable[[float], float]
    bound: float
    mixed_bound: float
    cause: str


# invariant metric -> what breaking it means; each says so once per run (`InvariantWatch`)
INVARIANTS = {
    "invariants/groups_intact": Invariant(
        lambda v: 1.0 - v,
        0.0,
        0.0,
        "a run of G rows holds more than one prompt, so advantages compare completions of different "
        "prompts: the batch was reordered or merged out of group order",
    ),
    "invariants/group_advantage_sum_max": Invariant(
        abs,
        1e-4,  # float32 round-off of a mean-centred group is ~1e-7·G
        1e-4,  # (advantages are float32 on the host whatever the compute dtype)
        "a group's advantages do not sum to 0: they were computed over rows not ordered by group, or "
        "changed after group normalisation",
    ),
    "invariants/first_ratio_max": Invariant(
        abs,
        1e-3,
        0.1,
        "the policy ratio is not 1 before the policy has moved: the old log-probs are not those of the "
        "policy being updated (a stale or different model, another sampling distribution such as top-k "
        "or top-p treated as the loss's, or a forward that differs from the training one)",
    ),
    "invariants/kl_at_start_max": Invariant(
        abs,
        1e-3,
        0.1,
        "the reference's log-probs differ from the policy's at step 1, though the reference is the "
        "starting policy: a stale or different reference model, or a reference pass that differs from "
        "the training forward",
    ),
    "invariants/loss_weight_error": Invariant(
        abs,
        1e-5,  # a sum of a few float32 weights of at most 1
        1e-5,
        "the loss's normaliser gives the batch's tokens another total weight than one process with the "
        "whole batch would: the result depends on the micro-batch split or the world size (a token count "
        "not summed over ranks, or a mean not divided by the number of micro-batches)",
    ),
}


class InvariantWatch:
    """Says once per run and invariant when a step breaks one of `INVARIANTS`: its name, the step,
    the value and the likely cause. `exact`: the policy computes in float32 without autocast or TF32
    (the tight bounds apply). `strict` (strict_invariants): the first break also asks the loop to stop,
    with a checkpoint (`stop` names the invariant)."""

    def __init__(self, exact: bool = True, strict: bool = False) -> None:
        self.exact, self.strict = exact, strict
        self.said: set[str] = set()
        self.stop: str | None = None

    def update(self, step: int, metrics: dict[str, Any]) -> list[str]:
        messages = []
        for name, rule in INVARIANTS.items():
            value = metrics.get(name)
            if value is None or name in self.said:
                continue
            number = float(value)
            bound = rule.bound if self.exact else rule.mixed_bound
            if not rule.deviation(number) > bound:
                continue
            self.said.add(name)
            short = name.split("/", 1)[1]
            head = f"invariant {short} broken at step {step} (value {number:.3g}, bound {bound:g})"
            message = f"{head}: {rule.cause}."
            if self.strict and self.stop is None:
                self.stop = f"invariant {short}"
                message += " strict_invariants=true: the run stops here, with a checkpoint of this step."
            messages.append(message)
        return messages
