"""Sampling G completions (or G multi-turn episodes) per prompt: the one decode loop (`decode.py`),
the distribution it draws from (`processing.py`) and its static-shape step (`static_decode.py`)."""

from .decode import Decoder, LoopControl, episode_seed, tokenize_prompts
from .processing import process_logits
from .static_decode import DECODE_LOOPS, resolve_decode_loop
from .types import Rollout, SamplingParams

__all__ = [
    "DECODE_LOOPS",
    "Decoder",
    "LoopControl",
    "Rollout",
    "SamplingParams",
    "episode_seed",
    "process_logits",
    "resolve_decode_loop",
    "tokenize_prompts",
]
