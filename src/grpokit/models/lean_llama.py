"""A lean forward pass for transformers' Llama: the same modules and parameters, the same math, a
fraction of the Python overhead.

On a small model transformers' own forward spends most of its time outside arithmetic: per call it
builds a 4-D mask, dispatches through output-capturing wrappers and attention registries, and its
`DynamicCache` concatenates every layer's keys and values at every decoded token. This module
calls the model's own submodules (embedding, norms, projections, rotary embedding, MLP; LoRA
layers injected by peft included) in the order transformers does, with

* one boolean mask per call, built from the attention mask;
* a preallocated KV cache (`KVCache`) written in place: O(1) work per token per layer, not O(t);
* `scaled_dot_product_attention` with grouped-query attention handled by the kernel, and an
  additive mask made once per pass;
* for GRPO's groups (`shared_prefix`), the prompt and its G completions packed into one row with a
  block mask when that is cheaper than running the prompt separately;
* with activation checkpointing on (`gradient_checkpointing_enable`), each layer checkpointed in
  every pass that records gradients: autograd keeps a layer's input and runs the layer again in
  the backward, with the same arithmetic, so the gradients are the same.

It covers `LlamaForCausalLM` configurations without dropout, logit post-processing or rope
variants other than the default; `lean_decoder` returns None for anything else, and callers use
transformers' forward. Tests check equality with transformers to float32 round-off.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


@dataclass
class KVCache:
    """Keys and values of every layer, preallocated: [layers, B, kv_heads, capacity, head_dim] each,
    filled up to `length` positions."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0
    # each layer's keys and values as views, taken once rather than at every decoded token
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.layers = list(zip(self.keys.unbind(0), self.values.unbind(0), strict=True))

    def repeat_rows(self, times: int) -> KVCache:
        """Each row repeated `times` times in place of one: [P] rows -> [P·times] (prefix sharing)."""
        keys = self.keys.repeat_interleave(times, dim=1)
        return KVCache(keys, self.values.repeat_interleave(times, dim=1), self.length)


@dataclass(frozen=True)
class LeanOutput:
    last_hidden_state: torch.Tensor  # [b, L, H]


def _supported(inner: Any) -> bool:
    config = getattr(inner, "config", None)
    if type(inner).__name__ not in ("LlamaForCausalLM", "Qwen2ForCausalLM") or config is None:
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return (
        not getattr(config, "use_sliding_window", False)  # Qwen2's sliding window: not covered
        and float(getattr(config, "attention_dropout", 0.0) or 0.0) == 0.0
        and getattr(config, "hidden_act", "silu") == "silu"
        and int(getattr(config, "pretraining_tp", 1) or 1) == 1
        and rope.get("rope_type", "default") == "default"
    )


