"""A tiny, fast GRPO set-up for loop tests: 1-layer policy, 4 prompts × 4 completions, 4 tokens."""

from __future__ import annotations

from typing import Any

import torch

from grpokit.config import GRPOConfig
from tests.helpers import TINY_RUN_VALUES


def ones_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """A dense, deterministic reward a random policy earns sometimes: the share of '1' characters."""
    return [c.count("1") / max(len(c), 1) for c in completions]


def tiny_config(tmp_path, **overrides: Any) -> GRPOConfig:
    """The tiny run (tests.helpers.TINY_RUN_VALUES) on the addition task, seed 3, into tmp_path/run."""
    base = dict(output_dir=str(tmp_path / "run"), task="addition", model="tiny", seed=3) | TINY_RUN_VALUES
    return GRPOConfig(**(base | overrides))


def weights(output_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from grpokit.train.checkpoint import list_checkpoints

    return load_file(list_checkpoints(output_dir)[-1] / "model.safetensors")
