"""grpokit: Group Relative Policy Optimization for language models.

The math lives in `grpokit.ops` (pure torch). `GRPOTrainer` and `GRPOConfig` (and their asynchronous
forms) are imported on first use, so `import grpokit` stays light and never pulls in transformers.
"""

from typing import Any

from .ops import LossOutput, bradley_terry_loss, group_advantages, grpo_loss

__version__ = "0.1.0"

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "LossOutput",
    "__version__",
    "bradley_terry_loss",
    "group_advantages",
    "grpo_loss",
]


def __getattr__(name: str) -> Any:
    if name == "AsyncGRPOTrainer":
        from .trainer import AsyncGRPOTrainer

        return AsyncGRPOTrainer
    if name == "AsyncGRPOConfig":
        from .config import AsyncGRPOConfig

        return AsyncGRPOConfig
    if name == "GRPOTrainer":
        from .trainer import GRPOTrainer

        return GRPOTrainer
    if name == "GRPOConfig":
        from .config import GRPOConfig

        return GRPOConfig
    if name == "RewardTrainer":
        from .reward_trainer import RewardTrainer

        return RewardTrainer
    if name == "RewardConfig":
        from .config import RewardConfig

        return RewardConfig
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")
