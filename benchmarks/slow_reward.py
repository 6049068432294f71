"""A reward that takes 100 ms a batch: the main job's exact-answer reward behind the latency of a
sandbox or a remote judge (benchmarks/async_vs_sync.py)."""

from __future__ import annotations

import time
from typing import Any

from grpokit.rewards.builtin import exact_answer

LATENCY_S = 0.1


def exact_answer_slowly(prompts: list[Any], completions: list[str], **columns: Any) -> list[float | None]:
    time.sleep(LATENCY_S)
    return exact_answer(prompts, completions, **columns)
