"""A decode step with static shapes: the step a pure function over preallocated buffers, so that it
compiles whole (`torch.compile(fullgraph=True)`) and, on a GPU, replays as one CUDA graph.

Everything a step reads or writes lives in `DecodeState`, allocated once for B rows and a fixed KV
capacity S; the step takes no Python value that changes from token to token (the token index and the
KV slot are one-element tensors it advances itself), so a captured graph replays unchanged. Per step:

1. feed the last drawn token: embed it, write its keys and values at the current slot of every
   layer, attend over all S slots under the key mask (unwritten slots masked), LM head -> [b, V];
2. draw the next token from the processed distribution (`kv_sampler.process_logits`'s order) by
   inverse CDF with a uniform number drawn before the loop, record it and its exact log-probability;
3. mark rows that drew an end-of-sequence token finished (they draw padding from then on).

Rows that finish early stop costing work by compaction: the live rows are gathered to the front of
the buffers and the step then runs on a view of the first b < B rows (`DecodeState.compact`), b
from a few bucket sizes so that few graphs are compiled. Outputs go to full-size [B, T] buffers
through each slot's original row number.

Weights: the step multiplies by `DecodeWeights`, the model's own tensors, or under mixed precision
copies of its matrices in the compute dtype refreshed once per rollout (not cast at every token:
the cast would read the float32 weights at every step, three times the traffic of the step itself).
Norms, embeddings and the residual stream stay in the master dtype, as under autocast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..models.lean_llama import LeanLlamaDecoder, _plain
from .processing import inverse_cdf, process_logits


@dataclass(frozen=True)
class LayerWeights:
    """One Llama layer's tensors: norms in the master dtype, matrices in the compute dtype."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(h + 2·kv)·d, H] the three projections stacked: one product
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, h·d]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2·I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class DecodeWeights:
    """What the decode step multiplies by (see the module docstring)."""

    embed: torch.Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [H]
    head: torch.Tensor  # [V, H]
    head_bias: torch.Tensor | None
    rotary: torch.Tensor  # [S, 2·d] cos and signed sin per position (`LeanLlamaDecoder.rotary_table`)
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


def supports_static_decode(decoder: LeanLlamaDecoder, head_weight: Any) -> bool:
    """Whether every projection is a plain linear layer (no LoRA or hooks: the step multiplies by the
    weights directly)."""
    for layer in decoder.llama.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
        if not all(_plain(m) for m in [*modules, mlp.down_proj]):
            return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn, mlp)):  # noqa: SLF001
            return False
    return isinstance(head_weight, torch.Tensor)


def _cat(tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    return torch.cat([t for t in tensors if t is not None]).to(dtype)  # Llama: all or none have a bias


def decode_weights(
    decoder: LeanLlamaDecoder,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    compute_dtype: torch.dtype,
    capacity: int,
) -> DecodeWeights:
    """The step's weights, made from the model's parameters now (call `refresh_weights` after they
    change: stacked and cast copies do not follow the parameters)."""
    layers = []
    # ordinary tensors that do not require grad: usable in inference mode and out of it, and the
    # compiled step never traces a backward pass
    with torch.inference_mode(False), torch.no_grad():
        for layer in decoder.llama.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).to(
                        compute_dtype
                    ),
                    qkv_bias=_cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], compute_dtype),
                    o=attn.o_proj.weight.to(compute_dtype, copy=True),
                    o_bias=_cat([attn.o_proj.bias], compute_dtype),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).to(compute_dtype),
                    gate_up_bias=_cat([mlp.gate_proj.bias, mlp.up_proj.bias], compute_dtype),
                    down=mlp.down_proj.weight.to(compute_dtype, copy=True),
                    down_bias=_cat([mlp.down_proj.bias], compute_dtype),
                )
            )
        embed = decoder.llama.embed_tokens.weight.detach()
        first = decoder.llama.layers[0]
        return DecodeWeights(
            embed=embed,
            layers=tuple(layers),
            norm=decoder.llama.norm.weight.detach(),
            head=head_weight.to(compute_dtype, copy=True),
            head_bias=None if head_bias is None else head_bias.to(compute_dtype, copy=True),
            rotary=decoder.rotary_table(capacity, embed.dtype, embed.device).clone(),
            eps=float(decoder.llama.norm.variance_epsilon),
            num_heads=decoder.num_heads,
            num_kv_heads=decoder.num_kv_heads,
            head_dim=decoder.head_dim,
            scaling=float(first.self_attn.scaling),
        )


