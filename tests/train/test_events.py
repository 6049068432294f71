"""The events a run reports are one declared set (train/events.py): every call site names a declared
kind, and the progress display handles each kind or deliberately ignores it."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest
from rich.console import Console

from grpokit.config.plan import Display
from grpokit.train.events import EventKind
from grpokit.train.progress import RichReporter, SFTLines

SRC = Path(__file__).resolve().parents[2] / "src" / "grpokit"
REPORTERS = ("emit", "on_event")  # the names a run reports through: emit(kind, ...), on_event(kind, ...)


def _reports(tree: ast.AST) -> list[ast.Call]:
    """The calls `emit(...)`, `on_event(...)`, `self.emit(...)`, ... with arguments."""
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args]
    name = lambda f: f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""  # noqa: E731
    return [call for call in calls if name(call.func) in REPORTERS]


def test_every_report_names_a_declared_kind():
    sites, undeclared = 0, []
    for path in sorted(SRC.rglob("*.py")):
        for call in _reports(ast.parse(path.read_text(), str(path))):
            kind = call.args[0]
            declared = (
                isinstance(kind, ast.Attribute)
                and isinstance(kind.value, ast.Name)
                and kind.value.id == "EventKind"
                and kind.attr in EventKind.__members__
            )
            sites += 1
            if not declared:
                undeclared.append(f"{path.relative_to(SRC.parent)}:{call.lineno} {ast.unparse(kind)}")
    assert undeclared == []
    assert sites >= 14  # the scan finds the sites (train/run.py, grpo.py, grpo_setup.py, metrics.py, sft)


@pytest.mark.parametrize(
    "display",
    [lambda console: RichReporter(console, Display()), SFTLines],
    ids=["train and reward", "sft"],
)
def test_every_kind_is_shown_or_deliberately_ignored(display):
    reporter = display(Console(file=io.StringIO()))
    shown = set(reporter.handlers)
    assert shown | set(reporter.ignored) == set(EventKind)
    assert shown & set(reporter.ignored) == set()
    assert all(why.strip() for why in reporter.ignored.values())


def test_a_kind_is_its_plain_name():
    """A callback written for the names ("step", "stopped") keeps working, and prints the name."""
    assert EventKind.STEP == "step" and f"{EventKind.STOPPED}" == "stopped" and str(EventKind.EVAL) == "eval"
    assert {"warning": 1}[EventKind.WARNING] == 1
    console = Console(file=io.StringIO(), width=200)
    with RichReporter(console, Display(progress=False), enabled=False) as reporter:
        reporter.on_event("warning", 3, {"message": "careful"})  # a plain name dispatches as its kind
        reporter.on_event("no_such_kind", 3, {})  # a caller's own event shows nothing
    assert "warning at step 3: careful" in console.file.getvalue()


def test_a_warm_start_that_stops_early_stops_its_bar_and_clock():
    """Ended at step 230 of 1000 (its target reached): the bar is full at 230 and its clock stopped,
    not running on through the GRPO steps."""
    console = Console(file=io.StringIO(), width=200)
    with RichReporter(console, Display(max_steps=10, sft_steps=1000), enabled=False) as reporter:
        reporter.on_event(EventKind.SFT_STEP, 230, {"loss": 0.5})
        reporter.on_event(EventKind.SFT_DONE, 230, {"probe_accuracy": 0.9, "reached": True})
        task = reporter.progress.tasks[reporter.sft_task]
        assert (task.completed, task.total, task.finished) == (230, 230, True)
        assert task.stop_time is not None  # the clock stopped
    assert "warm start reached its target after 230 steps" in console.file.getvalue()


def test_an_evaluation_with_nothing_to_show_prints_no_line():
    """eval_steps=0 or no held-out rows: no empty "step N eval:" line, and the last line names no {}."""
    from types import SimpleNamespace

    from grpokit.train.progress import grpo_summary

    console = Console(file=io.StringIO(), width=200)
    with RichReporter(console, Display(progress=False), enabled=False) as reporter:
        reporter.on_event(EventKind.EVAL, 5, {})
        reporter.on_event(EventKind.EVAL, 6, {"eval/reward": 0.25})
    printed = console.file.getvalue()
    assert "step 5 eval" not in printed and "step 6 eval: reward 0.250" in printed
    result = SimpleNamespace(eval_before={}, eval_after={}, steps=3, output_dir="runs/x")
    assert grpo_summary(result) == "done: 3 steps. Run: runs/x"
    result = SimpleNamespace(eval_before={}, eval_after={"reward": 0.5}, steps=3, output_dir="runs/x")
    assert grpo_summary(result) == "done: 3 steps, held-out reward 0.5. Run: runs/x"


def test_sample_completions_of_a_conversation_show_its_last_message():
    """A chat prompt (system prompt + question, as the gsm8k preset makes) is a list of messages: the
    table shows the question, once per group (found running the docs' gsm8k command)."""
    console = Console(file=io.StringIO(), width=200)
    chat = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2+3?"}]
    data = {"prompts": [chat, chat, "7+1="], "completions": ["5", "6", "8"], "rewards": [1.0, 0.0, 1.0]}
    with RichReporter(console, Display(progress=False, num_generations=1), enabled=False) as reporter:
        reporter.on_event(EventKind.COMPLETIONS, 4, data)
    printed = console.file.getvalue()
    assert "2+3?" in printed and "Solve it." not in printed and "7+1=" in printed and "1.00" in printed
