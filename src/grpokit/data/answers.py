"""How a dataset writes its reference answers (`answer_format`), turned once, when rows are loaded,
into the bare answer that the exact-answer accuracy and the built-in rewards compare with.

ANSWER_FORMATS maps a name to a pure function (answer text -> bare answer, or None when the text
is not in that format); add a format by adding an entry. Nothing here loads anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


ANSWER_FORMATS: dict[str, Callable[[str], str | None]] = {"raw": raw_answer, "gsm8k": gsm8k_answer}

# what each format expects, for the error a row that is not in it gets
_EXPECTED = {"gsm8k": "a worked solution ending in '#### ANSWER' (GSM8K's form, e.g. '... #### 42')"}


def apply_answer_format(
    rows: Sequence[dict[str, Any]], answer_column: str, answer_format: str, source: str
) -> list[dict[str, Any]]:
    """`rows` with `answer_column` replaced by its bare answer under `answer_format` (new dicts; 'raw'
    leaves the rows as they are). A row whose answer is not in that format is one DataError naming
    the row, its answer and the fix."""
    if answer_format not in ANSWER_FORMATS:
        raise DataError(f"unknown answer_format {answer_format!r}; use one of {', '.join(ANSWER_FORMATS)}.")
    if answer_format == "raw":
        return list(rows)
    extract = ANSWER_FORMATS[answer_format]
    if rows and all(answer_column not in row for row in rows):
        columns = ", ".join(sorted(rows[0])) or "none"
        raise DataError(
            f"{source} has no column {answer_column!r} (columns: {columns}) for "
            f"answer_format={answer_format}; set answer_column to the column holding the answers."
        )
    out = []
    for index, row in enumerate(rows):
        value = row.get(answer_column)
        answer = extract(value) if isinstance(value, str) else None
        if answer is None:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise DataError(
                f"{source}: row {index} has {answer_column}={shown}, not {_EXPECTED[answer_format]}; "
                "fix or remove that row, or set answer_format=raw."
            )
        out.append({**row, answer_column: answer})
    return out
