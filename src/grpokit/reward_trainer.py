"""`RewardTrainer`: the Python entry point for reward models, a thin façade over `train.reward`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import RewardConfig
from .config.plan import display
from .data import load_preferences
from .train.progress import reporting
from .train.reward import RewardResult, train_reward


class RewardTrainer:
    """RewardTrainer(model, train_dataset, config, eval_dataset=None, tokenizer=None).train()

    model: a local directory (a sequence-classification model, or a causal LM whose backbone gets
    a new scalar head), or a loaded sequence-classification model (then pass its tokenizer).
    train_dataset / eval_dataset: a preference file, a list of dicts or a datasets.Dataset with
    chosen / rejected (prompt and margin optional).
    """

    def __init__(
        self,
        model: Any,
        train_dataset: Any,
        config: RewardConfig | dict[str, Any] | None = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
    ) -> None:
        cfg = config if isinstance(config, RewardConfig) else RewardConfig(**(config or {}))
        if isinstance(model, str):
            cfg, model = cfg.model_copy(update={"model": model}), None
        elif tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: RewardTrainer(..., tokenizer=tokenizer).")
        self.config = cfg.model_copy(update={"task": None})
        self.model, self.tokenizer = model, tokenizer
        self.train_rows = load_preferences(train_dataset)
        self.eval_rows = load_preferences(eval_dataset) if eval_dataset is not None else []

    def train(self, on_event: Callable[[str, int, dict[str, Any]], None] | None = None) -> RewardResult:
        """Run; progress as on the command line when `config.progress` (unless `on_event` is given)."""
        with reporting(display(self.config), on_event) as events:
            return train_reward(
                self.config,
                model=self.model,
                tokenizer=self.tokenizer,
                train_rows=self.train_rows,
                eval_rows=self.eval_rows,
                on_event=events,
            )
