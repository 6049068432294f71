"""Checkpoints and the output directory they live in.

* Checkpoints: `checkpoint-<step>/` written atomically (a staging directory, fsynced, then renamed),
  from any world size (`save_distributed` / `restore_distributed`: DCP shards under FSDP); always on
  the host, so a checkpoint written on a GPU loads on any machine.
* The run-directory guard: a new run never starts where an earlier one lives unless told to
  (`claim_output_dir`), and `overwrite=true` deletes only what a run writes (`clear_earlier_run`).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from ..models import is_lora, load_lora_weights, quiet_saving, save_lora
from . import distributed

CHECKPOINT_PREFIX = "checkpoint-"

# ----------------------------------------------------------------------------- run directories

# What a run writes into its output_dir (and `overwrite=true` removes): nothing else there is touched.
RUN_FILES = ("metrics.jsonl", "sft_metrics.jsonl", "calibration.json", "config.yaml")
RUN_DIRS = ("tensorboard", "wandb", "report", "final")


def earlier_run(output_dir: Path) -> list[str]:
    """What in `output_dir` belongs to an earlier run (metrics or checkpoints), by name."""
    if not output_dir.is_dir():
        return []
    found = [p.name for p in sorted(output_dir.glob(f"{CHECKPOINT_PREFIX}*")) if p.is_dir()]
    # (a warm start stopped by a signal leaves only config.yaml and sft_metrics.jsonl: not a run yet,
    # so the same command starts again)
    found += [name for name in ("metrics.jsonl", "final") if (output_dir / name).exists()]
    return found


def claim_output_dir(output_dir: Path, *, resume: bool, overwrite: bool) -> bool:
    """Refuse, before any work, to start a new run where an earlier one lives (its metrics would be
    mixed with the new ones and save_total_limit would delete the new checkpoints, the older run's
    having higher step numbers). Returns whether there is an earlier run that `overwrite` asks to
    delete: the caller deletes it (`clear_earlier_run`) once its input is validated, so a command
    that fails on bad input never destroys anything."""
    found = earlier_run(output_dir)
    if not found or resume:
        return False
    if not overwrite:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise FileExistsError(
            f"output_dir {str(output_dir)!r} already holds a run ({shown}); continue it with resume=true, "
            "start a new one with another output_dir=..., or replace it with overwrite=true."
        )
    return True


def clear_earlier_run(output_dir: Path) -> None:
    """Delete what a run writes into `output_dir` (`overwrite=true`); nothing else there is touched."""
    for name in RUN_FILES:
        (output_dir / name).unlink(missing_ok=True)
    for path in [*output_dir.glob(f"{CHECKPOINT_PREFIX}*"), *output_dir.glob(f".tmp-{CHECKPOINT_PREFIX}*")]:
        shutil.rmtree(path, ignore_errors=True)
    for name in RUN_DIRS:
        shutil.rmtree(output_dir / name, ignore_errors=True)


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_staging(output_dir: Path, step: int) -> Path:
    """The temporary directory a checkpoint is written into before it is renamed into place."""
    return output_dir / f".tmp-{CHECKPOINT_PREFIX}{step}"


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    training_state: dict[str, Any],
    config_yaml: str,
    keep: int,
    *,
    weights: dict[str, torch.Tensor] | None = None,
    keep_staged: bool = False,
) -> Path:
    """Write checkpoint-<step>/ atomically: into a temporary directory, then renamed.

    Contents: weights (safetensors) and tokenizer, `state.pt` (optimizer, scheduler, RNG states,
    data position; tensors and plain values only, loadable with weights_only=True), config.yaml."""
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = checkpoint_staging(output_dir, step)
    if not keep_staged:  # FSDP ranks have already written their shards into the staging directory
        shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    with quiet_saving():
        if is_lora(model):  # base weights at the root, adapters in lora_adapter/ (load_policy merges them)
            save_lora(model, tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    torch.save(_on_host(training_state), tmp / "state.pt")  # loadable on a machine without the GPU
    (tmp / "config.yaml").write_text(config_yaml)
    _fsync_tree(tmp)  # every byte on disk before the rename makes the checkpoint visible
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(output_dir)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for directory in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        _fsync_dir(directory)


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories are never listed)."""
    found = [p for p in output_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def _load_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's `state.pt`, on the host whatever device wrote it (the optimizer moves its
    state to its parameters' device as it loads)."""
    return torch.load(checkpoint / "state.pt", weights_only=True, map_location="cpu")


def load_training_state(checkpoint: Path, model: Any) -> dict[str, Any]:
    """Restore the weights of `model` from `checkpoint` and return its training state."""
    from safetensors.torch import load_file

    if is_lora(model):
        load_lora_weights(model, checkpoint)
        return _load_state(checkpoint)
    weights = load_file(checkpoint / "model.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise ValueError(
            f"checkpoint {checkpoint} does not match the model (missing {missing}, unexpected {unexpected})."
        )
    return _load_state(checkpoint)


def _on_host(value: Any) -> Any:
    """`value` with every tensor in it copied to the CPU (those already there are kept as they are)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(item) for item in value)
    return value


def training_state(
    step: int, optimizer: Any, scheduler: Any, sampler: Any, eval_before: dict[str, float]
) -> dict[str, Any]:
    """What a checkpoint needs beyond the weights to continue exactly where the run stopped."""
    return {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "prompts": sampler.state_dict(),
        "rng": rng_state(),
        "eval_before": eval_before,
    }


def restore_training(
    checkpoint: Path, model: Any, optimizer: Any, scheduler: Any, sampler: Any
) -> dict[str, Any]:
    """Weights, optimizer, schedule, data position and RNG from `checkpoint`; returns its state
    (`step`, `eval_before` and anything else the loop saved)."""
    state = load_training_state(checkpoint, model)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["prompts"])
    set_rng_state(state["rng"])
    return state


def rng_state() -> dict[str, Any]:
    """The generators a step draws from outside its own seeded ones: torch's CPU generator, Python's,
    and on a GPU the CUDA generators (dropout there, LoRA's included, draws from them)."""
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()  # one CPU byte tensor per visible GPU
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state`. The CUDA generators are restored when the checkpoint has them and this
    machine has as many GPUs (a checkpoint written on a GPU may resume on a CPU, and back)."""
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def save_distributed(
    d: Any,
    strategy: str,
    output_dir: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: Any,
    scheduler: Any,
    sampler: Any,
    eval_before: dict[str, float],
    config_yaml: str,
    keep: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """A complete checkpoint from any world size. Under FSDP every rank writes its model and
    optimizer shards with torch.distributed.checkpoint (dcp/), and rank 0 adds consolidated
    safetensors weights for inference; otherwise rank 0 writes everything."""
    sharded = d.enabled and strategy == "fsdp"
    state = training_state(step, optimizer, scheduler, sampler, eval_before) | (extra or {})
    if sharded:
        state.pop("optimizer")  # it lives in the DCP shards
        if d.is_main:
            shutil.rmtree(checkpoint_staging(output_dir, step), ignore_errors=True)
        distributed.barrier(d)
        distributed.save_sharded(d, str(checkpoint_staging(output_dir, step) / "dcp"), model, optimizer)
    weights = distributed.full_state_dict(d, model)  # collective under FSDP
    if d.is_main:
        save_checkpoint(
            output_dir,
            step,
            distributed.unwrap(model),
            tokenizer,
            state,
            config_yaml,
            keep,
            weights=weights,
            keep_staged=sharded,
        )
    distributed.barrier(d)


def restore_distributed(
    d: Any, strategy: str, checkpoint: Path, model: Any, optimizer: Any, scheduler: Any, sampler: Any
) -> dict[str, Any]:
    """The inverse of `save_distributed`, for the same world size; returns the checkpoint's state."""
    if d.enabled and strategy == "fsdp":
        distributed.load_sharded(d, str(checkpoint / "dcp"), model, optimizer)
        state = _load_state(checkpoint)
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["prompts"])
        set_rng_state(state["rng"])
        return state
    return restore_training(checkpoint, distributed.unwrap(model), optimizer, scheduler, sampler)
