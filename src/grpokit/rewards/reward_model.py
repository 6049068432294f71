"""A trained sequence-classification reward model used as a reward function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class RewardModelFunction:
    """f(prompts, completions) -> the model's scalar score of prompt + completion, batched,
    in eval mode, without gradients, on the model's own device."""

    def __init__(
        self, model: Any, tokenizer: Any, *, batch_size: int = 16, max_length: int | None = None
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.__name__ = getattr(getattr(model, "config", None), "name_or_path", None) or "reward_model"

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float | None]:
        device = next(self.model.parameters()).device
        texts = [f"{p}{c}" for p, c in zip(prompts, completions, strict=True)]
        scores: list[float | None] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                return_tensors="pt",
                add_special_tokens=False,
            ).to(device)
            logits = self.model(**enc).logits  # [b, 1]
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
