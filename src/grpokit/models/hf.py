"""The one module that builds and loads models and tokenizers through transformers.

A model is named as a user's other tools name it (`ModelSource`): a local directory (read as it is,
never from the network), or a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` with an optional revision,
loaded by transformers through the Hugging Face cache (downloading into it unless HF_HUB_OFFLINE=1).
The built-in tasks build their policy from a config (`build_policy`) and their tokenizer from an
alphabet (`char_tokenizer`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .lora import ADAPTER_DIR, merge_lora, unmerged_checkpoint

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


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what a tokenizer maps (its vocabulary, each token's id, and its special tokens):
    two processes that must agree on token ids (a trainer and its rollout server) compare it."""
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(getattr(tokenizer, "all_special_tokens", []))
    return hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()[:16]


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
    """The Llama shape `build_policy` and `build_reward_model` share (untied embeddings, MHA, unless
    `extra` says otherwise: `num_key_value_heads`, `tie_word_embeddings`, any other LlamaConfig field)."""
    from transformers import LlamaConfig

    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}.")
    fields = {"num_key_value_heads": num_heads, "tie_word_embeddings": False} | extra
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        max_position_embeddings=max_seq_len,
        **fields,
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
    revision: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> LoadedPolicy:
    """A sequence-classification model with one label, and its tokenizer, from a local directory or a
    hub id (`ModelSource`). A causal LM (a policy) works too: its backbone is loaded and a new scalar
    head added."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = ModelSource.of(path, revision)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tokenizer = source.load(AutoTokenizer, trust_remote_code=trust_remote_code)
    _ensure_pad_token(tokenizer)
    model = source.load(
        AutoModelForSequenceClassification,
        trust_remote_code=trust_remote_code,
        num_labels=1,
        dtype=torch_dtype,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = model.to(device)  # outside readable(): a device out of memory is no loading failure
    return LoadedPolicy(model=model, tokenizer=tokenizer)


# owner/name as the hub spells ids (or a bare legacy name such as gpt2): what is not a directory here and
# has this shape is looked up in the Hugging Face cache and, unless offline, on the hub
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a local directory, or a hub id at a revision (None: the default branch)."""

    name: str
    directory: Path | None  # a local directory; None: a hub id
    revision: str | None = None

    @classmethod
    def of(cls, name: str | Path, revision: str | None = None) -> ModelSource:
        path = Path(name).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(
                    f"{str(name)!r} has no config.json: it is not a saved transformers model."
                )
            return cls(str(name), path, None)
        if not _HUB_ID.match(str(name)) or path.exists():
            raise FileNotFoundError(
                f"model directory {str(name)!r} does not exist; give a local model directory or a hub id "
                "(ORG/NAME, e.g. Qwen/Qwen2.5-0.5B-Instruct)."
            )
        return cls(str(name), None, revision)

    def kwargs(self) -> dict[str, Any]:
        """What `from_pretrained` takes besides the name: a directory is read locally only; a hub id
        goes through the cache (transformers and huggingface_hub honour HF_HUB_OFFLINE)."""
        return {"local_files_only": True} if self.directory is not None else {"revision": self.revision}

    @property
    def where(self) -> str | Path:
        return self.directory if self.directory is not None else self.name

    @contextlib.contextmanager
    def readable(self) -> Any:
        """A failure to load becomes one message naming the model and what to do (the cause chained)."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - safetensors, tokenizers, json and the hub raise their own
            raise self.failure(error) from error

    def load(self, auto_class: Any, *, trust_remote_code: bool, **options: Any) -> Any:
        """`auto_class.from_pretrained` (a transformers Auto class) of this model with `options`, read
        as `kwargs` says; a failure is `readable`'s one message."""
        with self.readable():
            return auto_class.from_pretrained(
                self.where, trust_remote_code=trust_remote_code, **options, **self.kwargs()
            )

    def cached(self) -> bool:
        """Whether the hub cache holds this id's config.json at its revision (a download was made)."""
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(self.name, "config.json", revision=self.revision)
        except Exception:  # noqa: BLE001 - an id the hub client refuses, an unreadable cache: not there
            return False
        return isinstance(found, str)

    def failure(self, error: Exception) -> ValueError:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        if self.directory is not None:
            return ValueError(
                f"could not load the model in {self.name!r} ({type(error).__name__}: {reason}); "
                "is it a complete save_pretrained directory (config.json, weights, tokenizer)?"
            )
        from huggingface_hub import constants

        at = f" at revision {self.revision!r}" if self.revision else ""
        download = f"hf download {self.name}" + (f" --revision {self.revision}" if self.revision else "")
        if constants.HF_HUB_OFFLINE and self.cached():  # there, but it does not load: say why
            return ValueError(
                f"could not load model {self.name!r}{at} from the Hugging Face cache "
                f"{constants.HF_HUB_CACHE} ({type(error).__name__}: {reason}); a partial download is "
                f"completed by `{download}`, and a model whose code is its own needs trust_remote_code=true."
            )
        if constants.HF_HUB_OFFLINE:
            return ValueError(
                f"model {self.name!r}{at} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and "
                f"HF_HUB_OFFLINE=1 forbids downloading it; download it ahead (`{download}`) or unset "
                "HF_HUB_OFFLINE (HF_HOME / HF_HUB_CACHE choose the cache)."
            )
        return ValueError(
            f"could not load model {self.name!r}{at} from the Hugging Face hub or the cache "
            f"{constants.HF_HUB_CACHE} ({type(error).__name__}: {reason}); check the id and the revision, "
            f"your network and HF_TOKEN for a gated model, or download it ahead (`{download}`)."
        )