def refresh_weights(
    weights: DecodeWeights,
    decoder: LeanLlamaDecoder,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
) -> None:
    """Copy the model's current parameters into the step's stacked copies, in place (the buffers a
    captured graph reads keep their addresses). Norms and the embedding are the parameters themselves."""
    with torch.no_grad():
        for w, layer in zip(weights.layers, decoder.llama.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            _refresh(w.qkv, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            _refresh(w.qkv_bias, [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            _refresh(w.o, [attn.o_proj.weight])
            _refresh(w.o_bias, [attn.o_proj.bias])
            _refresh(w.gate_up, [mlp.gate_proj.weight, mlp.up_proj.weight])
            _refresh(w.gate_up_bias, [mlp.gate_proj.bias, mlp.up_proj.bias])
            _refresh(w.down, [mlp.down_proj.weight])
            _refresh(w.down_bias, [mlp.down_proj.bias])
        weights.head.copy_(head_weight)
        if weights.head_bias is not None and head_bias is not None:
            weights.head_bias.copy_(head_bias)


def _refresh(target: torch.Tensor | None, sources: list[torch.Tensor | None]) -> None:
    if target is None:
        return
    start = 0
    for source in sources:
        assert source is not None
        target.narrow(0, start, source.shape[0]).copy_(source)
        start += source.shape[0]


@dataclass
class DecodeState:
    """Every buffer of a decode loop over B rows, KV capacity S and T new tokens. A bucket of the first
    b rows is a view (`rows_view`), so compaction moves rows within these buffers."""

    keys: list[torch.Tensor]  # per layer [B, kv, S, d], compute dtype (separate tensors: a compiled
    # step then writes each in place; slices of one 5-D buffer were copied whole at every step)
    values: list[torch.Tensor]  # per layer [B, kv, S, d]
    key_mask: torch.Tensor  # [B, S] bool: True where a real key has been written
    ids: torch.Tensor  # [B, S] long: prompt and drawn tokens (read by the repetition penalty)
    position: torch.Tensor  # [B] long: rotary position of the token fed next
    token: torch.Tensor  # [B] long: the token fed next (the last one drawn)
    finished: torch.Tensor  # [B] bool
    row: torch.Tensor  # [B] long: the output row each slot writes to
    uniform: torch.Tensor  # [T, B] float32: the uniform number of each draw, by output row
    step: torch.Tensor  # [1] long: index t of the token drawn next
    slot: torch.Tensor  # [1] long: KV slot of the token fed next
    out_tokens: torch.Tensor  # [B, T] long, by output row
    out_logps: torch.Tensor  # [B, T] float32, by output row

    @classmethod
    def allocate(
        cls, weights: DecodeWeights, layers: int, B: int, S: int, T: int, dtype: torch.dtype
    ) -> DecodeState:
        with torch.inference_mode(False):  # ordinary tensors (see `decode_weights`)
            return cls._allocate(weights, layers, B, S, T, dtype)

    @classmethod
    def _allocate(
        cls, weights: DecodeWeights, layers: int, B: int, S: int, T: int, dtype: torch.dtype
    ) -> DecodeState:
        device = weights.embed.device
        kv_shape = (B, weights.num_kv_heads, S, weights.head_dim)
        long = {"dtype": torch.long, "device": device}
        return cls(
            keys=[torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(layers)],
            values=[torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(layers)],
            key_mask=torch.zeros(B, S, dtype=torch.bool, device=device),
            ids=torch.zeros(B, S, **long),
            position=torch.zeros(B, **long),
            token=torch.zeros(B, **long),
            finished=torch.zeros(B, dtype=torch.bool, device=device),
            row=torch.arange(B, device=device),
            uniform=torch.ones(T, B, dtype=torch.float32, device=device),
            step=torch.zeros(1, **long),
            slot=torch.zeros(1, **long),
            out_tokens=torch.zeros(B, T, **long),
            out_logps=torch.zeros(B, T, dtype=torch.float32, device=device),
        )

    def rows_view(self, b: int) -> dict[str, torch.Tensor]:
        """The step's arguments for the first b rows (views: the same memory)."""
        return {
            "keys": [k[:b] for k in self.keys],
            "values": [v[:b] for v in self.values],
            "key_mask": self.key_mask[:b],
            "ids": self.ids[:b],
            "position": self.position[:b],
            "token": self.token[:b],
            "finished": self.finished[:b],
            "row": self.row[:b],
            "uniform": self.uniform,
            "step": self.step,
            "slot": self.slot,
            "out_tokens": self.out_tokens,
            "out_logps": self.out_logps,
        }

    def compact(self, b: int, bucket: int) -> None:
        """Gather the unfinished rows among the first b to the front, then pad them to `bucket` rows
        with finished ones (which draw padding: their writes to the output repeat what is there)."""
        order = torch.argsort(self.finished[:b].to(torch.int8), stable=True)[:bucket]  # live rows first
        for buffer in (
            *self.keys,
            *self.values,
            self.key_mask,
            self.ids,
            self.position,
            self.token,
            self.finished,
            self.row,
        ):
            buffer[:bucket] = buffer[:b].index_select(0, order)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: float32 statistics, the weight applied in the input's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x·wᵀ (+ bias) in w's dtype (what autocast does to a matrix product)."""
    return F.linear(x.to(w.dtype), w, bias)


def feed(w: DecodeWeights, keys: list[torch.Tensor], values: list[torch.Tensor], key_mask: torch.Tensor,
         position: torch.Tensor, token: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Run one token per row through the decoder, writing its keys and values at `slot` (in place,
    and marking the slot in key_mask). -> next-token logits [b, V] float32"""
    b = token.shape[0]
    h, kv, d = w.num_heads, w.num_kv_heads, w.head_dim
    key_mask.index_fill_(1, slot, True)
    dtype = keys[0].dtype
    mask = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)  # [b, S] additive
    mask = mask.masked_fill(~key_mask, -torch.inf)[:, None, None, :]  # [b, 1, 1, S]
    hidden = F.embedding(token, w.embed)[:, None]  # [b, 1, H] master dtype
    cos, sin = w.rotary[position].to(hidden.dtype).chunk(2, dim=-1)  # [b, d] each
    cos, sin = cos[:, None, None], sin[:, None, None]  # [b, 1, 1, d]
    for i, layer in enumerate(w.layers):
        qkv = _mm(_rms(hidden, layer.input_norm, w.eps), layer.qkv, layer.qkv_bias)  # [b, 1, (h+2kv)·d]
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        q, k, v = q.view(b, h, 1, d), k.view(b, kv, 1, d), v.view(b, kv, 1, d)
        q = torch.addcmul(q * cos, q.roll(d // 2, dims=-1), sin)  # rotary (see `lean_llama._rope`)
        k = torch.addcmul(k * cos, k.roll(d // 2, dims=-1), sin)
        keys[i].index_copy_(2, slot, k.to(dtype))
        values[i].index_copy_(2, slot, v.to(dtype))
        out = F.scaled_dot_product_attention(
            q.to(dtype), keys[i], values[i], attn_mask=mask, scale=w.scaling, enable_gqa=kv != h
        )  # [b, h, 1, d]
        hidden = hidden + _mm(out.reshape(b, 1, h * d), layer.o, layer.o_bias)
        gate_up = _mm(_rms(hidden, layer.post_norm, w.eps), layer.gate_up, layer.gate_up_bias)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = hidden + _mm(F.silu(gate) * up, layer.down, layer.down_bias)
    return _mm(_rms(hidden[:, 0], w.norm, w.eps), w.head, w.head_bias).float()  # [b, V]


@dataclass(frozen=True)
class DrawParams:
    """The sampling distribution, fixed for a compiled step (`SamplingParams` minus what the loop
    handles outside the step). Hashable: one compiled step per distinct value."""

    temperature: float
    top_k: int | None
    top_p: float
    min_p: float | None
    repetition_penalty: float
    pad_token_id: int
    eos_token_ids: tuple[int, ...]


def draw_and_record(
    logits: torch.Tensor,
    p: DrawParams,
    ids: torch.Tensor,
    finished: torch.Tensor,
    row: torch.Tensor,
    uniform: torch.Tensor,
    step: torch.Tensor,
    out_tokens: torch.Tensor,
    out_logps: torch.Tensor,
    eos: torch.Tensor,
) -> torch.Tensor:
    """Draw token `step` of every row from `logits` [b, V], record it and its log-probability under
    the processed distribution at the row's output row, update `finished` (in place). -> tokens [b]"""
    # the full sort for top-p: no branch on the data
    logprobs = process_logits(logits, ids if p.repetition_penalty != 1.0 else None, p, top_p_candidates=None)
    if p.temperature == 0.0:
        token = logprobs.argmax(-1)  # [b]
    else:
        token = inverse_cdf(logprobs, uniform.index_select(0, step)[0].index_select(0, row))  # [b]
    token = torch.where(finished, p.pad_token_id, token)
    logp = torch.where(finished, 0.0, logprobs.gather(-1, token[:, None]).squeeze(-1))  # [b]
    at = torch.stack([row, step.expand_as(row)])  # [2, b] (output row, t)
    out_tokens.index_put_((at[0], at[1]), token)
    out_logps.index_put_((at[0], at[1]), logp)
    finished.logical_or_(torch.isin(token, eos))
    return token


def decode_step(
    w: DecodeWeights,
    p: DrawParams,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    key_mask: torch.Tensor,
    ids: torch.Tensor,
    position: torch.Tensor,
    token: torch.Tensor,
    finished: torch.Tensor,
    row: torch.Tensor,
    uniform: torch.Tensor,
    step: torch.Tensor,
    slot: torch.Tensor,
    out_tokens: torch.Tensor,
    out_logps: torch.Tensor,
    eos: torch.Tensor,
) -> None:
    """Feed the last token, draw the next: the whole step, in place on the buffers (see the module
    docstring). Returns nothing: a captured graph's outputs would be overwritten at its next replay."""
    logits = feed(w, keys, values, key_mask, position, token, slot)  # [b, V]
    ids.index_copy_(1, slot, token[:, None])  # the fed token joins the sequence the penalty reads
    drawn = draw_and_record(logits, p, ids, finished, row, uniform, step, out_tokens, out_logps, eos)
    token.copy_(drawn)
    position.add_(1)
    step.add_(1)
    slot.add_(1)


# ----------------------------------------------------------------------------- the loop

DECODE_LOOPS = ("eager", "static", "compiled", "cuda_graph")  # `decode_loop`, besides "auto"


def resolve_decode_loop(requested: str, device: torch.device) -> str:
    """`decode_loop` for this device: auto is cuda_graph on a GPU and eager on a CPU, where the
    compiled step was measured no faster than the eager loop (benchmarks/decode_loops.py: 0.98-1.2×
    the eager loop's time on the addition and V = 32k setups)."""
    if requested == "auto":
        return "cuda_graph" if device.type == "cuda" else "eager"
    if requested not in DECODE_LOOPS:
        raise ValueError(f"decode_loop must be auto or one of {', '.join(DECODE_LOOPS)}, got {requested!r}")
    if requested == "cuda_graph" and device.type != "cuda":
        raise ValueError(
            f"decode_loop=cuda_graph needs a CUDA device, and this run is on {device}; use "
            "decode_loop=compiled (the same step, compiled without graphs) or auto"
        )
    return requested


SMALLEST_BUCKET = 8  # rows below which compaction stops (a step's cost no longer falls with rows)


def buckets_of(B: int) -> list[int]:
    """The row counts a step runs at: B, then halving down to SMALLEST_BUCKET (few shapes, few
    compiled graphs)."""
    sizes = [B]
    while sizes[-1] // 2 >= SMALLEST_BUCKET and sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


@dataclass(frozen=True)
class _Shape:
    """What the buffers and compiled steps are made for."""

    B: int
    S: int  # KV capacity
    T: int
    dtype: torch.dtype
    draw: DrawParams


@dataclass
class _Buffers:
    """The buffers of one shape and the steps made over them, per bucket of rows."""

    state: DecodeState
    eos: torch.Tensor  # [E] long
    steps: dict[int, Any] = field(default_factory=dict)  # bucket rows -> step (compiled or graph replay)


# A CUDA graph is warmed up by running the step twice (`_warm_up`), which may happen at the last
# token: the buffers hold that many extra tokens and slots, never read by a rollout.
HEADROOM = 2
# Compiled steps kept per decode_step: one per (shape, bucket), e.g. 6 buckets for training and 4 for
# evaluation; torch's default of 8 would stop a fullgraph compile with an error.
RECOMPILE_LIMIT = 64
KEPT_SHAPES = 2  # training's and evaluation's; a third evicts the oldest


class StaticDecoder:
    """Runs `decode_step` over `DecodeState` for a lean Llama: prefill with the lean decoder, the
    first draw, then steps, compacting finished rows away at every `check_every` tokens. `mode`:
    "static" (the step as it is), "compiled" (`torch.compile(fullgraph=True)`), "cuda_graph" (the
    compiled step captured once per bucket and replayed; a CUDA device only). Buffers, weight copies,
    compiled steps and graphs are kept between calls for the last KEPT_SHAPES shapes."""

    def __init__(self, decoder: LeanLlamaDecoder, head: Any, mode: str) -> None:
        if mode not in ("static", "compiled", "cuda_graph"):
            raise ValueError(f"StaticDecoder mode must be static, compiled or cuda_graph, got {mode!r}")
        self.decoder, self.head, self.mode = decoder, head, mode
        self.weights: dict[tuple[torch.dtype, int], DecodeWeights] = {}  # by (dtype, capacity)
        self.buffers: dict[_Shape, _Buffers] = {}
        self.pool: Any = None  # the CUDA graphs' memory pool

    def _prepare(self, shape: _Shape) -> tuple[DecodeWeights, _Buffers]:
        key = (shape.dtype, shape.S)
        if key not in self.weights:
            self.weights[key] = decode_weights(
                self.decoder, self.head.weight, self.head.bias, shape.dtype, shape.S + HEADROOM
            )
        weights = self.weights[key]
        if shape not in self.buffers:
            if len(self.buffers) >= KEPT_SHAPES:
                self.buffers.pop(next(iter(self.buffers)))  # the oldest
            layers = len(weights.layers)
            state = DecodeState.allocate(
                weights, layers, shape.B, shape.S + HEADROOM, shape.T + HEADROOM, shape.dtype
            )
            with torch.inference_mode(False):
                eos = torch.tensor(shape.draw.eos_token_ids, device=weights.embed.device)
            self.buffers[shape] = _Buffers(state, eos)
        return weights, self.buffers[shape]

    def _step(self, w: DecodeWeights, p: DrawParams, buffers: _Buffers, b: int) -> Any:
        """The step over the first b rows, made on first use."""
        if b in buffers.steps:
            return buffers.steps[b]
        args = buffers.state.rows_view(b) | {"eos": buffers.eos}
        if self.mode == "static":
            step = lambda: decode_step(w, p, **args)  # noqa: E731
        else:
            compiled = torch.compile(decode_step, fullgraph=True, dynamic=False)

            def step() -> None:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # noqa: SLF001
                    compiled(w, p, **args)

        if self.mode == "cuda_graph":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            step = _capture(step, buffers.state, self.pool)
        buffers.steps[b] = step
        return step

    @torch.no_grad()
    def run(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        G: int,
        T: int,
        draw: DrawParams,
        generator: torch.Generator | None,
        check_every: int,
        sync_finished: Any,
        capacity: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Completions of P left-padded prompts [P, Lp], G each: tokens [B, t] and their log-probs
        [B, t] float32 (t ≤ T: the loop ends once every row has finished). `capacity` ≥ Lp + T − 1:
        the KV slots (a fixed value keeps the buffers and graphs between rollouts)."""
        P, Lp = prompt_ids.shape
        B = P * G
        device = self.decoder.device
        cache = self.decoder.new_cache(P, Lp, self.head.weight)  # the prefill's, in the compute dtype
        hidden = self.decoder(prompt_ids, key_mask=prompt_mask.bool(), position_ids=positions, cache=cache)
        w, buffers = self._prepare(_Shape(B, max(capacity, Lp + T - 1), T, cache.keys.dtype, draw))
        state = buffers.state
        refresh_weights(w, self.decoder, self.head.weight, self.head.bias)
        for i, (k, v) in enumerate(cache.layers):  # [P, kv, Lp, d] each
            state.keys[i][:, :, :Lp] = k.repeat_interleave(G, dim=0)  # [B, kv, Lp, d]
            state.values[i][:, :, :Lp] = v.repeat_interleave(G, dim=0)
        state.key_mask.zero_()
        state.key_mask[:, :Lp] = prompt_mask.bool().repeat_interleave(G, dim=0)  # [B, Lp]
        ids = prompt_ids.repeat_interleave(G, dim=0)  # [B, Lp]
        state.ids.copy_(ids[:, :1].expand_as(state.ids))  # unwritten slots repeat a token already seen
        state.ids[:, :Lp] = ids
        state.position.copy_(positions[:, -1].repeat_interleave(G) + 1)  # [B]
        state.finished.zero_()
        state.row.copy_(torch.arange(B, device=device))
        # [T, B] by output row (on a CPU the same numbers, in the same order, as the eager loop's draws)
        state.uniform[:T] = torch.rand(T, B, generator=generator, device=device)
        state.step.zero_()
        state.slot.fill_(Lp)
        state.out_tokens.fill_(draw.pad_token_id)
        state.out_logps.zero_()
        last = hidden.last_hidden_state[:, -1]  # [P, H]
        logits = F.linear(last.to(self.head.weight.dtype), self.head.weight, self.head.bias)
        logits = logits.float().repeat_interleave(G, dim=0)  # [B, V]
        view = state.rows_view(B)
        token = draw_and_record(
            logits, draw, view["ids"], view["finished"], view["row"], state.uniform, state.step,
            state.out_tokens, state.out_logps, buffers.eos,
        )  # fmt: skip
        state.token.copy_(token)
        state.step.add_(1)
        b, buckets, done = B, buckets_of(B), 1
        with torch.autocast(device.type, enabled=False):  # the step casts by itself (DecodeWeights)
            for t in range(1, T):
                if t % check_every == 0:
                    live = int((~state.finished[:b]).sum())  # (waits for the device)
                    if sync_finished(live == 0):
                        break
                    smaller = [size for size in buckets if size >= max(live, 1)][-1]
                    if smaller < b:
                        state.compact(b, smaller)
                        b = smaller
                self._step(w, draw, buffers, b)()
                done = t + 1
        return state.out_tokens[:, :done].clone(), state.out_logps[:, :done].clone()


def _warm_up(step: Any, state: DecodeState, stream: Any = None) -> None:
    """Run `step` twice (on `stream` if given: a CUDA graph's warm-up, which also compiles it), then put
    back every buffer but the KV cache: the KV slots it wrote are masked again and rewritten before they
    are read. The buffers have HEADROOM extra tokens and slots for a warm-up at the last token."""
    kept = {
        name: getattr(state, name).clone()
        for name in ("key_mask", "ids", "position", "token", "finished", "row", "step", "slot")
        + ("out_tokens", "out_logps")
    }
    for _ in range(HEADROOM):
        if stream is None:
            step()
        else:
            with torch.cuda.stream(stream):
                step()
    for name, value in kept.items():
        getattr(state, name).copy_(value)


def _capture(step: Any, state: DecodeState, pool: Any) -> Any:
    """`step` captured as a CUDA graph (in memory pool `pool`, shared by the buckets: they never run
    at once), after `_warm_up` on a side stream. Returns a function that replays the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    _warm_up(step, state, stream)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()  # recorded, not run
    return graph.replay
