"""A Hugging Face cache made in the test: what `hf download ORG/NAME` would leave under HF_HOME, with
tiny random models whose tokenizers are byte-level BPE trained here and whose chat templates are the
real families' shapes. Nothing is downloaded; `model=ORG/NAME` with HF_HUB_OFFLINE=1 then runs the
same code path a user's download feeds.

* `QWEN`: a Qwen2ForCausalLM (GQA, qkv bias, tied embeddings), ChatML, EOS `<|im_end|>` (generation
  config: `<|im_end|>` and `<|endoftext|>`), pad `<|endoftext|>`: pad ≠ EOS.
* `LLAMA`: a LlamaForCausalLM (GQA, untied head), Llama 3's header template with `<|begin_of_text|>`,
  EOS `<|eot_id|>` (generation config: `<|end_of_text|>` and `<|eot_id|>`), no pad token.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

QWEN = "tiny-org/qwen2-chat"
LLAMA = "tiny-org/llama-chat"
REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the hub's are

CHATML = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# what the BPE merges are learned from: arithmetic, words of the test prompts, tool calls, answers
CORPUS = [
    "What is 12 + 34? The answer is 46.",
    "Solve: 7 * 8 = 56. #### 56",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    '<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>',
    "<tool_response>7</tool_response> <answer>7</answer> <think>reason step by step</think>",
    "You are a helpful assistant. Think, then give the final answer after ####.",
    "user assistant system The quick brown fox jumps over the lazy dog 0123456789 ,.!?:;()[]{}+-*/=",
] * 20


def bpe_tokenizer(special: list[str], chat_template: str, **tokens: Any) -> Any:
    """A byte-level BPE tokenizer trained on CORPUS (every byte is in its alphabet: any text encodes),
    with `special` tokens that are never split, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    tokenizer.chat_template = chat_template
    return tokenizer


def snapshot(hf_home: Path, repo: str) -> Path:
    """`hub/models--ORG--NAME/snapshots/REV/`, with `refs/main` naming REV (huggingface_hub's layout)."""
    folder = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(REVISION)
    snapshot = folder / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def _save(model: Any, tokenizer: Any, where: Path) -> None:
    model.save_pretrained(where, safe_serialization=True)
    tokenizer.save_pretrained(where)


# Qwen2.5-0.5B-Instruct's shape (benchmarks/gsm8k_gpu.py builds it with random weights)
QWEN_05B_SHAPE = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
}  # fmt: skip
TINY_QWEN_SHAPE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 0, "max_position_embeddings": 512,
}  # fmt: skip


def build_qwen(where: Path, seed: int = 0, shape: dict[str, int] | None = None) -> None:
    """A Qwen2 chat model (ChatML, EOS <|im_end|>, pad <|endoftext|>, tied head) of `shape` (default
    TINY_QWEN_SHAPE; its vocabulary is at least the tokenizer's, as Qwen's embedding is padded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = bpe_tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        CHATML,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    ids = tokenizer.convert_tokens_to_ids
    shape = dict(TINY_QWEN_SHAPE if shape is None else shape)
    shape["vocab_size"] = max(len(tokenizer), shape["vocab_size"])
    config = Qwen2Config(
        **shape,
        tie_word_embeddings=True,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [ids("<|im_end|>"), ids("<|endoftext|>")]
    model.generation_config.pad_token_id = ids("<|endoftext|>")
    _save(model, tokenizer, where)


def build_llama(where: Path, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    special = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tokenizer = bpe_tokenizer(special, LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=ids("<|begin_of_text|>"),
        eos_token_id=[ids("<|end_of_text|>"), ids("<|eot_id|>")],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [ids("<|end_of_text|>"), ids("<|eot_id|>")]
    _save(model, tokenizer, where)


def build_hub_cache(hf_home: Path) -> None:
    """Both models under `hf_home/hub`, as a download would leave them."""
    build_qwen(snapshot(hf_home, QWEN))
    build_llama(snapshot(hf_home, LLAMA))


def dataset_snapshot(hf_home: Path, repo: str, source: Path) -> str:
    """The dataset directory `source` (hub repo layout) moved into `hf_home`'s cache under `repo`, as
    `hf download REPO --repo-type dataset` leaves it: files in blobs/ (named by their hash), the
    snapshot of a revision linking to them, refs/main naming that revision."""
    cache = hf_home / "hub" / ("datasets--" + repo.replace("/", "--"))
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = cache / "blobs" / sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = cache / "snapshots" / REVISION / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(
            Path("..", *[".."] * (len(file.relative_to(source).parts) - 1), "..", "blobs", blob.name)
        )
    (cache / "refs").mkdir(exist_ok=True)
    (cache / "refs" / "main").write_text(REVISION)
    shutil.rmtree(source)  # only the cache holds it now
    return repo


def gsm8k_like(root: Path, train: int, test: int, seed: int = 0) -> Path:
    """Word problems with GSM8K's answer form (`... #### 1,234`), as the hub repo lays them out
    (config `main`: train and test splits in parquet, named by README front matter)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)

    def row() -> dict[str, str]:
        a, b, c = rng.randint(2, 900), rng.randint(2, 900), rng.randint(2, 9)
        total = (a + b) * c
        question = f"A shop sells {a} pens on Monday and {b} on Tuesday, {c} times a week. How many pens?"
        return {"question": question, "answer": f"({a} + {b}) * {c} = {total}\n#### {total:,}"}

    (root / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([row() for _ in range(train)]), root / "main" / "train-0.parquet")
    pq.write_table(pa.Table.from_pylist([row() for _ in range(test)]), root / "main" / "test-0.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n"
    )
    return root


def build_docs_hub_cache(hf_home: Path) -> None:
    """What the docs' commands download, made here: `Qwen/Qwen2.5-0.5B-Instruct` (the tiny Qwen, its
    context 2048 so the gsm8k preset's 512 + 1024 tokens fit, as in the real model's 32768) and
    `openai/gsm8k` (64 training and 16 test problems)."""
    build_qwen(
        snapshot(hf_home, "Qwen/Qwen2.5-0.5B-Instruct"),
        shape=TINY_QWEN_SHAPE | {"max_position_embeddings": 2048},
    )
    dataset_snapshot(hf_home, "openai/gsm8k", gsm8k_like(hf_home / "gsm8k_download", train=64, test=16))


def offline_env(hf_home: Path) -> dict[str, str]:
    """The environment of a process that reads the hub only from `hf_home`'s cache."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def grpokit_offline(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    """`python3 -m grpokit ARGS` in a process that reads the hub only from `hf_home`'s cache, with no
    GPU, its output captured as text (10 minutes at most)."""
    env = {**os.environ, **offline_env(hf_home), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "grpokit", *args], capture_output=True, text=True, env=env, timeout=600
    )
