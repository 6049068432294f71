"""How an option is declared: everything about it sits on its schema field.

Each field of the config classes (schema.py) is declared with `option(default, ..., resume=...,
description=..., trl=...)`, a pydantic `Field` whose extra facts are kept in `json_schema_extra`:

- `resume`: what a resumed run does when the option differs from the checkpoint's config.yaml
  (`Resume.fixed(why)`: refused, it shaped the checkpoint; `Resume.applied(why)`: used and said once;
  `Resume.invocation(why)`: how this command treats output_dir, never compared). config/resume.py
  reads it from here;
- `trl`: the TRL name this option is a plain rename of (TRL's `dataset_name` is grpokit's `dataset`):
  config/trl_names.py translates it and says so. TRL names that need logic (bf16 -> dtype, the
  *_strategy options, TRL's batch geometry) stay rules in trl_names.py;
- `description`: the line `--help` and the config reference (config/reference.py) show.

pydantic's own constraints (ge, le, pattern, min_length...) pass through unchanged. A config class
whose field lacks a resume rule or a description fails when it is defined (schema.py `_Keys`), so
every option is classified by construction. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

Rule = Literal["fixed", "applied", "invocation"]
RULES: tuple[Rule, ...] = ("fixed", "applied", "invocation")


@dataclass(frozen=True)
class Resume:
    """An option's resume rule and why."""

    rule: Rule
    why: str

    def __post_init__(self) -> None:
        if self.rule not in RULES or not self.why.strip():
            raise ValueError(f"a resume rule is one of {', '.join(RULES)} with its reason, not {self!r}")

    @classmethod
    def fixed(cls, why: str) -> Resume:
        """Refused on resume when it differs: the checkpoint was made with it."""
        return cls("fixed", why)

    @classmethod
    def applied(cls, why: str) -> Resume:
        """Used on resume when it differs, and said once."""
        return cls("applied", why)

    @classmethod
    def invocation(cls, why: str) -> Resume:
        """How this command treats output_dir, not part of the run: never compared."""
        return cls("invocation", why)


def option(
    default: Any = PydanticUndefined,
    *,
    resume: Resume,
    description: str,
    trl: str | None = None,
    **bounds: Any,
) -> Any:
    """A config field: pydantic's `Field(default, description=..., **bounds)` carrying its resume rule
    and the TRL name it renames."""
    extra: dict[str, Any] = {"resume": resume.rule, "resume_why": resume.why}
    if trl is not None:
        extra["trl"] = trl
    return Field(default, description=description, json_schema_extra=extra, **bounds)


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def resume_of(field: FieldInfo) -> Resume | None:
    """The resume rule a field declares (None: declared without `option`)."""
    extra = _extra(field)
    return Resume(extra["resume"], extra.get("resume_why", "")) if "resume" in extra else None


def trl_rename(field: FieldInfo) -> str | None:
    """The TRL name a field is a plain rename of, if it declares one."""
    name = _extra(field).get("trl")
    return name if isinstance(name, str) else None


def undeclared(fields: dict[str, FieldInfo]) -> list[str]:
    """The fields of a config class declared without a resume rule or a description, each said how
    to fix it ([] when every one has both)."""
    missing = []
    for name, field in fields.items():
        if resume_of(field) is None or not (field.description or "").strip():
            missing.append(name)
    return missing
