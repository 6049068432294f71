"""The run directory is exclusive and its metrics are never lost.

* One run at a time: `output_dir/.grpokit.lock` (an flock held for the whole run) refuses a second run
  in one line naming the holder's PID; a holder killed with SIGKILL leaves no stale lock.
* Checkpoints are staged under names of their own run, which `list_checkpoints` never lists.
* Resume rewrites metrics.jsonl through a temporary file and a rename: a crash mid-rewrite loses nothing.
* An output_dir that is a file, holds a run, or cannot be written: one line, exit code 2, no traceback.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from grpokit.config.load import run_config_yaml
from grpokit.train.checkpoint import list_checkpoints
from grpokit.train.metrics import truncate_metrics_after
from grpokit.train.rundir import (
    LOCK_NAME,
    RunDirectoryError,
    RunDirectoryInUse,
    RunDirLock,
    checkpoint_staging,
    clear_earlier_run,
    exclusive_output_dir,
)
from tests.helpers import read_alerts, read_metrics

from ..test_reliability import TINY
from .helpers import ones_reward, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _cli(output_dir: Path | str, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpokit", "train", f"output_dir={output_dir}", "max_steps=2", *TINY, *extra],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def _error_line(stderr: str) -> str:
    """The CLI's one-line error (the line after it only points at --debug)."""
    lines = [line for line in stderr.splitlines() if line.startswith("grpokit train: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def _wait_for_holder(lock_file: Path, process: subprocess.Popen, timeout: float = 120) -> str:
    """The PID line the lock's holder writes once it holds the lock."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        text = lock_file.read_text().strip() if lock_file.exists() else ""
        if text:
            return text
        time.sleep(0.02)
    raise AssertionError(f"no holder wrote {lock_file} (exit code {process.poll()})")


# ----------------------------------------------------------------------------- the lock


HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from grpokit.train.rundir import RunDirLock
    lock = RunDirLock.acquire(Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_a_second_process_is_refused_while_the_lock_is_held_and_a_kill_9_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryInUse) as refused:
            RunDirLock.acquire(out)
        message = str(refused.value)
        assert f"output_dir {str(out)!r} is in use by another grpokit run (PID {holder.pid})" in message
        assert "output_dir=" in message  # the fix
        assert isinstance(refused.value, ValueError)  # so the command line prints it as one line
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=30)  # reaped, its pipe closed
    lock = RunDirLock.acquire(out)  # the kernel dropped the dead holder's flock: no stale lock
    try:
        assert lock.held and (out / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    finally:
        lock.release()


def test_the_lock_is_per_run_even_within_one_process_and_released_for_the_next(tmp_path):
    out = tmp_path / "run"
    first = RunDirLock.acquire(out)
    with pytest.raises(RunDirectoryInUse, match=f"PID {os.getpid()}"):
        RunDirLock.acquire(out)  # another run in this process (a thread, a nested call)
    (out / "config.yaml").write_text(run_config_yaml("x: 1\n"))  # the run wrote: the directory is kept
    first.release()
    assert not first.held and (out / LOCK_NAME).is_file()  # the lock file stays
    again = RunDirLock.acquire(out)
    again.release()


def test_a_directory_the_lock_created_for_a_refused_command_is_removed(tmp_path):
    out = tmp_path / "a" / "b" / "run"
    RunDirLock.acquire(out).release()  # nothing was written (a command refused on bad input)
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    RunDirLock.acquire(existing).release()
    assert existing.is_dir()  # not this lock's to remove


def test_a_lock_file_unlinked_between_open_and_flock_is_not_trusted(tmp_path, monkeypatch):
    """A run releasing a directory it created unlinks the lock file; a contender that opened that file
    just before must not believe it holds the lock (a third run would lock the new file)."""
    import fcntl

    out = tmp_path / "run"
    real_flock, calls = fcntl.flock, []

    def flock_after_an_unlink(fd, operation):
        calls.append(operation)
        if len(calls) == 1:
            (out / LOCK_NAME).unlink()  # the holder released and removed it meanwhile
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_an_unlink)
    lock = RunDirLock.acquire(out)
    try:
        assert len(calls) == 2  # it locked the unlinked file, saw that, and locked the one at the path
        assert os.fstat(lock._fd).st_ino == os.stat(out / LOCK_NAME).st_ino
    finally:
        lock.release()


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    """Refusing every run on such a filesystem would leave the user no way on; any other error of
    flock is one line."""
    import fcntl
    import logging

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        lock = RunDirLock.acquire(tmp_path / "run")
    lock.release()
    assert any("without file locks" in r.getMessage() for r in caplog.records)

    def broken(fd, operation):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(RunDirectoryError, match="cannot be used: Input/output error"):
        RunDirLock.acquire(tmp_path / "run")


def test_train_grpo_releases_the_lock_when_it_raises_and_refuses_while_held(tmp_path):
    out = tmp_path / "run"

    def broken_reward(prompts, completions, **_):
        raise RuntimeError("a bug in the reward")

    with pytest.raises(Exception, match="a bug in the reward"):
        train_grpo_with(tmp_path, broken_reward)
    RunDirLock.acquire(out).release()  # released although the run raised
    held = RunDirLock.acquire(out)
    try:
        with pytest.raises(RunDirectoryInUse, match="in use by another grpokit run"):
            train_grpo_with(tmp_path, ones_reward, overwrite=True)
        from grpokit.config import RewardConfig
        from grpokit.train.reward import train_reward

        with pytest.raises(RunDirectoryInUse):
            train_reward(RewardConfig(output_dir=str(out), progress=False, max_steps=1))
    finally:
        held.release()
    assert (out / "config.yaml").is_file()  # the refused runs touched nothing


def train_grpo_with(tmp_path, reward, **overrides):
    from grpokit.train.grpo import train_grpo

    return train_grpo(tiny_config(tmp_path, **overrides), reward_funcs=[reward])


# ----------------------------------------------------------------------------- staging


def test_each_run_stages_checkpoints_under_its_own_name_and_stale_staging_is_cleared(tmp_path):
    from grpokit.train import distributed

    out = tmp_path / "run"
    out.mkdir()
    d = distributed.Dist()
    with exclusive_output_dir(d, out):
        first = checkpoint_staging(out, 3)
    with exclusive_output_dir(d, out):
        second = checkpoint_staging(out, 3)
    assert first != second and first.parent == out and first.name.startswith(".tmp-checkpoint-3-")
    # a killed run's half-written checkpoints: never listed, cleared by the next run and by overwrite
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "state.pt").write_bytes(b"")
    for stale in (first, second, out / ".tmp-checkpoint-2"):
        stale.mkdir()
        (stale / "state.pt").write_bytes(b"")
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]
    clear_earlier_run(out)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_a_resumed_run_clears_the_staging_a_killed_one_left(tmp_path):
    from grpokit.train.grpo import train_grpo

    train_grpo(tiny_config(tmp_path, save_steps=1), reward_funcs=[ones_reward])
    out = tmp_path / "run"
    stale = out / ".tmp-checkpoint-3-12345-abcdef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    train_grpo(tiny_config(tmp_path, max_steps=3, save_steps=1, resume=True), reward_funcs=[ones_reward])
    assert not stale.exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".tmp")] == []
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-3"


# ----------------------------------------------------------------------------- two runs, one directory

GATED_REWARD = """
import os
import time
from pathlib import Path


def gated_ones(prompts, completions, **kwargs):
    # the share of '1' characters, once the test opens the gate: the run holds its lock until then
    gate = Path(os.environ["GRPOKIT_TEST_GATE"])
    deadline = time.time() + 120
    while not gate.exists() and time.time() < deadline:
        time.sleep(0.02)
    return [c.count("1") / max(len(c), 1) for c in completions]
"""


@pytest.mark.slow
def test_two_concurrent_cli_runs_into_one_directory_one_is_refused_the_other_completes(tmp_path):
    (tmp_path / "gated.py").write_text(GATED_REWARD)
    gate, out, steps = tmp_path / "gate", tmp_path / "run", 4
    command = [
        sys.executable, "-m", "grpokit", "train", f"output_dir={out}", f"max_steps={steps}", *TINY,
        f"reward_funcs=[{{python: {tmp_path / 'gated.py'}:gated_ones}}]",
    ]  # fmt: skip
    env = os.environ | {"GRPOKIT_TEST_GATE": str(gate)}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.Popen(command, cwd=tmp_path, env=env, **pipes)
    try:
        assert _wait_for_holder(out / LOCK_NAME, first).split()[0] == str(first.pid)
        # the first run holds the directory (and waits at the gate): the same command again
        second = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    finally:
        gate.write_text("open")
    _, first_err = first.communicate(timeout=300)
    assert second.returncode == 2, second.stderr
    assert "Traceback" not in second.stderr
    line = _error_line(second.stderr)
    assert f"output_dir {str(out)!r} is in use by another grpokit run (PID {first.pid})" in line
    assert first.returncode == 0, first_err
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))  # each step once
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, steps]  # one run's evaluations
    checkpoints = list_checkpoints(out)
    assert [p.name for p in checkpoints] == [f"checkpoint-{steps - 1}", f"checkpoint-{steps}"]  # limit 2
    for checkpoint in checkpoints:
        assert {"model.safetensors", "state.pt", "config.yaml"} <= {p.name for p in checkpoint.iterdir()}
        state = torch.load(checkpoint / "state.pt", weights_only=True)
        assert state["step"] == int(checkpoint.name.split("-")[1])
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp")]


DISTRIBUTED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from grpokit.train import distributed
    from grpokit.train.rundir import RunDirectoryError, checkpoint_staging, exclusive_output_dir

    d = distributed.init("cpu")
    out, report = Path(sys.argv[1]), Path(sys.argv[2])
    lines = []
    with exclusive_output_dir(d, out):  # rank 0 takes the lock; every rank gets the staging token
        lines.append(str(checkpoint_staging(out, 7)))
        try:
            with exclusive_output_dir(d, out):  # a second run: rank 0 is refused, so every rank is
                lines.append("not refused")
        except RunDirectoryError as error:
            lines.append(f"{type(error).__name__}: {error}")
    (report / f"rank{d.rank}.txt").write_text("\\n".join(lines))
    distributed.shutdown(d)
    """
)


@pytest.mark.slow
def test_under_torchrun_rank_0_locks_and_every_rank_gets_its_answer(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(DISTRIBUTED)
    out = tmp_path / "run"
    env = os.environ | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(out), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    zero, one = ((tmp_path / f"rank{r}.txt").read_text().splitlines() for r in (0, 1))
    assert zero == one  # the same staging directory (FSDP shards meet there), the same refusal
    assert zero[0].startswith(str(out / ".tmp-checkpoint-7-"))
    assert zero[1].startswith("RunDirectoryInUse: output_dir")
    assert "in use by another grpokit run (PID" in zero[1]


# ----------------------------------------------------------------------------- metrics


class _DiskFullHalfway:
    """A text file whose write stores the first half of what it is given, then fails: a full disk,
    or a crash, in the middle of a rewrite."""

    def __init__(self, file):
        self._file = file

    def write(self, text):
        self._file.write(text[: len(text) // 2])
        self._file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def _disk_full_on_writes(monkeypatch) -> None:
    """Every file opened for writing through Path.open fills the disk halfway through its write."""
    real_open = Path.open

    def open_failing_writes(self, mode="r", *args, **kwargs):
        file = real_open(self, mode, *args, **kwargs)
        return _DiskFullHalfway(file) if "w" in mode else file

    monkeypatch.setattr(Path, "open", open_failing_writes)


def test_a_crash_while_resume_rewrites_metrics_leaves_them_intact(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5 * s}) + "\n" for s in range(12)))
    before = path.read_text()
    _disk_full_on_writes(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        truncate_metrics_after(tmp_path, 3)
    monkeypatch.undo()
    assert path.read_text() == before  # every row still there: the resume can be tried again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left
    truncate_metrics_after(tmp_path, 3)
    assert [row["step"] for row in read_metrics(tmp_path)] == [0, 1, 2, 3]


def test_a_crash_while_resume_rewrites_alerts_leaves_them_intact(tmp_path, monkeypatch):
    from grpokit.train.alerts import AlertWatch

    alert = {"name": "zero_spread", "value": 1.0, "threshold": 0.5, "advice": "a warm start"}
    path = tmp_path / "alerts.jsonl"
    path.write_text("".join(json.dumps({"step": s, **alert}) + "\n" for s in (2, 5, 9)))
    before = path.read_text()
    _disk_full_on_writes(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        AlertWatch().resume(tmp_path, 6)
    monkeypatch.undo()
    assert path.read_text() == before  # every alert still there: the resume can be tried again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alerts.jsonl"]  # no temporary file left
    AlertWatch().resume(tmp_path, 6)
    assert [alert["step"] for alert in read_alerts(tmp_path)] == [2, 5]


# ----------------------------------------------------------------------------- one line for the user


@pytest.mark.slow
def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    out = tmp_path / "run"
    out.write_text("not a directory")
    result = _cli(out, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    line = _error_line(result.stderr)
    assert f"output_dir {str(out)!r} is a file, not a directory" in line and "output_dir=" in line
    assert out.read_text() == "not a directory"
    inside = out / "sub"  # a parent that is a file
    result = _cli(inside, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{str(out)!r} is a file, not a directory" in _error_line(result.stderr)


def test_an_output_dir_that_holds_a_run_is_one_line(tmp_path, capsys):
    from grpokit.cli import main

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", f"output_dir={out}", "max_steps=2", *TINY]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = _error_line(err)
    assert f"output_dir {str(out)!r} already holds a run (checkpoint-2, metrics.jsonl)" in line
    assert "resume=true" in line and "overwrite=true" in line and "output_dir=" in line
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize(
    "where, code",
    [("mkdir", errno.EROFS), ("lock", errno.EACCES)],
    ids=["read-only-file-system", "permission-denied"],
)
def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, where, code):
    """Tests run as root here, which writes anywhere: the refusal is simulated where the operating
    system gives it (creating the directory on a read-only file system; the lock file in a directory
    without write permission). The real thing is `test_a_read_only_directory_is_one_line`."""
    from grpokit.cli import main

    out = tmp_path / "ro" / "run"
    real_mkdir, real_open = os.mkdir, os.open

    def refusing_mkdir(path, *args, **kwargs):
        if where == "mkdir" and str(path).startswith(str(tmp_path / "ro")):
            raise OSError(code, os.strerror(code), str(path))
        return real_mkdir(path, *args, **kwargs)

    def refusing_open(path, *args, **kwargs):
        if where == "lock" and str(path) == str(out / LOCK_NAME):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    monkeypatch.setattr(os, "open", refusing_open)
    assert main(["train", f"output_dir={out}", "max_steps=1", *TINY]) == 2
    err = capsys.readouterr().err
    line = _error_line(err)
    assert f"output_dir {str(out)!r} cannot be written: {os.strerror(code)}" in line
    assert "Traceback" not in err
    assert "writable output_dir=" in line
    assert not (tmp_path / "ro").exists() or not any((tmp_path / "ro").iterdir())  # nothing left behind


def test_a_read_only_directory_is_one_line(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("this user writes anywhere (root): the simulated test covers the code path")
        result = _cli(parent / "run", cwd=tmp_path)
    finally:
        parent.chmod(0o700)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"output_dir {str(parent / 'run')!r} cannot be written" in _error_line(result.stderr)
