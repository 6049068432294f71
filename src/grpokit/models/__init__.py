"""Policies, reference policies and tokenizers. transformers is imported lazily, inside the
functions of `hf.py`, so `import grpokit.models` stays cheap."""

from ..ops.compat import default_group_size, recommended_defaults
from .hf import LoadedPolicy, build_policy, char_tokenizer, load_policy, save_policy
from .lora import apply_lora, is_lora, reference_model
from .reference import make_reference, should_sync, sync_reference

__all__ = [
    "LoadedPolicy",
    "apply_lora",
    "is_lora",
    "reference_model",
    "build_policy",
    "char_tokenizer",
    "default_group_size",
    "load_policy",
    "make_reference",
    "recommended_defaults",
    "save_policy",
    "should_sync",
    "sync_reference",
]
