"""What a rollout produces, with the shape of every field. How completions are drawn
(`SamplingParams`) is the plan's own type (config/specs.py), re-exported here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config.specs import SamplingParams as SamplingParams  # re-exported: the plan builds it


@dataclass(frozen=True)
class Rollout:
    """G completions for each of P prompts; rows p·G … p·G+G−1 belong to prompt p."""

    prompt_ids: torch.Tensor  # [B, Lp] left-padded, each prompt repeated G times
    prompt_mask: torch.Tensor  # [B, Lp] bool
    completion_ids: torch.Tensor  # [B, T] right-padded with the pad id
    completion_mask: torch.Tensor  # [B, T] bool: True up to and including the first EOS (or stop)
    truncated: torch.Tensor  # [B] bool: no EOS and no stop string within max_completion_length
    sampling_logps: torch.Tensor  # [B, T] float32 log-prob of each token under the sampling distribution
    completions: list[str]  # [B] decoded completion texts (special tokens removed)
    num_generations: int  # G
    num_truncated_prompts: int  # prompts cut to max_prompt_length (counted once per prompt)
    # multi-turn rollouts (the decode loop with an environment) also fill these; one turn leaves the defaults
    # [B, T] bool: the completion tokens a forward attends to: the policy's and the environment's, not
    # padding. completion_mask ⊆ it; None: the same as completion_mask (a single turn)
    completion_attention: torch.Tensor | None = None
    env_rewards: torch.Tensor | None = None  # [B] float32 sum of the environment's rewards, NaN: none given
    num_turns: torch.Tensor | None = None  # [B] policy turns written
    env_metrics: dict[str, float] = field(default_factory=dict)  # summed counts (tool calls, errors...)
    # episodes through the chat template (conversational prompts): each row's turns as messages,
    # [{"role": "assistant" | the observation's role, "content": text}, ...]; completions then hold
    # each row's last policy turn
    messages: list[list[dict[str, str]]] | None = None

    @property
    def attention(self) -> torch.Tensor:
        """[B, T] bool: the completion tokens that are real (attended to), whoever wrote them."""
        return self.completion_mask if self.completion_attention is None else self.completion_attention

    @property
    def num_prompts(self) -> int:
        return self.completion_ids.shape[0] // self.num_generations
