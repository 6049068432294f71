"""How a dataset writes its reference answers (`answer_format`), turned once, when rows are loaded,
into the bare answer that accuracy and the built-in rewards compare with, and how a completion is
judged against it.

ANSWER_FORMATS maps a name to an AnswerFormat: a pure function (answer text -> bare answer, or None
when the text is not in that format), the built-in reward that judges a completion under it, and
whether the text is a worked solution (kept, for what learns from demonstrations). Add a format by
adding an entry. Nothing here loads anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import DataError


def raw_answer(text: str) -> str | None:
    """The answer as the dataset writes it."""
    return text


def gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution: what follows its last '####', without thousands commas
    ('... #### 1,234' -> '1234'); None when there is no '####' or nothing after it."""
    if "####" not in text:
        return None
    return text[text.rindex("####") + 4 :].strip().replace(",", "") or None


@dataclass(frozen=True)
class AnswerFormat:
    """One way of writing answers. `bare`: the dataset's answer text -> the bare answer (None: not
    in this format). `judge`: the built-in reward (rewards.builtin) whose 1.0 marks a right
    completion, so that accuracy counts what the reward pays; None: the completion, stripped, equals
    the bare answer. `worked`: the text is a worked solution, kept in `solution_column` for the
    demonstrations a warm start or gkd's off-policy steps learn. `expected`: what a row must hold."""

    bare: Callable[[str], str | None]
    judge: str | None = None
    worked: bool = False
    expected: str = ""


ANSWER_FORMATS: dict[str, AnswerFormat] = {
    "raw": AnswerFormat(raw_answer),
    "gsm8k": AnswerFormat(
        gsm8k_answer,
        judge="gsm8k_answer",  # the number after the completion's last '####', as verl's strict scorer
        worked=True,
        expected="a worked solution ending in '#### ANSWER' (GSM8K's form, e.g. '... #### 42')",
    ),
}


def solution_column(answer_column: str) -> str:
    """Where a worked answer format keeps the dataset's own text of `answer_column` (the demonstration)."""
    return f"{answer_column}_solution"


def demonstration(row: dict[str, Any], answer_column: str, answer_format: str = "raw") -> str:
    """What a demonstration of `row` writes: under a worked answer format, the worked solution that
    `apply_answer_format` kept; else its answer."""
    if ANSWER_FORMATS[answer_format].worked:
        return str(row[solution_column(answer_column)])
    return str(row[answer_column])


def apply_answer_format(
    rows: Sequence[dict[str, Any]], answer_column: str, answer_format: str, source: str
) -> list[dict[str, Any]]:
    """`rows` with `answer_column` replaced by its bare answer under `answer_format` (new dicts; 'raw'
    leaves the rows as they are); a worked format keeps the text in `solution_column(answer_column)`.
    A row whose answer is not in that format is one DataError naming the row, its answer and the fix;
    so is a row that has that column already."""
    if answer_format not in ANSWER_FORMATS:
        raise DataError(f"unknown answer_format {answer_format!r}; use one of {', '.join(ANSWER_FORMATS)}.")
    if answer_format == "raw":
        return list(rows)
    form = ANSWER_FORMATS[answer_format]
    kept = solution_column(answer_column) if form.worked else None
    if rows and all(answer_column not in row for row in rows):
        columns = ", ".join(sorted(rows[0])) or "none"
        raise DataError(
            f"{source} has no column {answer_column!r} (columns: {columns}) for "
            f"answer_format={answer_format}; set answer_column to the column holding the answers."
        )
    out = []
    for index, row in enumerate(rows):
        value = row.get(answer_column)
        answer = form.bare(value) if isinstance(value, str) else None
        if answer is None:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise DataError(
                f"{source}: row {index} has {answer_column}={shown}, not {form.expected}; "
                "fix or remove that row, or set answer_format=raw."
            )
        if kept is not None and kept in row:
            raise DataError(
                f"{source}: row {index} has a column {kept!r}, where answer_format={answer_format} keeps the "
                f"worked solution of {answer_column!r}; rename or drop that column."
            )
        out.append({**row, answer_column: answer, **({kept: value} if kept is not None else {})})
    return out
