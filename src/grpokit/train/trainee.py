"""What the GRPO loop trains with: the step's parameters, the policy engine and what updates it, the
prompts in order, and the state a checkpoint carries beside the weights (target_entropy's control)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config.plan import LossSpec, StepSpec
from ..data import PromptSampler
from ..engine import PolicyEngine
from ..rollout import SamplingParams
from .batch import Batch


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


@dataclass
class EntropyControl:
    """target_entropy: the coefficient c ≥ 0 of an entropy bonus −c·H in the loss, moved after each
    step by `rate` × (target − the step's mean token entropy): it grows while the entropy is below the
    target and shrinks to 0 above it. Saved in every checkpoint (`state_dict`), so a resumed run goes on
    with the same c."""

    target: float
    rate: float
    coef: float = 0.0

    def update(self, entropy: float) -> None:
        self.coef = max(0.0, self.coef + self.rate * (self.target - entropy))

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])


@dataclass(frozen=True)
class Trainee:
    """What the loop trains with: the policy engine, what updates it, the step's parameters and the
    training prompts in order (and target_entropy's control, when set)."""

    engine: PolicyEngine
    update: Update
    params: StepParams
    prompts: PromptSampler
    entropy: EntropyControl | None = None
    teacher: PolicyEngine | None = None  # loss_type=opd or gkd: the teacher, scoring only
    # max_staleness: the rollout worker that draws the batches (train/rollout_worker.AsyncRollout)
    rollout: Any = None


@dataclass(frozen=True)
class DrawnBatch:
    """A step's batch as drawn and scored, on the host: its metrics, whether the student wrote it, and
    the random state right after drawing it (a redo of the step starts from here)."""

    batch: Batch
    metrics: dict[str, Any]
    on_policy: bool
    rng: dict[str, Any]


@dataclass
class StepProgress:
    """How far a step got: its phase ("sampling"; "reference" for the passes before the update;
    "update"; "optimizer" while the optimizer applies an update, which may then be half done), the
    optimizer updates applied (0: the weights and optimizer are as after the step before), and the
    batch once drawn, from which the step can be redone without sampling again."""

    phase: str = "sampling"
    updates: int = 0
    drawn: DrawnBatch | None = None
