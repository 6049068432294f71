"""Checkpoints: writing, listing and restoring them.

* Checkpoints: `checkpoint-<step>/` written atomically (a staging directory, fsynced, then renamed),
  from any world size (`save_distributed` / `restore_distributed`: per-rank shards under FSDP); always
  on the host, so a checkpoint written on a GPU loads on any machine.
* Integrity: `manifest.json` holds the size and SHA-256 of every file of a checkpoint;
  `newest_intact_checkpoint` skips one that does not match it (a truncated file, a flipped byte).
* Nothing a checkpoint holds can run code when resumed: weights and shards are safetensors, the rest
  JSON or YAML, and `state.pt` is read with torch.load(weights_only=True) (tensors and plain values).
* The run directory's lock, its guard against earlier runs and the staging names are in rundir.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..models import is_lora, load_lora_weights, quiet_saving, save_lora
from . import distributed
from .checkpoint_state import fit_problem, parse_state, reference_problem
from .rundir import CHECKPOINT_PREFIX, checkpoint_staging, list_checkpoints

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: corrupt, unsafe, or written for another model or world size."""


# ----------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class TrainingParts:
    """What a checkpoint saves and restores: the model (as training passes go through it: DDP's
    wrapper, FSDP's sharded module, or the module itself), its tokenizer, the optimizer, its schedule
    and the prompt sampler's position."""

    model: Any
    tokenizer: Any
    optimizer: Any
    scheduler: Any
    sampler: Any
    reference: Any = None  # a synced reference model, whose weights the checkpoint holds too


@dataclass(frozen=True)
class SaveTo:
    """Where a run's checkpoints go: `output_dir`, each with the run's `config_yaml`, the last `keep`
    of them kept."""

    output_dir: Path
    config_yaml: str
    keep: int


def save_checkpoint(
    to: SaveTo,
    step: int,
    model: Any,
    tokenizer: Any,
    training_state: dict[str, Any],
    *,
    weights: dict[str, torch.Tensor] | None = None,
    keep_staged: bool = False,
) -> Path:
    """Write checkpoint-<step>/ atomically: into a temporary directory, then renamed.

    Contents: weights (safetensors) and tokenizer, `state.pt` (optimizer, scheduler, RNG states,
    data position; tensors and plain values only, loadable with weights_only=True), config.yaml, and
    last `manifest.json` (size and SHA-256 of every other file, the FSDP shards included).

    A write that fails (a full disk, a quota, an I/O error) removes the temporary directory, leaves
    every earlier checkpoint as it was, and raises OSError with `filename` the path being written."""
    output_dir, config_yaml, keep = to.output_dir, to.config_yaml, to.keep
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = checkpoint_staging(output_dir, step)
    if not keep_staged:  # FSDP ranks have already written their shards into the staging directory
        shutil.rmtree(tmp, ignore_errors=True)
    writing = tmp  # what is being written, for the error
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        writing = tmp / "model.safetensors"
        with quiet_saving():
            if is_lora(model):  # the merged model at the root; adapters and base in lora_adapter/
                save_lora(model, tmp)
            else:
                model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
        writing = tmp  # the tokenizer's files
        tokenizer.save_pretrained(tmp)
        writing = tmp / "state.pt"
        with writing.open("wb") as f:  # a file object: a full disk surfaces as OSError, not RuntimeError
            torch.save(_on_host(training_state), f)  # loadable on a machine without the GPU
        writing = tmp / "config.yaml"
        writing.write_text(config_yaml)
        writing = tmp / MANIFEST
        write_manifest(tmp)
        writing = tmp
        _fsync_tree(tmp)  # every byte on disk before the rename makes the checkpoint visible
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)  # earlier checkpoints are not touched
        if isinstance(error.__context__, KeyboardInterrupt):  # torch's writer failing as Ctrl-C unwound it
            raise error.__context__ from None
        disk = as_os_error(error, writing) if isinstance(error, Exception) else None  # not Ctrl-C
        if disk is None or disk is error:
            raise
        raise disk from error
    _discard(final, tmp.name)
    tmp.rename(final)
    _fsync_dir(output_dir)
    # only checkpoints up to this one count towards `keep`: a newer one that resume skipped as damaged
    # must not push the intact ones out (it is replaced when the run saves its step again)
    kept = [p for p in list_checkpoints(output_dir) if int(p.name[len(CHECKPOINT_PREFIX) :]) <= step]
    for old in kept[:-keep]:
        _discard(old, tmp.name)
    return final


