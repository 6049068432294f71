"""How a model computes: one backend per model, chosen once (`backend_of`).

A backend answers what the engine and the decode loop ask of a causal LM, and nothing else:

* `hidden(prompt_ids, prompt_mask, targets, attended, G)`: the final hidden states that score each
  completion token, for the fused log-prob head (`ops.linear_logps`, no [B, T, V] logits); `head` is
  that linear head, None where the model's logits are not exactly `hidden · weightᵀ + bias`;
* `prefill(ids, key_mask, positions, G)`: each prompt once into a KV cache, repeated for its G rows,
  and the next-token logits of every row; `append(cache, ids, key_mask, positions, at)`: more tokens
  into the cache, and the logits after each row's token `at`;
* what it supports (`Capabilities`): the static-shape decode step (and so compile and CUDA graphs),
  and sampling log-probs equal to the training forward's.

Two implementations: `LeanBackend`, the Llama family (Qwen2's qkv bias included) through
`lean_llama` (one forward shared by training and decoding, a preallocated cache written in place),
and `TransformersBackend`, any causal LM through its own forward and cache. Capability checks live
here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .lean_llama import KVCache, LeanLlamaDecoder, lean_decoder, supports_static_decode

# config attributes that change logits after the head, with the value that means "no change"
_LOGIT_POSTPROCESSING = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
GROW = 64  # cache slots added at least when the lean cache is full


@dataclass(frozen=True)
class LMHead:
    """A causal LM's plain linear head: logits = hidden · weightᵀ + bias."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V] or None


@dataclass(frozen=True)
class Capabilities:
    static_shapes: bool  # the static-shape decode step over preallocated buffers (compile, CUDA graphs)
    exact_sampler_logps: bool  # the decode loop's log-probs equal the training forward's (float32 round-off)


