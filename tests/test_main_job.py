"""The main job (`grpokit train`, the addition preset, about 80 s on 2 cores) as a user runs it: every
runtime invariant holds at every step, no training-health alert fires, held-out accuracy rises, and
`grpokit doctor` forecast its zero-spread share (issue 26). The run is shared by the module's tests;
the doctor of every train preset finishes within a minute."""

from __future__ import annotations

import time

import pytest

from grpokit.config import GRPOConfig
from grpokit.config.applied import preset_of, preset_values
from grpokit.train.doctor import checkup
from grpokit.train.grpo import train_grpo
from grpokit.train.metrics import INVARIANTS, InvariantWatch
from tests.helpers import read_metrics

pytestmark = pytest.mark.slow

# "within a minute on 2 cores" (the doctor's promise), in CPU seconds: what a 2-core machine computes in a
# minute. A wall clock would also count the time other processes hold the cores (another pytest-xdist
# worker, anything else running), so the doctor is timed by this process's CPU time (time.process_time,
# all its threads), on the thread count tests/conftest.py pins (one per worker on 2 cores: no idle
# thread spin-waits). Seen: 50-60 CPU seconds for the addition preset on one thread.
A_MINUTE_ON_TWO_CORES = 2 * 60.0


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("main_job")
    overrides = {"output_dir": str(out / "run"), "progress": False}
    cfg = GRPOConfig(**(preset_values("addition") | overrides))
    events = []
    result = train_grpo(
        cfg,
        preset=preset_of("addition", overrides),
        on_event=lambda kind, step, data: events.append((kind, step, data)),
    )
    rows = read_metrics(result.output_dir)
    return result, rows, events


@pytest.mark.xdist_group("main_job")  # the module's run, built once
def test_the_main_job_holds_every_invariant_at_every_step(main_job):
    result, rows, events = main_job
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == result.steps == 400
    watch = InvariantWatch(exact=True)
    for row in steps:
        assert watch.update(row["step"], row) == []
        assert row["invariants/groups_intact"] == 1.0
        assert abs(row["invariants/loss_weight_error"]) <= 1e-6
        assert row["sampling/sampling_logp_difference/max"] <= 1e-3  # the float32 lean sampler
    assert {k for k in INVARIANTS if k in steps[0]} >= {
        "invariants/groups_intact",
        "invariants/group_advantage_sum_max",
        "invariants/loss_weight_error",
    }


@pytest.mark.xdist_group("main_job")  # the module's run, built once
def test_the_main_job_fires_no_alert(main_job):
    result, rows, events = main_job
    assert not (result.output_dir / "alerts.jsonl").exists()
    warnings = [data["message"] for kind, _, data in events if kind == "warning"]
    assert not [m for m in warnings if m.startswith(("alert ", "invariant "))], warnings
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert evals[-1] > evals[0] + 0.15  # and it learned (37% -> 55-75% over seeds and CPUs)


@pytest.mark.xdist_group("main_job")  # the module's run, built once
def test_the_doctor_forecasts_the_main_jobs_zero_spread(main_job, tmp_path):
    """The doctor's share of zero-spread groups, sampled after the same warm start, is within 15
    points of the share the main job's first 10 steps saw."""
    result, rows, _ = main_job
    seen = sum(r["frac_reward_zero_std"] for r in rows if "loss" in r and r["step"] <= 10) / 10
    overrides = {"output_dir": str(tmp_path / "doctor"), "progress": False}
    began = time.process_time()
    report = checkup(GRPOConfig(**(preset_values("addition") | overrides)), preset_of("addition", overrides))
    seconds = time.process_time() - began
    assert not report.fatal
    assert abs(report.zero_spread - seen) <= 0.15, (report.zero_spread, seen)
    assert seconds < A_MINUTE_ON_TWO_CORES  # the pre-flight of the main job, warm start included


@pytest.mark.parametrize("preset", ["tool_addition", "rlhf_addition", "gsm8k"])
def test_the_doctor_of_every_train_preset_finishes_within_a_minute(preset, tmp_path, empty_hub_offline):
    """gsm8k's model and dataset are not in this machine's cache, and rlhf_addition's reward model is
    trained by another command first: each a fatal finding that names it, found fast."""
    overrides = {"output_dir": str(tmp_path / "doctor"), "progress": False}
    began = time.process_time()
    report = checkup(GRPOConfig(**(preset_values(preset) | overrides)), preset_of(preset, overrides))
    assert time.process_time() - began < A_MINUTE_ON_TWO_CORES
    missing = {"gsm8k": "gsm8k", "rlhf_addition": "reward_addition_rlhf"}
    assert report.fatal == (preset in missing)
    if preset in missing:
        fatal = [f for f in report.findings if f.level == "fatal"]
        assert missing[preset] in f"{fatal[0].item} {fatal[0].value} {fatal[0].advice}", fatal
