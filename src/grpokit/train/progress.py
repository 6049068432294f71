"""Terminal feedback for a run: for `grpokit train` and `grpokit reward`, a progress bar with ETA and key
metrics, evaluation lines and, every few steps, a table of sample completions; for `grpokit sft`, a loss
line every 100 steps. Each display maps every event kind (train/events.py) to a handler or ignores it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ..config.plan import Display
from .events import EventKind

Events = Callable[[str, int, dict[str, Any]], None]
Handler = Callable[[int, dict[str, Any]], None]  # (step, data)
Result = TypeVar("Result")


def stop_message(signal: str, phase: str, step: int, output_dir: str) -> str:
    """What a run stopped by SIGINT / SIGTERM says, and how to go on."""
    if phase == "grpo":
        return (
            f"stopped by {signal} after step {step}: checkpoint-{step} saved in {output_dir}; run the same "
            "command with resume=true to continue."
        )
    if phase == "sft":  # grpokit sft: its model so far, where a checkpoint goes
        saved = Path(output_dir) / f"checkpoint-{step}"
        return (
            f"stopped by {signal} after step {step}: checkpoint-{step} saved in {output_dir} (the model "
            f"trained so far: train from it with model={saved}); run the same command with overwrite=true "
            "to start over."
        )
    if phase == "sft set-up":
        return (
            f"stopped by {signal} during set-up, before any step: nothing was written to {output_dir}; run "
            "the same command again to start over."
        )
    where = "the supervised warm start" if phase == "warm start" else phase
    return (
        f"stopped by {signal} during {where}, before any checkpoint: nothing in {output_dir} needs keeping; "
        "run the same command again to start over (the warm start is short and is not checkpointed)."
    )


def run_reported(
    console: Any, display: Display, run: Callable[[Events], Result], device: str = "auto"
) -> Result | None:
    """`run(on_event)` with the command line's progress display (shown with `display.progress`) on rank 0
    of a torchrun job, then the process group left (`device`: the run's). Returns the run's result on
    rank 0, None on the other ranks, which say nothing."""
    from . import distributed

    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 talks
    with RichReporter(console, display, enabled=display.progress and main_rank) as reporter:
        result = run(reporter.on_event)
    distributed.shutdown(distributed.init(device))
    return result if main_rank else None


def grpo_summary(result: Any) -> str:
    """The last line of `grpokit train`: the held-out accuracy before and after, and where the run is."""
    before, after = result.eval_before.get("accuracy"), result.eval_after.get("accuracy")
    if before is None or after is None:
        shown = "  ".join(f"{k} {v:.3g}" for k, v in result.eval_after.items() if isinstance(v, (int, float)))
        evaluated = f", held-out {shown}" if shown else ""
        return f"done: {result.steps} steps{evaluated}. Run: {result.output_dir}"
    return (
        f"held-out greedy accuracy: [bold]{100 * before:.1f}%[/] before GRPO → [bold]{100 * after:.1f}%[/] "
        f"after {result.steps} steps ({100 * (after - before):+.1f} points). Run: {result.output_dir}"
    )


def reward_summary(result: Any) -> str | None:
    """The last line of `grpokit reward`: the held-out pairwise accuracy before and after (None: no
    held-out pairs)."""
    before, after = result.eval_before.get("accuracy"), result.eval_after.get("accuracy")
    if before is None or after is None:
        return None
    return (
        f"held-out pairwise accuracy: [bold]{before:.3f}[/] → [bold]{after:.3f}[/] "
        f"after {result.steps} steps. Run: {result.output_dir}"
    )


def sft_summary(result: Any) -> str:
    """The last line of `grpokit sft`: the held-out accuracy, and where the model is."""
    if "accuracy" not in result.eval_after:
        return f"saved to {result.saved} (no eval_dataset: no held-out accuracy)"
    return f"held-out greedy accuracy {100 * result.eval_after['accuracy']:.1f}%; saved to {result.saved}"


@contextmanager
def reporting(display: Display, on_event: Events | None = None) -> Iterator[Events | None]:
    """What the Python trainers report to: the caller's `on_event` if given; else, with
    `display.progress` on the main process, the same progress display as the command line; else
    nothing (warnings then go to the `grpokit` logger)."""
    if on_event is not None or not display.progress or os.environ.get("RANK", "0") != "0":
        yield on_event
        return
    from rich.console import Console

    with RichReporter(Console(), display) as reporter:
        yield reporter.on_event


class Dispatch:
    """A display of a run's events: `on_event(kind, step, data)` calls the handler `handlers` maps the
    kind to; `ignored` names each kind it deliberately does not show, and why."""

    handlers: dict[EventKind, Handler]
    ignored: dict[EventKind, str] = {}

    def on_event(self, kind: str, step: int, data: dict[str, Any]) -> None:
        """Show one event of the run; a kind in `ignored`, or one no run emits, shows nothing."""
        try:
            handler = self.handlers.get(EventKind(kind))
        except ValueError:  # not a declared kind (a caller's own event)
            return
        if handler is not None:
            handler(step, data)


class SFTLines(Dispatch):
    """`grpokit sft`'s display: its loss every `every` steps, a change of CPU threads, the stop line."""

    ignored = {EventKind.SFT_START: "the first loss line follows"} | {
        kind: "an SFT run does not emit it"
        for kind in (
            EventKind.SFT_DONE,
            EventKind.START,
            EventKind.RESUMED,
            EventKind.STEP,
            EventKind.EVAL,
            EventKind.COMPLETIONS,
        )
    }

    def __init__(self, console: Any, every: int = 100) -> None:
        self.console, self.every = console, every
        self.handlers = {
            EventKind.SFT_STEP: self._on_sft_step,
            EventKind.WARNING: self._on_warning,
            EventKind.STOPPED: self._on_stopped,
        }

    def _on_sft_step(self, step: int, data: dict[str, Any]) -> None:
        if step % self.every == 0:
            self.console.print(f"sft step {step}: loss {data['loss']:.4f}")

    def _on_warning(self, step: int, data: dict[str, Any]) -> None:
        self.console.print(f"[yellow]{data['message']}[/]")

    def _on_stopped(self, step: int, data: dict[str, Any]) -> None:
        self.console.print(stop_message(data["signal"], data["phase"], step, data["output_dir"]))


class RichReporter(Dispatch):
    """The progress display of a run (`config.plan.Display`: its label, lengths and group size)."""

    ignored = {EventKind.SFT_START: "the warm start's bar is there from the start (sft_steps is known)"}

    def __init__(self, console: Any, display: Display, *, enabled: bool = True) -> None:
        self.console, self.display, self.enabled = console, display, enabled
        self.label = display.label
        self.progress: Any = None
        self.sft_task = self.grpo_task = None
        self.handlers = {
            EventKind.SFT_STEP: self._on_sft_step,
            EventKind.SFT_DONE: self._on_sft_done,
            EventKind.START: self._on_start,
            EventKind.RESUMED: self._on_resumed,
            EventKind.STEP: self._on_step,
            EventKind.EVAL: self._on_eval,
            EventKind.STOPPED: self._on_stopped,
            EventKind.WARNING: self._on_warning,
            EventKind.COMPLETIONS: self._on_completions,
        }

    def __enter__(self) -> RichReporter:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            disable=not self.enabled,
        )
        self.progress.__enter__()
        if self.display.sft_steps:
            self.sft_task = self.progress.add_task("sft ", total=self.display.sft_steps, status="")
        total = self.display.max_steps
        self.grpo_task = self.progress.add_task(self.label, total=total, status="", start=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def _on_sft_step(self, step: int, data: dict[str, Any]) -> None:
        if self.sft_task is not None:
            self.progress.update(self.sft_task, completed=step, status=f"loss {data['loss']:.3f}")

    def _on_sft_done(self, step: int, data: dict[str, Any]) -> None:
        if self.sft_task is not None:  # done, early or not: its bar full at the steps run, its clock stopped
            self.progress.update(self.sft_task, total=step, completed=step)
            self.progress.stop_task(self.sft_task)
        reached = "reached its target" if data["reached"] else "did not reach its target"
        self.console.print(
            f"warm start {reached} after {step} steps: greedy accuracy "
            f"{100 * data['probe_accuracy']:.1f}% on a probe of training prompts"
        )

    def _on_start(self, step: int, data: dict[str, Any]) -> None:
        self.progress.start_task(self.grpo_task)
        self.progress.update(self.grpo_task, completed=step)
        if "accuracy" in data:
            self.console.print(f"held-out accuracy before training: {100 * data['accuracy']:.1f}%")

    def _on_resumed(self, step: int, data: dict[str, Any]) -> None:
        self.progress.start_task(self.grpo_task)
        self.progress.update(self.grpo_task, completed=step)
        self.console.print(f"resumed from {data['checkpoint']} at step {step}")

    def _on_step(self, step: int, data: dict[str, Any]) -> None:
        shown = [k for k in ("reward", "kl", "loss", "accuracy") if isinstance(data.get(k), (int, float))]
        status = "  ".join(f"{k} {data[k]:.3g}" for k in shown) + f"  {data.get('step_time', 0.0):.2f}s/step"
        self.progress.update(self.grpo_task, completed=step, status=status)

    def _on_eval(self, step: int, data: dict[str, Any]) -> None:
        shown = {
            k[len("eval/") :]: v for k, v in data.items() if k.startswith("eval/") and isinstance(v, float)
        }
        if shown:  # (no held-out rows, or eval_steps=0: nothing to say)
            self.console.print(f"step {step} eval: " + "  ".join(f"{k} {v:.3f}" for k, v in shown.items()))

    def _on_stopped(self, step: int, data: dict[str, Any]) -> None:
        self.console.print(stop_message(data["signal"], data.get("phase", "grpo"), step, data["output_dir"]))

    def _on_warning(self, step: int, data: dict[str, Any]) -> None:
        self.console.print(f"[bold yellow]warning[/] at step {step}: {data['message']}")

    def _on_completions(self, step: int, data: dict[str, Any]) -> None:
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"sample completions at step {step}")
        for column in ("prompt", "completion", "reward"):
            table.add_column(column)
        for prompt, completion, reward in list(
            zip(data["prompts"], data["completions"], data["rewards"], strict=True)
        )[:: self.display.num_generations][: self.display.num_completions_to_print]:
            # as plain text: "[calc(...)]" would otherwise be read as rich markup and vanish
            table.add_row(Text(shown_prompt(prompt)), Text(repr(completion)), f"{reward:.2f}")
        self.console.print(table)


def shown_prompt(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt as one line of the completions table: a conversation (system prompt, chat messages)
    shows its last message, the one the completion answers."""
    if isinstance(prompt, str):
        return prompt
    return str(prompt[-1].get("content", "")) if prompt else ""
