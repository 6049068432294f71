"""The plan's types that the layers below train/ take as they are: how completions are drawn
(`SamplingParams`, for rollout/) and how the policy engine runs (`EngineSpec`, for engine/).

`config.plan.grpo_plan` builds them from the config, once; rollout/ and engine/ import them from here
(and re-export them: `from grpokit.rollout import SamplingParams`, `from grpokit.engine import
EngineSpec`), so there is one type per concept, not a plan type copied into a runtime one. What the
data decides later (the lengths of prompts and completions) and the per-step seed are filled in with
`dataclasses.replace` on the same object; the device is not part of either: the engine is built on
a rank's device (`PolicyEngine.create(..., device=...)`).

Torch-free, in the bottom layer, so that config/ (no torch) and rollout/ and engine/ can share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
class EngineSpec:
    """How the engine runs the policy: resolved once from the config (`config.plan`), the same for
    training, evaluation, the warm-start probe and `grpokit eval`. The precision is named as the
    config names it (`models.Precision.of(dtype, master_weights)` makes the torch dtypes)."""

    dtype: str = "float32"  # compute precision: float32, bfloat16 or float16
    master_weights: str = "float32"  # "float32", or "dtype": the trainable weights stored in `dtype`
    decode_loop: str = "auto"  # eager, static, compiled, cuda_graph, or auto (by device)
    fused_logps: bool = True  # log-probs from hidden states and the head, no [B, T, V] logits
    temperature: float = 1.0  # log-probs are taken at the sampling temperature
    group_size: int = 1  # G: rows come in groups sharing a prompt (prefix sharing when checked true)
    # the training passes through torch.compile (engine/compiled.py): true, false or auto (by device)
    torch_compile: bool | str = "auto"
    torch_compile_mode: str | None = None  # torch.compile's mode (None: its default)
    torch_compile_backend: str | None = None  # torch.compile's backend (None: inductor)
