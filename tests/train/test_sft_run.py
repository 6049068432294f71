"""`grpokit sft` is a run like the others (train/sft_run.py): it holds its output_dir's lock, and
SIGINT / SIGTERM finish the current step, save the model so far as checkpoint-<step> and say so in one
line, with the exit code GRPO's stop gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpokit.config import SFTConfig
from grpokit.config.plan import sft_plan
from grpokit.models import load_policy
from grpokit.train.rundir import LOCK_NAME, RunDirectoryInUse, RunDirLock
from grpokit.train.sft_run import train_sft
from tests.helpers import TINY_MODEL, TINY_MODEL_VALUES

from .test_run_directory import _wait_for_holder


def _plan(tmp_path: Path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "sft"),
        max_steps=3,
        batch_size=8,
        num_eval_prompts=4,
        **TINY_MODEL_VALUES,
    )
    return sft_plan(SFTConfig(**values | overrides))


def test_a_signal_finishes_the_step_saves_the_model_so_far_and_says_so(tmp_path):
    events = []

    def on_event(kind, step, data):
        events.append((kind, step, data))
        if kind == "sft_step" and step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # StopSignals notes it; the run stops after this step

    plan = _plan(tmp_path, max_steps=1000)
    result = train_sft(plan, on_event=on_event)
    out = Path(plan.output_dir)
    assert result.stopped_by == "SIGTERM" and result.steps == 5 and result.saved == out / "checkpoint-5"
    assert events[-1] == ("stopped", 5, {"signal": "SIGTERM", "phase": "sft", "output_dir": str(out)})
    assert [e[1] for e in events if e[0] == "sft_step"] == [1, 2, 3, 4, 5]
    assert load_policy(out / "checkpoint-5").model is not None  # a model `train model=` can start from
    assert (out / "config.yaml").is_file() and not (out / "final").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoint-5\)"):
        train_sft(plan)  # the stopped run is a run: the same command refuses it...
    again = train_sft(_plan(tmp_path, max_steps=2, overwrite=True))  # ...and overwrite=true replaces it
    assert again.stopped_by is None and again.saved == out / "final" and "accuracy" in again.eval_after
    assert not (out / "checkpoint-5").exists()


def test_a_second_sft_into_a_held_output_dir_is_refused_and_touches_nothing(tmp_path):
    plan = _plan(tmp_path)
    out = Path(plan.output_dir)
    out.mkdir(parents=True)
    (out / "notes.md").write_text("mine")
    held = RunDirLock.acquire(out)
    try:
        with pytest.raises(RunDirectoryInUse, match="in use by another grpokit run"):
            train_sft(plan)
    finally:
        held.release()
    assert {p.name for p in out.iterdir()} <= {"notes.md", LOCK_NAME}
    assert (out / "notes.md").read_text() == "mine"


@pytest.mark.slow
def test_sigterm_to_the_command_mid_run_saves_and_exits_as_grpo_does_and_a_second_one_is_refused(tmp_path):
    out = tmp_path / "sft"
    command = [sys.executable, "-m", "grpokit", "sft", f"output_dir={out}", "max_steps=1000000", *TINY_MODEL]
    command += ["batch_size=8"]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "COLUMNS": "1000"}  # each line as it comes, unwrapped
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert _wait_for_holder(out / LOCK_NAME, first).split()[0] == str(first.pid)
        second = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"output_dir {str(out)!r} is in use by another grpokit run (PID {first.pid})" in second.stderr
        deadline = time.time() + 120
        line = first.stdout.readline()
        while not line.startswith("sft step 100:") and time.time() < deadline and first.poll() is None:
            line = first.stdout.readline()  # training: a line every 100 steps
        assert line.startswith("sft step 100: loss "), line
    finally:
        first.send_signal(signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1, stdout
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert step >= 100 and f"checkpoint-{step} saved in {out}" in stopped[0]
    assert f"model={out / f'checkpoint-{step}'}" in stopped[0] and "overwrite=true" in stopped[0]
    assert (out / f"checkpoint-{step}" / "model.safetensors").is_file() and (out / "config.yaml").is_file()
