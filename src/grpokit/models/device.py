"""Where a model runs and in what precision: the one place `device` and `dtype` of a config become
torch objects.

* `resolve_device("auto" | "cpu" | "cuda" | "cuda:N", local_rank)`: auto is CUDA when available; under
  torchrun each rank takes cuda:LOCAL_RANK.
* `Precision`: mixed precision done one way everywhere. The trainable weights and AdamW state stay
  float32 (the master copy) and the forward passes run under autocast in the compute dtype; frozen
  models (the reference, reward models) may be stored in the compute dtype directly, since nothing
  updates them. Log-softmax, log-probs and the loss are float32 whatever the compute dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(ValueError, RuntimeError):
    """The configured `device` does not exist on this machine (cuda without a GPU, cuda:N past the
    last GPU): a setting the user fixes, so the command line prints its one line, not a traceback
    (it catches ValueError). Also a RuntimeError, the type these errors had before, so that code
    catching that keeps working."""


def resolve_device(name: str = "auto", local_rank: int | None = None) -> torch.device:
    """The torch device a config's `device` names. `local_rank` (torchrun's LOCAL_RANK) picks the GPU of
    this process for "auto" and "cuda"; an explicit "cuda:N" is taken as written."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if name not in ("auto", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}.")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device={name} but torch sees no CUDA GPU (torch {torch.__version__}, built for "
            f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU only'}); use device=cpu or "
            "device=auto, or install a CUDA build of torch on a machine with a GPU."
        )
    index = int(name.split(":", 1)[1]) if ":" in name else (local_rank or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device=cuda:{index} but this machine has {count} GPU(s) (cuda:0..cuda:{count - 1})."
        )
    return torch.device("cuda", index)


def enable_fast_matmul(device: torch.device) -> None:
    """TF32 for float32 matmuls and convolutions on a GPU (Ampere and later): float32 master weights
    then cost little more than bf16 where autocast does not reach. No effect on a CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@dataclass(frozen=True)
class Precision:
    """compute: the dtype of matmuls; master: the dtype of trainable weights and optimizer state."""

    compute: torch.dtype = torch.float32
    master: torch.dtype = torch.float32

    @classmethod
    def of(cls, dtype: str = "float32", master_weights: str = "float32") -> Precision:
        """From a config's `dtype` and `master_weights` ("float32" or "dtype")."""
        compute = _DTYPES[dtype]
        return cls(compute=compute, master=torch.float32 if master_weights == "float32" else compute)

    @property
    def mixed(self) -> bool:
        """Whether forward passes need autocast (weights kept wider than the compute dtype)."""
        return self.compute != self.master

    def autocast(self, device: torch.device) -> Any:
        """The context the forward passes of a model stored in `master` run in."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute)


def model_device(model: Any) -> torch.device:
    """The device of a model's first parameter (CPU for a model without parameters)."""
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def place(model: torch.nn.Module, device: torch.device, precision: Precision) -> torch.nn.Module:
    """`model` on `device` with its floating-point weights in `precision.master` (in place, returned)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {precision.master}:
        model.to(dtype=precision.master)
    return model.to(device)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The GPU's peak allocated memory so far, in GiB, as a metric (`memory/max_allocated_gib`): what
    a run needs of the card; {} on a CPU, whose memory the metric would not describe."""
    if device.type != "cuda":
        return {}
    return {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def release_cached_memory(device: torch.device) -> None:
    """Give a GPU's cached free blocks back (after running out of memory: a smaller retry then starts
    from unfragmented memory); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
