"""The one module that talks to torch.distributed.

`torchrun --nproc_per_node N -m grpokit train ...` sets RANK / WORLD_SIZE / LOCAL_RANK; `init(device)`
reads them and starts a process group: gloo on the CPU (device=cpu, or no GPU), nccl with rank r on
cuda:r (device=auto or cuda), never two NCCL ranks on one GPU (`choose_backend`). With one process
everything here is a no-op, so the loops call it unconditionally.

Strategies:
* ddp: every rank holds the whole model; gradients are averaged in backward.
* fsdp: FSDP2 (`fully_shard`) on each decoder layer and the root: parameters, gradients and
  optimizer state are sharded; optional CPU offload; bf16 compute with fp32 reduction on GPU.
Both average gradients over ranks, which is why loss normalisers that must be global (dapo's
token count) are divided by the world size (`loss_scale`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..models.device import DeviceError, resolve_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_backend(
    device: str, cuda_count: int, local_rank: int, local_world_size: int
) -> tuple[str, torch.device]:
    """The process-group backend and the device of rank `local_rank` of the `local_world_size` ranks
    of a node with `cuda_count` visible GPUs, for a config's `device` (auto | cpu | cuda | cuda:N).

    cpu, or auto without a GPU: gloo on the CPU. auto or cuda: nccl, rank r on cuda:r. NCCL cannot
    run two ranks on one GPU, so with more ranks than GPUs on the node, cuda is an error and auto is
    gloo on the CPU (with a warning). The decision depends on the node, not the rank, so that every
    rank takes the same backend. cuda:N, one GPU for every rank of the node, is refused with more
    than one rank. Pure (no torch.cuda call): tested with any counts."""
    if device == "cpu" or (device == "auto" and cuda_count == 0):
        return "gloo", torch.device("cpu")
    if re.fullmatch(r"auto|cuda(:[0-9]+)?", device) is None:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}.")
    if cuda_count == 0:
        raise DeviceError(f"device={device} but torch sees no CUDA GPU; use device=cpu or device=auto.")
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        if local_world_size > 1:
            raise ValueError(
                f"device={device} puts all {local_world_size} ranks of this node on one GPU, and NCCL runs "
                "one rank per GPU; use device=cuda (rank r takes cuda:r) or device=cpu."
            )
        if index >= cuda_count:
            raise DeviceError(f"device={device} but this machine has {cuda_count} GPU(s).")
        return "nccl", torch.device("cuda", index)
    if local_world_size <= cuda_count:
        return "nccl", torch.device("cuda", local_rank)
    if device == "cuda":
        raise DeviceError(
            f"device=cuda with {local_world_size} ranks on a node with {cuda_count} GPU(s): NCCL runs one "
            f"rank per GPU; start at most {cuda_count} (torchrun --nproc_per_node) or use device=cpu."
        )
    logger.warning(
        "device=auto with %d ranks on a node with %d GPU(s) (NCCL runs one rank per GPU): all ranks run "
        "on the CPU with gloo; start at most %d per node to use the GPUs",
        local_world_size,
        cuda_count,
        cuda_count,
    )
    return "gloo", torch.device("cpu")


def init(device: str = "auto") -> Dist:
    """Join the process group torchrun describes (once), or run alone. `device` is the config's (auto |
    cpu | cuda | cuda:N): alone, the device it resolves to; under torchrun, as `choose_backend` says."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(device=resolve_device(device))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, placed = choose_backend(device, cuda_count, local, local_world)
    if not dist.is_initialized():
        if placed.type == "cuda":
            torch.cuda.set_device(placed)
        dist.init_process_group(backend)
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, device=placed)


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(d: Dist, value: torch.Tensor) -> torch.Tensor:
    """Σ over ranks (a new tensor; the input is not modified)."""
    out = value.detach().clone().float() if value.is_floating_point() else value.detach().clone()
    if d.enabled:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def any_rank(d: Dist | None, flag: bool) -> bool:
    """True if `flag` is True on any rank (every rank gets the same answer; `d` None: one process)."""
    if d is None or not d.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def mean_metrics(d: Dist, metrics: dict[str, Any]) -> dict[str, Any]:
    """Numeric metrics averaged over ranks, in one collective (NaN-aware: a rank with NaN is skipped)."""
    if not d.enabled:
        return metrics
    keys = [k for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))]
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)  # [M]
    valid = ~torch.isnan(values)
    stacked = torch.stack([torch.where(valid, values, 0.0), valid.double()]).to(d.device)  # [2, M]
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    means = (stacked[0] / stacked[1].clamp(min=1)).cpu()
    means = torch.where(stacked[1].cpu() > 0, means, torch.nan)
    return metrics | {k: means[i].item() for i, k in enumerate(keys)}


