"""The JSON and JSONL files a run leaves in its output_dir, and the one way they are read back.

Each file has a schema here: metrics.jsonl (`MetricsRow`, one row per logged step or evaluation),
sft_metrics.jsonl (`SftMetricsRow`, the warm start's losses), alerts.jsonl (`AlertRow`),
reward_diagnostics.json (`RewardDiagnostics`) and calibration.json (`Calibration`). A schema accepts
exactly what grpokit's own writers write (train/metrics.py, train/alerts.py, train/reward.py and
train/reward_diagnostics.py), so a resume never refuses a run grpokit wrote; anything else is a file
that was edited or damaged, and the readers refuse it with one line naming the file, the line, the
field and the fix (`RunFileError`), never a traceback from deep inside the report or a resume.

`read_jsonl` and `read_json` read one file; `check_run_files` reads every one a run directory holds
(what a resume does before anything in the directory changes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from pydantic_core import PydanticCustomError

DAMAGED_LINE = "the file was edited or damaged: repair or delete that line"
DAMAGED_FILE = "the file was edited or damaged: repair or delete it"
STEP_LIMIT = 2**63  # a step or count beyond int64 was never written by a run (and numpy cannot plot it)
SHOWN = 40  # characters of an offending value quoted in an error


class RunFileError(ValueError):
    """A file of a run directory that its schema refuses, in one line: the file, the line (or the
    field's path in a .json file), what is wrong and the fix."""


# ----------------------------------------------------------------------------- the values


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("run_file", message)


def _whole(value: Any) -> int:
    """A step or a count: an int (not a bool, not 3.0) from 0 to 2**63 - 1."""
    if type(value) is not int or value < 0:
        raise _refuse("must be a whole number of at least 0")
    if value >= STEP_LIMIT:
        raise _refuse("is too large (at most 2**63 - 1)")
    return value


def _is_number(value: Any) -> bool:
    """An int or float JSON number (NaN and ±inf included: json writes them for a float metric that
    is not finite); an int only where it fits a float, as every plot and mean needs."""
    return type(value) is float or (type(value) is int and abs(value) <= sys.float_info.max)


def _number(value: Any) -> float | int:
    if not _is_number(value):
        raise _refuse("must be a number")
    return value


def _number_or_null(value: Any) -> float | int | None:
    if value is not None and not _is_number(value):
        raise _refuse("must be a number or null")
    return value


def _metric(value: Any) -> float | int | bool | None:
    """A metric's value as MetricsWriter writes it: a number, null (a value that was not finite), or
    true/false (a flag metric: a bool, or a bool tensor's .item())."""
    if value is not None and type(value) is not bool and not _is_number(value):
        raise _refuse("must be a number or null")
    return value


def _name(value: Any) -> str:
    if type(value) is not str or not value:
        raise _refuse("must be a non-empty string")
    return value


def _text(value: Any) -> str:
    if type(value) is not str:
        raise _refuse("must be a string")
    return value


def _text_or_null(value: Any) -> str | None:
    return None if value is None else _text(value)


def _flag_or_null(value: Any) -> bool | None:
    if value is not None and type(value) is not bool:
        raise _refuse("must be true, false or null")
    return value


def _point(value: Any) -> tuple[int, float]:
    """A length-bias point: [tokens, score]."""
    if not (isinstance(value, list) and len(value) == 2 and _is_number(value[0]) and _is_number(value[1])):
        raise _refuse("must be a [tokens, score] pair of numbers")
    return value[0], value[1]


Whole = Annotated[int, PlainValidator(_whole)]
Number = Annotated[float, PlainValidator(_number)]
NumberOrNull = Annotated[float | None, PlainValidator(_number_or_null)]
Metric = Annotated[float | None, PlainValidator(_metric)]
Name = Annotated[str, PlainValidator(_name)]
Text = Annotated[str, PlainValidator(_text)]
TextOrNull = Annotated[str | None, PlainValidator(_text_or_null)]
FlagOrNull = Annotated[bool | None, PlainValidator(_flag_or_null)]
Point = Annotated[tuple[int, float], PlainValidator(_point)]


class _Schema(BaseModel):
    """Fields a later grpokit adds are let through (extra="ignore"): an older grpokit reading a newer
    run's file checks what it knows."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


# ----------------------------------------------------------------------------- the JSONL rows


class MetricsRow(_Schema):
    """A row of metrics.jsonl (MetricsWriter.write): the step, then each metric (its name is free
    text, "time" among them) with a number, null or a flag."""

    model_config = ConfigDict(extra="allow", frozen=True)

    step: Whole
    __pydantic_extra__: dict[str, Metric] = Field(init=False)  # type: ignore[assignment]


class SftMetricsRow(_Schema):
    """A row of sft_metrics.jsonl (write_sft_metrics): the warm start's step and its loss (NaN when
    the loss was not finite)."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    sft_step: Whole
    loss: Metric = Field(alias="sft/loss")
    __pydantic_extra__: dict[str, Metric] = Field(init=False)  # type: ignore[assignment]


