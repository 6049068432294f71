"""The one line a user's mistake prints (`grpokit COMMAND: error: LINE`, exit code 2), naming the
culprit and the fix: a config, data, reward function or device the machine lacks, a missing file, a full
disk, a read-only filesystem, missing permissions, memory. Any other exception is a bug: `one_line`
returns None, and the command line shows its traceback."""

from __future__ import annotations

import re
from pathlib import Path


def one_line(error: Exception, command: str) -> str | None:
    """The line `grpokit COMMAND` prints for `error`, or None for a bug (its traceback is shown)."""
    import torch

    from .config import ConfigError
    from .data import DataError
    from .rewards import RewardFunctionError
    from .train.grpo_step import OutOfDeviceMemory, first_line
    from .train.rollout_worker import RolloutError
    from .train.run import TooManySkips

    said = (
        ConfigError,
        DataError,
        RewardFunctionError,
        TooManySkips,
        OutOfDeviceMemory,
        RolloutError,
        ValueError,
    )
    if isinstance(error, said):
        return str(error)  # ValueError: a DeviceError (device=cuda without a GPU) among others
    if isinstance(error, torch.OutOfMemoryError):  # outside a training step (warm start, a reward model...)
        return (
            f"out of device memory ({first_line(error)}); lower micro_batch_size (rows per forward and "
            "backward, and per evaluation call) or set gradient_checkpointing=true; `grpokit doctor` "
            "forecasts the peak"
        )
    if isinstance(error, OSError):
        return environment_error(error, command)
    if isinstance(
        error, RuntimeError
    ):  # the host's allocator refusing (torch raises no OutOfMemoryError there)
        return host_memory_error(error)
    return None


def readable_size(num_bytes: float) -> str:
    """A byte count as people read it: 12.0 MB (powers of 1000, as `df -H` shows them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"


def free_space(path: str) -> str | None:
    """The free space of the filesystem `path` is on, measured at its nearest existing parent (the
    file that could not be written may not exist, nor its directory); None when even that fails."""
    import shutil

    place = Path(path).absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        return readable_size(shutil.disk_usage(place).free)
    except OSError:
        return None


def environment_error(error: OSError, command: str) -> str | None:
    """The one line for an OSError that the machine or the user's paths caused (a full disk, a
    read-only filesystem, missing permissions, a file where a directory belongs, a run already in
    output_dir), naming the path and what to do; None for any other OSError, which then shows its
    traceback as a bug would."""
    import errno

    path = error.filename
    where = repr(str(path)) if path is not None else "a file"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if error.errno == errno.ENOSPC else "disk quota exceeded"
        free = free_space(path) if path is not None else None
        room = f" ({free} free on that filesystem)" if free else ""
        kept = " Earlier checkpoints are kept." if command in ("train", "reward") else ""  # they checkpoint
        return f"{what} writing {where}{room}; free some space or choose another output_dir.{kept}"
    if error.errno == errno.EROFS:
        return f"{where} is on a read-only filesystem; choose a path on a writable one (output_dir=...)."
    if error.errno == errno.ENAMETOOLONG:
        return f"the file name {where} is too long for its filesystem; choose a shorter path."
    if isinstance(error, PermissionError):
        return f"permission denied on {where}; give this user access to it, or choose another path."
    if isinstance(error, IsADirectoryError):
        return f"{where} is a directory where a file is expected; give the path of a file."
    if isinstance(error, NotADirectoryError):
        return f"{where} is not a directory (it, or a folder on its path, is a file); choose another path."
    if isinstance(error, (FileNotFoundError, FileExistsError)):
        if error.errno is None:  # raised by grpokit with a message that names the path and the fix
            return str(error)
        if isinstance(error, FileExistsError):
            return f"{where} already exists; remove it or choose another path."
        return f"{where} does not exist; check the path."
    return None


def host_memory_error(error: RuntimeError) -> str | None:
    """The one line for the host's allocator refusing a tensor (None for any other RuntimeError, a bug):
    a size far beyond the machine's memory, usually from max_completion_length, num_generations or
    num_eval_prompts; nothing has been written by then (a run refuses such sizes before its directory)."""
    found = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", str(error))
    if found is None:
        return None
    gib = int(found.group(1)) / 2**30
    return (
        f"out of host memory: a tensor of {gib:,.1f} GiB could not be allocated; lower "
        "max_completion_length, num_generations, prompts_per_step, num_eval_prompts or micro_batch_size "
        "(`grpokit doctor` forecasts a step's memory); a run it stopped continues with resume=true from "
        "its last checkpoint, or starts again with overwrite=true"
    )
