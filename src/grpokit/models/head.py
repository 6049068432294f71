"""The split of a causal LM into its decoder (tokens -> last hidden states) and its LM head (a plain
linear map to the vocabulary), so that log-probs can be taken with `ops.linear_logps` without ever
forming [B, T, V] logits.

The split is offered only where it is exact: the head must be a plain `nn.Linear`, no forward hook
may sit on the model or its head (it would be bypassed), and the model must not post-process its
logits (Gemma's soft-capping, Cohere's `logit_scale`, Granite's
`logits_scaling`). Otherwise `lm_head_of` returns None and callers use the model's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .lean_llama import lean_decoder

# config attributes that change logits after the head, with the value that means "no change"
_LOGIT_POSTPROCESSING = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


@dataclass(frozen=True)
class LMHead:
    """A causal LM seen as decoder + linear head: logits = decoder(ids) · weightᵀ + bias."""

    decoder: Any  # callable(input_ids=, attention_mask=) -> output with .last_hidden_state [b, L, H]:
    # the lean Llama forward where it applies (`lean_llama`), else transformers' own decoder
    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V] or None


def lm_head_of(model: Any) -> LMHead | None:
    """The decoder and linear head of a transformers causal LM (LoRA-wrapped too), or None when the
    model's logits are not exactly `hidden · weightᵀ + bias` or the parts cannot be found."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the LM inside
    if any(_has_hooks(m) for m in (model, inner, getattr(inner, "lm_head", None))):
        return None  # hooks on the whole model or its head would be skipped: keep its own forward
    config = getattr(inner, "config", None)
    if config is None or not hasattr(inner, "get_output_embeddings"):
        return None
    for name, neutral in _LOGIT_POSTPROCESSING.items():
        if getattr(config, name, neutral) not in (neutral, None):
            return None
    head = inner.get_output_embeddings()
    decoder = lean_decoder(inner) or getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    if type(head) is not torch.nn.Linear or decoder is None or decoder is inner:
        return None
    return LMHead(decoder=decoder, weight=head.weight, bias=head.bias)


def _has_hooks(module: Any) -> bool:
    return isinstance(module, torch.nn.Module) and bool(
        module._forward_hooks or module._forward_pre_hooks  # noqa: SLF001 - torch keeps them private
    )


def last_hidden_states(
    head: LMHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int
) -> torch.Tensor:
    """The decoder's final hidden states at the last `keep` positions, on the model's device (inputs
    are moved there). [b, L] -> [b, keep, H]"""
    device = head.weight.device
    out = head.decoder(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    )
    return out.last_hidden_state[:, -keep:]  # [b, keep, H]