class LeanLlamaDecoder:
    """Tokens -> last hidden states of a transformers Llama, with the model's own parameters.

    Call it like the decoder it replaces (`input_ids=`, `attention_mask=`, optional `position_ids`);
    pass `cache=` to extend a `KVCache` (decoding). Differentiable: gradients reach the model's
    parameters exactly as through transformers' forward.
    """

    def __init__(self, llama: Any) -> None:
        self.llama = llama  # LlamaModel: embed_tokens, layers, norm, rotary_emb
        config = llama.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        self.layers = [ModuleLayer(layer) for layer in llama.layers]  # read their modules at each call
        self.scaling = float(llama.layers[0].self_attn.scaling)
        self._rotary: torch.Tensor | None = None  # [positions, 2·head_dim]: cos, signed sin (`_cos_sin`)

    def _cos_sin(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own rotary embedding, computed once for a range of positions and then looked
        up (cos and signed sin side by side: one lookup a pass); `needed` bounds the positions (no
        device sync to read their maximum). [b, L] -> [b, L, head_dim] each"""
        table = self.rotary_table(needed, hidden.dtype, hidden.device)
        return table[position_ids].chunk(2, dim=-1)

    def rotary_table(self, needed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """cos and signed sin (rotate_half's sign folded in, see `_rope`) of positions 0 … ≥ needed−1,
        side by side, from the model's own rotary embedding; built once and grown by doubling.
        -> [positions, 2·head_dim]"""
        table = self._rotary
        if table is None or table.shape[0] < needed or table.device != device or table.dtype != dtype:
            with torch.inference_mode(False), torch.no_grad():  # read by passes that train, too
                return self._grow_rotary(needed, dtype, device)
        return table

    def _grow_rotary(self, needed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        old = self._rotary
        size = max(needed, 2 * (old.shape[0] if old is not None else 0), 256)
        positions = torch.arange(size, device=device)[None]  # [1, size]
        probe = torch.zeros((), dtype=torch.float32, device=device)  # rotary_emb reads dtype and device
        cos, sin = self.llama.rotary_emb(probe, positions)  # [1, size, head_dim]
        half = self.head_dim // 2
        signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=1)  # [size, head_dim]
        table = self._rotary = torch.cat([cos[0], signed], dim=1).to(dtype)  # [size, 2·head_dim]
        return table

    def weights_cast_once(self, dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
        """Within this context every plain projection multiplies by a `dtype` copy of its weight and bias,
        made at its first use and kept until the context ends (`WeightCopies`), instead of autocast
        casting them again at every pass: one cast per weight for all the micro-batches of an update, or
        all the passes of a frozen pass. The weights must not change inside (the engine opens it around
        the passes between two optimizer steps); a context already open is kept."""
        if any(layer.copies is not None for layer in self.layers):
            return contextlib.nullcontext()
        return self._layers_set("copies", WeightCopies(dtype), None)

    def joined_projections(self) -> contextlib.AbstractContextManager[None]:
        """Within this context q/k/v and gate/up are one product each (`ModuleLayer.join`): for compiled
        passes, which trace it once."""
        return self._layers_set("join", True, False)

    @contextlib.contextmanager
    def _layers_set(self, name: str, value: Any, after: Any) -> Iterator[None]:
        """Every layer's attribute `name` set to `value` while the context lasts, then to `after`."""
        for layer in self.layers:
            setattr(layer, name, value)
        try:
            yield
        finally:
            for layer in self.layers:
                setattr(layer, name, after)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are: inputs are moved here, and what is made here lives here."""
        return self.llama.embed_tokens.weight.device

    def checkpoints(self) -> bool:
        """Whether a pass checkpoints its layers: activation checkpointing is on (the decoder's flag,
        which transformers' `gradient_checkpointing_enable` sets) and the pass records gradients."""
        return bool(getattr(self.llama, "gradient_checkpointing", False)) and torch.is_grad_enabled()

    def new_cache(self, batch: int, capacity: int, like: torch.Tensor | None = None) -> KVCache:
        """An empty cache on the model's device, in the dtype the key and value projections produce:
        `like`'s (default: the embedding's), or under autocast for that device its dtype (the
        projections then return it while the weights stay wider; keys and values rounded to it are
        exactly what attention, cast by autocast, reads, at half the memory of a float32 cache)."""
        like = self.llama.embed_tokens.weight if like is None else like
        device = self.device
        dtype = like.dtype
        if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        shape = (len(self.llama.layers), batch, self.num_kv_heads, capacity, self.head_dim)
        return KVCache(
            torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> LeanOutput:
        """input_ids [b, L]; attention_mask [b, L] (1/True = a real token), or with a cache,
        key_mask [b, cache.length + L] over every position attended to; position_ids, if given, must
        be below cache.length + L (left padding only lowers them). -> hidden [b, L, H]"""
        device = self.device  # inputs may come from the host: everything runs where the weights are
        input_ids = input_ids.to(device)
        b, L = input_ids.shape
        start = cache.length if cache is not None else 0
        if key_mask is None:
            key_mask = (
                attention_mask
                if attention_mask is not None
                else torch.ones(b, start + L, dtype=torch.bool, device=device)
            )
        if position_ids is not None:
            position_ids = position_ids.to(device)
        key_mask = key_mask.to(device=device, dtype=torch.bool)
        hidden, _ = self._run(input_ids, key_mask, position_ids, cache=cache)
        if cache is not None:
            cache.length = start + L
        return LeanOutput(hidden)

    def shared_prefix(
        self,
        prefix_ids: torch.Tensor,
        prefix_mask: torch.Tensor,
        suffix_ids: torch.Tensor,
        suffix_mask: torch.Tensor,
        group_size: int,
    ) -> torch.Tensor:
        """Hidden states that score every suffix token, when each prefix is shared by `group_size`
        consecutive suffixes (GRPO's G completions of one prompt). The prefix is run once per
        group and its keys and values repeated, not recomputed G times; differentiable, and equal
        to running each full row on its own.

        prefix_ids, prefix_mask: [P, Lp] (left-padded); suffix_ids, suffix_mask: [P·G, T].
        Returns [P·G, T, H]: row r, position t is the state after prefix + suffix[r, :t], the one
        that scores suffix[r, t].
        """
        device = self.device  # inputs may come from the host: everything runs where the weights are
        prefix_ids, suffix_ids = prefix_ids.to(device), suffix_ids.to(device)
        prefix_mask = prefix_mask.to(device=device, dtype=torch.bool)
        suffix_mask = suffix_mask.to(device)
        P, Lp = prefix_ids.shape
        B, T = suffix_ids.shape
        if T > 1 and packing_pays(Lp, T, group_size):
            return self._packed_groups(prefix_ids, prefix_mask, suffix_ids, group_size)
        prefix_hidden, kv = self._run(prefix_ids, prefix_mask, None, keep_kv=True)  # [P, Lp, H]
        kv = [(k.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0)) for k, v in kv]
        key_mask = torch.cat([prefix_mask.repeat_interleave(group_size, 0), suffix_mask.bool()], dim=1)
        # key_mask: [B, Lp+T]
        last = prefix_hidden[:, -1:].repeat_interleave(group_size, 0)  # [B, 1, H] scores suffix[:, 0]
        if T == 1:
            return last
        suffix_hidden, _ = self._run(suffix_ids[:, :-1], key_mask[:, :-1], None, past=kv)  # [B, T-1, H]
        return torch.cat([last, suffix_hidden], dim=1)  # [B, T, H]

    def padding_free(
        self,
        prefix_ids: torch.Tensor,
        prefix_mask: torch.Tensor,
        suffix_ids: torch.Tensor,
        suffix_mask: torch.Tensor,
        group_size: int,
    ) -> torch.Tensor:
        """`shared_prefix` without the completions' padding: each prefix is run once per group of
        `group_size` rows, then the attended suffix tokens of all rows are packed into one sequence of
        N tokens for the embeddings, projections, MLPs and norms (no padding multiplied), and attention
        runs over each row's segment (its offsets in the pack, cu_seqlens-style) padded only to the
        longest segment, with its prefix's keys in front. Positions are those of the padded rows, so
        the states equal the padded pass's to float32 round-off; differentiable.

        prefix_ids, prefix_mask: [P, Lp] (left-padded); suffix_ids, suffix_mask: [P·G, T] (a row's
        attended tokens come first). -> [P·G, T, H]; a state after a padding token is 0.
        """
        device = self.device  # inputs may come from the host: everything runs where the weights are
        prefix_ids, suffix_ids = prefix_ids.to(device), suffix_ids.to(device)
        prefix_mask = prefix_mask.to(device=device, dtype=torch.bool)
        inputs = suffix_mask.to(device=device, dtype=torch.bool)[
            :, :-1
        ]  # [B, T-1]: the last token scores nothing
        G, Lp, (B, T) = group_size, prefix_ids.shape[1], suffix_ids.shape
        prefix_hidden, kv = self._run(prefix_ids, prefix_mask, None, keep_kv=True)  # [P, Lp, H]
        last = prefix_hidden[:, -1:].repeat_interleave(G, 0)  # [B, 1, H] scores suffix token 0
        pack = _pack_layout(inputs)
        if pack.flat.numel() == 0:  # no completion has a second token
            return torch.cat([last, last.new_zeros(B, T - 1, last.shape[-1])], dim=1)
        tokens = suffix_ids[:, :-1].reshape(-1)[pack.flat][None]  # [1, N]
        positions = (Lp + pack.flat % (T - 1))[None]  # [1, N]: the padded rows' positions
        hidden = F.embedding(tokens, self.llama.embed_tokens.weight)  # [1, N, H]
        cos, sin = self._cos_sin(hidden, positions, Lp + T)  # [1, N, d] each
        W, h, d = pack.width, self.num_heads, self.head_dim
        slots = torch.arange(W, device=device)  # [W]
        own = (slots[None, :] <= slots[:, None])[None] & (slots[None, :] < pack.lengths[:, None])[:, None, :]
        own = own | torch.eye(W, dtype=torch.bool, device=device)[None]  # [B, W, W]; padding sees itself
        sees = prefix_mask.repeat_interleave(G, 0)[:, None, :].expand(B, W, Lp)  # [B, W, Lp]
        allowed = torch.cat([sees, own], dim=2)[:, None]  # [B, 1, W, Lp+W]
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=device).masked_fill_(
            ~allowed, -torch.inf
        )
        past = [(k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)) for k, v in kv]  # [B, kv, Lp, d] each

        def segments(x: torch.Tensor) -> torch.Tensor:  # [1, heads, N, d] -> [B, heads, W, d]
            heads = x.shape[1]
            dense = x.new_zeros(B * W, heads, d).index_copy(0, pack.dest, x[0].transpose(0, 1))
            return dense.view(B, W, heads, d).transpose(1, 2)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = torch.cat([past[i][0], segments(k)], dim=2)  # [B, kv, Lp+W, d]
            values = torch.cat([past[i][1], segments(v)], dim=2)  # [B, kv, Lp+W, d]
            out = F.scaled_dot_product_attention(
                segments(q),
                keys,
                values,
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )  # [B, h, W, d]
            return out.transpose(1, 2).reshape(B * W, h, d).index_select(0, pack.dest).transpose(0, 1)[None]

        hidden = llama_layers(
            self.layers, self.shape, hidden, cos[:, None], sin[:, None], attend, self.checkpoints()
        )  # [1, N, H]
        hidden = _rms_norm(self.llama.norm.weight, self.llama.norm.variance_epsilon, hidden)
        states = hidden.new_zeros(B * (T - 1), hidden.shape[-1]).index_copy(0, pack.flat, hidden[0])
        return torch.cat([last, states.view(B, T - 1, -1)], dim=1)  # [B, T, H]

    def _packed_groups(
        self, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, suffix_ids: torch.Tensor, G: int
    ) -> torch.Tensor:
        """`shared_prefix` in one pass: row p holds prompt p followed by its G completions (each
        without its last token, which scores nothing), and a block mask lets completion g see the
        prompt and its own earlier tokens only. [P, Lp], [P·G, T] -> [P·G, T, H]"""
        P, Lp = prefix_ids.shape
        Ts = suffix_ids.shape[1] - 1  # input tokens per completion
        # (a compiled pass traces the layout into its graph: the cache is for eager passes)
        make = _group_layout.__wrapped__ if torch.compiler.is_compiling() else _group_layout
        layout = make(Lp, G, Ts, prefix_ids.device)
        ids = torch.cat([prefix_ids, suffix_ids[:, :Ts].reshape(P, G * Ts)], dim=1)  # [P, N]
        real = torch.cat([prefix_mask, prefix_mask.new_ones(P, G * Ts)], dim=1)  # [P, N]
        mask = (layout.allowed[None] & real[:, None, :]) | layout.diagonal[None]  # [P, N, N]
        positions = layout.positions[None].expand(P, -1)  # [P, N]
        hidden, _ = self._run(ids, real, positions, mask=mask[:, None])  # [P, N, H]
        return hidden[:, layout.scoring].reshape(P * G, Ts + 1, -1)  # [P, G·T, H] -> [B, T, H]

    def _run(
        self,
        input_ids: torch.Tensor,
        key_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        *,
        cache: KVCache | None = None,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        keep_kv: bool = False,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The decoder over positions start … start+L−1 of input_ids [b, L], attending to the `start`
        earlier positions held in `cache` (written in place: inference) or `past` (per-layer keys and
        values [b, kv, start, d], concatenated: differentiable). key_mask [b, start+L]; `mask`
        [b, 1, L, S] (True = may attend) replaces the causal one built from it.
        -> final-normed hidden [b, L, H], and each layer's keys and values if keep_kv."""
        start = cache.length if cache is not None else past[0][0].shape[2] if past is not None else 0
        b, L = input_ids.shape
        S = start + L
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(start, S, device=device)[None].expand(b, L)
        if mask is None and L == 1:  # one new token (decoding): it sees every earlier real key
            mask = key_mask[:, None, None, :]  # [b, 1, 1, S]
        elif mask is None:
            # [b, 1, L, S]: causal over the new positions, padding keys excluded; a query with no key
            # (a left-pad position) attends to itself so that no row becomes NaN
            keys = torch.arange(S, device=device)[None, :]  # [1, S]
            queries = torch.arange(start, S, device=device)[:, None]  # [L, 1]
            mask = (((keys <= queries)[None] & key_mask[:, None, :]) | (keys == queries)[None])[:, None]
        hidden = F.embedding(input_ids, self.llama.embed_tokens.weight)  # [b, L, H]
        # additive, made once rather than converted from booleans in every layer's attention
        mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=device).masked_fill_(~mask, -torch.inf)
        if L == 1:  # the token always sees itself (its own key is the last): no all-masked row
            mask[..., -1] = 0.0
        cos, sin = self._cos_sin(hidden, position_ids, S)  # [b, L, d] each
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if keep_kv and len(kept) == i:  # (a checkpointed layer run again in the backward: kept already)
                kept.append((k, v))
            if cache is not None:
                layer_keys, layer_values = cache.layers[i]  # [b, kv, capacity, d] each
                layer_keys.narrow(2, start, L).copy_(k)
                layer_values.narrow(2, start, L).copy_(v)
                k, v = layer_keys.narrow(2, 0, S), layer_values.narrow(2, 0, S)  # [b, kv, S, d]
            elif past is not None:
                k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)  # [b, kv, S, d]
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=self.num_kv_heads != self.num_heads
            )  # [b, h, L, d]

        checkpoint = cache is None and self.checkpoints()  # (decoding writes a cache in place: never)
        hidden = llama_layers(self.layers, self.shape, hidden, cos[:, None], sin[:, None], attend, checkpoint)
        return _rms_norm(self.llama.norm.weight, self.llama.norm.variance_epsilon, hidden), kept


