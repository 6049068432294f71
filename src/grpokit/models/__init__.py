"""Policies, reference policies and tokenizers. transformers is imported lazily, inside the
functions of `hf.py`, so `import grpokit.models` stays cheap."""

from .device import Precision, enable_fast_matmul, model_device, place, resolve_device
from .backend import Capabilities, LeanBackend, LMHead, TransformersBackend, backend_of, has_dropout, lm_head_of, whole_groups
from .hf import (
    LoadedPolicy,
    build_policy,
    build_reward_model,
    char_tokenizer,
    char_vocabulary,
    load_policy,
    load_reward_model,
    quiet_saving,
    save_policy,
)
from .lean_llama import KVCache, LeanLlamaDecoder, lean_decoder
from .lora import (
    ADAPTER_DIR,
    apply_lora,
    base_state_dict,
    check_lora_targets,
    is_lora,
    linear_module_names,
    load_lora_weights,
    merge_lora,
    reference_model,
    require_peft,
    save_lora,
)
from .reference import make_reference, should_sync, sync_reference
from .reward_model import encode_for_reward, pad_left, reward_scores

__all__ = [
    "place",
    "Precision",
    "enable_fast_matmul",
    "model_device",
    "resolve_device",
    "KVCache",
    "LMHead",
    "Capabilities",
    "LeanBackend",
    "TransformersBackend",
    "backend_of",
    "has_dropout",
    "whole_groups",
    "LeanLlamaDecoder",
    "lean_decoder",
    "LoadedPolicy",
    "lm_head_of",
    "ADAPTER_DIR",
    "apply_lora",
    "base_state_dict",
    "char_vocabulary",
    "check_lora_targets",
    "linear_module_names",
    "load_lora_weights",
    "merge_lora",
    "require_peft",
    "save_lora",
    "is_lora",
    "reference_model",
    "build_policy",
    "build_reward_model",
    "encode_for_reward",
    "load_reward_model",
    "pad_left",
    "reward_scores",
    "char_tokenizer",
    "load_policy",
    "make_reference",
    "quiet_saving",
    "save_policy",
    "should_sync",
    "sync_reference",
]