def loss_scale(d: Dist, global_normaliser: bool) -> float:
    """Factor undoing the gradient averaging over ranks for losses normalised by a global count."""
    return float(d.world_size) if global_normaliser else 1.0


def wrap(
    d: Dist,
    model: Any,
    strategy: str,
    *,
    cpu_offload: bool = False,
    trainable: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> Any:
    """DDP or FSDP2 around `model` (unchanged with one process). Under FSDP on a GPU, parameters are
    gathered in `compute_dtype` (default bf16) and gradients reduced in float32."""
    if not d.enabled:
        return model
    if strategy == "ddp":
        if not trainable:
            return model  # a frozen model needs no gradient synchronisation
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if cpu_offload:
        # pinned host memory speeds copies to a GPU; there is none to copy to on a CPU-only machine
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=d.device.type == "cuda")
    if d.device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype or torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (what FSDP shards one by one)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None) or getattr(base, "h", None) or []
    return list(layers)


def unwrap(model: Any) -> Any:
    """The model inside DDP (FSDP2 modifies the model in place, so it is its own module)."""
    return getattr(model, "module", model)


def full_state_dict(d: Dist, model: Any) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict on CPU (on rank 0; other ranks get an empty dict under FSDP)."""
    if not d.enabled or not _is_fsdp(model):
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _is_fsdp(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# Sharded checkpoints (FSDP): every rank writes the local part of each tensor it holds, and reads it
# back into the same DTensor layout. Not torch.distributed.checkpoint: its `.metadata` is a pickle,
# and unpickling runs whatever code the file names, so a checkpoint directory someone else could write
# would run their code on `resume=true`. Here tensors are safetensors and the rest is JSON, neither of
# which can name code. Resume already requires the world size that wrote the checkpoint (the data
# split depends on it), so rank r's shards are exactly what rank r holds again.

SHARD_FORMAT = 1
_TENSOR, _TUPLE = "__tensor__", "__tuple__"  # the two JSON node kinds that are not plain JSON
_DAMAGED = (
    "the checkpoint is damaged or was not written by grpokit: move it aside to resume from an earlier one, "
    "or use another output_dir"
)


def shard_files(directory: Path, rank: int) -> tuple[Path, Path]:
    """Rank `rank`'s files of a sharded checkpoint: its tensors and its index (JSON)."""
    return directory / f"rank-{rank}.safetensors", directory / f"rank-{rank}.json"


def save_sharded(d: Dist, directory: Path, model: Any, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state, each rank its own shards (`shard_files`): the local part of every
    tensor in safetensors, everything else (hyperparameters, parameter names, where each tensor goes)
    in JSON. Collective: returns once every rank has written and fsynced its files."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode({"model": model_state, "optimizer": optim_state}, "", tensors)
    directory.mkdir(parents=True, exist_ok=True)
    tensor_file, index_file = shard_files(directory, d.rank)
    save_file(tensors, str(tensor_file))
    index = {"format": SHARD_FORMAT, "rank": d.rank, "world_size": d.world_size, "state": tree}
    index_file.write_text(json.dumps(index), encoding="utf-8")
    for path in (tensor_file, index_file):  # on disk before rank 0 seals the checkpoint
        with path.open("rb") as f:
            os.fsync(f.fileno())
    barrier(d)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters and optimizer states), else the tensor. No
    DTensor exists unless torch.distributed.tensor was imported (FSDP imports it), so a run that never
    shards does not pay the ~0.8 s that importing it costs at start."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is not None and isinstance(tensor, tensor_module.DTensor):
        return tensor.to_local()
    return tensor


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON, its tensors moved to `tensors` (keyed by their path in the state) and replaced
    by {"__tensor__": key}; a DTensor is stored as this rank's local shard."""
    if isinstance(value, torch.Tensor):
        local = _local(value)
        # a copy of its own (safetensors refuses tensors sharing memory, and FSDP's shards are views)
        tensors[path] = local.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: path}
    if isinstance(value, dict):
        if any(not isinstance(k, str) or k in (_TENSOR, _TUPLE) for k in value):
            keys = list(value)
            raise TypeError(f"state at {path or '/'} has keys a sharded checkpoint cannot store: {keys}")
        return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"state at {path} is a {type(value).__name__}, which a sharded checkpoint cannot store")


