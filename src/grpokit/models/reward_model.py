"""Scalar reward models: scores of token sequences, independent of how much padding they carry.

A reward model is a transformers sequence-classification model with one label (any architecture
transformers can load, or `build_reward_model`: the Llama of `build_policy` with a scalar head). It
scores a sequence at its last real token. Left or right padding give the same score because
position ids are derived from the attention mask and pooling uses the last attended position.
"""

from __future__ import annotations

from typing import Any

import torch

from .device import model_device


def encode_for_reward(tokenizer: Any, prompt: str, completion: str) -> list[int]:
    """Token ids a reward model scores: prompt + completion + EOS (TRL appends EOS to text pairs)."""
    ids = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else ids


def pad_left(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists. -> ids [n, L], attention mask [n, L] bool"""
    width = max(len(s) for s in sequences)
    ids = torch.tensor(
        [[pad_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long
    )  # one copy
    lengths = torch.tensor([len(s) for s in sequences])
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]  # [n, L]
    return ids, mask


def reward_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One scalar per sequence, read at its last attended token. [n, L], [n, L] bool -> [n], on the
    model's device (the inputs are moved there; differentiable: reward training takes its gradient)."""
    device = model_device(model)
    input_ids = input_ids.to(device)
    mask = attention_mask.to(device=device, dtype=torch.long)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, L] padding does not shift positions
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, output_hidden_states=False)
    logits = out.logits  # [n, 1] pooled by transformers at the last non-pad token
    if logits.dim() == 3:  # an unpooled head: pick the last attended position ourselves
        last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)  # [n]
        logits = logits[torch.arange(logits.shape[0], device=logits.device), last]
    return logits[:, 0]