def _discard(checkpoint: Path, staging_name: str) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted one under its own name (it
    could then pass for a checkpoint without a manifest): renamed to a staging name first, which
    `rundir.clear_staging` removes if a kill interrupts the deletion."""
    if not checkpoint.exists():
        return
    trash = checkpoint.with_name(f"{staging_name}-discard-{checkpoint.name}")
    shutil.rmtree(trash, ignore_errors=True)
    checkpoint.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def as_os_error(error: BaseException, path: Path) -> OSError | None:
    """`error` as the OSError underneath it, its `filename` set to `path` when it has none (the
    command line then says which disk is full), or None when no OSError is behind it. torch.save
    wraps a failed write in a RuntimeError, safetensors in a SafetensorError naming "os error N" (or,
    serializing, "IoError(Os { code: N, ... })")."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            if seen.filename is None:
                seen.filename = str(path)
            return seen
        seen = seen.__cause__ or seen.__context__
    code = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(error))  # (Rust's Display, its Debug)
    if code is not None:
        number = int(code.group(1) or code.group(2))
        return OSError(number, os.strerror(number), str(path))
    return None


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


# ----------------------------------------------------------------------------- integrity


def _sha256(path: Path) -> str:
    """The file's SHA-256, read 1 MiB at a time (checkpoints reach gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class ManifestEntry(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    size: Annotated[int, Field(ge=0)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Manifest(BaseModel):
    """manifest.json, as `write_manifest` writes it: one size and SHA-256 per file."""

    model_config = ConfigDict(strict=True, extra="forbid")
    format: Literal[1]
    files: dict[str, ManifestEntry]


def write_manifest(checkpoint: Path) -> None:
    """`manifest.json`: the size and SHA-256 of every file under `checkpoint` (paths relative to it,
    with "/"). It detects damage (a truncated or altered file), not tampering: whoever can write the
    checkpoint can write its manifest too; what keeps a checkpoint from running code is its formats."""
    files = {
        path.relative_to(checkpoint).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    (checkpoint / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1), encoding="utf-8")


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What is wrong with `checkpoint` by its manifest (None when every file it lists has its size and
    SHA-256): a missing, truncated, altered or unreadable file, named. Sizes are checked before any
    file is read. A checkpoint without a manifest (written before grpokit wrote them) cannot be
    checked and is taken as it is, as before; files the manifest does not list are not checked."""
    try:
        return _problem(checkpoint)
    except OSError as error:  # a bad sector, a permission: damage like any other, so resume falls back
        return f"{Path(error.filename or checkpoint).name} is unreadable ({error.strerror or error})"


def _problem(checkpoint: Path) -> str | None:
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return None if (checkpoint / "state.pt").is_file() else "state.pt is missing"
    try:
        listed = Manifest.model_validate_json(manifest.read_bytes()).files
    except ValueError as error:  # not JSON, or not a manifest (pydantic's ValidationError is one)
        first = error.errors(include_url=False)[0] if isinstance(error, ValidationError) else None
        why = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first else str(error)
        return f"{MANIFEST} is unreadable ({why})"
    files = [(name, entry.size, entry.sha256) for name, entry in listed.items()]
    for name, size, _ in files:
        if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            return f"{MANIFEST} names a file outside the checkpoint ({name})"
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes where {MANIFEST} says {size}"
    for name, _, digest in files:
        if _sha256(checkpoint / name) != digest:
            return f"{name} does not match its SHA-256 in {MANIFEST}"
    return None


