"""What a rollout produces, with the shape of every field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. Names follow TRL's GRPOConfig."""

    num_generations: int = 8  # G, completions per prompt
    max_completion_length: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_strings: tuple[str, ...] = ()
    max_prompt_length: int | None = None  # None = no limit
    prompt_truncation: Literal["left", "error"] = "left"  # keep the end of a long prompt, or refuse it
    seed: int | None = None  # the same seed gives the same completions

    def __post_init__(self) -> None:
        checks = [
            (self.num_generations >= 1, f"num_generations must be ≥ 1, got {self.num_generations}"),
            (
                self.max_completion_length >= 1,
                f"max_completion_length must be ≥ 1, got {self.max_completion_length}",
            ),
            (self.temperature >= 0.0, f"temperature must be ≥ 0 (0 = greedy), got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k is None or self.top_k >= 0, f"top_k must be ≥ 0, got {self.top_k}"),
            (self.min_p is None or 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length must be ≥ 1"),
            (self.prompt_truncation in ("left", "error"), "prompt_truncation must be 'left' or 'error'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message + ".")


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
