"""Sampling G completions per prompt. The trainer talks to a `Sampler`; backends plug in here."""

from __future__ import annotations

from typing import Protocol

from .hf_generate import HFGenerateSampler, completion_mask_from_ids
from .kv_sampler import KVCacheSampler
from .multi_turn import EpisodeSampler
from .static_decode import DECODE_LOOPS, StaticDecoder, resolve_decode_loop
from .types import Rollout, SamplingParams


class Sampler(Protocol):
    """Anything that turns P prompt texts into a Rollout of P·G completions."""

    def sample(self, prompts: list[str], params: SamplingParams) -> Rollout: ...


SAMPLERS = {"hf": HFGenerateSampler, "kv": KVCacheSampler}

__all__ = [
    "DECODE_LOOPS",
    "SAMPLERS",
    "StaticDecoder",
    "resolve_decode_loop",
    "EpisodeSampler",
    "HFGenerateSampler",
    "KVCacheSampler",
    "Rollout",
    "Sampler",
    "SamplingParams",
    "completion_mask_from_ids",
]
