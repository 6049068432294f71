"""LoRA adapters through PEFT (the `lora` extra). With adapters, the reference policy is the same
weights with the adapters switched off: no second copy of the model in memory."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch


def require_peft(option: str = "use_peft=true") -> None:
    """One clear line, before any work, when LoRA is asked for and peft is not installed."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ValueError(f"{option} needs the peft package: pip install 'grpokit[lora]'.")


def apply_lora(
    model: Any,
    *,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> Any:
    """Wrap `model` with trainable LoRA adapters; only the adapters require gradients.
    target_modules: module names, or "all-linear" (every linear projection except the LM head)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("LoRA needs the peft package: pip install 'grpokit[lora]'.") from None
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    if not isinstance(targets, str):
        check_lora_targets(model, targets)
        check_tied_targets(model, targets)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)
    return get_peft_model(model, config)


def linear_module_names(model: Any) -> list[str]:
    """The distinct last names of the model's linear layers (what lora_target_modules may name)."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names)


def check_lora_targets(model: Any, targets: Sequence[str]) -> None:
    """Every name in `targets` must be the last name of some module of `model`; else one line listing
    the linear layers there are."""
    present = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in present)]
    if missing:
        raise ValueError(
            f"lora_target_modules {missing} match no module of the model; its linear layers are "
            f"{', '.join(linear_module_names(model))} (or leave lora_target_modules unset for all of them)."
        )


# A LoRA checkpoint: at its root the trained model with the adapters merged, a plain model that
# AutoModelForCausalLM.from_pretrained (and a hub upload) loads as it is; in lora_adapter/ PEFT's
# adapter files, and in lora_adapter/base/ the frozen base weights, which resume continues from
# exactly (merging is round-off, so the base is not recovered from the merged weights).
def check_tied_targets(model: Any, targets: Sequence[str]) -> None:
    """A model whose output layer shares its weights with the input embeddings (tied, as Qwen2.5-0.5B's)
    cannot adapt either one alone: the merged checkpoint would hold two different matrices where the
    model has one. One line naming the fix."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return
    shared = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is head or m is embeddings}
    named = sorted(shared & set(targets))
    if named:
        raise ValueError(
            f"lora_target_modules names {', '.join(named)}: in this model the output layer and the input "
            "embeddings share one weight matrix (tied), which an adapter on either would split; adapt "
            "the other linear layers (leave lora_target_modules unset for all of them)."
        )


ADAPTER_DIR = "lora_adapter"
BASE_DIR = "base"


def base_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights of a LoRA model under the plain model's own names (no adapters)."""
    weights = model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in weights.items() if "lora_" not in k}


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The weights of a LoRA model with each adapted layer's update (scale · B·A) added, under the
    plain model's names: what PEFT's merge_and_unload gives, without changing `model`. The merged
    tensors are made on the host, one layer's update on the device at a time, so that saving needs no
    second copy of the adapted weights in GPU memory; the others are the model's own tensors."""
    weights = base_state_dict(model)
    for name, module in model.get_base_model().named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a LoRA layer
            key = f"{name}.weight"
            merged = weights[key].cpu()
            for adapter in module.active_adapters:
                merged = merged + module.get_delta_weight(adapter).to(device="cpu", dtype=merged.dtype)
            weights[key] = merged
    return weights


def save_lora(model: Any, directory: Path) -> None:
    """A LoRA model as a checkpoint (layout above): the merged model at the root, PEFT's adapter files
    in `lora_adapter/`, the base weights as a plain model in `lora_adapter/base/`."""
    base = model.get_base_model()
    base.save_pretrained(directory, safe_serialization=True, state_dict=merged_state_dict(model))
    # save_embedding_layers: the adapters wrap linear layers only (the embeddings are the base's, saved
    # beside them); "auto" would look the base model up on the hub and warn when offline
    model.save_pretrained(directory / ADAPTER_DIR, safe_serialization=True, save_embedding_layers=False)
    base.save_pretrained(
        directory / ADAPTER_DIR / BASE_DIR, safe_serialization=True, state_dict=base_state_dict(model)
    )


def unmerged_checkpoint(directory: Path) -> bool:
    """A LoRA checkpoint of the earlier layout: the base weights at the root and the adapters in
    `lora_adapter/` (loading merges them; resume reads the base from the root)."""
    adapters = directory / ADAPTER_DIR
    return (adapters / "adapter_config.json").is_file() and not (adapters / BASE_DIR).is_dir()


