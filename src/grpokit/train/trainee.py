"""What the GRPO loop trains with: the step's parameters, the policy engine and what updates it, the
prompts in order, where each step's batch comes from (`BatchSource`), and the state a checkpoint
carries beside the weights (the entropy bonus's control)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Protocol

import torch

from ..config.plan import EntropySpec, LossSpec, StepSpec
from ..data import PromptSampler
from ..engine import PolicyEngine
from ..rollout import SamplingParams
from .batch import Batch
from .distributed import Dist
from .threads import ThreadGovernor


@dataclass(frozen=True)
class StepParams:
    """What one step needs: the config's step (`config.plan.StepSpec`: rewards, filters, clipping,
    reference sync...) with this rank's share of the prompts, the sampling and the loss's arguments
    (the plan's `LossSpec` with the data's max_completion_length)."""

    spec: StepSpec
    prompts_per_rank: int  # P on this rank (prompts_per_step / world size): whole groups
    sampling: SamplingParams  # G, lengths, temperature, filters (the seed is set per step)
    loss: LossSpec

    @classmethod
    def of(cls, spec: StepSpec, sampling: SamplingParams, world_size: int = 1) -> StepParams:
        """The config's step with its sampling and this rank's share."""
        return cls(
            spec=spec,
            prompts_per_rank=spec.prompts_per_step // world_size,
            sampling=sampling,
            loss=replace(spec.loss, max_completion_length=sampling.max_completion_length),
        )


@dataclass(frozen=True)
class Update:
    """What applies gradients: the optimizer and its schedule."""

    optimizer: torch.optim.Optimizer
    scheduler: Any


def _towards_target(control: EntropyControl, entropy: float) -> float:
    """target_entropy: c + rate × (target − H), at least 0 (grows below the target, shrinks above)."""
    assert control.spec.target is not None
    return max(0.0, control.coef + control.spec.rate * (control.spec.target - entropy))


def _stepped(control: EntropyControl, entropy: float) -> float:
    """TRL's use_adaptive_entropy (Skywork-OR1): c ± delta within [min, max], up while H ≤ target."""
    assert control.spec.target is not None
    low, high = control.spec.bounds
    up = entropy <= control.spec.target
    return min(control.coef + control.spec.rate, high) if up else max(control.coef - control.spec.rate, low)


# EntropySpec.rule -> the next coefficient from this one and the step's mean token entropy
ENTROPY_RULES: dict[str, Callable[[EntropyControl, float], float]] = {
    "target": _towards_target,
    "fixed": lambda control, entropy: control.coef,  # TRL's entropy_coef alone
    "stepped": _stepped,
}


@dataclass
class EntropyControl:
    """The coefficient c of the entropy bonus −c·H in the loss, moved after each step by its rule
    (`ENTROPY_RULES`) from the step's mean token entropy. Saved in every checkpoint (`state_dict`), so
    a resumed run goes on with the same c."""

    spec: EntropySpec
    coef: float = math.nan  # (NaN: the spec's first coefficient)
    last_entropy: float = math.inf  # the last step's mean token entropy (none yet: above any target)

    def __post_init__(self) -> None:
        if math.isnan(self.coef):
            self.coef = self.spec.coef

    @property
    def applied(self) -> float:
        """The coefficient this step's loss uses: TRL's adaptive bonus acts only while the entropy is
        at or below its target (not before a first step has measured it)."""
        if self.spec.rule == "stepped" and not self.last_entropy <= (self.spec.target or 0.0):
            return 0.0
        return self.coef

    def update(self, entropy: float) -> None:
        self.coef = ENTROPY_RULES[self.spec.rule](self, entropy)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float | None]:
        return {
            "coef": self.coef,
            "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy,
        }

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.coef = float(state["coef"])  # type: ignore[arg-type]
        last = state.get("last_entropy")
        self.last_entropy = math.inf if last is None else float(last)


@dataclass(frozen=True)
class DrawnBatch:
    """A step's batch as drawn and scored, on the host: its metrics, whether the student wrote it, and
    the random state right after drawing it (a redo of the step starts from here)."""

    batch: Batch
    metrics: dict[str, object]  # numbers and 0-d tensors, TRL's names
    on_policy: bool
    rng: dict[str, object]  # train.checkpoint.rng_state()


RewardFuncs = Sequence[Callable[..., object]]
StopCheck = Callable[[], bool] | None  # a stop signal, looked at while reward functions run


class BatchSource(Protocol):
    """The one place a step's batch comes from, opened by train/batch_source.py: drawn in process, or
    by the asynchronous rollout (workers or servers). The loop, set-up and checkpoint glue never ask
    which. Its life: `prepare` (the policy, before wrapping), `start`, each step `draw` and `after_step`,
    `state_dict` with each checkpoint (`load_state_dict` on resume, before `start`), `close` however the
    run ends. A source subclasses this: what it does not override does nothing."""

    def prepare(self, policy: torch.nn.Module) -> None:
        """The placed, warm-started policy, before it is wrapped for training."""

    def start(self, trainee: Trainee, steps: range, threads: ThreadGovernor | None) -> None:
        """The loop begins: `steps` are those it runs; `threads`: the run's CPU-thread governor."""

    def draw(self, step: int, trainee: Trainee, rewards: RewardFuncs, d: Dist, stop: StopCheck) -> DrawnBatch:
        """Step `step`'s batch, scored by `rewards`, with its metrics."""
        ...

    def after_step(self, step: int, module: torch.nn.Module) -> None:
        """Step `step`'s update is applied to `module` (version `step` of the weights exists)."""

    def state_dict(self, step: int) -> dict[str, object]:
        """What checkpoint-<step> holds of it, beside the weights: entries of the checkpoint's state."""
        return {}

    def load_state_dict(self, state: dict[str, object], trainee: Trainee) -> str | None:
        """Restored from a checkpoint's whole `state`; what does not fit this run, in one phrase. (A
        checkpoint of an asynchronous run resumes synchronously: its batches in flight unused.)"""
        return None

    def close(self) -> None:
        """The run ended (returned, raised, or stopped before its first step)."""


@dataclass(frozen=True)
class Trainee:
    """What the loop trains with: the policy engine, what updates it, the step's parameters, the
    training prompts in order and where each step's batch comes from (and target_entropy's control,
    a teacher, when set)."""

    engine: PolicyEngine
    update: Update
    params: StepParams
    prompts: PromptSampler
    source: BatchSource
    entropy: EntropyControl | None = None
    teacher: PolicyEngine | None = None  # loss_type=opd or gkd: the teacher, scoring only


class Phase(str, Enum):
    """Where a step is: what the failure path reads (step_failures.py) to say what ran out of memory,
    whether the step can be redone with a smaller micro-batch, and whether the weights may be half
    updated."""

    SAMPLING = "sampling"  # drawing and scoring the batch
    REFERENCE = "reference"  # the passes before the update (old policy, reference, teacher)
    UPDATE = "update"  # forward and backward of the update's micro-batches
    OPTIMIZER = "optimizer"  # the optimizer applying an update: the weights may be half updated
    EVALUATION = "evaluation"  # the held-out evaluation after a step

    @property
    def said(self) -> str:
        """How a message names it: "out of device memory in {said} of step N"."""
        return {"reference": "the reference pass", "update": "the update"}.get(self.value, self.value)


@dataclass
class StepProgress:
    """How far a step got: its `Phase`, the optimizer updates applied (0: the weights and optimizer
    are as after the step before), and the batch once drawn, from which the step can be redone without
    sampling again."""

    phase: Phase = Phase.SAMPLING
    updates: int = 0
    drawn: DrawnBatch | None = None
