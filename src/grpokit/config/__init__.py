"""Typed, validated run configuration (pydantic + YAML). No torch import."""

from .load import ConfigError, load_config, parse_overrides, to_yaml
from .schema import AsyncGRPOConfig, GRPOConfig, RewardConfig, SFTConfig

__all__ = [
    "AsyncGRPOConfig",
    "ConfigError",
    "GRPOConfig",
    "RewardConfig",
    "SFTConfig",
    "load_config",
    "parse_overrides",
    "to_yaml",
]
