"""The run directory: one run at a time, and never on top of an earlier one unless told to.

* The lock: a run holds an exclusive `fcntl.flock` on `output_dir/.grpokit.lock` from before its
  first look at the directory until it returns or raises (`exclusive_output_dir`), so a second run
  into the same directory is refused in one line naming the holder's PID, instead of the two mixing
  their metrics and overwriting each other's checkpoints. The kernel drops a flock when its holder
  dies, so a run killed with SIGKILL never leaves a stale lock. Under torchrun only rank 0 takes it;
  the other ranks wait for its answer and raise the same error.
* The guard: a new run never starts where an earlier one lives unless told to (`claim_output_dir`),
  and `overwrite=true` deletes only what a run writes (`clear_earlier_run`). What a run that failed
  in its first step leaves (its opening: config.yaml and the starting evaluation) is not a run: the
  same or the corrected command starts again there.
* Checkpoint staging: a checkpoint is written into `.tmp-checkpoint-<step>-<token>` and renamed into
  place; the token is the run's own (chosen by rank 0, the same on every rank), so two writers never
  share a staging directory.

Errors are `RunDirectoryError`s (ValueErrors: the command line prints them as one line).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..config.load import RUN_CONFIG_MARKER
from . import distributed

CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_NAME = re.compile(rf"{CHECKPOINT_PREFIX}[0-9]+")
STAGING_PREFIX = f".tmp-{CHECKPOINT_PREFIX}"
LOCK_NAME = ".grpokit.lock"
# what flock raises where the filesystem has no locks (some FUSE and parallel filesystems)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)

logger = logging.getLogger(__name__)

# What a run writes into its output_dir (and `overwrite=true` removes): nothing else there is touched.
RUN_FILES = (
    "metrics.jsonl",
    "sft_metrics.jsonl",
    "alerts.jsonl",
    "calibration.json",
    "reward_diagnostics.json",
    "config.yaml",
)
RUN_DIRS = ("tensorboard", "wandb", "final")
REPORT_DIR = "report"  # `grpokit report` writes index.html and PNG plots there, and nothing else
# What marks a directory as a checkpoint (grpokit's) or a saved model (anyone's): a run must not write there
CHECKPOINT_FILES = ("state.pt", "manifest.json")
MODEL_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "adapter_model.*")
# What a run writes before its first step, beside its config.yaml (`run.begin`): the starting
# evaluation, in metrics.jsonl and TensorBoard. A run that failed in step 1 leaves only these.
OPENING = ("metrics.jsonl", "tensorboard")
# the first line of the config.yaml a version before RUN_CONFIG_MARKER wrote (`applied.annotated_yaml`)
_EARLIER_CONFIG_HEADER = "# every value is its default unless the comment above it says where it came from"


class RunDirectoryError(ValueError):
    """output_dir cannot be used: a file, not writable, or in use. A ValueError, so the command line
    prints the one-line message (no traceback)."""


class RunDirectoryInUse(RunDirectoryError, FileExistsError):
    """Another grpokit run holds output_dir's lock."""


class EarlierRunError(RunDirectoryError, FileExistsError):
    """output_dir holds an earlier run, and neither resume=true nor overwrite=true was given."""


# ----------------------------------------------------------------------------- the lock