def newest_intact_checkpoint(output_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of `output_dir` whose files match its manifest (None when there is no
    checkpoint), and what is wrong with each newer one ("checkpoint-3: state.pt has ..."). Only
    checkpoints down to the first intact one are read. Raises CheckpointError (one line) when there
    are checkpoints and none is intact."""
    corrupt: list[str] = []
    for checkpoint in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, corrupt
        corrupt.append(f"{checkpoint.name}: {problem}")
    if corrupt:
        raise CheckpointError(
            f"no checkpoint in {output_dir} is intact ({'; '.join(corrupt)}), so resume=true has nothing "
            "to continue from: start a new run with another output_dir, or overwrite=true."
        )
    return None, []


# ----------------------------------------------------------------------------- loading


def _load_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's `state.pt`, on the host whatever device wrote it (the optimizer moves its
    state to its parameters' device as it loads). weights_only=True: tensors and plain values only,
    so a state.pt that refers to code is refused, never run."""
    try:
        return torch.load(checkpoint / "state.pt", weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:  # what weights_only refuses: anything that names code
        raise CheckpointError(
            f"checkpoint {checkpoint}: state.pt holds more than tensors and plain values and is not "
            "loaded (it could run code); resume from a checkpoint grpokit wrote, or use another output_dir."
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as error:  # truncated, or not a torch file
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointError(f"checkpoint {checkpoint}: state.pt is unreadable ({first}).") from None


def _stored_shapes(checkpoint: Path, name: str) -> dict[str, torch.Size]:
    """The shape of every tensor in the safetensors file `name` of `checkpoint`, from its header."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(checkpoint / name), framework="pt") as f:
            return {key: torch.Size(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"checkpoint {checkpoint}: {name} is unreadable ({error}).") from None


def _shapes(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Size], dict[str, set[str]]]:
    """Each tensor's shape, and the names sharing its memory (a tied head and embedding, which
    save_pretrained stores once, under either name)."""
    names: dict[tuple[int, torch.Size], set[str]] = {}
    for name, value in weights.items():
        names.setdefault((value.data_ptr(), value.shape), set()).add(name)
    tied = {name: group - {name} for group in names.values() for name in group}
    return {name: value.shape for name, value in weights.items()}, tied


def _check_fits(checkpoint: Path, stored: dict[str, torch.Size], weights: dict[str, torch.Tensor]) -> None:
    """One line naming the first tensor where the checkpoint's weights and the model's differ (in
    name or shape), instead of load_state_dict's list of every key or its traceback."""
    problem = None
    expected, tied = _shapes(weights)
    for name, shape in expected.items():
        if name not in stored and tied[name] & set(stored):
            continue  # stored once under the name it is tied to; loading that fills both
        if name not in stored and "rotary" not in name:  # rotary tables are recomputed, maybe not saved
            problem = f"it has no {name}"
        elif name in stored and stored[name] != shape:
            problem = f"{name} is {tuple(stored[name])} there and {tuple(shape)} in this model"
        if problem is not None:
            break
    extra = [name for name in stored if name not in expected]
    if problem is None and extra:
        problem = f"it has {extra[0]}, which this model has not"
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not fit this model: {problem}; resume with the model settings of "
            "the run that wrote it (model, tiny_* sizes, use_peft), or use another output_dir."
        )


def load_training_state(checkpoint: Path, model: Any) -> dict[str, Any]:
    """Restore the weights of `model` from `checkpoint` and return its training state, unchecked. A
    checkpoint of another model shape is one CheckpointError naming the first tensor that differs."""
    load_weights(checkpoint, model)
    return _load_state(checkpoint)


def load_weights(checkpoint: Path, model: Any) -> None:
    """The weights of `checkpoint` into `model` (its LoRA adapters and base when it has them)."""
    from safetensors.torch import load_file

    stored = _stored_shapes(checkpoint, "model.safetensors")
    if is_lora(model):  # the base weights, named as in a plain model (load_lora_weights' mapping)
        base = model.get_base_model().state_dict()
        _check_fits(
            checkpoint,
            stored,
            {k.replace(".base_layer.", "."): v for k, v in base.items() if "lora_" not in k},
        )
        load_lora_weights(model, checkpoint)
        return
    _check_fits(checkpoint, stored, model.state_dict())
    model.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)  # rotary: recomputed


