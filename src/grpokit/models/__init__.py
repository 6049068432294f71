"""Policies, reference policies and tokenizers. transformers is imported lazily, inside the
functions of `hf.py`, so `import grpokit.models` stays cheap."""

from ..ops.compat import default_group_size, recommended_defaults
from .head import LMHead, last_hidden_states, lm_head_of
from .hf import (
    LoadedPolicy,
    build_policy,
    build_reward_model,
    char_tokenizer,
    load_policy,
    load_reward_model,
    save_policy,
)
from .lean_llama import KVCache, LeanLlamaDecoder, lean_decoder
from .lora import apply_lora, is_lora, reference_model
from .reference import make_reference, should_sync, sync_reference
from .reward_model import encode_for_reward, pad_left, reward_scores

__all__ = [
    "KVCache",
    "LMHead",
    "LeanLlamaDecoder",
    "lean_decoder",
    "LoadedPolicy",
    "last_hidden_states",
    "lm_head_of",
    "apply_lora",
    "is_lora",
    "reference_model",
    "build_policy",
    "build_reward_model",
    "encode_for_reward",
    "load_reward_model",
    "pad_left",
    "reward_scores",
    "char_tokenizer",
    "default_group_size",
    "load_policy",
    "make_reference",
    "recommended_defaults",
    "save_policy",
    "should_sync",
    "sync_reference",
]