def load_lora_weights(model: Any, directory: Path) -> None:
    """Restore a LoRA model's base weights and adapters from a `save_lora` directory (resume)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    stored = directory if unmerged_checkpoint(directory) else directory / ADAPTER_DIR / BASE_DIR
    adapters = adapter_weights(directory)  # (a refused adapter file: before anything is loaded)
    plain = load_file(stored / "model.safetensors")
    base = model.get_base_model()
    names = {k.replace(".base_layer.", "."): k for k in base.state_dict() if "lora_" not in k}
    missing = [n for n in names if n not in plain and "rotary" not in n]
    if missing or set(plain) - set(names):
        raise ValueError(
            f"checkpoint {directory} does not match the model (missing {missing}, unexpected "
            f"{sorted(set(plain) - set(names))})."
        )
    base.load_state_dict({names[k]: v for k, v in plain.items()}, strict=False)
    result = set_peft_model_state_dict(model, adapters)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(
            f"checkpoint {directory}: its adapters do not match the model ({result.unexpected_keys})."
        )


def adapter_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The adapters of the LoRA checkpoint `directory`: `lora_adapter/adapter_model.safetensors`, or in
    a checkpoint of older PEFT versions the pickled `adapter_model.bin`, read as torch.load with
    weights_only=True reads it (tensors only: a pickle that names code is refused, never run). Any
    other content is one ValueError naming the file and the fix."""
    from safetensors.torch import load_file

    adapters = directory / ADAPTER_DIR
    if (adapters / "adapter_model.safetensors").is_file():
        return load_file(adapters / "adapter_model.safetensors")
    pickled = adapters / "adapter_model.bin"
    if not pickled.is_file():
        raise ValueError(
            f"checkpoint {directory}: {ADAPTER_DIR}/ has no adapter weights (adapter_model.safetensors); "
            "copy them back from the run that wrote it, or give the merged model at its root without "
            f"{ADAPTER_DIR}/."
        )
    convert = (
        "save the adapters as adapter_model.safetensors from a trusted copy (PEFT's save_pretrained with "
        "safe_serialization=True)"
    )
    try:
        weights = torch.load(pickled, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:  # what weights_only refuses: a pickle that names code
        raise ValueError(
            f"checkpoint {directory}: {ADAPTER_DIR}/adapter_model.bin is a pickle that holds more than "
            f"tensors and is not loaded (it could run code); {convert}."
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as error:  # truncated, or not a torch file
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"checkpoint {directory}: {ADAPTER_DIR}/adapter_model.bin is unreadable ({first}); {convert}."
        ) from None
    if not (isinstance(weights, dict) and all(isinstance(v, torch.Tensor) for v in weights.values())):
        raise ValueError(
            f"checkpoint {directory}: {ADAPTER_DIR}/adapter_model.bin holds a {type(weights).__name__}, "
            "not the adapters' tensors by name; give a checkpoint whose adapters PEFT saved."
        )
    return weights


def merge_lora(model: Any, directory: Path) -> Any:
    """`model` (the base loaded from the root of an `unmerged_checkpoint`) with the adapters of
    `directory/lora_adapter` merged into its weights: a plain model of the same architecture."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ValueError(
            f"{directory} holds LoRA adapters ({ADAPTER_DIR}/); loading them needs the peft package: "
            "pip install 'grpokit[lora]'."
        ) from None
    adapter_weights(directory)  # a pickled adapter_model.bin is checked before PEFT reads it
    merged = PeftModel.from_pretrained(model, directory / ADAPTER_DIR).merge_and_unload()
    return merged.requires_grad_(True)  # PEFT froze the base for the adapters: trainable, as loaded


def is_lora(model: Any) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


@contextlib.contextmanager
def reference_model(policy: Any, reference: torch.nn.Module | None) -> Iterator[Any]:
    """The model to score reference log-probs with: the frozen copy when there is one, else the
    LoRA policy with its adapters disabled for the duration of the block."""
    if reference is not None:
        yield reference
    elif is_lora(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise ValueError("no reference policy: beta = 0 needs none, otherwise use make_reference or LoRA.")
