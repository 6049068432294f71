"""What watches a GRPO run after each step: the invariants (a strict one stops the run), the alerts
(alerts.jsonl), reward functions that scored nothing, sample completions, and the held-out evaluation
where due. The loop makes one call after a step (`StepWatchers.after_step`) and one for the evaluation
(`StepWatchers.evaluate_if_due`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..models import release_cached_memory
from ..rewards import reward_names
from ..rewards.scoring import ScoringStopped
from .alerts import AlertWatch
from .batch import Batch
from .events import Emit, EventKind
from .grpo_step import first_line
from .metrics import InvariantWatch, warn
from .run import Run


class StepWatchers:
    """Everything that looks at a step's figures once it is logged. On rank 0 only, except the
    invariants, whose strict stop every rank takes."""

    def __init__(
        self,
        run: Run,
        on_event: Emit | None,
        reward_funcs: Sequence[Callable[..., Any]],
        *,
        exact: bool,
        learns_from_spread: bool,
    ) -> None:
        self.run, self.control, self.on_event = run, run.control, on_event
        self.output_dir, self.d = Path(run.output_dir), run.d
        self.unscored = UnscoredWatch(reward_funcs)
        self.invariants = InvariantWatch(exact=exact, strict=run.control.strict_invariants)
        # zero spread starves a loss whose only signal is the group-relative advantage, not dynamic
        # sampling's (it drops such groups) nor a teacher's (its term differs token by token)
        self.alerts = AlertWatch(run.control.alert_thresholds, watch_zero_spread=learns_from_spread)
        self.evaluation_oom: str | None = None  # the evaluation ran out of device memory: the error
        if self.d.is_main:  # (alerts.jsonl: rank 0's, as metrics.jsonl)
            self.alerts.resume(self.output_dir, run.start)
            if run.start == 0:
                self.alerts.evaluated(0, {f"eval/{k}": v for k, v in run.eval_before.items()})

    def after_step(self, step: int, metrics: dict[str, Any], batch: Batch) -> None:
        """The step's logged figures: invariants, alerts, unscored rewards, sample completions."""
        stop, is_main = self.run.stop, self.d.is_main
        broken = self.invariants.update(step, metrics)  # every rank: a strict stop is every rank's
        if self.invariants.stop is not None and stop.signal is None:
            stop.signal = self.invariants.stop  # finish_step saves this step and stops
        fired = self.alerts.update(step, metrics) if is_main else []
        for message in self.unscored.update(metrics) + broken + [a.line() for a in fired] if is_main else []:
            warn(self.on_event, step, message)
        AlertWatch.write(self.output_dir, fired)
        every = self.control.log_completions_steps
        if every and step % every == 0:
            texts = {"prompts": batch.prompts, "completions": batch.completions}
            self.run.emit(EventKind.COMPLETIONS, step, texts | {"rewards": batch.rewards.tolist()})

    def evaluate_if_due(self, step: int) -> None:
        """The held-out evaluation where due, and its alerts (held-out accuracy against the reward:
        hacking). A stop signal while it scores, or the device out of memory, abandons it: the update is
        done, so the loop's finish_step saves the step and stops (the error said after)."""
        try:
            evaluated = self.run.evaluate_if_due(step)
        except ScoringStopped as stopped:
            evaluated = None
            if self.d.is_main:
                warn(self.on_event, step, f"evaluation at step {step} abandoned: {stopped}")
        except torch.OutOfMemoryError as error:
            evaluated, self.evaluation_oom = None, first_line(error)
            self.run.stop.signal = self.run.stop.signal or "out of device memory in evaluation"
            release_cached_memory(self.d.device)
        if evaluated is not None and self.d.is_main:
            fired = self.alerts.evaluated(step, evaluated)
            for alert in fired:
                warn(self.on_event, step, alert.line())
            AlertWatch.write(self.output_dir, fired)


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
