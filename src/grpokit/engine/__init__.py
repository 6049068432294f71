"""The engine: the one way the policy generates or scores. It stands above `models/` (backends) and
`rollout/` (the decode loop) and joins them; training, evaluation, the warm-start probe, `grpokit
eval` and the Python API all go through it."""

from .engine import EngineSpec, PolicyEngine, Replayed, Sampler, Sequences, Wrapping, truncates

__all__ = ["EngineSpec", "PolicyEngine", "Replayed", "Sampler", "Sequences", "Wrapping", "truncates"]