class AlertRow(_Schema):
    """A row of alerts.jsonl (AlertWatch.write of an Alert)."""

    step: Whole
    name: Name
    value: Number
    threshold: Number
    advice: Text


# ----------------------------------------------------------------------------- the JSON documents


class CalibrationBucket(_Schema):
    bucket: Text
    lo: Number
    hi: NumberOrNull  # null: the last bucket, which has no upper edge
    count: Whole
    observed_accuracy: NumberOrNull
    predicted_accuracy: NumberOrNull


class CalibrationTable(_Schema):
    buckets: list[CalibrationBucket]
    expected_calibration_error: NumberOrNull


class MarginRow(_Schema):
    bucket: Text
    count: Whole
    accuracy: NumberOrNull  # null: an empty bucket


class LengthPoints(_Schema):
    chosen: list[Point]
    rejected: list[Point]


class LengthBias(_Schema):
    correlation: NumberOrNull
    longer_wins: NumberOrNull
    num_unequal_pairs: Whole
    num_equal_length_pairs: Whole
    points: LengthPoints


class PaddingCheck(_Schema):
    """padding_invariance: only num_sequences (0) when there was nothing to check."""

    num_sequences: Whole
    max_abs_delta: NumberOrNull = None
    left: NumberOrNull = None
    right: NumberOrNull = None
    max_padding: Whole | None = None
    num_padded: Whole | None = None
    compute_dtype: TextOrNull = None
    tolerance: NumberOrNull = None
    invariant: FlagOrNull = None


class RewardDiagnostics(_Schema):
    """reward_diagnostics.json (train/reward_diagnostics.py's `reward_diagnostics`, plus the step)."""

    num_pairs: Whole
    step: Whole
    calibration: CalibrationTable
    accuracy_by_margin: list[MarginRow]
    length_bias: LengthBias
    padding_invariance: PaddingCheck


class Calibration(_Schema):
    """calibration.json (the reward model's latest held-out evaluation, train/reward.py's
    `pair_metrics`): its metrics by name, every one a number."""

    model_config = ConfigDict(extra="allow", frozen=True)

    accuracy: Number
    margin: Number
    chosen_rewards: Number
    rejected_rewards: Number
    num_pairs: Number
    __pydantic_extra__: dict[str, Number] = Field(init=False)  # type: ignore[assignment]


# the files of a run directory that are read back, by name
RUN_FILES: dict[str, type[_Schema]] = {
    "metrics.jsonl": MetricsRow,
    "sft_metrics.jsonl": SftMetricsRow,
    "alerts.jsonl": AlertRow,
    "reward_diagnostics.json": RewardDiagnostics,
    "calibration.json": Calibration,
}


# ----------------------------------------------------------------------------- the readers

Model = TypeVar("Model", bound=BaseModel)


def read_jsonl(path: Path, schema: type[BaseModel]) -> list[dict[str, Any]]:
    """The rows of a run's .jsonl file, each an object that `schema` accepts, as written (the
    parsed JSON, not the model's copy: a resume writes kept rows back unchanged). Blank lines carry
    nothing and are skipped. A last line cut short (no newline after it, and not JSON: the run was
    killed while writing it) is left out, as a resume drops it. Anything else that is not a row
    raises RunFileError naming the file, the line and the field."""
    lines = Path(path).read_bytes().split(b"\n")
    rows = []
    for number, raw in enumerate(lines, start=1):
        where = f"{path}: line {number}"
        row = _parse_line(raw, where, torn=number == len(lines))  # the last has no newline after it
        if row is None:
            continue
        if not isinstance(row, dict):
            raise RunFileError(f"{where} is not a JSON object (got {_got(row)}); {DAMAGED_LINE}")
        _validate(schema, row, where, DAMAGED_LINE)
        rows.append(row)
    return rows


