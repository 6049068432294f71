"""A user's own prompt data, beyond what the built-in tasks bring with them: the alphabet a character
tokenizer is built from, the check that a tokenizer knows every character of the prompts, the
answers a supervised warm start learns, and the exact-answer accuracy of rows with an answer column.

Pure functions over rows (dicts); nothing here loads a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .answers import demonstration, solution_column
from .prompts import DataError, render_prompt

if TYPE_CHECKING:
    from ..envs import ChatTurns, EnvironmentSpec


def _texts(value: Any) -> list[str]:
    """The text of a prompt or answer: a string, or the contents of a list of chat messages."""
    if isinstance(value, list):
        return [str(m.get("content", "")) for m in value if isinstance(m, dict)]
    return [] if value is None else [str(value)]


def data_alphabet(
    *row_lists: Sequence[dict[str, Any]],
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    extra: str = "",
) -> str:
    """The sorted set of characters of every prompt, answer, worked solution (answer_format) and worked
    episode ("demonstration") of the given rows, and of `extra` (a tool-call format's markers): the
    alphabet of the character tokenizer that `model: tiny` builds for a dataset of the user's own."""
    chars: set[str] = set(extra)
    for rows in row_lists:
        for row in rows:
            for column in (prompt_column, answer_column, solution_column(answer_column)):
                for text in _texts(row.get(column)):
                    chars.update(text)
            for segment in row.get("demonstration") or ():
                chars.update(str(segment[0]))
    if not chars:
        raise DataError("the data has no characters to build a tokenizer from: its prompts are empty.")
    return "".join(sorted(chars))


def check_characters(
    rows: Sequence[dict[str, Any]],
    known: Iterable[str],
    *,
    columns: Sequence[str] = ("prompt",),
    source: str = "the data",
    model: str = "the model",
) -> None:
    """Raise one DataError naming the first character of `columns` that is not in `known` (a
    character tokenizer's vocabulary), its row and the fix; a character tokenizer would otherwise
    read it as <unk> and the model would train or be scored on text it never sees."""
    vocab = set(known)
    seen = set().union(*(text for row in rows for column in columns for text in _texts(row.get(column))))
    if seen <= vocab:  # the common case, in one pass over the set of characters; else find the first row
        return
    for index, row in enumerate(rows):
        for column in columns:
            for text in _texts(row.get(column)):
                unknown = set(text) - vocab
                if unknown:
                    char, alphabet = min(unknown, key=text.index), "".join(sorted(vocab))
                    raise DataError(
                        f"{source}: row {index} has the character {char!r} in {column!r}, which the "
                        f"character tokenizer of {model} does not know (it knows {alphabet!r}); remove it "
                        "from the data, or train a model over it (model: tiny builds its tokenizer from the "
                        "data's own characters)."
                    )


def require_answers(
    rows: Sequence[dict[str, Any]],
    answer_column: str,
    *,
    source: str,
    purpose: str,
    otherwise: str = "set sft_steps=0",
) -> None:
    """Every row must have a non-empty `answer_column` for `purpose` (a supervised warm start);
    `otherwise` is the way out that does without it."""
    missing = [i for i, row in enumerate(rows) if row.get(answer_column) in (None, "")]
    if not missing:
        return
    if len(missing) == len(rows):
        columns = ", ".join(sorted({k for row in rows for k in row})) or "none"
        raise DataError(
            f"{source} has no column {answer_column!r} (columns: {columns}), which {purpose} learns from; "
            f"add an {answer_column!r} column to every row, set answer_column to the column holding the "
            f"answers, or {otherwise}."
        )
    raise DataError(
        f"{source}: row {missing[0]} has no {answer_column!r} ({len(missing)} rows lack one), which "
        f"{purpose} learns from; fill them, or {otherwise}."
    )


def require_demonstrations(rows: Sequence[dict[str, Any]], source: str = "the training rows") -> None:
    """A multi-turn warm start learns worked episodes: every row needs a "demonstration" column."""
    missing = [i for i, row in enumerate(rows) if not row.get("demonstration")]
    if missing:
        raise DataError(
            f"{source}: row {missing[0]} has no 'demonstration' column; a multi-turn warm start learns "
            "whole episodes, [[text, written_by_policy], ...]: add one, or set sft_steps: 0"
        )


def sft_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    environment: EnvironmentSpec | None = None,
    template_kwargs: dict[str, Any] | None = None,
    answer_format: str = "raw",
) -> list[dict[str, Any]]:
    """Rows as the supervised warm start reads them: {"prompt": rendered text, "answer": text, the
    worked solution under a worked `answer_format`}; with
    an `environment` (multi-turn training), {"prompt", "segments"} from the row's "demonstration"
    column: a transcript as [text, written_by_policy] pairs, only the policy's text being learned, the
    prompt rendered with the environment's tools. Episodes through the chat template
    (`environment.chat`) are laid out as a rollout lays them out: a policy turn followed by an
    observation ends with the end-of-turn token (learned), and the observation, given as its
    message's content, is the template's message and the generation prompt."""
    if environment is not None:
        require_demonstrations(rows)
        tools, turns = environment.tool_schemas, environment.chat_turns(tokenizer)
        return [
            {
                "prompt": render_prompt(row[prompt_column], tokenizer, tools, template_kwargs),
                "segments": _chat_segments(row["demonstration"], turns),
            }
            for row in rows
        ]
    return [
        {
            "prompt": render_prompt(row[prompt_column], tokenizer, None, template_kwargs),
            "answer": demonstration(row, answer_column, answer_format),
        }
        for row in rows
    ]


def _chat_segments(demonstration: Sequence[Any], turns: ChatTurns | None) -> list[tuple[str, bool]]:
    segments = [(str(text), bool(policy)) for text, policy in demonstration]
    if turns is None:
        return segments
    out = []
    for k, (text, policy) in enumerate(segments):
        observed = k + 1 < len(segments) and not segments[k + 1][1]
        if policy:
            out.append((text + turns.tokenizer.eos_token if observed else text, True))
        elif not any(p for _, p in segments[:k]):  # before the first turn: reset's text, as it is
            out.append((text, False))
        elif not segments[k - 1][1]:
            raise DataError(
                f"a demonstration has two environment segments in a row ({segments[k - 1][0]!r}, "
                f"{text!r}): with a chat model each observation follows a policy turn; join them into one"
            )
        else:
            out.append((turns.observation_text(text), False))
    return out


def answer_checker(
    answer_column: str = "answer", judge: Callable[[str, Any], bool] | None = None
) -> Callable[[str, dict[str, Any]], bool]:
    """Correctness for rows of the user's own data: `judge(completion, the row's answer)`, or, without
    one, exact answer as the built-in tasks judge theirs: the completion, stripped of surrounding white
    space, equals the row's answer (as text, stripped)."""

    def is_correct(completion: str, row: dict[str, Any]) -> bool:
        answer = row.get(answer_column)
        if answer is None:
            return False
        if judge is not None:
            return judge(completion, answer)
        return completion.strip() == str(answer).strip()

    is_correct.__name__ = f"exact_{answer_column}"
    return is_correct


def has_answers(rows: Sequence[dict[str, Any]], answer_column: str = "answer") -> bool:
    """Whether every row has a non-empty `answer_column` (then evaluation reports accuracy)."""
    return bool(rows) and all(row.get(answer_column) not in (None, "") for row in rows)
