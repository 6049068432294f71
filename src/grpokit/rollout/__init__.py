"""Sampling G completions per prompt. The trainer talks to a `Sampler`; backends plug in here."""

from __future__ import annotations

from typing import Protocol

from .hf_generate import HFGenerateSampler, completion_mask_from_ids
from .kv_sampler import KVCacheSampler
from .types import Rollout, SamplingParams


class Sampler(Protocol):
    """Anything that turns P prompt texts into a Rollout of P·G completions."""

    def sample(self, prompts: list[str], params: SamplingParams) -> Rollout: ...


SAMPLERS = {"hf": HFGenerateSampler, "kv": KVCacheSampler}

__all__ = [
    "SAMPLERS",
    "HFGenerateSampler",
    "KVCacheSampler",
    "Rollout",
    "Sampler",
    "SamplingParams",
    "completion_mask_from_ids",
]