def _parse_line(raw: bytes, where: str, torn: bool) -> Any:
    """One line of a .jsonl file as JSON; None for a blank line, or for the last line (`torn`)
    when it is not JSON: cut short by a kill mid-write."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RunFileError(
            f"{where} is not valid UTF-8 (byte 0x{raw[error.start]:02x} at column {error.start + 1}); "
            f"{DAMAGED_LINE}"
        ) from None
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if torn:
            return None
        why = f"{error.msg} at column {error.colno}"
        raise RunFileError(f"{where} is not valid JSON ({why}); {DAMAGED_LINE}") from None
    except (ValueError, RecursionError) as error:  # an int of thousands of digits; nesting past the limit
        raise RunFileError(f"{where} cannot be read as JSON ({_why(error)}); {DAMAGED_LINE}") from None


def read_json(path: Path, schema: type[Model]) -> Model:
    """A run's .json file as `schema`'s model; RunFileError naming the file and the field (its
    path in the document, e.g. 'calibration.buckets[2].count'), or the line and column where the
    text stops being JSON."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1  # in bytes, 1-based
        raise RunFileError(
            f"{path}: line {line} is not valid UTF-8 (byte 0x{data[error.start]:02x} at column {column}); "
            f"{DAMAGED_FILE}"
        ) from None
    try:
        found = json.loads(text)
    except json.JSONDecodeError as error:
        why = f"{error.msg} at line {error.lineno} column {error.colno}"
        raise RunFileError(f"{path} is not valid JSON ({why}); {DAMAGED_FILE}") from None
    except (ValueError, RecursionError) as error:
        raise RunFileError(f"{path} cannot be read as JSON ({_why(error)}); {DAMAGED_FILE}") from None
    if not isinstance(found, dict):
        raise RunFileError(f"{path} is not a JSON object (got {_got(found)}); {DAMAGED_FILE}")
    return _validate(schema, found, str(path), DAMAGED_FILE)


def check_run_files(output_dir: Path) -> None:
    """Read every file of `RUN_FILES` that `output_dir` holds through its schema; the first one
    refused raises its RunFileError. A resume calls it before it changes anything in the directory,
    so a damaged file stops the run with the file and line named, not a traceback mid-way."""
    for name, schema in RUN_FILES.items():
        path = Path(output_dir) / name
        if not path.is_file():
            continue
        if name.endswith(".jsonl"):
            read_jsonl(path, schema)
        else:
            read_json(path, schema)


def _validate(schema: type[Model], found: dict[str, Any], where: str, fix: str) -> Model:
    """`found` as `schema`'s model, or RunFileError with the first field it refuses."""
    try:
        return schema.model_validate(found)
    except ValidationError as error:
        first = error.errors()[0]
        raise RunFileError(f"{where}: {_field(first['loc'])} {_said(first)}; {fix}") from None


def _field(loc: tuple[str | int, ...]) -> str:
    """A field's path in the document, quoted: 'step', 'calibration.buckets[2].count'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return _quoted(path)


def _said(error: Any) -> str:
    """What is wrong with the field, and the value found (for a missing field, nothing)."""
    kind = error["type"]
    if kind == "missing":
        return "is missing"
    said = {
        "run_file": error["msg"],
        "model_type": "must be an object",
        "model_attributes_type": "must be an object",
        "dict_type": "must be an object",
        "list_type": "must be a list",
    }.get(kind, error["msg"][:1].lower() + error["msg"][1:])
    return f"{said} (got {_got(error['input'])})"


def _got(value: Any) -> str:
    """The value found, short and on one line: a scalar as written, a list or object by its kind."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return _quoted(value) if isinstance(value, str) else _short(repr(value))


def _quoted(text: str) -> str:
    """A string from the file quoted as Python does (newlines and control characters escaped: the
    error stays one line), cut to SHOWN characters."""
    return _short(repr(text))


def _short(text: str) -> str:
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def _why(error: BaseException) -> str:
    """Why json.loads could not read a text that is not malformed: too deep for its recursion, or an
    int longer than Python converts (sys.get_int_max_str_digits, 4300 by default)."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()  # (Python 3.10.7 and later)
    return f"a number of more than {limit} digits"
