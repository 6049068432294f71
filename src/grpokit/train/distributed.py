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

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..models.device import resolve_device

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
        raise RuntimeError(f"device={device} but torch sees no CUDA GPU; use device=cpu or device=auto.")
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        if local_world_size > 1:
            raise ValueError(
                f"device={device} puts all {local_world_size} ranks of this node on one GPU, and NCCL runs "
                "one rank per GPU; use device=cuda (rank r takes cuda:r) or device=cpu."
            )
        if index >= cuda_count:
            raise RuntimeError(f"device={device} but this machine has {cuda_count} GPU(s).")
        return "nccl", torch.device("cuda", index)
    if local_world_size <= cuda_count:
        return "nccl", torch.device("cuda", local_rank)
    if device == "cuda":
        raise RuntimeError(
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


def any_rank(d: Dist, flag: bool) -> bool:
    """True if `flag` is True on any rank (every rank gets the same answer)."""
    if not d.enabled:
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


def save_sharded(d: Dist, directory: str, model: Any, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state with torch.distributed.checkpoint (each rank writes its shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory)


def load_sharded(d: Dist, directory: str, model: Any, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()
