"""Bradley–Terry pairwise loss for reward models.

    P(chosen ≻ rejected) = σ(r_c − r_r − m)
    loss = −mean_b log σ(r_c[b] − r_r[b] − m[b])  +  c · mean_b (r_c[b] + r_r[b])²

m is an optional per-pair margin (Llama 2's margin loss), c the optional reward-centering
coefficient (Eisenstein et al. 2023) that pulls scores towards mean zero.

Parity: TRL `RewardTrainer.compute_loss` and EasyDeL reward `training_step` / `evaluation_step`.
Deviation from EasyDeL: its scores are [B, 1] and its margin [B], so `r_c − r_r − m` broadcasts
to a [B, B] matrix and averages B² wrong terms (grpo-math.md §3.2). Here every input is reduced to
[B] first and any other shape is an error, so that can never happen. EasyDeL's centering default
is 0.1; TRL's (and ours) is None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .outputs import LossOutput


def _as_pair_vector(x: torch.Tensor, name: str, batch: int | None = None) -> torch.Tensor:
    """[B] or [B, 1] -> [B]; anything else is an error naming the argument."""
    if x.dim() == 2 and x.shape[1] == 1:
        x = x.squeeze(1)  # [B, 1] -> [B]: a score head's output
    if x.dim() != 1 or (batch is not None and x.shape[0] != batch):
        expected = "[B] or [B, 1]" if batch is None else f"[{batch}] or [{batch}, 1]"
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {expected} (one value per pair).")
    return x


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> LossOutput:
    """Pairwise ranking loss of a reward model's scores.

    Args:
        chosen_rewards: [B] (or [B, 1]) scores of the preferred completions.
        rejected_rewards: [B] (or [B, 1]) scores of the other completions.
        margin: optional [B] required score gap per pair.
        center_rewards_coefficient: optional weight of mean((r_c + r_r)²).
    Returns:
        LossOutput(loss [], metrics): `accuracy` = mean(r_c > r_r) (strict: ties count as wrong),
        `margin` = mean(r_c − r_r), `chosen_rewards` and `rejected_rewards` = their means.
    """
    chosen = _as_pair_vector(chosen_rewards, "chosen_rewards")
    if chosen.shape[0] == 0:
        raise ValueError("empty batch: bradley_terry_loss needs at least one (chosen, rejected) pair.")
    rejected = _as_pair_vector(rejected_rewards, "rejected_rewards", chosen.shape[0])
    gap = chosen - rejected  # [B]
    logits = gap if margin is None else gap - _as_pair_vector(margin, "margin", chosen.shape[0]).to(gap.dtype)
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        metrics = {
            "accuracy": (chosen > rejected).to(gap.dtype).mean(),
            "margin": gap.mean(),
            "chosen_rewards": chosen.mean(),
            "rejected_rewards": rejected.mean(),
        }
    return LossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})
