"""token_logps keeps no second [B, T, V] tensor: measured, in a fresh process, by the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "logps_memory.py"


def _peak(method: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--method", method, "--shape", "4", "512", "32000"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs"
)
def test_token_logps_peak_memory_under_no_grad_is_below_30_percent_of_logits():
    """[4, 512, 32000] float32 logits (250 MiB): the issue's bound is 30% beyond the logits.
    The naive log_softmax + gather is measured the same way, to show the probe sees a full copy."""
    ours, naive = _peak("grpokit"), _peak("naive")
    assert naive["peak_extra_fraction"] > 0.9, naive  # the probe does see a [B, T, V] temporary
    assert ours["peak_extra_fraction"] < 0.30, ours