def load_sharded(d: Dist, directory: Path, model: Any, optimizer: torch.optim.Optimizer) -> None:
    """The inverse of `save_sharded`, for the same world size and model: every tensor is copied into
    this rank's shard of the model's and optimizer's state (same shape and dtype, or a ValueError of
    one line). Reads only safetensors and JSON: nothing in the directory can run code."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    index, tensors = _read_shards(d, directory)
    model_state, optim_state = get_state_dict(model, optimizer)
    template = {"model": model_state, "optimizer": optim_state}
    filled: set[str] = set()
    state = _decode(index["state"], template, tensors, filled, directory)
    unfilled = [path for path in _tensor_paths(template, "") if path not in filled]
    if unfilled:
        raise ValueError(
            f"{directory} has no {unfilled[0]} (and {len(unfilled) - 1} more tensors of this model or "
            "optimizer): resume with the model and optimizer settings of the run that wrote it, or use "
            "another output_dir."
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _read_shards(d: Dist, directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This rank's index and tensors, checked to be what `save_sharded` wrote for this world size."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensor_file, index_file = shard_files(directory, d.rank)
    if not index_file.is_file() and (directory / ".metadata").exists():
        raise ValueError(
            f"{directory} holds torch.distributed.checkpoint shards (an older grpokit), which are not "
            "loaded: their .metadata is a pickle and could run code. Continue that run with the grpokit "
            "that wrote it, or start a new one (another output_dir, or overwrite=true)."
        )
    if not index_file.is_file() or not tensor_file.is_file():
        raise ValueError(
            f"{directory} has no shards for rank {d.rank} ({index_file.name}, {tensor_file.name}): resume "
            "with the world size and strategy of the run that wrote it."
        )
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except ValueError as error:  # not UTF-8, or not JSON
        raise ValueError(f"{index_file} is not a shard index (JSON): {error}; {_DAMAGED}") from None
    if not isinstance(index, dict) or index.get("format") != SHARD_FORMAT or "state" not in index:
        raise ValueError(
            f"{index_file} is not a shard index grpokit can read (format {SHARD_FORMAT}); {_DAMAGED}"
        )
    if index.get("world_size") != d.world_size or index.get("rank") != d.rank:
        raise ValueError(
            f"{directory} was written by {index.get('world_size')} processes and this run has "
            f"{d.world_size}: resume with the same number of processes (torchrun --nproc_per_node)."
        )
    try:
        tensors = load_file(str(tensor_file), device="cpu")
    except SafetensorError as error:
        raise ValueError(f"{tensor_file} is not a readable safetensors file ({error}); {_DAMAGED}") from None
    return index, tensors


def _decode(
    node: Any, template: Any, tensors: dict[str, torch.Tensor], filled: set[str], directory: Path
) -> Any:
    """The state `node` (from `_encode`) describes, its tensors copied into the matching tensors of
    `template` (this rank's current state: same layout, device and DTensor placement)."""
    if isinstance(node, dict) and _TENSOR in node:
        key = node[_TENSOR]
        stored = tensors.get(key) if isinstance(key, str) else None
        if stored is None:
            raise ValueError(f"{directory}: the index names a tensor {key!r} its safetensors file lacks.")
        if not isinstance(template, torch.Tensor):
            raise ValueError(
                f"{directory} has {key}, which this model or optimizer does not: resume with the model "
                "settings of the run that wrote it, or use another output_dir."
            )
        local = _local(template)
        if stored.shape != local.shape or stored.dtype != local.dtype:
            raise ValueError(
                f"{directory}: {key} is {tuple(stored.shape)} {stored.dtype} there and "
                f"{tuple(local.shape)} {local.dtype} here: resume with the model settings and world size "
                "of the run that wrote it, or use another output_dir."
            )
        with torch.no_grad():
            local.copy_(stored)
        filled.add(key)
        return template
    if isinstance(node, dict) and _TUPLE in node:
        items = template if isinstance(template, (list, tuple)) else []
        parts = enumerate(node[_TUPLE])
        return tuple(_decode(v, _at(items, i), tensors, filled, directory) for i, v in parts)
    if isinstance(node, dict):
        inner = template if isinstance(template, dict) else {}
        return {k: _decode(v, inner.get(k), tensors, filled, directory) for k, v in node.items()}
    if isinstance(node, list):
        items = template if isinstance(template, (list, tuple)) else []
        return [_decode(v, _at(items, i), tensors, filled, directory) for i, v in enumerate(node)]
    return node


def _at(items: Any, i: int) -> Any:
    return items[i] if i < len(items) else None


def _tensor_paths(value: Any, path: str) -> list[str]:
    """The paths (as `_encode` names them) of the tensors in `value`."""
    if isinstance(value, torch.Tensor):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _tensor_paths(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _tensor_paths(v, f"{path}/{i}")]
    return []


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def gather_objects(d: Dist, value: Any) -> list[Any]:
    """Every rank's `value` (anything picklable), in rank order, on every rank; [value] with one process."""
    if not d.enabled:
        return [value]
    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, value)
    return out


def broadcast_object(d: Dist, value: Any) -> Any:
    """Rank 0's `value` (anything picklable) on every rank; the other ranks' `value` is ignored and
    they wait here until rank 0 sends. With one process, `value` itself."""
    if not d.enabled:
        return value
    box = [value if d.is_main else None]
    dist.broadcast_object_list(box, src=0, device=d.device)  # nccl sends from the rank's GPU
    return box[0]
