"""The reference policy π_ref of the KL penalty.

* beta = 0: no reference at all (no memory, no forward pass).
* full fine-tuning: a frozen copy of the initial policy, in eval mode, never receiving gradients.
* periodic sync (TRL's `sync_ref_model`): every `sync_steps` updates,
  θ_ref ← α·θ + (1 − α)·θ_ref (TRL defaults α = 0.6, every 512 steps; EasyDeL 0.9 / 64).
"""

from __future__ import annotations

import copy

import torch


def make_reference(policy: torch.nn.Module, beta: float) -> torch.nn.Module | None:
    """A frozen eval-mode copy of `policy` when beta ≠ 0, else None. A LoRA policy needs no copy:
    its reference is itself with the adapters disabled (`models.lora.reference_model`)."""
    if beta == 0.0 or (callable(getattr(policy, "disable_adapter", None)) and hasattr(policy, "peft_config")):
        return None
    reference = copy.deepcopy(policy)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@torch.no_grad()
def sync_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """θ_ref ← α·θ + (1 − α)·θ_ref, parameter by parameter (α = 1 copies the policy)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {alpha}.")
    for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
        ref_param.mul_(1.0 - alpha).add_(param.detach(), alpha=alpha)


def should_sync(step: int, sync_steps: int) -> bool:
    """TRL's schedule: after every `sync_steps`-th optimizer step (step counts from 1)."""
    return sync_steps > 0 and step % sync_steps == 0
