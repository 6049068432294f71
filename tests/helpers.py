"""Test helpers importable as `tests.helpers`."""

from __future__ import annotations

import torch


def random_batch(
    gen: torch.Generator, B: int = 6, T: int = 7, *, empty_row: bool = False
) -> dict[str, torch.Tensor]:
    """A float64 off-policy batch: lp, old (= lp + 0.3·N), ref (= lp + 0.2·N), entropies, advantages,
    and a bool mask whose rows have lengths 1..T (row 0 all-masked when `empty_row`)."""
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05  # [B, T]
    lengths = torch.randint(1, T + 1, (B,), generator=gen)  # [B]
    if empty_row:
        lengths[0] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    return {
        "lp": lp,
        "old": lp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "ref": lp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        # float32-representable: TRL takes the entropy quantile in float32 (`.float()`), exact on these
        "entropies": (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 + 0.01).float().double(),
        "adv": torch.randn(B, generator=gen, dtype=torch.float64),
        "mask": mask,
    }


def small_llama(
    shape: tuple[int, int, int, int, int, int], *, tied: bool = False, bias: bool = False, seed: int = 0
) -> torch.nn.Module:
    """A randomly initialised transformers Llama of `shape` = (V, H, layers, heads, kv heads,
    intermediate), without dropout; `bias`: q/k/v/o biases, as Qwen2 has on q/k/v."""
    from transformers import LlamaForCausalLM

    from grpokit.models.hf import llama_config

    V, H, layers, heads, kv_heads, intermediate = shape
    config = llama_config(
        H,
        layers,
        heads,
        V,
        2048,
        intermediate,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
        attention_bias=bias,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
