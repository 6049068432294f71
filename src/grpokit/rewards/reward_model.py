"""A trained reward model used as a GRPO reward function: batched, eval mode, no gradients, on
its own device. The text it scores is built exactly as in reward-model training
(`models.encode_for_reward`: prompt + completion + EOS), so scores mean the same thing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..models import encode_for_reward, load_reward_model, pad_left, reward_scores


class RewardModelFunction:
    """f(prompts, completions, **_) -> the reward model's score of each prompt + completion."""

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 64, name: str | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.__name__ = name or "reward_model"

    @classmethod
    def from_path(cls, path: str | Path, *, batch_size: int = 64, device: str = "cpu") -> RewardModelFunction:
        loaded = load_reward_model(path, device=device)
        return cls(
            loaded.model, loaded.tokenizer, batch_size=batch_size, name=f"reward_model:{Path(path).name}"
        )

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float | None]:
        device = next(self.model.parameters()).device
        sequences = [
            encode_for_reward(self.tokenizer, str(p), c) for p, c in zip(prompts, completions, strict=True)
        ]
        scores: list[float | None] = []
        for start in range(0, len(sequences), self.batch_size):
            ids, mask = pad_left(sequences[start : start + self.batch_size], self.tokenizer.pad_token_id)
            scores.extend(reward_scores(self.model, ids.to(device), mask.to(device)).float().cpu().tolist())
        return scores
