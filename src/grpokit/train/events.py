"""The events a run reports to `on_event(kind, step, data)`: one declared set, each kind with its meaning.

Every run (GRPO, `grpokit sft`, a reward model) reports through `Emit`, whose `kind` is an `EventKind`.
An `EventKind` is a `str` (`EventKind.STEP == "step"`, and it prints as "step"), so a callback written
for the plain names keeps working; the display (train/progress.py) maps each kind to its handler, and
tests/train/test_events.py holds that every kind is handled or deliberately ignored there and that every
call site names a declared kind.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any


class EventKind(str, Enum):
    """The kinds of event, each with what `step` and `data` then hold."""

    SFT_START = "sft_start"  # a supervised run (warm start or `grpokit sft`) begins; data {}
    SFT_STEP = "sft_step"  # a supervised step is done; data {"loss"}
    SFT_DONE = "sft_done"  # the warm start ended at `step`; data {"probe_accuracy", "reached"}
    START = "start"  # training begins after `step`; data: the held-out metrics before it
    RESUMED = "resumed"  # resumed at `step`; data {"checkpoint"}
    STEP = "step"  # a logged step's metrics (every logging_steps)
    EVAL = "eval"  # a held-out evaluation at `step`; data: its "eval/..." metrics
    COMPLETIONS = "completions"  # sample completions; data {"prompts", "completions", "rewards"}
    WARNING = "warning"  # something the user should know; data {"message"}
    STOPPED = "stopped"  # SIGINT/SIGTERM ended the run after `step`; data {"signal", "output_dir", "phase"?}

    def __str__(self) -> str:  # "step", not "EventKind.STEP" (as StrEnum, which Python 3.10 lacks)
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


Emit = Callable[[EventKind, int, dict[str, Any]], None]  # on_event(kind, step, data)
