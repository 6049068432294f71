"""Prompt datasets: rows (dicts) with a prompt column; every other column reaches the rewards.

Sources: a JSON Lines / JSON / CSV / Parquet file, a Hugging Face Hub dataset or a directory laid
out like one (data/hub.py), a `datasets.Dataset`, or a Python list of dicts. A prompt is a string, or
a list of chat messages ({"role", "content"}) rendered with the tokenizer's chat template.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .curriculum import Curriculum, CurriculumRule
from .errors import DataError


def _decoded(path: Path) -> str:
    """The text of a data file, which must be UTF-8. A byte that is not UTF-8 (a file saved as Latin-1
    or Windows-1252, a binary file under a data suffix) is named by line and column, since the
    decoder's own message gives only a byte offset into the whole file."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1  # in bytes, 1-based
        raise DataError(
            f"{path}: line {line} is not valid UTF-8 (byte 0x{data[error.start]:02x} at column {column}); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE)."
        ) from None


def _deepest(text: str) -> tuple[int, int]:  # noqa: C901 - one scan of a small state machine, read best whole
    """(depth, line) of the most deeply nested bracket of a JSON text: where a document that json
    cannot parse for the recursion it needs (json.loads raises RecursionError, with no position)
    goes too deep. Brackets inside strings do not count."""
    depth = deepest = 0
    line = deepest_line = 1
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest, deepest_line = depth, line
        elif char in "]}":
            depth -= 1
        if char == "\n":
            line += 1
    return deepest, deepest_line


def _too_deep(path: Path, text: str, first_line: int = 1) -> DataError:
    depth, line = _deepest(text)
    return DataError(
        f"{path}: line {first_line + line - 1} nests lists or objects {depth} levels deep, more than "
        "Python's JSON reader can follow; a row needs a few levels at most: flatten that value."
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    # split on "\n" alone: str.splitlines would also split on U+2028 and other characters that JSON
    # strings may hold unescaped
    for number, line in enumerate(_decoded(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path}: line {number} is not valid JSON ({error.msg} at column {error.colno})."
            ) from None
        except RecursionError:
            raise _too_deep(path, line, number) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{path}: line {number} is a JSON {type(row).__name__}, expected an object {{...}}."
            )
        rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    text = _decoded(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}).") from None
    except RecursionError:
        raise _too_deep(path, text) from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a JSON list of objects (or use JSON Lines, one object per line).")
    return data


def _read_csv(path: Path) -> list[dict[str, Any]]:
    return [dict(row) for row in csv.DictReader(io.StringIO(_decoded(path), newline=""))]


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow.") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({error}).") from None


# one reader per suffix in FILE_SUFFIXES (tests/data/test_data.py holds them equal)
READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def _read_source(source: Any, split: str, dataset_config: str | None) -> tuple[list[dict[str, Any]], str]:
    """(rows, how errors name them) of any source `load_prompts` takes."""
    from .hub import is_dataset_name, load_dataset_dict, split_rows

    if is_dataset_name(source):
        loaded, label = load_dataset_dict(source, dataset_config)
        where = f"config {dataset_config}, split {split}" if dataset_config else f"split {split}"
        return split_rows(loaded, label, split), f"dataset {str(source)!r} ({where})"
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise DataError(f"prompt file {str(path)!r} does not exist.")
        reader = READERS.get(path.suffix.lower())
        if reader is None:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; use one of {', '.join(READERS)}.")
        return reader(path), str(path)
    if isinstance(source, dict) and source and all(hasattr(d, "to_list") for d in source.values()):
        return split_rows(source, "the DatasetDict", split), f"the DatasetDict (split {split})"
    if hasattr(source, "column_names") and hasattr(source, "to_list"):  # datasets.Dataset
        return source.to_list(), "the dataset"
    if isinstance(source, Sequence) and all(isinstance(r, dict) for r in source):
        return [dict(r) for r in source], "the prompt list"
    raise DataError(
        f"cannot read prompts from a {type(source).__name__}; "
        "give a file path, a dataset name, a list of dicts or a datasets.Dataset."
    )


def load_prompts(
    source: Any,
    *,
    prompt_column: str = "prompt",
    split: str = "train",
    dataset_config: str | None = None,
    answer_column: str = "answer",
    answer_format: str = "raw",
) -> list[dict[str, Any]]:
    """Rows of a prompt dataset, checked: non-empty, each with a non-empty `prompt_column`, answers
    in `answer_column` made bare by `answer_format` (data/answers.py), once, here.

    Args:
        source: a path (.jsonl, .json, .csv, .parquet), a Hugging Face Hub dataset name or a directory
            laid out like one (data/hub.py; its `split` of config `dataset_config`), a `datasets.Dataset`
            (or DatasetDict: its `split`), or a list of dicts.
        prompt_column: the column holding the prompt (a string or a list of chat messages).
    """
    from .answers import apply_answer_format

    rows, name = _read_source(source, split, dataset_config)
    if not rows:
        raise DataError(f"{name} has no rows: a prompt dataset needs at least one prompt.")
    missing = [i for i, row in enumerate(rows) if row.get(prompt_column) in (None, "", [])]
    if missing:
        columns = ", ".join(sorted(rows[missing[0]])) or "none"
        if all(prompt_column not in row for row in rows):
            raise DataError(
                f"{name} has no column {prompt_column!r} (columns: {columns}); "
                "set prompt_column to the right one."
            )
        raise DataError(
            f"{name}: row {missing[0]} has an empty {prompt_column!r} ({len(missing)} rows do); "
            "remove or fill them."
        )
    return apply_answer_format(rows, answer_column, answer_format, name)