class RunDirLock:
    """An exclusive flock on `output_dir/.grpokit.lock`, held by this process until `release`.

    The lock file holds the holder's PID and host (for the message a second run gets). It stays in
    the directory: a run that locked a file another process was about to unlink would hold a lock
    nobody else can see. The one exception is a directory this lock created and nothing else was
    written into (a command refused on bad input leaves nothing behind); that is safe because
    `acquire` checks, once it holds a lock, that the file is still the one at the path, and starts
    again if not."""

    def __init__(self, output_dir: Path, fd: int, created: list[Path]) -> None:
        self.output_dir = output_dir
        self.path = output_dir / LOCK_NAME
        self._fd: int | None = fd
        self._created = created  # the directories `acquire` made, deepest first

    @classmethod
    def acquire(cls, output_dir: Path) -> RunDirLock:
        """Create `output_dir` if needed and lock it, or raise a RunDirectoryError: in use (naming
        the holder's PID), a file, or not writable."""
        output_dir = Path(output_dir)
        # before the lock file: nothing is written into a checkpoint, or beside a user's config.yaml
        refuse_foreign_directory(output_dir)
        refuse_replacing_user_config(output_dir)  # (`claim_output_dir` checks again, under the lock)
        created = [p for p in [output_dir, *output_dir.parents] if not p.exists()]
        try:
            return cls._acquire(output_dir, created)
        except RunDirectoryError:
            _remove_empty(created)  # a refused command leaves nothing behind
            raise

    @classmethod
    def _acquire(cls, output_dir: Path, created: list[Path]) -> RunDirLock:
        for _ in range(100):  # only a directory removed or a lock file replaced meanwhile loops again
            _make_directory(output_dir)
            try:
                fd = os.open(output_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue  # a refused run removed the directory it had created between mkdir and open
            except OSError as error:
                raise _unusable(output_dir, error) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise RunDirectoryInUse(
                    f"output_dir {str(output_dir)!r} is in use by another grpokit run ({holder}); wait for "
                    "it to finish or choose another output_dir=..."
                ) from None
            except OSError as error:
                if error.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise _unusable(output_dir, error) from None
                logger.warning(  # refusing every run there would leave the user no way on
                    "output_dir %r is on a filesystem without file locks (%s): a second run into it at "
                    "the same time would not be refused",
                    str(output_dir),
                    os.strerror(error.errno),
                )
            if _still_at(fd, output_dir / LOCK_NAME):
                try:  # the holder's identity, for the message a second run gets
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
                except OSError as error:  # a full disk: the run could not have written anything
                    os.close(fd)
                    raise _unusable(output_dir, error) from None
                return cls(output_dir, fd, created)
            os.close(fd)  # the file was unlinked between open and flock: lock the one there now
        raise RunDirectoryError(f"output_dir {str(output_dir)!r} could not be locked: it keeps changing.")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the file drops it). A directory this lock created that holds
        nothing but the lock file is removed first, while still locked."""
        if self._fd is None:
            return
        try:
            if self._created and [p.name for p in self.output_dir.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                _remove_empty(self._created)
        except OSError:
            pass  # another run's files arrived meanwhile: the directory is theirs now
        finally:
            os.close(self._fd)
            self._fd = None


def _remove_empty(directories: list[Path]) -> None:
    """Remove `directories` (deepest first) as long as they are empty: one that is not stays, with
    its parents (another run's files arrived meanwhile)."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


def _make_directory(output_dir: Path) -> None:
    """`output_dir` and its parents, or one line saying why they cannot be made."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        if output_dir.exists() and not output_dir.is_dir():
            raise RunDirectoryError(
                f"output_dir {str(output_dir)!r} is a file, not a directory; choose another output_dir=... "
                "or move the file away."
            ) from None
        files = [p for p in reversed(output_dir.parents) if p.exists() and not p.is_dir()]
        culprit = files[0] if files else error.filename
        raise RunDirectoryError(
            f"output_dir {str(output_dir)!r} cannot be created: {str(culprit)!r} is a file, not a directory; "
            "choose another output_dir=..."
        ) from None
    except OSError as error:
        raise _unusable(output_dir, error) from None


def _unusable(output_dir: Path, error: OSError) -> RunDirectoryError:
    """The one-line error for an output_dir that cannot be created or written."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(output_dir) else ""
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return RunDirectoryError(
            f"output_dir {str(output_dir)!r} cannot be written: {reason}{where}; choose a writable "
            "output_dir=... or change its permissions."
        )
    return RunDirectoryError(f"output_dir {str(output_dir)!r} cannot be used: {reason}{where}.")


def _holder(fd: int) -> str:
    """ "PID 1234" (", on host" when another machine holds it) from a lock file another process holds.
    The holder writes it just after locking: a contender that comes in between waits a moment."""
    text = ""
    for _ in range(50):  # up to ~0.5 s
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if text:
            break
        time.sleep(0.01)
    if not text:
        return "PID unknown"
    pid, _, host = text.partition(" ")
    return f"PID {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


def _still_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path` (not unlinked or replaced)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


# The staging token of each output_dir this process is running in (the same on every rank).
_staging_tokens: dict[Path, str] = {}


@contextmanager
def exclusive_output_dir(d: Any, output_dir: Path) -> Iterator[None]:
    """Hold `output_dir` for the whole of a run: rank 0 takes the lock, every rank gets its answer
    (the same RunDirectoryError on every rank when refused) and the run's staging token. Released
    when the run returns or raises, so one process can run one training after another."""
    output_dir = Path(output_dir)
    lock: RunDirLock | None = None
    answer: Any = None
    if d.is_main:
        try:
            lock = RunDirLock.acquire(output_dir)
            answer = f"{os.getpid()}-{secrets.token_hex(3)}"  # the staging token
        except RunDirectoryError as refusal:
            answer = refusal
        except Exception as error:  # a bug: the other ranks must not wait for an answer forever
            distributed.broadcast_object(d, RunDirectoryError(f"rank 0 could not lock output_dir: {error}"))
            raise
    try:  # the other ranks wait here for rank 0's answer
        answer = distributed.broadcast_object(d, answer)
    except BaseException:  # a dead peer, a Ctrl-C: the lock is not kept for the rest of the process
        if lock is not None:
            lock.release()
        raise
    if isinstance(answer, BaseException):
        raise answer
    key = output_dir.resolve()
    _staging_tokens[key] = answer
    try:
        yield
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, Interrupted):
            raise
        raise Interrupted(interrupted_line(output_dir)) from None
    finally:
        _staging_tokens.pop(key, None)
        if lock is not None:
            lock.release()


def checkpoint_staging(output_dir: Path, step: int) -> Path:
    """The temporary directory checkpoint `step` is written into before it is renamed into place:
    `.tmp-checkpoint-<step>-<token>`, the token the run's (this process's PID outside a run)."""
    token = _staging_tokens.get(Path(output_dir).resolve(), str(os.getpid()))
    return Path(output_dir) / f"{STAGING_PREFIX}{step}-{token}"


# ----------------------------------------------------------------------------- earlier runs


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoints that were renamed into place, oldest first: `checkpoint-<step>` directories holding
    a state.pt or a manifest.json (a manifest names a missing state.pt). Temporary directories are
    never listed; files are not checked here (this runs at every save): `newest_intact_checkpoint`
    does, for the one a resume takes."""
    found = [
        p
        for p in output_dir.glob(f"{CHECKPOINT_PREFIX}*")
        if CHECKPOINT_NAME.fullmatch(p.name)
        and p.is_dir()
        and any((p / name).is_file() for name in CHECKPOINT_FILES)
    ]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def earlier_run(output_dir: Path) -> list[str]:
    """What in `output_dir` belongs to an earlier run (metrics or checkpoints), by name."""
    if not output_dir.is_dir():
        return []
    found = sorted(
        (p.name for p in output_dir.glob(f"{CHECKPOINT_PREFIX}*") if CHECKPOINT_NAME.fullmatch(p.name)),
        key=lambda name: int(name[len(CHECKPOINT_PREFIX) :]),
    )  # (a checkpoint-best/ of the user's is not a run's)
    # (a warm start stopped by a signal leaves only config.yaml and sft_metrics.jsonl: not a run yet,
    # so the same command starts again)
    found += [name for name in ("metrics.jsonl", "final", "tensorboard") if (output_dir / name).exists()]
    return found


def claim_output_dir(output_dir: Path, *, resume: bool | None, overwrite: bool) -> bool:
    """Refuse, before any work, to start a new run where an earlier one lives (its metrics would be
    mixed with the new ones and save_total_limit would delete the new checkpoints, the older run's
    having higher step numbers), to resume a run that has no checkpoint to resume from (starting it
    again would delete its metrics and replace its checkpoint directories), and to replace a
    config.yaml that grpokit did not write. The opening of a run that failed in its first step
    (`only_an_opening`) is no run to protect: any command replaces it, saying so in one line. Returns
    whether there is an earlier run to delete (`overwrite`'s, or such an opening): the caller deletes
    it (`clear_earlier_run`) once its input is validated, so a command that fails on bad input never
    destroys anything. Called under the lock (`exclusive_output_dir`), so what it finds cannot change
    before the run writes. `resume`: None for a command that cannot resume (`grpokit sft`): its refusal
    then offers only the other two ways."""
    found = earlier_run(output_dir)
    refuse_replacing_user_config(output_dir, found)
    shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    if only_an_opening(output_dir, found):  # a run that failed in its first step: started again
        logger.warning(
            "output_dir %r holds only the opening of a run that finished no step (%s: its starting "
            "evaluation) and saved no checkpoint%s; this run replaces it",
            str(output_dir),
            shown,
            ", so resume=true has nothing to continue" if resume else "",
        )
        return True
    if found and resume and not list_checkpoints(output_dir):
        raise EarlierRunError(
            f"output_dir {str(output_dir)!r} holds a run ({shown}) but no checkpoint to resume from (a "
            f"{CHECKPOINT_PREFIX}<step> directory with its state.pt), so resume=true has nothing to "
            "continue; "
            "nothing was changed: start it again with overwrite=true (deleting that run's files), or "
            "choose another output_dir=..."
        )
    if not found or resume:
        return False
    if not overwrite:
        then = "" if resume is None else "continue it with resume=true, "
        raise EarlierRunError(
            f"output_dir {str(output_dir)!r} already holds a run ({shown}); {then}"
            "start a new one with another output_dir=..., or replace it with overwrite=true."
        )
    return True


def only_an_opening(output_dir: Path, found: list[str]) -> bool:
    """Whether the earlier run `found` in `output_dir` (`earlier_run`'s names) is only a run's opening:
    what a run that failed or was killed in its first step leaves, its starting evaluation (metrics.jsonl
    and TensorBoard's copy, every row of metrics.jsonl and alerts.jsonl at step 0) and no checkpoint or
    final model. Nothing there can be resumed, and no step's figures would mix with a new run's, so the
    same or the corrected command replaces it. A row that cannot be read, or a reward model's diagnostics
    (written when a run ends, even with max_steps=0), keep the directory protected as any run's."""
    if "metrics.jsonl" not in found or not set(found) <= set(OPENING):
        return False
    if (output_dir / "reward_diagnostics.json").exists():  # a finished reward-model run
        return False
    return all(_rows_at_step_0(output_dir / name) for name in ("metrics.jsonl", "alerts.jsonl"))


def _rows_at_step_0(path: Path) -> bool:
    """Whether every line of the JSONL file `path` (none where it is absent) is a row of step 0; read up
    to the first that is not, so a long run's file costs one line. A line that is not a JSON row: False."""
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if not isinstance(row, dict) or type(row.get("step")) is not int or row["step"] != 0:
                    return False
    except FileNotFoundError:
        return True
    except (OSError, ValueError):  # (UnicodeDecodeError and json's errors are ValueErrors)
        return False
    return True


def written_by_grpokit(config: Path) -> bool:
    """Whether `config` (an output_dir's config.yaml) is one a run wrote: it starts with
    RUN_CONFIG_MARKER (or the header grpokit wrote before the marker existed)."""
    try:
        with config.open("rb") as f:
            first = f.readline(512).decode("utf-8", errors="replace").strip()
    except OSError:
        return False
    return first.startswith(RUN_CONFIG_MARKER) or first == _EARLIER_CONFIG_HEADER


def refuse_replacing_user_config(output_dir: Path, found: list[str] | None = None) -> None:
    """One line, before anything is written, when `output_dir/config.yaml` is a file grpokit did not
    write (`cd project && grpokit train config.yaml output_dir=.` would replace the user's config with
    the resolved one). A config.yaml beside an earlier run's files is that run's (runs of versions
    before the marker wrote none)."""
    config = output_dir / "config.yaml"
    found = earlier_run(output_dir) if found is None else found
    if config.is_file() and not found and not written_by_grpokit(config):
        raise RunDirectoryError(
            f"output_dir {str(output_dir)!r} holds a config.yaml that grpokit did not write (your own "
            "config?), which a run would replace with its resolved config; choose another output_dir=... "
            "(runs/NAME, say)."
        )


def refuse_foreign_directory(output_dir: Path) -> None:
    """One line, before the directory is touched, when `output_dir` is or lies inside a checkpoint or a
    saved model: a run writing there would overwrite its config.yaml, and a resume of the checkpoint's
    own run would then take the checkpoint as damaged."""
    resolved = Path(os.path.abspath(output_dir))
    for path in [resolved, *resolved.parents]:
        what = _checkpoint_or_model(path)
        if what is None:
            continue
        where = "is" if path == resolved else f"lies inside {str(path)!r},"
        real = path.resolve()  # (the run a symbolic link points into, not the link's own folder)
        if what == "checkpoint":
            raise RunDirectoryError(
                f"output_dir {str(output_dir)!r} {where} a checkpoint of the run in {str(real.parent)!r}; "
                f"continue that run with output_dir={str(real.parent)!r} resume=true, or train from these "
                f"weights with model={str(real)!r} and another output_dir=..."
            )
        raise RunDirectoryError(
            f"output_dir {str(output_dir)!r} {where} a saved model (config.json and weights), which a run "
            f"would write its files among; train from it with model={str(path)!r} and choose another "
            "output_dir=..."
        )


def _checkpoint_or_model(path: Path) -> str | None:
    """ "checkpoint" for a grpokit checkpoint (its state.pt or manifest.json, or a checkpoint-<step>
    directory beside a run's config.yaml or metrics), "model" for a saved model or adapter directory,
    else None."""
    try:
        if not path.is_dir():
            return None
        if any((path / name).is_file() for name in CHECKPOINT_FILES) or (
            CHECKPOINT_NAME.fullmatch(path.name)
            and any((path.parent / name).is_file() for name in ("config.yaml", "metrics.jsonl"))
        ):
            return "checkpoint"
        if ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()) and any(
            next(path.glob(pattern), None) is not None for pattern in MODEL_WEIGHTS
        ):
            return "model"
    except OSError:  # a directory this user cannot list is not one grpokit would write into either
        return None
    return None


def clear_staging(output_dir: Path) -> None:
    """Delete what killed runs left half-written: checkpoint staging directories of any name, and
    the temporary files of a metrics or alerts rewrite (`metrics.replace_file`). Only under the lock: no one
    else can be writing them."""
    for path in output_dir.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in output_dir.glob(".*.jsonl.tmp-*"):  # (metrics.replace_file's)
        path.unlink(missing_ok=True)


def clear_earlier_run(output_dir: Path) -> None:
    """Delete what a run writes into `output_dir` (`overwrite=true`): its files, its
    `checkpoint-<step>` directories, and what `grpokit report` wrote into report/. Nothing else there is
    touched (a `checkpoint-best/` of the user's, notes in report/)."""
    for name in RUN_FILES:
        if name != "config.yaml" or written_by_grpokit(output_dir / name):  # a user's config.yaml stays
            (output_dir / name).unlink(missing_ok=True)
    for path in output_dir.glob(f"{CHECKPOINT_PREFIX}*"):
        if CHECKPOINT_NAME.fullmatch(path.name) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    clear_staging(output_dir)
    for name in RUN_DIRS:
        shutil.rmtree(output_dir / name, ignore_errors=True)
    report = output_dir / REPORT_DIR
    for path in [report / "index.html", *report.glob("*.png")]:
        path.unlink(missing_ok=True)
    if report.is_dir() and not any(report.iterdir()):
        report.rmdir()


# ----------------------------------------------------------------------------- interrupted


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run at once (a second Ctrl-C, or one before its stop handler was set): the
    message says which checkpoint is the last complete one. A KeyboardInterrupt, so callers that let
    Ctrl-C through still do; the command line prints the message as one line."""


def interrupted_line(output_dir: Path) -> str:
    """What a run stopped by Ctrl-C leaves to resume from, in one line. A checkpoint being written
    when it came was removed (save_checkpoint) and does not block a resume."""
    saved = list_checkpoints(output_dir)
    if saved:
        return (
            f"interrupted (Ctrl-C); {str(saved[-1])!r} is the last complete checkpoint: continue with "
            f"output_dir={str(output_dir)!r} resume=true"
        )
    found = earlier_run(output_dir)
    if found and not only_an_opening(output_dir, found):
        return (
            "interrupted (Ctrl-C) before the first checkpoint was complete: start again with "
            f"output_dir={str(output_dir)!r} overwrite=true"
        )
    return "interrupted (Ctrl-C) before anything was saved: run the same command again"
