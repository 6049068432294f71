"""What configuration errors are made of: the error type and how a user's value is shown in one.
The loader and the TRL-name table both build messages from these (neither imports the other back)."""

from __future__ import annotations

import reprlib
from typing import Any

SHOWN_CHARS = 80  # the most characters of a user's value that a message repeats


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and what to change."""


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut to `limit` characters, marked with "…" where cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, SHOWN_CHARS, SHOWN_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8


def shown(value: Any) -> str:
    """repr(value) for a message: reprlib stops early in a large or deep structure (a plain repr of
    an expanded YAML alias bomb would not return), and the result is cut to SHOWN_CHARS."""
    return shorten(_repr.repr(value))