def render_prompt(
    prompt: Any,
    tokenizer: Any = None,
    tools: Sequence[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """A text prompt as is; a conversation (list of {"role", "content"}) through the chat template,
    which also receives the JSON schemas of the episode's `tools` (`envs.tool_schema`), if any, as a
    tool-calling model expects them, and `template_kwargs` (the config's chat_template_kwargs, e.g.
    enable_thinking=False)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "a conversational prompt needs a tokenizer with a chat template; this one has none."
            )
        extra = {**(template_kwargs or {}), **({"tools": list(tools)} if tools else {})}
        try:
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as error:  # noqa: BLE001 - its own refusal (raise_exception), or a Jinja error
            raise template_refusal(tokenizer, prompt, error) from None
    raise DataError(
        f"a prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}."
    )


def template_refusal(tokenizer: Any, messages: list[dict[str, Any]], error: Exception) -> DataError:
    """The one line for a chat template that raised on a conversation: its own words (a template's
    raise_exception, "System role not supported", "roles must alternate user/assistant/..."), or
    Jinja's error for one that cannot render it, with the roles it was given and the options that
    change what it is given."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    roles = ", ".join(str(m.get("role")) for m in messages) or "none"
    model = getattr(tokenizer, "name_or_path", "") or "the model"
    return DataError(
        f"the chat template of {model} rejects these messages (roles: {roles}): {reason}; give prompts in "
        "the roles and order it takes (without a system message if it takes none: unset system_prompt), "
        "set the variables it reads with chat_template_kwargs, or use a model whose template takes them."
    )


def with_system_prompt(
    rows: Sequence[dict[str, Any]], prompt_column: str, system: str
) -> list[dict[str, Any]]:
    """Rows whose prompt is a conversation opened by `system`: a text prompt becomes [system, user]; a
    conversation without a system message gets it first; one with its own keeps it."""
    out = []
    for row in rows:
        prompt = row[prompt_column]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            raise DataError(f"system_prompt needs text or chat-message prompts, got {type(prompt).__name__}.")
        if prompt[0].get("role") != "system":
            prompt = [{"role": "system", "content": system}, *prompt]
        out.append({**row, prompt_column: prompt})
    return out


def columns_of(rows: Sequence[dict[str, Any]], prompt_column: str, repeat: int = 1) -> dict[str, list[Any]]:
    """Every non-prompt column as a list, each value repeated `repeat` times (once per completion)."""
    keys = {k for row in rows for k in row if k != prompt_column}
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in sorted(keys)}


class PromptSampler:
    """Endless batches of rows, reshuffled every epoch from `seed`; its position is a state dict
    so that a resumed run continues with exactly the next batch.

    With a `curriculum` (data/curriculum.py) the walk through an epoch's order passes over set-aside
    prompts except with the rule's revisit probability; `record` takes the visits of the latest batch
    (`last_indices`), and the curriculum's pools are part of the state dict.

    `is_correct(completion, row)`, where the rows' answers can be judged right or wrong (a built-in
    task's check, or the Python API's): what a step's metrics split completion lengths by."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        curriculum: CurriculumRule | None = None,
        is_correct: Callable[[str, dict[str, Any]], bool] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}.")
        self.rows, self.batch_size, self.seed, self.shuffle = list(rows), batch_size, seed, shuffle
        self.is_correct = is_correct
        self.epoch, self.position = 0, 0
        self._cached: tuple[int, list[int]] | None = None  # (epoch, order): shuffled once per epoch
        self.curriculum: Curriculum | None = None  # (a step's prompts stay active: floor=batch_size)
        if curriculum is not None:
            self.curriculum = Curriculum(len(self.rows), curriculum, floor=batch_size, seed=seed)
        self.last_indices: list[int] = []  # [batch_size] the rows of the latest batch, in order

    def _order(self) -> list[int]:
        import random

        if self._cached is None or self._cached[0] != self.epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._cached = (self.epoch, order)
        return self._cached[1]

    def next_batch(self) -> list[dict[str, Any]]:
        taken: list[int] = []
        while len(taken) < self.batch_size:  # (the curriculum keeps ≥ 1 prompt active: it ends)
            index = self._order()[self.position]
            if self.curriculum is None or self.curriculum.offers(index, self.epoch):
                taken.append(index)
            self.position += 1
            if self.position >= len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
        self.last_indices = taken
        return [self.rows[i] for i in taken]

    def record(
        self, indices: Sequence[int], rewards: Sequence[Sequence[float]], equal: Sequence[bool]
    ) -> None:
        """The curriculum's visits (`Curriculum.record`); nothing without one."""
        if self.curriculum is not None:
            self.curriculum.record(indices, rewards, equal)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position}
        if self.curriculum is not None:
            state["curriculum"] = self.curriculum.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state of `state_dict`; one without a curriculum's leaves this sampler's curriculum fresh."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self.curriculum is not None and "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
