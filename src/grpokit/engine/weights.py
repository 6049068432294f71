"""Loading a published weights file into a policy, written once: what a rollout worker and a rollout
server (`PolicyEngine.update_weights`) do with each version the trainer writes
(train/async_rollout.py `publish_weights`). The whole file is checked before any weight changes."""

from __future__ import annotations

import torch
from safetensors import safe_open


class WeightsFileError(ValueError):
    """A weights file that cannot replace the policy's weights (the fault, in words): nothing changed."""


def load_weights_file(module: torch.nn.Module, path: str, device: torch.device) -> None:
    """`module`'s weights replaced by the safetensors file at `path`, once the whole file is checked
    (`checked_weights`); a refused file raises WeightsFileError and changes nothing."""
    state = module.state_dict()
    tensors = checked_weights(path, state, device)
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)  # (the state's tensors are the module's: copied in place)


def checked_weights(
    path: str, state: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path` that replace `state`'s (a model's state_dict), after
    checking the whole file: the state's names (tied weights: any one of their names) and no other,
    each shape equal, a floating dtype where the state's is floating (cast when copied; an integer file
    is refused) and the state's own dtype elsewhere, every value finite. WeightsFileError on the first
    fault; `state` is not touched."""
    with safe_open(path, framework="pt", device=str(device)) as file:
        names = set(file.keys())
        _check_names(names, state)
        for name in sorted(names):
            header, held = file.get_slice(name), state[name]
            shape, dtype = tuple(header.get_shape()), header.get_dtype()  # (dtype: F32, BF16, I8, ...)
            if shape != tuple(held.shape):
                raise WeightsFileError(
                    f"{name!r} has shape {list(shape)}, not the model's {list(held.shape)}"
                )
            if held.is_floating_point() and not dtype.startswith(("F", "BF")):
                raise WeightsFileError(
                    f"{name!r} is {dtype}, not a floating type the model's {held.dtype} can take"
                )
        tensors = {name: file.get_tensor(name) for name in sorted(names)}
    for name, tensor in tensors.items():
        if not state[name].is_floating_point() and tensor.dtype != state[name].dtype:
            raise WeightsFileError(f"{name!r} is {tensor.dtype}, not the model's {state[name].dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightsFileError(f"{name!r} holds values that are not finite (NaN or inf)")
    return tensors


def _check_names(names: set[str], state: dict[str, torch.Tensor]) -> None:
    """WeightsFileError unless `names` are `state`'s, each tensor by one of its names at least (tied
    weights share a tensor: safetensors writes one of their names)."""
    extra = sorted(names - set(state))
    if extra:
        raise WeightsFileError(
            f"it holds {len(extra)} tensor(s) the model does not have, such as {extra[0]!r}"
        )
    groups: dict[object, list[str]] = {}  # the state's names by the tensor they name
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape)) if tensor.numel() else name  # (empty: its own)
        groups.setdefault(key, []).append(name)
    missing = [group[0] for group in groups.values() if not names.intersection(group)]
    if missing:
        raise WeightsFileError(f"it lacks {len(missing)} of the model's tensors, such as {missing[0]!r}")