def _ensure_pad_token(tokenizer: Any) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; add one before training.")
        logger.info("tokenizer has no pad token: using its eos token %r for padding", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token


def load_policy(
    path: str | Path,
    *,
    revision: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> LoadedPolicy:
    """Load a causal LM and its tokenizer from a local directory or a hub id (`ModelSource`: through
    the Hugging Face cache, at `revision`).

    A tokenizer without a pad token gets its eos token as pad (logged); prompts are left-padded.
    A LoRA checkpoint loads as the merged model at its root (one of the earlier layout, base weights
    at the root and adapters in `lora_adapter/`, comes back with its adapters merged).
    """
    from transformers import AutoModelForCausalLM

    source = ModelSource.of(path, revision)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = source.load(AutoModelForCausalLM, trust_remote_code=trust_remote_code, dtype=torch_dtype)
    model = model.to(device)  # outside readable(): a device out of memory is no loading failure
    directory = source.directory
    if directory is not None and unmerged_checkpoint(directory):
        model = merge_lora(model, directory)  # a LoRA checkpoint of the earlier layout: merged on load
    tokenizer = load_tokenizer(path, revision=revision, trust_remote_code=trust_remote_code)
    embedding = model.get_input_embeddings()
    refusal = embedding_refusal(f"model {str(path)!r}", getattr(embedding, "num_embeddings", None), tokenizer)
    if refusal is not None:
        raise ValueError(refusal)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return LoadedPolicy(model=model, tokenizer=tokenizer)


def embedding_refusal(what: str, rows: int | None, tokenizer: Any) -> str | None:
    """A model whose input embedding has fewer rows than its tokenizer has ids (`rows` < len(tokenizer):
    tokens added to the tokenizer and the model saved without resizing, or another model's tokenizer)
    would fail at the first such id with an index error inside the embedding: one line naming `what`
    (the model, or the teacher), both sizes and the fix. None when every id has its row (more rows, a
    padded embedding as Qwen's, is fine) or the size is unknown."""
    if rows is None or len(tokenizer) <= rows:
        return None
    return (
        f"{what}: its input embedding has {rows} rows but its tokenizer has {len(tokenizer)} token ids, so "
        f"ids from {rows} on cannot be embedded; resize the embeddings to the tokenizer "
        "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or use the tokenizer the "
        "model was trained with."
    )


def load_tokenizer(path: str | Path, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """A model's tokenizer alone, as `load_policy` loads it: through the cache for a hub id, its eos
    token as pad when it has no pad token (logged), left padding."""
    from transformers import AutoTokenizer

    source = ModelSource.of(path, revision)
    tokenizer = source.load(AutoTokenizer, trust_remote_code=trust_remote_code)
    _ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    return tokenizer


def load_model_config(
    path: str | Path, *, revision: str | None = None, trust_remote_code: bool = False
) -> Any:
    """A model's transformers config alone, from a directory or a hub id (through the cache, as
    `load_policy` reads it): what a forecast needs of a model it does not load (a teacher)."""
    from transformers import AutoConfig

    return ModelSource.of(path, revision).load(AutoConfig, trust_remote_code=trust_remote_code)


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


def export_model(checkpoint: str | Path, out_dir: str | Path) -> bool:
    """A checkpoint (or any directory `load_policy` reads) as a plain model directory `out_dir`: LoRA
    adapters merged into the base weights, no optimizer or training state; `eval model=` and `train
    model=` load it. Refuses an `out_dir` that is not empty. Returns whether adapters were merged."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{str(out)!r} is not empty; export into a new directory.")
    loaded = load_policy(checkpoint)
    save_policy(loaded.model, loaded.tokenizer, out)
    return (checkpoint / ADAPTER_DIR).is_dir()