def _rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic: float32 statistics, weight applied in the input dtype. In float32,
    `_RMSNorm` (a third fewer forward operations than torch's, which are not fused on CPU, and a
    hand-written backward); otherwise torch's `F.rms_norm` on a float32 copy."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _RMSNorm.apply(x, weight, eps)
        return _rms_normed(x, eps)[0] * weight
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _rms_normed(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x / sqrt(mean(x²) + eps) and that reciprocal root r, with mean(x²) taken as ‖x‖²/H (one
    reduction; equal to the mean of squares to float round-off). [..., H] -> [..., H], [..., 1]"""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [..., 1]
    r = torch.rsqrt(torch.addcmul(_constant(eps, x.device), n, n, value=1.0 / x.shape[-1]))  # [..., 1]
    return x * r, r


_CONSTANTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float32 scalar tensor, made once per device (making one per call costs as much as the
    operation it feeds)."""
    key = (value, device)
    if key not in _CONSTANTS:
        with torch.inference_mode(False):
            _CONSTANTS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return _CONSTANTS[key]


class _RMSNorm(torch.autograd.Function):
    """y = x̂·w with x̂ = x·r, r = (mean(x²) + eps)^(-1/2). Backward with g = ∂L/∂y:
    ∂L/∂w = Σ_rows g·x̂;  ∂L/∂x = r·(g·w − x̂·mean(g·w·x̂)) — eight operations, against the dozen
    or so autograd records for torch's decomposed forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        normed, r = _rms_normed(x, eps)
        ctx.save_for_backward(normed, r, weight)
        return normed * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        normed, r, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed).reshape(-1, normed.shape[-1]).sum(0)  # [H]
        if ctx.needs_input_grad[0]:
            g = grad * weight  # ∂L/∂x̂
            grad_x = r * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x, grad_w, None


def _heads(x: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """[b, L, heads·d] -> [b, heads, L, d]; one view when L = 1 (decoding)."""
    b, L, _ = x.shape
    return x.view(b, heads, 1, d) if L == 1 else x.view(b, L, heads, d).transpose(1, 2)


def _plain(module: Any) -> bool:
    """A bare `nn.Linear` that no hook watches: its arithmetic can be called without the module."""
    return type(module) is torch.nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)  # noqa: SLF001


def _linear(module: Any, x: torch.Tensor) -> torch.Tensor:
    """module(x), without the module-call overhead for a plain linear layer; LoRA layers injected
    by peft, or any other wrapper, are called as modules."""
    return F.linear(x, module.weight, module.bias) if _plain(module) else module(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, with rotate_half(x)·sin = swap_halves(x)·signed_sin and the swap
    one `roll`. [b, heads, L, d]"""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


# ----------------------------------------------------------------------------- the layers, once


class _CastOnce(torch.autograd.Function):
    """A weight's compute-dtype copy standing for the weight in a product: forward gives the copy (made
    once, outside), backward hands the gradient to the weight in the weight's dtype, as autocast's own
    cast does (`grad.to(weight.dtype)`). So the products, and the gradients the weights receive, are
    those of autocast casting the weight at each pass, bit for bit."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = weight.dtype
        return copy.view_as(copy)  # (a fresh tensor object: the graph's node is its own, not the copy's)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.to(ctx.dtype), None


class WeightCopies:
    """Compute-dtype copies of the weights a pass multiplies by, each made at its first use
    (`LeanLlamaDecoder.weights_cast_once`). A weight that records gradients gets its copy through
    `_CastOnce`, so that its gradient still reaches it."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the weight, its copy)

    def __call__(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        if weight is None or weight.dtype == self.dtype or not weight.is_floating_point():
            return weight
        made = self._made.get(id(weight))
        if made is None or made[0] is not weight:
            with torch.inference_mode(False), torch.no_grad():  # read by passes that train, too
                copy = weight.to(self.dtype)
            made = self._made[id(weight)] = (weight, copy)
        if weight.requires_grad and torch.is_grad_enabled():
            return _CastOnce.apply(weight, made[1])
        return made[1]


class ModuleLayer:
    """A transformers Llama layer seen through its modules (LoRA layers injected by peft included):
    what training, prefill and the eager decode loop multiply by. `copies`: set while the decoder's
    `weights_cast_once` is open."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.copies: WeightCopies | None = None
        # q/k/v and gate/up as one product each, from their weights joined in the pass (`joined`): set
        # only while a compiled pass traces, where the join is made once in the graph and shared by
        # the prompt's pass and the completions'; eager passes keep the separate products (joining at
        # every call costs what it saves on a CPU: benchmarks/RESULTS.md)
        self.join = False

    def _joined(self, x: torch.Tensor, modules: tuple[Any, ...]) -> tuple[torch.Tensor, ...] | None:
        """The products of x by plain linear `modules`, as one product by their weights joined (split
        back), or None when one of them is not plain (LoRA, a hook) or no join was asked."""
        if not self.join or not all(_plain(m) for m in modules):
            return None
        weight = torch.cat([m.weight for m in modules])  # [Σ out, H]
        bias = None
        if any(m.bias is not None for m in modules):  # (a missing bias joins as zeros)
            zeros = [m.weight.new_zeros(m.weight.shape[0]) for m in modules]
            bias = torch.cat(
                [m.bias if m.bias is not None else z for m, z in zip(modules, zeros, strict=True)]
            )
        return F.linear(x, weight, bias).split([m.weight.shape[0] for m in modules], dim=-1)

    def _linear(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """`_linear`, by the compute-dtype copies of a plain layer's weight and bias when they are kept."""
        copies = self.copies
        if copies is None or not _plain(module):
            return _linear(module, x)
        return F.linear(x, copies(module.weight), copies(module.bias))

    def input_norm(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.layer.input_layernorm
        return _rms_norm(norm.weight, norm.variance_epsilon, x)

    def post_norm(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.layer.post_attention_layernorm
        return _rms_norm(norm.weight, norm.variance_epsilon, x)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn = self.layer.self_attn
        joined = self._joined(x, (attn.q_proj, attn.k_proj, attn.v_proj))
        if joined is not None:
            return joined
        return self._linear(attn.q_proj, x), self._linear(attn.k_proj, x), self._linear(attn.v_proj, x)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self.layer.self_attn.o_proj, x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """LlamaMLP: down(silu(gate(x)) · up(x)) (`_supported` checks the activation)."""
        mlp = self.layer.mlp
        if mlp._forward_hooks or mlp._forward_pre_hooks:  # noqa: SLF001
            return mlp(x)
        joined = self._joined(x, (mlp.gate_proj, mlp.up_proj))
        gate, up = (
            joined if joined is not None else (self._linear(mlp.gate_proj, x), self._linear(mlp.up_proj, x))
        )
        return self._linear(mlp.down_proj, F.silu(gate) * up)


@dataclass(frozen=True)
class StackedLayer:
    """One layer's tensors for the static decode step: norms in the master dtype, matrices in the
    compute dtype, the q/k/v and gate/up projections stacked (one product each)."""

    input_weight: torch.Tensor  # [H]
    post_weight: torch.Tensor  # [H]
    eps: float
    qkv_weight: torch.Tensor  # [(h + 2·kv)·d, H]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # [H, h·d]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2·I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None
    split: tuple[int, int, int]  # h·d, kv·d, kv·d

    def input_norm(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self.input_weight, self.eps, x)

    def post_norm(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self.post_weight, self.eps, x)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _mm(x, self.qkv_weight, self.qkv_bias).split(self.split, dim=-1)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return _mm(x, self.o_weight, self.o_bias)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _mm(x, self.gate_up, self.gate_up_bias).chunk(2, dim=-1)
        return _mm(F.silu(gate) * up, self.down, self.down_bias)


def _mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x·wᵀ (+ bias) in w's dtype (what autocast does to a matrix product)."""
    return F.linear(x.to(w.dtype), w, bias)


def llama_layers(
    layers: Any,
    shape: tuple[int, int, int],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Any,
    checkpoint: bool = False,
) -> torch.Tensor:
    """The Llama decoder layers, the one forward of every pass (training, prefill, the eager and the
    static decode step): `layers` are `ModuleLayer`s or `StackedLayer`s; `attend(i, q, k, v)` writes
    layer i's keys and values where its caller keeps them and attends (with `checkpoint`, it is called
    again for each layer in the backward). `checkpoint`: activation checkpointing per layer.
    hidden [b, L, H] -> [b, L, H]"""
    h, kv, d = shape
    b, L, _ = hidden.shape

    def one(i: int, layer: Any, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = layer.qkv(layer.input_norm(hidden))  # [b, L, ·] each
        q, k, v = _heads(q, h, d), _heads(k, kv, d), _heads(v, kv, d)  # [b, heads, L, d]
        out = attend(i, _rope(q, cos, sin), _rope(k, cos, sin), v)  # [b, h, L, d]
        out = out.reshape(b, L, -1) if L == 1 else out.transpose(1, 2).reshape(b, L, -1)  # [b, L, h·d]
        hidden = hidden + layer.o(out)
        return hidden + layer.mlp(layer.post_norm(hidden))

    for i, layer in enumerate(layers):
        if checkpoint:
            # autograd keeps the layer's input only and runs the layer again in the backward (no random
            # operation in a layer: `_supported` refuses attention dropout, so no RNG state is kept)
            hidden = torch.utils.checkpoint.checkpoint(
                one, i, layer, hidden, use_reentrant=False, preserve_rng_state=False
            )
        else:
            hidden = one(i, layer, hidden)
    return hidden


@dataclass(frozen=True)
class DecodeWeights:
    """What the static decode step multiplies by: the model's own norms and embedding, and under
    mixed precision copies of its matrices in the compute dtype refreshed once per rollout (a cast at
    every token would read the float32 weights at every step)."""

    embed: torch.Tensor  # [V, H]
    layers: tuple[StackedLayer, ...]
    norm: torch.Tensor  # [H]
    eps: float
    head: torch.Tensor  # [V, H]
    head_bias: torch.Tensor | None
    rotary: torch.Tensor  # [S, 2·d] cos and signed sin per position (`LeanLlamaDecoder.rotary_table`)
    shape: tuple[int, int, int]  # heads, kv heads, head dim
    scaling: float


def _stacked(tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    return torch.cat([t for t in tensors if t is not None]).to(dtype)  # Llama: all or none have a bias


def _layer_sources(layer: Any) -> dict[str, list[Any]]:
    """Which parameters each stacked tensor holds, in order."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv_weight": [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
        "qkv_bias": [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias],
        "o_weight": [attn.o_proj.weight],
        "o_bias": [attn.o_proj.bias],
        "gate_up": [mlp.gate_proj.weight, mlp.up_proj.weight],
        "gate_up_bias": [mlp.gate_proj.bias, mlp.up_proj.bias],
        "down": [mlp.down_proj.weight],
        "down_bias": [mlp.down_proj.bias],
    }


def decode_weights(
    decoder: LeanLlamaDecoder, head: Any, compute_dtype: torch.dtype, capacity: int
) -> DecodeWeights:
    """The static step's weights from the model's parameters now (`refresh_weights` after they
    change). Ordinary tensors that do not require grad: usable in inference mode and out of it."""
    h, kv, d = decoder.shape
    with torch.inference_mode(False), torch.no_grad():
        layers = tuple(
            StackedLayer(
                input_weight=layer.input_layernorm.weight.detach(),
                post_weight=layer.post_attention_layernorm.weight.detach(),
                eps=float(layer.input_layernorm.variance_epsilon),
                split=(h * d, kv * d, kv * d),
                **{name: _stacked(parts, compute_dtype) for name, parts in _layer_sources(layer).items()},
            )
            for layer in decoder.llama.layers
        )
        embed = decoder.llama.embed_tokens.weight.detach()
        return DecodeWeights(
            embed=embed,
            layers=layers,
            norm=decoder.llama.norm.weight.detach(),
            eps=float(decoder.llama.norm.variance_epsilon),
            head=head.weight.to(compute_dtype, copy=True),
            head_bias=None if head.bias is None else head.bias.to(compute_dtype, copy=True),
            rotary=decoder.rotary_table(capacity, embed.dtype, embed.device).clone(),
            shape=decoder.shape,
            scaling=decoder.scaling,
        )


def refresh_weights(weights: DecodeWeights, decoder: LeanLlamaDecoder, head: Any) -> None:
    """Copy the model's current parameters into the stacked copies, in place (a captured graph keeps
    reading the same addresses). Norms and the embedding are the parameters themselves."""
    with torch.no_grad():
        for stacked, layer in zip(weights.layers, decoder.llama.layers, strict=True):
            for name, sources in _layer_sources(layer).items():
                target, start = getattr(stacked, name), 0
                for source in sources if target is not None else ():
                    target.narrow(0, start, source.shape[0]).copy_(source)
                    start += source.shape[0]
        weights.head.copy_(head.weight)
        if weights.head_bias is not None and head.bias is not None:
            weights.head_bias.copy_(head.bias)


def feed_static(
    w: DecodeWeights,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    key_mask: torch.Tensor,
    position: torch.Tensor,
    token: torch.Tensor,
    slot: torch.Tensor,
) -> torch.Tensor:
    """One token per row through `llama_layers` over preallocated per-layer keys and values [b, kv, S,
    d], written at `slot` (a one-element tensor: nothing changes from token to token, so a captured
    graph replays) and marked in key_mask [b, S]. -> next-token logits [b, V] float32"""
    key_mask.index_fill_(1, slot, True)
    dtype = keys[0].dtype
    mask = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)  # [b, S] additive
    mask = mask.masked_fill(~key_mask, -torch.inf)[:, None, None, :]  # [b, 1, 1, S]
    hidden = F.embedding(token, w.embed)[:, None]  # [b, 1, H] master dtype
    cos, sin = w.rotary[position].to(hidden.dtype).chunk(2, dim=-1)  # [b, d] each
    h, kv, _ = w.shape

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys[i].index_copy_(2, slot, k.to(dtype))
        values[i].index_copy_(2, slot, v.to(dtype))
        return F.scaled_dot_product_attention(
            q.to(dtype), keys[i], values[i], attn_mask=mask, scale=w.scaling, enable_gqa=kv != h
        )  # [b, h, 1, d]

    hidden = llama_layers(w.layers, w.shape, hidden, cos[:, None, None], sin[:, None, None], attend)
    return _mm(_rms_norm(w.norm, w.eps, hidden[:, 0]), w.head, w.head_bias).float()  # [b, V]


def supports_static_decode(decoder: LeanLlamaDecoder) -> bool:
    """Whether every projection is a plain linear layer (no LoRA or hooks: the static step multiplies
    by the weights directly)."""
    for layer in decoder.llama.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
        if not all(_plain(m) for m in [*modules, mlp.down_proj]):
            return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn, mlp)):  # noqa: SLF001
            return False
    return True


@dataclass(frozen=True)
class _PackLayout:
    """Where the real tokens of b padded rows of width L sit in a pack of N tokens (cu_seqlens-style)."""

    flat: torch.Tensor  # [N] long: index in the flattened [b·L] rows of each packed token, in order
    dest: torch.Tensor  # [N] long: index in the [b·W] segments (row·W + slot) of each packed token
    lengths: torch.Tensor  # [b] long: real tokens of each row (its segment's length)
    width: int  # W: the longest segment


def _pack_layout(real: torch.Tensor) -> _PackLayout:
    """The pack of the True entries of real [b, L], row after row (one host sync: N and W)."""
    b, L = real.shape
    flat = real.reshape(-1).nonzero().squeeze(1)  # [N]
    lengths = real.sum(1)  # [b]
    width = max(int(lengths.max()), 1)
    slot = real.long().cumsum(1).reshape(-1)[flat] - 1  # [N] rank of each token in its row
    return _PackLayout(flat=flat, dest=(flat // L) * width + slot, lengths=lengths, width=width)


@dataclass(frozen=True)
class _GroupLayout:
    """Where things sit in a packed row of one prompt (Lp positions) and G completions of Ts input
    tokens each: N = Lp + G·Ts positions."""

    positions: torch.Tensor  # [N] as in the unpacked rows (left padding counted, as transformers does)
    allowed: torch.Tensor  # [N, N] bool: causal within the prompt and within each completion, and
    # every completion position sees the whole prompt (the prompt's padding is masked per row)
    diagonal: torch.Tensor  # [N, N] bool: each position sees itself, so no padded row is all masked
    scoring: torch.Tensor  # [G·(Ts+1)] the state scoring each completion token: for token t of
    # completion g, the prompt's last position when t = 0, else the position of token t-1


@functools.lru_cache(maxsize=32)
def _group_layout(Lp: int, G: int, Ts: int, device: torch.device) -> _GroupLayout:
    with torch.inference_mode(False):  # kept across passes, some of which train
        N = Lp + G * Ts
        steps = torch.arange(Lp, Lp + Ts, device=device).repeat(G)  # [G·Ts]
        positions = torch.cat([torch.arange(Lp, device=device), steps])  # [N]
        # segment of each position: -1 for the prompt, g for completion g
        segment = torch.cat(
            [torch.full((Lp,), -1, device=device), torch.arange(G, device=device).repeat_interleave(Ts)]
        )  # [N]
        index = torch.arange(N, device=device)
        causal = (index[None, :] <= index[:, None]) & (segment[None, :] == segment[:, None])  # [N, N]
        sees_prompt = (segment[None, :] < 0) & (segment[:, None] >= 0)  # [N, N] completion -> prompt
        first = torch.full((G, 1), Lp - 1, device=device)  # [G, 1]
        rest = Lp + torch.arange(G, device=device)[:, None] * Ts + torch.arange(Ts, device=device)  # [G, Ts]
        scoring = torch.cat([first, rest], dim=1).reshape(-1)  # [G·(Ts+1)]
        return _GroupLayout(positions, causal | sees_prompt, index[None, :] == index[:, None], scoring)


def packing_pays(Lp: int, T: int, G: int) -> bool:
    """Whether `_packed_groups` should serve `shared_prefix`: packing costs (Lp + G·T)² attention
    scores per group instead of G·(Lp + T)², and saves a second pass over the layers; it is taken
    while the attention work at most doubles (short completions, or long shared prompts)."""
    return (Lp + G * (T - 1)) ** 2 <= 2 * G * (Lp + T) ** 2


# one decoder per model, so that its rotary table is built once, not at every forward pass
_DECODERS: weakref.WeakKeyDictionary[Any, LeanLlamaDecoder] = weakref.WeakKeyDictionary()


def lean_decoder(model: Any) -> LeanLlamaDecoder | None:
    """The lean decoder of a (possibly LoRA-wrapped) transformers Llama, or None if unsupported."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not _supported(inner):
        return None
    decoder = _DECODERS.get(inner.model)
    if decoder is None:
        decoder = _DECODERS[inner.model] = LeanLlamaDecoder(inner.model)
    return decoder
