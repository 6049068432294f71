"""A trained reward model used as a GRPO reward function: batched, eval mode, no gradients, on
its own device. The text it scores is built exactly as in reward-model training
(`models.encode_for_reward`: prompt + completion + EOS), so scores mean the same thing."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..models import (
    encode_for_reward,
    load_reward_model,
    model_device,
    pad_left,
    resolve_device,
    reward_scores,
)


def placement(name: str) -> torch.device:
    """The device a reward model's `device` names: `models.resolve_device` with torchrun's LOCAL_RANK,
    except that "auto" on a rank without a GPU of its own (more ranks than GPUs) is the CPU, as for
    the policy (`train.distributed.choose_backend`)."""
    rank = os.environ.get("LOCAL_RANK")
    local = int(rank) if rank is not None else None
    if name == "auto" and local is not None and local >= torch.cuda.device_count():
        return torch.device("cpu")
    return resolve_device(name, local)


class RewardModelFunction:
    """f(prompts, completions, **_) -> the reward model's score of each prompt + completion."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 64,
        name: str | None = None,
        eos: bool = True,
    ) -> None:
        """`eos`: a text prompt + completion is scored with EOS appended, as grpokit's reward training
        encodes its pairs (`encode_for_reward`); False: as TRL's GRPOTrainer scores a reward model given in
        reward_funcs (the text prompt + completion tokenized alone, no special token added)."""
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        if getattr(tokenizer, "pad_token", "") is None:  # (as TRL: pads with EOS)
            tokenizer.pad_token = tokenizer.eos_token
        self.batch_size = batch_size
        self.eos = eos
        self.__name__ = name or "reward_model"
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "pad_token_id", None) is None:  # (TRL sets it too)
            config.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        batch_size: int = 64,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = torch.float32,
        revision: str | None = None,
        eos: bool = True,
    ) -> RewardModelFunction:
        """The reward model saved in `path` (a directory, or a hub id at `revision`), on `device`: a
        torch.device as it is, or a config's name (auto = CUDA when available, under torchrun
        cuda:LOCAL_RANK; see `models.resolve_device`). dtype: its storage (frozen: nothing updates it,
        so the compute dtype serves)."""
        if not isinstance(device, torch.device):
            device = placement(device)
        loaded = load_reward_model(path, device=device, dtype=dtype, revision=revision)
        return cls(
            loaded.model,
            loaded.tokenizer,
            batch_size=batch_size,
            name=f"reward_model:{Path(path).name}",
            eos=eos,
        )

    takes_text = True  # completions as text; a conversation's prompt is rendered here (`_ids`)

    def _ids(self, prompt: Any, completion: str) -> list[int]:
        """A text prompt + completion + EOS; a conversation's messages and the completion as the
        assistant's turn through this model's own chat template, as its conversational training pairs
        were rendered (`data.preferences`)."""
        if not isinstance(prompt, list):
            if not self.eos:
                return self.tokenizer(str(prompt) + completion, add_special_tokens=False)["input_ids"]
            return encode_for_reward(self.tokenizer, str(prompt), completion)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{self.name}: a conversational prompt needs the reward model's tokenizer to have a chat "
                "template; this one has none."
            )
        turn = [*prompt, {"role": "assistant", "content": completion}]
        text = self.tokenizer.apply_chat_template(turn, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float | None]:
        device = model_device(self.model)  # batches go to the model; the scores come back to the host
        sequences = [self._ids(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float | None] = []
        for start in range(0, len(sequences), self.batch_size):
            ids, mask = pad_left(sequences[start : start + self.batch_size], self.tokenizer.pad_token_id)
            scores.extend(reward_scores(self.model, ids.to(device), mask.to(device)).float().cpu().tolist())
        return scores