def check_state(
    state: Any, checkpoint: Path, optimizer: Any, scheduler: Any, sampler: Any, reference: Any = None
) -> dict[str, Any]:
    """`state` (`checkpoint`'s state.pt) once every value in it is of the kind and range a run writes
    and fits this run (checkpoint_state.py: `optimizer` None under FSDP, whose shards are checked as
    they load; `reference` the synced reference model, if any), else one CheckpointError naming the
    value. A resume restores nothing before this returns."""
    parsed, problem = parse_state(state)
    if parsed is not None:
        step = int(checkpoint.name[len(CHECKPOINT_PREFIX) :])
        problem = fit_problem(parsed, step, optimizer, scheduler, sampler)
        if problem is None and reference is not None:
            problem = reference_problem(parsed.reference, distributed.unwrap(reference).state_dict())
    if problem:
        raise CheckpointError(state_error(checkpoint, problem))
    return state


def state_error(checkpoint: Path, problem: str) -> str:
    """The one line for a state.pt value that no run of this kind writes."""
    return (
        f"checkpoint {checkpoint} cannot be resumed: in its state.pt, {problem}; it was edited, or written "
        "by another run: resume from an earlier checkpoint (move this one away), or start a new run with "
        "another output_dir=... or overwrite=true"
    )


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
    checkpoint: Path, model: Any, optimizer: Any, scheduler: Any, sampler: Any, reference: Any = None
) -> dict[str, Any]:
    """Weights, optimizer, schedule, data position and RNG from `checkpoint`; returns its state
    (`step`, `eval_before` and anything else the loop saved)."""
    state = check_state(_load_state(checkpoint), checkpoint, optimizer, scheduler, sampler, reference)
    load_weights(checkpoint, model)
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
    to: SaveTo,
    step: int,
    parts: TrainingParts,
    eval_before: dict[str, float],
    extra: dict[str, Any] | None = None,
) -> None:
    """A complete checkpoint from any world size. Under FSDP every rank writes its model and
    optimizer shards (dcp/rank-<r>.safetensors and .json, `distributed.save_sharded`), and rank 0
    adds consolidated safetensors weights for inference; otherwise rank 0 writes everything."""
    sharded = d.enabled and strategy == "fsdp"
    model, optimizer = parts.model, parts.optimizer
    state = training_state(step, optimizer, parts.scheduler, parts.sampler, eval_before) | (extra or {})
    if sharded:
        state.pop("optimizer")  # it lives in the DCP shards
        if d.is_main:
            shutil.rmtree(checkpoint_staging(to.output_dir, step), ignore_errors=True)
        distributed.barrier(d)
        distributed.save_sharded(d, checkpoint_staging(to.output_dir, step) / "dcp", model, optimizer)
    weights = distributed.full_state_dict(d, model)  # collective under FSDP
    if d.is_main:
        save_checkpoint(
            to,
            step,
            distributed.unwrap(model),
            parts.tokenizer,
            state,
            weights=weights,
            keep_staged=sharded,
        )
    distributed.barrier(d)


def restore_distributed(d: Any, strategy: str, checkpoint: Path, parts: TrainingParts) -> dict[str, Any]:
    """The inverse of `save_distributed`, for the same world size; returns the checkpoint's state."""
    model, optimizer, scheduler, sampler = parts.model, parts.optimizer, parts.scheduler, parts.sampler
    if d.enabled and strategy == "fsdp":
        state = check_state(_load_state(checkpoint), checkpoint, None, scheduler, sampler, parts.reference)
        try:
            distributed.load_sharded(d, checkpoint / "dcp", model, optimizer)
        except ValueError as error:  # one line already, naming the file
            raise CheckpointError(str(error)) from None
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["prompts"])
        set_rng_state(state["rng"])
        return state
    return restore_training(
        checkpoint, distributed.unwrap(model), optimizer, scheduler, sampler, parts.reference
    )
