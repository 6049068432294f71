"""A tiny, fast GRPO set-up for loop tests: 1-layer policy, 4 prompts × 4 completions, 4 tokens."""

from __future__ import annotations

from typing import Any

import torch

from grpokit.config import GRPOConfig


def ones_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """A dense, deterministic reward a random policy earns sometimes: the share of '1' characters."""
    return [c.count("1") / max(len(c), 1) for c in completions]


def tiny_config(tmp_path, **overrides: Any) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path / "run"),
        task="addition",
        model="tiny",
        seed=3,
        tiny_hidden_size=16,
        tiny_num_layers=1,
        tiny_num_heads=2,
        tiny_intermediate_size=32,
        max_steps=2,
        prompts_per_step=4,
        num_generations=4,
        micro_batch_size=8,
        max_completion_length=4,
        num_eval_prompts=4,
        eval_steps=0,
        save_steps=0,
        log_completions_steps=0,
        learning_rate=1e-2,
        progress=False,
    )
    return GRPOConfig(**(base | overrides))


def weights(output_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from grpokit.train.checkpoint import list_checkpoints

    return load_file(list_checkpoints(output_dir)[-1] / "model.safetensors")
