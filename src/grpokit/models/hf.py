"""The one module that builds and loads models and tokenizers through transformers.

Nothing here downloads: `load_policy` reads a local directory only (`local_files_only=True`), and
the built-in tasks build their policy from a config (`build_policy`) and their tokenizer from an
alphabet (`char_tokenizer`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .lora import ADAPTER_DIR, merge_lora

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"


@dataclass(frozen=True)
class LoadedPolicy:
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any  # a transformers tokenizer with pad and eos tokens


def char_tokenizer(alphabet: str, *, model_max_length: int = 2048) -> Any:
    """A character-level fast tokenizer: one token per character of `alphabet`, plus <pad>=0,
    <bos>=1, <eos>=2, <unk>=3. Round-trips through save_pretrained / AutoTokenizer.from_pretrained.

    No BOS is added automatically: prompts are encoded exactly as written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # unique, in order
    if not chars:
        raise ValueError("char_tokenizer needs a non-empty alphabet.")
    vocab = {token: i for i, token in enumerate([PAD, BOS, EOS, UNK, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=model_max_length,
        padding_side="left",
    )


def char_vocabulary(tokenizer: Any) -> set[str] | None:
    """The characters a character-level tokenizer knows (every ordinary token is one character, and
    anything else becomes <unk>), or None for any other kind of tokenizer."""
    if getattr(tokenizer, "unk_token", None) is None or not hasattr(tokenizer, "get_vocab"):
        return None
    special = set(getattr(tokenizer, "all_special_tokens", []))
    ordinary = [token for token in tokenizer.get_vocab() if token not in special]
    if not ordinary or any(len(token) != 1 for token in ordinary):
        return None
    return set(ordinary)


def llama_config(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    vocab_size: int,
    max_seq_len: int,
    intermediate_size: int | None,
    **extra: Any,
) -> Any:
    """The Llama shape `build_policy` and `build_reward_model` share (untied embeddings, MHA)."""
    from transformers import LlamaConfig

    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}.")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=False,
        **extra,
    )


def build_policy(
    hidden_size: int = 512,
    num_layers: int = 6,
    num_heads: int = 8,
    vocab_size: int = 32000,
    dropout: float = 0.1,
    max_seq_len: int = 2048,
    seed: int = 0,
    *,
    intermediate_size: int | None = None,
) -> Any:
    """A randomly initialised decoder-only transformer (Llama architecture), deterministic for `seed`,
    with `char_tokenizer`'s special ids (pad 0, bos 1, eos 2).

    The Edifice `GRPO.build` entry point, with its defaults (512 / 6 / 8 / 32000 / 0.1 / 2048).
    Differences from Edifice's Axon model, by design: learned token embeddings and rotary
    positions (Edifice uses a fixed iota embedding and sinusoidal positions), RMSNorm and SwiGLU:
    a standard Llama that transformers can save, load and generate with.
    """
    from transformers import LlamaForCausalLM

    shape = (hidden_size, num_layers, num_heads, vocab_size, max_seq_len, intermediate_size)
    special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    model = _seeded(LlamaForCausalLM, seed, shape, attention_dropout=dropout, **special)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    return model


def build_reward_model(
    hidden_size: int = 512,
    num_layers: int = 6,
    num_heads: int = 8,
    vocab_size: int = 32000,
    max_seq_len: int = 2048,
    seed: int = 0,
    *,
    intermediate_size: int | None = None,
) -> Any:
    """`build_policy`'s Llama with a scalar head on the last non-pad token (one label), seeded."""
    from transformers import LlamaForSequenceClassification

    shape = (hidden_size, num_layers, num_heads, vocab_size, max_seq_len, intermediate_size)
    return _seeded(LlamaForSequenceClassification, seed, shape, num_labels=1, pad_token_id=0)


def _seeded(model_class: Any, seed: int, shape: tuple, **extra: Any) -> Any:
    """`model_class` of the Llama shape (`llama_config`), its weights drawn from `seed` alone (the
    global random state is left as it was)."""
    config = llama_config(*shape, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config)


def load_reward_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> LoadedPolicy:
    """A sequence-classification model with one label, and its tokenizer, from a local directory.
    A causal-LM directory (a policy) works too: its backbone is loaded and a new scalar head added."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a saved transformers model (no config.json).")
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with _readable(directory):
        tokenizer = AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust_remote_code
        )
    _ensure_pad_token(tokenizer)
    with _readable(directory):
        model = AutoModelForSequenceClassification.from_pretrained(
            directory,
            num_labels=1,
            dtype=torch_dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            pad_token_id=tokenizer.pad_token_id,
        ).to(device)
    return LoadedPolicy(model=model, tokenizer=tokenizer)


@contextlib.contextmanager
def _readable(directory: Path) -> Any:
    """Turn a failure to read a model directory into one message naming it (the cause stays chained)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - safetensors, tokenizers and json raise their own types
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"could not load the model in {str(directory)!r} ({type(error).__name__}: {reason}); "
            "is it a complete save_pretrained directory (config.json, weights, tokenizer)?"
        ) from error


def _ensure_pad_token(tokenizer: Any) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; add one before training.")
        logger.info("tokenizer has no pad token: using its eos token %r for padding", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token


def load_policy(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> LoadedPolicy:
    """Load a causal LM and its tokenizer from a local directory (never from a hub).

    A tokenizer without a pad token gets its eos token as pad (logged); prompts are left-padded.
    A LoRA checkpoint (adapters in `lora_adapter/`) comes back with its adapters merged.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist; give a local directory.")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: it is not a saved transformers model.")
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with _readable(directory):
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch_dtype, local_files_only=True, trust_remote_code=trust_remote_code
        ).to(device)
    if (directory / ADAPTER_DIR / "adapter_config.json").is_file():  # a LoRA checkpoint: merged on load
        model = merge_lora(model, directory)
    with _readable(directory):
        tokenizer = AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust_remote_code
        )
    _ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return LoadedPolicy(model=model, tokenizer=tokenizer)


@contextmanager
def quiet_saving() -> Iterator[None]:
    """transformers' own progress bar for writing weight shards off (a run's log shows grpokit's
    progress, not one bar per checkpoint); its previous setting is restored afterwards."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def save_policy(model: Any, tokenizer: Any, path: str | Path) -> None:
    """Save weights (safetensors) and tokenizer so that `load_policy(path)` restores both."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    with quiet_saving():
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
