"""`GRPOTrainer`: the Python entry point, a thin façade over `train.grpo.train_grpo`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .config import GRPOConfig
from .config.plan import display
from .data import load_prompts
from .envs import EnvironmentSpec, tool_environment
from .train.grpo import TrainResult, train_grpo
from .train.progress import reporting


class GRPOTrainer:
    """GRPOTrainer(model, reward_funcs, train_dataset, config, eval_dataset=None, tokenizer=None).train()

    model: a local model directory, or a loaded causal LM (then pass its tokenizer).
    reward_funcs: one callable or a list, f(prompts, completions, **columns) -> list[float | None].
    train_dataset / eval_dataset: a file path, a list of dicts or a datasets.Dataset.
    config: a GRPOConfig (or a dict of its fields); its `task` is ignored: the data given here is used.
    tools: plain functions the policy may call (multi-turn episodes, the config's tool_call_format,
        max_turns and tool_timeout); environment_factory: a class or function returning a fresh
        environment per episode (reset(row) / step(text), see grpokit.envs). TRL's names; at most one.
        With either, reward_funcs may be empty: the reward is then what the environment paid.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]],
        train_dataset: Any,
        config: GRPOConfig | dict[str, Any] | None = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
        is_correct: Callable[[str, dict[str, Any]], bool] | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | None = None,
    ) -> None:
        cfg = config if isinstance(config, GRPOConfig) else GRPOConfig(**(config or {}))
        if tools and environment_factory is not None:
            raise ValueError(
                "give tools or environment_factory, not both: an environment runs its own tools."
            )
        self.environment = None
        if tools:
            self.environment = tool_environment(
                list(tools),
                cfg.tool_call_format or "hermes",
                max_turns=cfg.max_turns,
                timeout=cfg.tool_timeout,
            )
        elif environment_factory is not None:
            self.environment = EnvironmentSpec(
                environment_factory,
                max_turns=cfg.max_turns,
                stop_strings=getattr(environment_factory, "stop_strings", ()),
                name=getattr(environment_factory, "__name__", "environment"),
            )
        if isinstance(model, str):
            cfg, model = cfg.model_copy(update={"model": model}), None
        elif tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: GRPOTrainer(..., tokenizer=tokenizer).")
        self.config = cfg.model_copy(update={"task": None})
        self.model, self.tokenizer = model, tokenizer
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, Sequence) else [reward_funcs]
        self.train_rows = load_prompts(train_dataset, prompt_column=cfg.prompt_column)
        self.eval_rows = (
            load_prompts(eval_dataset, prompt_column=cfg.prompt_column) if eval_dataset is not None else []
        )
        self.is_correct = is_correct

    def train(self, on_event: Callable[[str, int, dict[str, Any]], None] | None = None) -> TrainResult:
        """Run; progress as on the command line when `config.progress` (unless `on_event` is given)."""
        with reporting(display(self.config), on_event) as events:
            return train_grpo(
                self.config,
                model=self.model,
                tokenizer=self.tokenizer,
                reward_funcs=self.reward_funcs,
                train_rows=self.train_rows,
                eval_rows=self.eval_rows,
                is_correct=self.is_correct,
                on_event=events,
                environment=self.environment,
            )
