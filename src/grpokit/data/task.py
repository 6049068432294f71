"""The `Task` record: what every task source (the built-in tasks in tasks.py, reasoning_gym.py)
returns and what training, evaluation and preference pairs read.

It has a module of its own so that the sources import it without importing each other:
`get_task` in tasks.py loads reasoning_gym.py lazily, and reasoning_gym.py needs only this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    name: str
    alphabet: str  # every character prompts and answers use (for `char_tokenizer`)
    train: list[dict[str, Any]]  # rows with a "prompt" column and the columns the reward reads
    eval: list[dict[str, Any]]  # held out: no prompt appears in train
    is_correct: Callable[[str, dict[str, Any]], bool]
    max_prompt_length: int
    max_completion_length: int
    # multi-turn: the tools its episodes may call (names of envs.BUILTIN_TOOLS) and how calls are written;
    # its rows then carry a "demonstration" column (a worked episode, for the warm start)
    tools: tuple[str, ...] = ()
    tool_call_format: str | None = None
    max_completion_length_without_tools: int | None = None  # when tools are switched off
    score: Callable[[str, dict[str, Any]], float] | None = None  # partial credit; None: 1.0 if correct

    def reward(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float | None]:
        """The task's score of each completion: by default 1.0 if correct, else 0.0 (the TRL
        reward-function convention)."""
        rows = [
            {k: v[i] for k, v in columns.items() if isinstance(v, list)} for i in range(len(completions))
        ]  # (TRL's trainer_state, log_metric: no column)
        if self.score is not None:
            return [self.score(c, row) for c, row in zip(completions, rows, strict=True)]
        return [1.0 if self.is_correct(c, row) else 0.0 for c, row in zip(completions, rows, strict=True)]

    reward.takes_text = True  # type: ignore[attr-defined]  # completions as text, also with conversations

    def accuracy(self, completions: list[str], rows: list[dict[str, Any]]) -> float:
        """Fraction of completions that are exactly right."""
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions for {len(rows)} rows.")
        return sum(self.is_correct(c, r) for c, r in zip(completions, rows, strict=True)) / max(len(rows), 1)
