"""grpokit: Group Relative Policy Optimization for language models.

The math lives in `grpokit.ops` (pure torch). `GRPOTrainer` and `GRPOConfig` (and their asynchronous
forms) are imported on first use, so `import grpokit` stays light and never pulls in transformers.
"""

import importlib
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


# the API's classes, imported on first use: name -> the module that defines it
_LAZY = {
    **dict.fromkeys(("GRPOTrainer", "AsyncGRPOTrainer"), ".trainer"),
    **dict.fromkeys(("GRPOConfig", "AsyncGRPOConfig", "RewardConfig"), ".config"),
    "RewardTrainer": ".reward_trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'grpokit' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
