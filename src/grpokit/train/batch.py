"""The batch one GRPO step learns from, and the checks its groups must pass.

B = P·G rows; rows p·G … p·G+G−1 share prompt p. Built on the host from a rollout (`Batch.from_rollout`,
the one place a rollout becomes a batch), moved to the policy's device for the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from ..rollout import Rollout


@dataclass(frozen=True)
class Batch:
    """One generation batch, B = P·G rows; rows p·G … p·G+G−1 share a prompt."""

    prompt_ids: torch.Tensor  # [B, Lp] left-padded
    prompt_mask: torch.Tensor  # [B, Lp] bool
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool (after mask_truncated_completions)
    advantages: torch.Tensor  # [B]
    sampling_logps: torch.Tensor  # [B, T] float32: log-probs of the sampled tokens as drawn
    prompts: list[str]  # [B]
    completions: list[str]  # [B]
    rewards: torch.Tensor  # [B]
    # [B, T] bool: the completion tokens attended to (multi-turn: the environment's too); None: the mask
    completion_attention: torch.Tensor | None = None

    @classmethod
    def from_rollout(
        cls,
        rollout: Rollout,
        *,
        mask_truncated: bool,
        advantages: torch.Tensor,
        rewards: torch.Tensor,
        prompts: list[str],
        completions: list[str] | None = None,
    ) -> Batch:
        """The rollout's tokens with their advantages [B] and rewards [B]; `mask_truncated`
        (mask_truncated_completions): a completion cut at max_completion_length counts no token.
        `completions`: the texts learned from, when not the rollout's own."""
        mask = rollout.completion_mask  # [B, T]
        if mask_truncated:
            mask = mask & ~rollout.truncated[:, None]
        return cls(
            prompt_ids=rollout.prompt_ids,
            prompt_mask=rollout.prompt_mask,
            completion_ids=rollout.completion_ids,
            completion_mask=mask,
            advantages=advantages,
            sampling_logps=rollout.sampling_logps,
            prompts=prompts,
            completions=rollout.completions if completions is None else completions,
            rewards=rewards,
            completion_attention=rollout.completion_attention,
        )

    def to(self, device: torch.device) -> Batch:
        """The tensors on `device` (texts stay as they are; rewards stay on the host for metrics)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if f.name != "rewards" and isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def pad_cat(tensors: Sequence[torch.Tensor], value: float | bool, left: bool) -> torch.Tensor:
    """Concatenate [n_i, L_i] tensors along rows, padding the width to the largest L."""
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1]), value)
        padded.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(padded, dim=0)


def merge_groups(parts: Sequence[tuple[Batch, list[int]]], G: int, pad_id: int) -> Batch:
    """The chosen groups of several generation batches, as one batch."""
    rows = [[g * G + i for g in groups for i in range(G)] for _, groups in parts]
    pick = [(b, r) for (b, _), r in zip(parts, rows, strict=True) if r]
    if len(pick) == 1 and pick[0][1] == list(range(len(pick[0][0].prompts))):
        return pick[0][0]  # one whole batch (no dynamic sampling): nothing to merge
    return Batch(
        prompt_ids=pad_cat([b.prompt_ids[r] for b, r in pick], pad_id, left=True),
        prompt_mask=pad_cat([b.prompt_mask[r] for b, r in pick], False, left=True),
        completion_ids=pad_cat([b.completion_ids[r] for b, r in pick], pad_id, left=False),
        completion_mask=pad_cat([b.completion_mask[r] for b, r in pick], False, left=False),
        advantages=torch.cat([b.advantages[r] for b, r in pick]),
        sampling_logps=pad_cat([b.sampling_logps[r] for b, r in pick], 0.0, left=False),
        prompts=[b.prompts[i] for b, r in pick for i in r],
        completions=[b.completions[i] for b, r in pick for i in r],
        rewards=torch.cat([b.rewards[r] for b, r in pick]),
        completion_attention=None
        if pick[0][0].completion_attention is None
        else pad_cat([b.completion_attention[r] for b, r in pick], False, left=False),
    )


def group_invariants(batch: Batch, G: int) -> dict[str, float]:
    """What GRPO's groups must satisfy in the batch the update reads, checked every step at no extra
    forward: `invariants/groups_intact` is 1.0 when each run of G rows holds one prompt (its text and
    its tokens), and `invariants/group_advantage_sum_max` is the largest |Σ advantages| of a group
    relative to the largest |advantage|: 0 to float32 round-off, as every scaling centres each group
    on its mean."""
    B = len(batch.prompts)
    same_text = all(batch.prompts[i] == batch.prompts[g] for g in range(0, B, G) for i in range(g, g + G))
    ids, mask = batch.prompt_ids.view(B // G, G, -1), batch.prompt_mask.view(B // G, G, -1)  # [P, G, Lp]
    same_ids = bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())
    advantages = batch.advantages.reshape(B // G, -1)  # [P, G] (or [P, G·T] per token)
    scale = max(float(advantages.abs().max()), 1.0)
    return {
        "invariants/groups_intact": float(same_text and same_ids),
        "invariants/group_advantage_sum_max": float(advantages.sum(-1).abs().max()) / scale,
    }
