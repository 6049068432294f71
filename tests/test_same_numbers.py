"""scripts/same_numbers.py, the acceptance check for refactors, compares two runs' files: here on
hand-made run directories (no training): wall-clock fields are ignored, a one-ulp change of a metric or
of one weight is caught and named. The harness itself (ten short trainings, minutes) is run by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "same_numbers.py"
    spec = importlib.util.spec_from_file_location("grpokit_same_numbers_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _run(root: Path, loss: float, weight: float, seconds: float) -> Path:
    rows = [{"step": 0, "time": seconds, "eval/accuracy": 0.25}]
    rows += [
        {"step": s, "time": seconds + s, "loss": loss * s, "step_time": seconds, "timing/update": seconds}
        for s in (1, 2)
    ]
    rows[2]["entropy"] = math.nan
    root.mkdir()
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "checkpoint-2").mkdir()
    weights = {"a": torch.tensor([1.0, weight]), "b": torch.arange(3)}
    save_file(weights, root / "checkpoint-2" / "model.safetensors")
    return root


def test_equal_runs_whatever_their_timings_and_the_first_difference_named(tmp_path):
    sn = _script()
    base = _run(tmp_path / "base", 0.1, 0.5, seconds=1.0)
    same = sn.compare(base, _run(tmp_path / "same", 0.1, 0.5, seconds=7.0))
    assert same.difference is None and (same.steps, same.tensors) == (2, 2)
    assert same.keys["metrics.jsonl"] == {"step", "eval/accuracy", "loss", "entropy"}  # NaN == NaN
    loss = sn.compare(base, _run(tmp_path / "loss", math.nextafter(0.1, 1.0), 0.5, seconds=1.0))
    assert loss.difference.startswith("metrics.jsonl step 1, 'loss': base 0.1 != current 0.10000000000000002")
    # one float32 ulp of 0.5
    weight = sn.compare(base, _run(tmp_path / "weight", 0.1, 0.5 + 2**-24, seconds=1.0))
    assert weight.difference.startswith("checkpoint-2 a: 1 of 2 elements differ")
    assert not sn.same(0.0, -0.0) and sn.same(2, 2.0) and not sn.same(True, 1)