def _inner(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the LM inside


def _has_hooks(module: Any) -> bool:
    return isinstance(module, torch.nn.Module) and bool(
        module._forward_hooks or module._forward_pre_hooks  # noqa: SLF001 - torch keeps them private
    )


def has_dropout(model: Any) -> bool:
    """Whether the model holds an active dropout module (peft's LoRA dropout, say)."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())  # noqa: SLF001


def lm_head_of(model: Any) -> LMHead | None:
    """The linear head of a transformers causal LM (LoRA-wrapped too), or None when the model's logits
    are not exactly `hidden · weightᵀ + bias`: a head that is not a plain `nn.Linear`, a forward hook
    on the model or its head (it would be bypassed), or logits post-processed after the head (Gemma's
    soft-capping, Cohere's `logit_scale`, Granite's `logits_scaling`)."""
    inner = _inner(model)
    if any(_has_hooks(m) for m in (model, inner, getattr(inner, "lm_head", None))):
        return None
    config = getattr(inner, "config", None)
    if config is None or not hasattr(inner, "get_output_embeddings"):
        return None
    for name, neutral in _LOGIT_POSTPROCESSING.items():
        if getattr(config, name, neutral) not in (neutral, None):
            return None
    head = inner.get_output_embeddings()
    decoder = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    if type(head) is not torch.nn.Linear or decoder is None or decoder is inner:
        return None
    return LMHead(weight=head.weight, bias=head.bias)


class TransformersBackend:
    """Any causal LM, through its own forward and cache."""

    def __init__(self, model: Any, head: LMHead | None) -> None:
        self.model, self.head = model, head
        # the lean decoder's padding-free pass: "auto" (where it pays), "always" or "never"
        self.packing = "auto"
        inner = _inner(model)
        self.decoder: Any = getattr(inner, getattr(inner, "base_model_prefix", ""), None)  # hidden states

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(static_shapes=False, exact_sampler_logps=False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def hidden(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        targets: torch.Tensor,
        attended: torch.Tensor,
        G: int,
        *,
        groups: bool | None = None,
        packing: str | None = None,
    ) -> torch.Tensor:
        """The final hidden states that score each target token, through the model's decoder; the lean
        decoder shares each prompt's keys and values across its G rows when they come in whole groups
        (checked, not assumed). [b, Lp], [b, T] -> [b, T, H]. `groups` (whether they do) and `packing`
        (the padding-free pass's choice, default `self.packing`), given, are not read from the data:
        a compiled pass decides them outside its graph (engine/compiled.py)."""
        if isinstance(self.decoder, LeanLlamaDecoder):
            groups = whole_groups(prompt_ids, prompt_mask, G) if groups is None else groups
            packing = self.packing if packing is None else packing
            wanted = packing == "always" or (packing == "auto" and padding_free_pays(attended))
            if wanted and targets.shape[1] > 1 and _leading(attended):
                g = G if groups else 1  # each prompt once per group, or once per row
                return self.decoder.padding_free(prompt_ids[::g], prompt_mask[::g], targets, attended, g)
            if groups:
                return self.decoder.shared_prefix(prompt_ids[::G], prompt_mask[::G], targets, attended, G)
        ids = torch.cat([prompt_ids, targets], dim=1).to(self.device)  # [b, Lp+T]
        attention = torch.cat([prompt_mask, attended], dim=1).long().to(self.device)  # [b, Lp+T]
        out = self.decoder(input_ids=ids, attention_mask=attention, use_cache=False)
        return out.last_hidden_state[:, -targets.shape[1] - 1 : -1]  # [b, T, H]: position t scores target t

    def _empty(self, batch: int, capacity: int) -> Any:
        return None  # transformers makes its cache at the first pass

    def _repeat(self, cache: Any, G: int) -> Any:
        cache.batch_repeat_interleave(G)  # in place
        return cache

    def _run(self, cache: Any, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor) -> Any:
        """ids [b, L] after what `cache` holds -> (cache, logits [b, L, V], only the last position's
        for a prompt or a single token)."""
        keep = 1 if cache is None or ids.shape[1] == 1 else 0  # 0: every position's
        out = self.model(
            input_ids=ids,
            attention_mask=key_mask.long(),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.past_key_values, out.logits

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return out  # already logits

    def prefill(
        self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor, G: int, room: int
    ) -> tuple[Any, torch.Tensor]:
        """Each prompt [P, Lp] once; the cache repeated for G rows, with `room` more tokens where it is
        preallocated -> (cache, logits [P·G, V] float32 or the compute dtype)."""
        cache, out = self._run(self._empty(ids.shape[0], ids.shape[1] + room), ids, key_mask, positions)
        # the one place prompts are repeated: [P] -> [B = P·G]
        return self._repeat(cache, G), self._logits(out[:, -1].repeat_interleave(G, dim=0))

    def append(
        self,
        cache: Any,
        ids: torch.Tensor,
        key_mask: torch.Tensor,
        positions: torch.Tensor,
        at: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor]:
        """ids [B, L] after what the cache holds, key_mask [B, S + L], positions [B, L] -> (cache, the
        logits after each row's token `at` [B] (None when L = 1), [B, V])."""
        cache, out = self._run(cache, ids, key_mask, positions)  # [B, L or 1, ·]
        last = out[:, -1] if out.shape[1] == 1 else out[torch.arange(ids.shape[0], device=ids.device), at]
        return cache, self._logits(last)


class LeanBackend(TransformersBackend):
    """A transformers Llama (or Qwen2) through `lean_llama`: the same modules and parameters, one
    forward for training and decoding, a preallocated KV cache, prompts shared by their G rows."""

    def __init__(self, model: Any, head: LMHead | None, decoder: LeanLlamaDecoder) -> None:
        super().__init__(model, head)
        self.decoder: LeanLlamaDecoder = decoder
        self.static_shapes = supports_static_decode(decoder) and head is not None
        self._dropout: bool | None = None

    @property
    def capabilities(self) -> Capabilities:
        if self._dropout is None:  # checked once: the modules are fixed once training starts
            self._dropout = has_dropout(self.model)
        exact = not self._dropout  # sampling runs in eval mode, training in train mode
        return Capabilities(static_shapes=self.static_shapes and exact, exact_sampler_logps=exact)

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return F.linear(hidden, self.head.weight, self.head.bias)  # [B, V]

    def _empty(self, batch: int, capacity: int) -> KVCache:
        return self.decoder.new_cache(batch, capacity, self.head.weight if self.head is not None else None)

    def _repeat(self, cache: KVCache, G: int) -> KVCache:
        return cache.repeat_rows(G)

    def _run(self, cache: KVCache, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor) -> Any:
        """As the base class, through the lean decoder: (cache, hidden [b, L, H]); a full cache grows."""
        needed, capacity = cache.length + ids.shape[1], cache.keys.shape[3]
        if needed > capacity:  # grow: a new cache holding what there is
            grown = self._empty(ids.shape[0], max(needed, capacity + GROW, 2 * capacity))
            grown.keys[:, :, :, : cache.length].copy_(cache.keys[:, :, :, : cache.length])
            grown.values[:, :, :, : cache.length].copy_(cache.values[:, :, :, : cache.length])
            grown.length, cache = cache.length, grown
        out = self.decoder(ids, key_mask=key_mask, position_ids=positions, cache=cache)
        return cache, out.last_hidden_state


def backend_of(model: Any) -> TransformersBackend:
    """The backend of a (possibly LoRA-wrapped) causal LM: lean where it covers the model and the head
    is plain, else transformers'."""
    head = lm_head_of(model)
    decoder = lean_decoder(_inner(model)) if head is not None else None
    return LeanBackend(model, head, decoder) if decoder is not None else TransformersBackend(model, head)


def whole_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, G: int) -> bool:
    """Whether rows come in whole groups of G that share one prompt (checked, not assumed)."""
    b = prompt_ids.shape[0]
    if G < 2 or b % G:
        return False
    first_ids = prompt_ids[::G].repeat_interleave(G, 0)  # [b, Lp]
    first_mask = prompt_mask[::G].repeat_interleave(G, 0)  # [b, Lp]
    return bool(torch.equal(first_ids, prompt_ids) and torch.equal(first_mask, prompt_mask))


# The padding-free pass is taken when at most this share of the completion slots hold attended
# tokens and the completions are at least PADDING_FREE_MIN_WIDTH wide. Measured on a 2-core CPU
# (benchmarks/packed_pass.py; RESULTS.md, "The padding-free packed pass"): with no padding it costs
# 5% more than the padded routes; with padding it is faster from T = 32 on (1.08-1.53x), with
# break-even at T = 16 and 0.7x at T = 8, where its fixed costs (the pack's layout, a scatter
# into segments and back in every layer) outweigh the padding saved.
PADDING_FREE_SHARE = 0.9
PADDING_FREE_MIN_WIDTH = 32


def padding_free_pays(attended: torch.Tensor) -> bool:
    """Whether enough of the completions' [b, T] slots are padding, in wide enough completions, for
    the padding-free pass to pay (its prompts' pass is the padded route's: only completions differ)."""
    if attended.shape[1] < PADDING_FREE_MIN_WIDTH:
        return False
    return int(attended.sum()) <= PADDING_FREE_SHARE * attended.numel()


def _leading(attended: torch.Tensor) -> bool:
    """Whether each row's attended tokens come first (no attended token after a padding one). [b, T]"""
    return bool((attended[:, 1:] <= attended[:, :-1]).all())
