"""Resuming with a changed config: what may change, what may not (STUB: being written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def resume_changes(cfg: Any, saved_config: Path) -> list[str]:
    """Compare the resolved `cfg` of a resumed run with the checkpoint's `saved_config` (its
    config.yaml). Options that cannot change raise ConfigError naming every difference; the options
    that may change and did are returned as one-line notes, to be said once."""
    return []
