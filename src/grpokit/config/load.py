"""YAML files plus `key=value` overrides -> a validated config, or one clear error.

    load_config(GRPOConfig, "run.yaml", ["learning_rate=3e-4", "loss_type=grpo"])

Override values are parsed as YAML scalars (`3e-4`, `true`, `null`, `[1.0, 0.5]`).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and what to change."""


def _closest(name: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value (for example learning_rate=3e-4).")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        values[key.strip()] = _number(value)
    return values


def _number(value: Any) -> Any:
    """YAML 1.1 reads `3e-4` (no dot) as a string; a user means the number."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") else int(value)
        except ValueError:
            return value
    return value


def _read_yaml(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist.")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level.")
    return data


def _explain(error: ValidationError, schema: type[BaseModel], source: str) -> ConfigError:
    lines = []
    valid = list(schema.model_fields)
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "config"
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}{_closest(key, valid)}")
        else:
            given = item.get("input")
            message = item["msg"].replace("Value error, ", "")
            lines.append(f"{key}: {message} (got {given!r})" if key != "config" else message)
    return ConfigError(f"invalid configuration ({source}):\n  " + "\n  ".join(lines))


def load_config(schema: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Validate `path` (optional YAML file) updated by `overrides` against `schema`."""
    from .trl_names import translate

    source = (
        ", ".join(filter(None, [str(path) if path else "", "command line" if overrides else ""]))
        or "defaults"
    )
    data: dict[str, Any] = {}
    # TRL names are translated per source, so that a command-line alias (bf16=true) overrides the
    # file's value of what it stands for (dtype) instead of contradicting it
    for where, values in [
        (str(path), _read_yaml(path) if path is not None else {}),
        ("command line", parse_overrides(overrides)),
    ]:
        try:
            data.update(translate(schema.__name__, schema.model_fields, values))
        except ConfigError as error:
            raise ConfigError(f"invalid configuration ({where}):\n  {error}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise _explain(error, schema, source) from None


def to_yaml(config: BaseModel) -> str:
    """Every resolved value, in declaration order (what `grpokit print-config` shows)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
