"""Faults around an asynchronous run's rollout worker, each one line or handled: a Ctrl-C while a worker
starts, a full disk while weights are published, a `.rollout` that grpokit did not make, and a trainer
killed while a reward hangs in the worker (train/rollout_worker.py, train/async_rollout.py)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from grpokit.train.async_rollout import WEIGHTS_DIR
from grpokit.train.grpo import train_grpo
from grpokit.train.rollout_worker import RolloutWorker
from grpokit.user_errors import environment_error
from tests.train.helpers import ones_reward, tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a rollout worker process
def test_a_ctrl_c_while_a_worker_starts_is_held_not_a_traceback(tmp_path, capfd):
    """SIGINT sent to a worker again and again while its interpreter starts and imports (a Ctrl-C
    reaches the whole process group): it neither dies nor prints a KeyboardInterrupt traceback (it
    did: 'the rollout worker died (exit code -2)'); told to stop, it ends cleanly."""
    worker = RolloutWorker(tmp_path / WEIGHTS_DIR, timeout=60)
    began = time.monotonic()
    while time.monotonic() - began < 3.0 and worker.process.is_alive():
        os.kill(worker.process.pid, signal.SIGINT)
        time.sleep(0.02)
    alive = worker.process.is_alive()
    worker.inbox.send(None)  # stop (as close does), waiting as long as its imports take
    worker.process.join(timeout=120)
    err = capfd.readouterr().err
    assert alive and worker.process.exitcode == 0, (worker.process.exitcode, err[-2000:])
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.slow  # a rollout worker process
def test_a_full_disk_while_publishing_weights_names_the_file_and_the_free_space(tmp_path, monkeypatch):
    """safetensors says a full disk as a SafetensorError ('os error 28'): the run ends with an OSError
    naming the weights file, which the command line says in one line with the free space; no staging
    file is left, and the checkpoints saved before it are kept."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_model, []

    def fills_the_disk(model: Any, filename: str, *args: Any, **kwargs: Any) -> None:
        calls.append(filename)
        if len(calls) == 3:  # the third version published: after step 2
            Path(filename).write_bytes(b"half")
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
        real(model, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_model", fills_the_disk)
    config = tiny_config(tmp_path, max_steps=4, save_steps=1, max_staleness=1)
    with pytest.raises(OSError) as error:
        train_grpo(config, reward_funcs=[ones_reward])
    assert error.value.errno == errno.ENOSPC
    assert Path(error.value.filename).name == "weights-v2.safetensors"
    line = environment_error(error.value, "train")
    assert line is not None and "\n" not in line
    assert line.startswith(f"no space left on device writing '{error.value.filename}' (")
    assert " free on that filesystem); free some space" in line and "Earlier checkpoints are kept" in line
    run = Path(config.output_dir)
    assert not list(run.rglob("*.tmp"))  # no half-written version left
    assert (run / "checkpoint-1").is_dir()


def test_the_os_error_code_is_read_as_safetensors_writes_it(tmp_path):
    """What as_os_error reads: safetensors' own message for ENOSPC ("os error 28")."""
    from grpokit.train.checkpoint import as_os_error

    said = as_os_error(RuntimeError("failed to write: No space left on device (os error 28)"), tmp_path / "w")
    assert said is not None and said.errno == errno.ENOSPC and said.filename == str(tmp_path / "w")


@pytest.mark.parametrize("kind", ["a symbolic link", "a file", "a user's file inside"])
def test_a_rollout_directory_grpokit_did_not_make_is_refused_and_left_alone(tmp_path, kind):
    """output_dir/.rollout as a link to the user's own weights (which a run used to overwrite, then
    delete), as a file, or holding a file of the user's: one line naming it, before anything is
    written, and the user's files are as they were."""
    config = tiny_config(tmp_path, max_steps=2, max_staleness=1)
    run, mine = Path(config.output_dir), tmp_path / "mine"
    run.mkdir()
    mine.mkdir()
    (mine / "weights-v0.safetensors").write_bytes(b"my own weights")
    rollout = run / WEIGHTS_DIR
    if kind == "a symbolic link":
        rollout.symlink_to(mine, target_is_directory=True)
    elif kind == "a file":
        rollout.write_text("notes")
    else:
        rollout.mkdir()
        (rollout / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as error:
        train_grpo(config, reward_funcs=[ones_reward])
    message = str(error.value)
    assert "\n" not in message and str(rollout) in message
    said = {
        "a symbolic link": "is a symbolic link",
        "a file": "is a file",
        "a user's file inside": "'notes.txt'",
    }
    assert said[kind] in message, message
    assert (mine / "weights-v0.safetensors").read_bytes() == b"my own weights"
    assert sorted(p.name for p in run.iterdir()) == [".grpokit.lock", WEIGHTS_DIR]  # no run opened


HANGS_AFTER = """
import os, time
from pathlib import Path

CALLS = [0]


def hangs_at_step_2(prompts, completions, **_):
    CALLS[0] += 1
    if CALLS[0] >= 2:
        Path(os.environ["HANG_MARKER"]).write_text(str(os.getpid()))
        time.sleep(600)
    return [0.0] * len(completions)
"""


@pytest.mark.slow  # a trainer process and its worker
def test_no_worker_outlives_a_trainer_killed_while_a_reward_hangs(tmp_path):
    """kill -9 of the trainer while a reward hangs in its worker (curriculum=true: scored in the
    sampling loop, which looks at the trainer only between steps): the worker ends within seconds
    (it stayed alive as long as the reward hung)."""
    (tmp_path / "hanging_reward.py").write_text(HANGS_AFTER)
    marker = tmp_path / "hanging"
    env = os.environ | {
        "HANG_MARKER": str(marker),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")]),
    }
    command = [
        sys.executable, "-m", "grpokit", "train", f"output_dir={tmp_path / 'run'}", "max_steps=6",
        "max_staleness=1", "curriculum=true", "sft_steps=0", "num_threads=1", "prompts_per_step=4",
        "num_generations=2", "max_completion_length=4", "reward_funcs=[hanging_reward:hangs_at_step_2]",
    ]  # fmt: skip
    log = tmp_path / "trainer.log"
    with log.open("wb") as out:
        trainer = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), log.read_text()[-2000:]
        time.sleep(0.3)
        worker = int(marker.read_text())
        trainer.kill()
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
        if marker.exists() and _alive(int(marker.read_text())):
            os.kill(int(marker.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped by init, counts as ended)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow  # a rollout worker process, stopped after its 5 s grace
def test_a_worker_that_does_not_read_its_setup_never_blocks_the_trainer(tmp_path, monkeypatch):
    """The setup (the whole policy) goes through the worker's pipe, which holds 64 KiB: the trainer hands
    it to a sending thread and goes on, so a worker stuck before reading it (here: a module of the
    policy's that takes 60 s to import) is met by `take`'s timeout, never a trainer blocked for good;
    closing it ends it."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = RolloutWorker(tmp_path / WEIGHTS_DIR, timeout=60, preload=("slow_to_import",))
    began = time.monotonic()
    worker.begin(SimpleNamespace(rank=0, worker=0, policy=bytes(4 << 20)))  # a 4 MiB "policy"
    worker.announce(0)
    handed = time.monotonic() - began
    worker.close()
    assert handed < 2.0 and not worker.process.is_alive()
