"""Resuming with a changed config: what may change, what may not.

A checkpoint holds weights, optimizer and scheduler state, sampler positions and RNG states that were
made under its config.yaml. An option that shaped them (the model, the data, the algorithm, the batch
geometry, the optimizer and its schedule) cannot change on resume: the new value would be ignored
(AdamW's betas, epsilon, weight decay and the scheduler's base learning rate are restored from the
checkpoint) or would silently mix two runs in one output_dir, whose next checkpoints would record a
config that describes neither. Those are refused, every difference in one ConfigError. An option
that only says how the rest of the run is watched, saved or bounded may change: it is applied and
said once.

Each option's rule, and why, sits on its field (`option(..., resume=Resume.fixed(why))`,
config/options.py; the shared reasons are schema.py's FIXED_* constants): "fixed" is refused when it
differs, "applied" is used and said, "invocation" (resume, overwrite) says how this command treats
output_dir and is never compared. A config class whose field has no rule fails when it is defined, so
every option is classified. No torch import here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .load import ConfigError, load_config, shorten, shown
from .options import Resume, resume_of
from .remote_reward import redacted_entries


def resume_rules(schema: type[Any]) -> dict[str, Resume]:
    """option -> its resume rule and why, for every option of a config class (from its fields)."""
    rules = {name: resume_of(field) for name, field in schema.model_fields.items()}
    return {name: rule for name, rule in rules.items() if rule is not None}


_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)$")


def _value(value: Any) -> str:
    """A value as the user writes it in YAML: true/null, not True/None; shortened."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return shorten(value) if isinstance(value, str) else shown(value)


def resume_changes(cfg: Any, saved_config: Path) -> list[str]:
    """Compare the resolved `cfg` of a resumed run with the checkpoint's `saved_config` (its
    config.yaml). Options that cannot change raise ConfigError naming every difference; the options
    that may change and did are returned as one-line notes, to be said once."""
    saved_config = Path(saved_config)
    saved = load_config(type(cfg), saved_config, written=True)  # its ConfigError names the file
    refused: list[str] = []
    notes: list[str] = []
    for name, resume in resume_rules(type(cfg)).items():
        before, now = getattr(saved, name), getattr(cfg, name)
        if name == "reward_funcs":  # config.yaml holds the urls redacted: compared (and shown) alike
            before, now = redacted_entries(before), redacted_entries(now)
        if before == now or resume.rule == "invocation":
            continue
        if resume.rule == "fixed":
            refused.append(f"{name}: checkpoint {_value(before)}, now {_value(now)}")
        else:
            what = _why(cfg, name, before, now)
            notes.append(f"{name}: {_value(before)} in the checkpoint, {_value(now)} now (applied{what})")
    step = _CHECKPOINT_DIR.search(saved_config.parent.name)
    if step and cfg.max_steps < int(step.group(1)):
        refused.append(
            f"max_steps: {cfg.max_steps} is before the checkpoint's step {step.group(1)} "
            f"(set max_steps ≥ {step.group(1)})"
        )
    if refused:
        raise ConfigError(
            f"resume: options that cannot change on resume differ from {saved_config}:\n  "
            + "\n  ".join(refused)
            + "\n  resume with the checkpoint's values, or start a new run in another output_dir"
        )
    return notes


def _why(cfg: Any, name: str, before: Any, now: Any) -> str:
    """What an applied change of `name` does beyond the obvious ("" when nothing)."""
    if name == "max_steps" and getattr(cfg, "lr_scheduler_type", "constant") != "constant":
        direction = "higher" if now > before else "lower"
        return (
            f"; the {cfg.lr_scheduler_type} schedule now decays to 0 at step {now} instead of {before}: "
            f"after warm-up the learning rate is {direction} from here on than the checkpoint's "
            "schedule had it"
        )
    return ""
