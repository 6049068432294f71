"""A difficulty curriculum (`curriculum: true`): prompts that GRPO cannot learn from right now are set
aside, and come back now and then, so that a step spends its completions where the rewards differ.

A *visit* is one group: the G completions of a prompt, scored. GRPO learns nothing from a group whose
rewards all agree (zero spread: every advantage is 0), so a visit is judged by its spread, for any
reward:

* spread: the rewards differ (the group is not counted in `frac_reward_zero_std`);
* solved: they all agree, on a value in the upper half of the range of rewards seen so far in the run
  (`low` … `high`: every scored completion of every batch recorded) — for a verifiable 0/1 reward,
  every completion correct;
* failed: they all agree, in the lower half — every completion wrong. While every reward seen so far
  is the same (no spread anywhere yet), an all-equal group counts as failed: nothing has been seen to
  score better.

A group none of whose completions could be scored is not a visit. A prompt's pool follows its streak:
*solved* after `patience` solved visits in a row, *failed* after `patience` failed visits in a row,
else *active*; a visit that breaks the streak (spread, or the other kind) brings it back to active.
The sampler walks each epoch's shuffled order as before and takes every active prompt, and each
set-aside one with probability `revisit` (a coin per prompt and epoch, drawn from the seed: nothing
random to save), so a prompt set aside can come back once the policy has changed. The active pool
never shrinks below one step's prompts (`floor`): a prompt that would leave fewer stays active, so a
step can always draw that many distinct prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ACTIVE, SOLVED, FAILED = 0, 1, 2  # pools, as stored
POOLS = ("active", "solved", "failed")  # their names, by number (the metrics curriculum/<name>)


@dataclass(frozen=True)
class CurriculumRule:
    """The config's curriculum: `patience` (k) visits in a row set a prompt aside, `revisit` (p) is the
    chance that a set-aside prompt is drawn when its turn in an epoch comes."""

    patience: int = 1  # (the config's default, and why: config/schema.py)
    revisit: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.patience, int) and self.patience >= 1):
            raise ValueError(f"curriculum_patience must be an integer ≥ 1, got {self.patience!r}.")
        if not (isinstance(self.revisit, (int, float)) and 0.0 <= self.revisit <= 1.0):
            raise ValueError(f"curriculum_revisit must be a probability in [0, 1], got {self.revisit!r}.")


def judge(rewards: Sequence[float], equal: bool, low: float, high: float) -> int | None:
    """A visit's outcome: ACTIVE (spread), SOLVED or FAILED against the rewards seen so far
    [`low`, `high`]; None when no completion of the group was scored (NaN: not a visit)."""
    scored = [r for r in rewards if not math.isnan(r)]
    if not scored:
        return None
    if not equal:
        return ACTIVE
    value = sum(scored) / len(scored)
    return SOLVED if high > low and value >= (low + high) / 2 else FAILED


class Curriculum:
    """The pools of `size` prompts (row indices), their streaks and the range of rewards seen."""

    def __init__(self, size: int, rule: CurriculumRule, *, floor: int, seed: int) -> None:
        self.size, self.rule, self.seed = size, rule, seed
        self.floor = min(floor, size)  # the fewest active prompts (one step's)
        self.pool = [ACTIVE] * size  # [N]
        self.streak = [0] * size  # [N] +n: the last n visits solved, −n: failed, 0: spread or unseen
        self.low: float | None = None  # the range of every reward recorded so far
        self.high: float | None = None
        self.visits = 0  # groups recorded
        self.counts = [size, 0, 0]  # prompts per pool
        self._coins: tuple[int, list[float]] | None = None  # (epoch, [N] uniform draws)

    def coins(self, epoch: int) -> list[float]:
        """[N] one uniform draw per prompt for `epoch`, from (seed, epoch) alone."""
        if self._coins is None or self._coins[0] != epoch:
            rng = random.Random(f"grpokit-curriculum:{self.seed}:{epoch}")
            self._coins = (epoch, [rng.random() for _ in range(self.size)])
        return self._coins[1]

    def offers(self, index: int, epoch: int) -> bool:
        """Whether prompt `index` is drawn when its turn in `epoch`'s order comes."""
        return self.pool[index] == ACTIVE or self.coins(epoch)[index] < self.rule.revisit

    def record(
        self, indices: Sequence[int], rewards: Sequence[Sequence[float]], equal: Sequence[bool]
    ) -> None:
        """Visits of prompts `indices` [n]: each one's G `rewards` [n, G] (NaN: unscored) and whether they
        all agree, `equal` [n] (`GroupAdvantages.is_std_zero`)."""
        scored = [r for group in rewards for r in group if not math.isnan(r)]
        if scored:
            self.low = min(scored) if self.low is None else min(self.low, *scored)
            self.high = max(scored) if self.high is None else max(self.high, *scored)
        for index, group, same in zip(indices, rewards, equal, strict=True):
            outcome = judge(group, same, self.low, self.high)  # type: ignore[arg-type]
            if outcome is not None:
                self._visit(index, outcome)

    def _visit(self, index: int, outcome: int) -> None:
        k, streak = self.rule.patience, self.streak[index]
        if outcome == SOLVED:
            streak = min(k, streak + 1) if streak > 0 else 1
        elif outcome == FAILED:
            streak = max(-k, streak - 1) if streak < 0 else -1
        else:
            streak = 0
        pool = (SOLVED if streak > 0 else FAILED) if abs(streak) >= k else ACTIVE
        if pool != ACTIVE and self.pool[index] == ACTIVE and self.counts[ACTIVE] <= self.floor:
            pool = ACTIVE  # setting it aside would leave fewer active prompts than a step draws
        self.counts[self.pool[index]] -= 1
        self.counts[pool] += 1
        self.streak[index], self.pool[index] = streak, pool
        self.visits += 1

    def metrics(self) -> dict[str, float]:
        """The share of prompts in each pool: curriculum/active, curriculum/solved, curriculum/failed."""
        return {f"curriculum/{name}": self.counts[i] / self.size for i, name in enumerate(POOLS)}

    def state_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint's state.pt is read with weights_only=True); copies."""
        return {
            "pool": list(self.pool),
            "streak": list(self.streak),
            "low": self.low,
            "high": self.high,
            "visits": self.visits,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["pool"]) != self.size or len(state["streak"]) != self.size:
            raise ValueError(
                f"the curriculum state holds {len(state['pool'])} prompts, this dataset {self.size}: "
                "it was saved for other training data."
            )
        self.pool, self.streak = [int(p) for p in state["pool"]], [int(s) for s in state["streak"]]
        self.low = None if state["low"] is None else float(state["low"])
        self.high = None if state["high"] is None else float(state["high"])
        self.visits = int(state["visits"])
        self.counts = [self.pool.count(i) for i in range(len(POOLS))]
