"""grpokit: Group Relative Policy Optimization for language models.

The math lives in `grpokit.ops` (pure torch); import it directly for the loss functions.
Importing `grpokit` itself stays light: nothing here pulls in transformers.
"""

from .ops import LossOutput, bradley_terry_loss, group_advantages, grpo_loss

__version__ = "0.1.0"

__all__ = ["LossOutput", "__version__", "bradley_terry_loss", "group_advantages", "grpo_loss"]
