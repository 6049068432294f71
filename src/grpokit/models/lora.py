"""LoRA adapters through PEFT (the `lora` extra). With adapters, the reference policy is the same
weights with the adapters switched off: no second copy of the model in memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def apply_lora(
    model: Any,
    *,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> Any:
    """Wrap `model` with trainable LoRA adapters; only the adapters require gradients."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("LoRA needs the peft package: pip install 'grpokit[lora]'.") from None
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    return get_peft_model(model, config)


def is_lora(model: Any) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


@contextlib.contextmanager
def reference_model(policy: Any, reference: torch.nn.Module | None) -> Iterator[Any]:
    """The model to score reference log-probs with: the frozen copy when there is one, else the
    LoRA policy with its adapters disabled for the duration of the block."""
    if reference is not None:
        yield reference
    elif is_lora(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise ValueError("no reference policy: beta = 0 needs none, otherwise use make_reference or LoRA.")
