"""The values a GRPO run applies: the config's, with what it leaves unset chosen for its model, and where
each value came from.

Defaults are TRL's (schema.py), and TRL's suit pretrained models of a billion parameters. `model: tiny`
is built here with random weights, and TRL's learning rate of 1e-6 moves its 0.66M weights too little to
change one answer (an own-task run once went 31% → 31%, with no warning). So a tiny model built here
takes, for the options below that nothing set, the values of the tested addition preset
(presets/addition.yaml: +17 points or more in every measured run). A value the user or a preset sets
always wins; a real model (a directory or hub id), or a model passed in from Python, keeps TRL's.

`applied(cfg)` is called once, where the config is resolved into the plan (`config.plan.grpo_plan`), and
by `grpokit print-config`; the run's config.yaml and print-config show each value under a comment
saying where it came from (`annotated_yaml`). No torch import here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

from ..ops.loss_types import LOSS_TYPES
from .load import load_yaml
from .schema import GRPOConfig

TINY = "model=tiny"  # the source of a value chosen for the tiny model
CHOSEN = f"chosen for {TINY}"
DEFAULT = "default"
YOURS = "yours"
TINY_PRESET = "addition"  # the preset whose values a tiny model takes
# what learning needs from a randomly initialised model: a learning rate 100× TRL's, held constant (a
# linear decay to 0 would halve what a short run learns)
TINY_OPTIONS = ("learning_rate", "lr_scheduler_type")
# Not chosen: the preset's supervised warm start (sft_steps 1000 until 35% of a probe is solved). Your
# own rows may lack the answers it learns, and where a probe-stopped warm start ends depends on float
# round-off, which would make every tiny run that leaves sft_steps unset start elsewhere; set it yourself.


@dataclass(frozen=True)
class Preset:
    """A built-in preset a config was loaded from, and the options it set that the command line did not
    override."""

    name: str
    keys: frozenset[str]


@dataclass(frozen=True)
class Applied:
    """A config with the values chosen for its model, and where each option's value came from."""

    config: GRPOConfig
    sources: Mapping[str, str]  # option -> "default", "preset NAME", "yours", CHOSEN or ASYNC
    defaults: Mapping[str, Any]  # option -> the default a chosen value replaced


@cache
def preset_values(name: str) -> dict[str, Any]:
    """The options a built-in preset sets, as written (presets/NAME.yaml)."""
    return load_yaml(resources.files("grpokit.presets").joinpath(f"{name}.yaml").read_text())


def tiny_choices(cfg: GRPOConfig, model_given: bool = False) -> dict[str, Any]:
    """option -> value for the options a tiny model built here takes from the addition preset because
    `cfg` leaves them unset ({} for any other model, or when the caller passes its own model)."""
    if cfg.model != "tiny" or model_given:
        return {}
    preset = preset_values(TINY_PRESET)
    unset = [key for key in TINY_OPTIONS if key not in cfg.model_fields_set]
    return {key: preset[key] for key in unset if preset[key] != getattr(cfg, key)}


ASYNC = "chosen for max_staleness >= 1"  # the source of a value chosen for asynchronous GRPO


def async_choices(cfg: GRPOConfig) -> dict[str, Any]:
    """max_staleness ≥ 1 trains on batches sampled by older weights: with sampling_correction unset it
    takes token_truncate, the decoupled objective (AReaL): the ratio clipped against the weights before
    the update, each token weighted by their probability over the sampler's, capped at
    sampling_correction_max. (vespo folds its own weights in; a loss without a ratio has none to fix.)"""
    variant = LOSS_TYPES[cfg.loss_type]
    stale = cfg.max_staleness is not None and cfg.max_staleness >= 1
    if not stale or "sampling_correction" in cfg.model_fields_set or not variant.has_ratio:
        return {}
    return {} if cfg.loss_type == "vespo" else {"sampling_correction": "token_truncate"}


def applied(cfg: GRPOConfig, preset: Preset | None = None, *, model_given: bool = False) -> Applied:
    """`cfg` with the values chosen for its model (`tiny_choices`) and for asynchronous GRPO
    (`async_choices`), and each option's source: chosen, the default, the preset's, or yours (set in
    your file, on the command line or in Python)."""
    tiny, stale = tiny_choices(cfg, model_given), async_choices(cfg)
    chosen = tiny | stale
    sources = {}
    for name in type(cfg).model_fields:
        if name in stale:
            sources[name] = ASYNC
        elif name in tiny:
            sources[name] = CHOSEN
        elif name not in cfg.model_fields_set:
            sources[name] = DEFAULT
        elif preset is not None and name in preset.keys:
            sources[name] = f"preset {preset.name}"
        else:
            sources[name] = YOURS
    # (the values are the preset's, which validate: tests/config/test_effective_defaults.py)
    config = cfg.model_copy(update=chosen) if chosen else cfg
    return Applied(config, sources, {name: getattr(cfg, name) for name in chosen})


def annotated_yaml(resolved: Applied) -> str:
    """Every applied value in declaration order, as `to_yaml` writes it (one `key: value` block each),
    each one that is not the default under a comment saying where it came from: a config.yaml that
    loads back to the same config, and says which values a run chose."""
    lines = ["# every value is its default unless the comment above it says where it came from"]
    for name, value in resolved.config.model_dump(mode="json").items():
        source = resolved.sources[name]
        if name in resolved.defaults:  # chosen (for the model, or for max_staleness)
            default = yaml.safe_dump(resolved.defaults[name], default_flow_style=True).removesuffix("\n...\n")
            lines.append(f"# {source}, as unset (default: {default.strip()})")
        elif source != DEFAULT:
            lines.append(f"# {source}")
        lines.append(yaml.safe_dump({name: value}, sort_keys=False).rstrip("\n"))
    return "\n".join(lines) + "\n"


def preset_of(name: str, overridden: Collection[str]) -> Preset:
    """The built-in preset `name` as a config's source, less the options the command line overrode."""
    return Preset(name, frozenset(preset_values(name)) - set(overridden))
