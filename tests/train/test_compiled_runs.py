"""A run with torch_compile: the same training as eager to float32 round-off, the graphs it compiled
logged, and a stopped run resumed bitwise equal to an uninterrupted one (within the compiled mode)."""

from __future__ import annotations

import pytest
import torch

from grpokit.train.grpo import train_grpo
from tests.helpers import read_steps
from tests.train.helpers import ones_reward, tiny_config, weights

pytestmark = pytest.mark.slow  # each run compiles its passes (seconds on a CPU)


def test_a_compiled_run_trains_as_the_eager_one_and_logs_its_graphs(tmp_path):
    """Two steps of μ = 2 with a reference (every compiled pass: training, old policy, reference, and
    the loss). Tolerance: the engine's passes agree to 2e-5 (tests/models/test_compiled.py); after two
    Adam steps at lr 1e-3 a weight moves by at most ~2e-3, so a relative gap of 2e-5 in its gradient
    leaves it within 1e-6 of the eager run's; 1e-5 absolute leaves room for Adam's division by √v."""
    extra = {"num_iterations": 2, "beta": 0.04, "max_steps": 2, "save_steps": 2}
    eager = tiny_config(tmp_path / "eager", torch_compile=False, **extra)
    compiled = tiny_config(tmp_path / "compiled", torch_compile=True, **extra)
    train_grpo(eager, reward_funcs=[ones_reward])
    train_grpo(compiled, reward_funcs=[ones_reward])
    a, b = weights(tmp_path / "eager" / "run"), weights(tmp_path / "compiled" / "run")
    assert a.keys() == b.keys()
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    assert gap <= 1e-5, gap
    eager_steps, compiled_steps = (
        read_steps(tmp_path / "eager" / "run"),
        read_steps(tmp_path / "compiled" / "run"),
    )
    for e, c in zip(eager_steps, compiled_steps, strict=True):
        assert abs(e["loss"] - c["loss"]) <= 1e-5 and e["reward"] == c["reward"]
        assert "compile/graphs" not in e and 1 <= c["compile/graphs"] <= 6


def test_a_stopped_compiled_run_resumes_bitwise(tmp_path):
    """N = 4 steps straight, versus stopped after step 3 (last checkpoint: step 2) and resumed, both
    compiled."""
    extra = {"torch_compile": True, "max_steps": 4, "save_steps": 2, "num_iterations": 2}
    straight = tiny_config(tmp_path / "a", **extra)
    train_grpo(straight, reward_funcs=[ones_reward])
    interrupted = tiny_config(tmp_path / "b", **extra)

    def stop_at_3(kind, step, data):
        if kind == "step" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_grpo(interrupted, reward_funcs=[ones_reward], on_event=stop_at_3)
    train_grpo(interrupted.model_copy(update={"resume": True}), reward_funcs=[ones_reward])
    a, b = weights(tmp_path / "a" / "run"), weights(tmp_path / "b" / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
