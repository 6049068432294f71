"""Training-health alerts: a run that is going bad says so while it runs, once per alert.

Each alert reads the step's metrics (and the held-out evaluations), compares them with a threshold
(`config.alerts.ALERT_THRESHOLDS`, changed with `alert_thresholds: {name: value}`), and fires at most
once per run: a line for the terminal with the value, the threshold, the likely cause and the fix, a
row of `output_dir/alerts.jsonl` ({step, name, value, threshold, advice}), and a marker on the report's
plots (report.py reads the file). The zero-spread warning is one of them.

Windows: trends compare the mean of the last WINDOW steps with the mean of the first WINDOW steps
(the entropy: with the first step's, the starting policy's), so one noisy step never fires a trend
alert. A resumed run replays the metric rows it kept and the alerts already said, so it fires
nothing twice and judges trends from the run's real start.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config.alerts import ALERT_THRESHOLDS
from .metrics import ZeroSpreadWatch, replace_file
from .run_files import AlertRow, MetricsRow, read_jsonl

WINDOW = 5  # steps in a trend's mean
ALERTS_FILE = "alerts.jsonl"

# the alerts on one step's value above its threshold: name -> (metric, what it means and the fix)
ABOVE = {
    "clip_ratio": (
        "clip_ratio/region_mean",
        "a large share of tokens moved outside the clipping range within one step: the updates are too "
        "large for the trust region, and their gradients are dropped. Lower learning_rate or "
        "num_iterations, or raise epsilon.",
    ),
    "kl": (
        "kl",
        "the policy has moved far from the reference: rewards may be over-optimised and text degenerate. "
        "Raise beta, lower learning_rate, or sync the reference (sync_ref_model).",
    ),
}

# logp_mismatch (`AlertWatch._logp_mismatch`): the sampler's log-probs against the training forward's
MISMATCH = "sampling/sampling_logp_difference/mean"
# logged exactly when sampling_correction weighs the step (before_update.py or update.py: ratio_metrics)
CORRECTED = "sampling/importance_sampling_ratio/mean"
STALENESS = "async/staleness"  # weight versions between the batch's sampler and the trained policy
MISMATCH_ADVICE = {  # (the batch sampled by older weights, sampling_correction on) -> what it means, the fix
    (False, False): "the sampler's log-probs differ from the training forward's: the update is off-policy "
    "by more than round-off. Correct it with sampling_correction (token_truncate), or sample and train in "
    "the same precision.",
    (False, True): "the sampler's log-probs differ from the training forward's on a batch the current "
    "weights sampled: they compute differently (precision, kernels). sampling_correction weighs the "
    "difference already, but its bounds cut the weights of the tokens furthest apart: sample and train "
    "in the same precision.",
    (True, False): "the batches were sampled by older weights (async/staleness) and sampling_correction "
    "is none, so the update is off-policy by what the policy learned since. Set sampling_correction: "
    "token_truncate (the decoupled objective), or lower max_staleness.",
}


@dataclass(frozen=True)
class Alert:
    step: int
    name: str
    value: float
    threshold: float
    advice: str  # what it means and the fix

    def line(self) -> str:
        head = f"alert {self.name} at step {self.step} (value {self.value:.3g}, threshold {self.threshold:g})"
        return f"{head}: {self.advice}"


def _finite(value: Any) -> float | None:
    """A metric as a finite float, or None (absent, None or NaN)."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class AlertWatch:
    """Fires the training-health alerts (module doc). `thresholds`: the run's overrides of the
    defaults. `watch_zero_spread`: False under dynamic sampling (it drops zero-spread groups itself)."""

    def __init__(self, thresholds: Mapping[str, float] | None = None, watch_zero_spread: bool = True) -> None:
        self.threshold = {name: default for name, (default, _) in ALERT_THRESHOLDS.items()} | dict(
            thresholds or {}
        )
        self.fired: set[str] = set()
        self.history: dict[str, list[float]] = {}  # metric -> its finite values, in step order
        self.zero_spread = ZeroSpreadWatch(patience=10, threshold=self.threshold["zero_spread"])
        self.watch_zero_spread = watch_zero_spread
        # the best held-out accuracy, and where the training rewards stood then (an index into them)
        self.best_accuracy: tuple[float, int] | None = None

    # ------------------------------------------------------------------ the checks

    def _fire(self, step: int, name: str, value: float, threshold: float, advice: str) -> list[Alert]:
        if name in self.fired:
            return []
        self.fired.add(name)
        return [Alert(step, name, value, threshold, advice)]

    def _trend(self, key: str) -> tuple[float, float] | None:
        """(mean of the first WINDOW values, mean of the last WINDOW) once 2·WINDOW values are in."""
        values = self.history.get(key, [])
        return (_mean(values[:WINDOW]), _mean(values[-WINDOW:])) if len(values) >= 2 * WINDOW else None

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        """The step's training metrics: the alerts that fire now."""
        for key, value in metrics.items():
            number = _finite(value) if isinstance(value, (int, float)) or hasattr(value, "item") else None
            if number is not None:
                self.history.setdefault(key, []).append(number)
        fired: list[Alert] = []
        for check in self._checks():
            fired += check(step, metrics)
        return fired

    def _checks(self) -> list[Callable[[int, Mapping[str, Any]], list[Alert]]]:
        return [
            self._non_finite,
            self._entropy_collapse,
            self._length_blowup,
            self._thresholds,
            self._logp_mismatch,
            self._zero_spread,
        ]

    def _non_finite(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        loss, skipped = metrics.get("loss"), metrics.get("skipped_update")
        bad = (loss is not None and not math.isfinite(float(loss))) or float(skipped or 0.0) > 0
        if not bad:
            return []
        return self._fire(
            step,
            "non_finite",
            float(skipped or 0.0),
            0.0,
            "the loss, a gradient or the updated weights were not finite, so the update was skipped or "
            "undone (max_consecutive_skips in a row stops the run). Lower learning_rate, keep "
            "max_grad_norm set, or use bf16 instead of fp16.",
        )

    def _entropy_collapse(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        entropies, reward = self.history.get("entropy", []), self._trend("reward")
        if reward is None or not entropies or entropies[0] <= 0:
            return []
        # against the first step's entropy: that of the starting policy (a collapse can be over before
        # a first window's mean is taken)
        share = _mean(entropies[-WINDOW:]) / entropies[0]
        threshold = self.threshold["entropy_collapse"]
        spread = self.history.get("reward_std", [0.0])[:WINDOW]
        risen = reward[1] > reward[0] + max(_mean(spread), 1e-6)  # by more than the first groups' spread
        if share >= threshold or risen:
            return []
        return self._fire(
            step,
            "entropy_collapse",
            share,
            threshold,
            f"mean token entropy fell to {100 * share:.0f}% of its start while the reward did not rise: the "
            "policy turned deterministic without learning, and GRPO cannot explore from there. Lower "
            "learning_rate, raise temperature, or keep it near the reference with beta > 0.",
        )

    def _length_blowup(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        length, clipped = self._trend("completions/mean_length"), self._trend("completions/clipped_ratio")
        if length is None or clipped is None or length[0] <= 0:
            return []
        growth, threshold = length[1] / length[0], self.threshold["length_growth"]
        if growth < threshold or clipped[1] < self.threshold["truncation_share"]:
            return []
        return self._fire(
            step,
            "length_blowup",
            growth,
            threshold,
            f"completions grew to {growth:.1f}× their starting length and {100 * clipped[1]:.0f}% are cut "
            "at max_completion_length: the reward pays for length (or a cut completion is scored as "
            "if whole). Use a loss that does not favour length (dr_grpo, dapo), "
            "mask_truncated_completions=true, a length penalty in the reward, or a larger "
            "max_completion_length.",
        )

    def _thresholds(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        """The alerts on one step's value above a threshold (`ABOVE`)."""
        fired: list[Alert] = []
        for name, (key, advice) in ABOVE.items():
            value, threshold = _finite(metrics.get(key)), self.threshold[name]
            if value is not None and value > threshold:
                fired += self._fire(step, name, value, threshold, advice)
        return fired

    def _logp_mismatch(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        """The sampler's log-probs against the training forward's (`MISMATCH`), above the threshold. On
        a batch sampled by older weights (async/staleness > 0) that sampling_correction weighs, the
        difference is the policy's own moves since, which the decoupled objective is there to correct:
        not read (the run's fresh batches, step 1's, still show a sampler that computes differently).
        The advice never names a correction the run already applies (`MISMATCH_ADVICE`)."""
        value, threshold = _finite(metrics.get(MISMATCH)), self.threshold["logp_mismatch"]
        stale, corrected = (_finite(metrics.get(STALENESS)) or 0.0) > 0, CORRECTED in metrics
        if value is None or value <= threshold or (stale and corrected):
            return []
        return self._fire(step, "logp_mismatch", value, threshold, MISMATCH_ADVICE[stale, corrected])

    def _zero_spread(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        share, reward = _finite(metrics.get("frac_reward_zero_std")), _finite(metrics.get("reward"))
        if not self.watch_zero_spread or share is None:
            return []
        said = self.zero_spread.update(share, reward if reward is not None else 0.0)
        return (
            []
            if said is None
            else self._fire(step, "zero_spread", share, self.threshold["zero_spread"], said)
        )

    def evaluated(self, step: int, row: Mapping[str, Any]) -> list[Alert]:
        """A held-out evaluation's row (keys with the eval/ prefix): reward hacking, when the held-out
        accuracy has fallen from its best while the training reward has risen above its level then: the
        mean of the last WINDOW rewards before the best evaluation, or, for an evaluation before any
        step (step 0's), the first step's reward after it. A held-out fall with a falling training
        reward is a policy getting worse at everything (a collapse), not hacking, and is not said as
        hacking."""
        accuracy = _finite(row.get("eval/accuracy"))
        rewards = self.history.get("reward", [])
        if accuracy is None:
            return []
        if self.best_accuracy is None or accuracy > self.best_accuracy[0]:
            self.best_accuracy = (accuracy, len(rewards))
            return []
        best, seen = self.best_accuracy
        then = rewards[max(0, seen - WINDOW) : seen] or rewards[seen : seen + 1]
        drop, threshold = best - accuracy, self.threshold["reward_hacking"]
        if drop < threshold or not then or not rewards[seen:] or _mean(rewards[-WINDOW:]) <= _mean(then):
            return []
        return self._fire(
            step,
            "reward_hacking",
            drop,
            threshold,
            f"held-out accuracy fell from {best:.3f} to {accuracy:.3f} while the training "
            "reward rose: the policy is learning what the reward pays for, not the task. Inspect "
            "completions (log_completions_steps), tighten the reward, or stop at the best checkpoint.",
        )

    # ------------------------------------------------------------------ the file, and resuming

    @staticmethod
    def write(output_dir: Path, alerts: Sequence[Alert]) -> None:
        """Append the alerts to output_dir/alerts.jsonl."""
        if not alerts:
            return
        with (output_dir / ALERTS_FILE).open("a", encoding="utf-8") as f:
            for alert in alerts:
                f.write(json.dumps(asdict(alert)) + "\n")

    def resume(self, output_dir: Path, step: int) -> None:
        """A run resumed after `step`: the metric rows kept (metrics.jsonl, already cut at `step`) are
        replayed silently, alerts.jsonl keeps the alerts up to `step` and those are not said again.
        A fresh run (`step` 0) starts a new alerts.jsonl. Both files are read (through their schemas:
        a damaged line is a RunFileError naming it) before alerts.jsonl changes."""
        path = output_dir / ALERTS_FILE
        kept = [row for row in _read(path, AlertRow) if row["step"] <= step] if step else []
        replayed = _read(output_dir / "metrics.jsonl", MetricsRow) if step else []
        self.fired |= {row["name"] for row in kept}
        if kept:  # (through a temporary file and a rename: a crash mid-write loses no alert)
            replace_file(path, "".join(json.dumps(row) + "\n" for row in kept))
        else:
            path.unlink(missing_ok=True)
        for row in replayed:
            at = row["step"]
            if at > step:
                continue
            numbers = {
                k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))
            }
            if "loss" in row:  # a training row: what the run saw then, said then (or not at all)
                self.update(at, numbers)
            elif _finite(row.get("eval/accuracy")) is not None:
                self.evaluated(at, numbers)


def _read(path: Path, schema: type[Any]) -> list[dict[str, Any]]:
    """The rows of a .jsonl file through its schema (run_files.py: a damaged line is a RunFileError
    naming it; a last line torn by a crash is left out), or none when the file is absent."""
    return read_jsonl(path, schema) if path.is_file() else []
