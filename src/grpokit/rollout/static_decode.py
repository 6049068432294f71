"""The static-shape decode step: `decode.step` (feed the last token, draw the next) over buffers
allocated once, so that it compiles whole (`torch.compile(fullgraph=True)`) and, on a GPU, replays as
one CUDA graph. The loop that drives it is the one decode loop (`decode.py`); this module holds only
what is particular to static shapes.

Everything the step reads or writes lives in `DecodeState`, allocated for B rows and a fixed KV
capacity S; the step takes no Python value that changes from token to token (the token index and the
KV slot are one-element tensors it advances itself), so a captured graph replays unchanged. Rows that
finish early stop costing work by compaction: the live rows are gathered to the front and the step
then runs on a view of the first b < B rows, b from a few bucket sizes (few compiled graphs). Outputs
go to full-size buffers through each slot's original row number.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from ..models.lean_llama import DecodeWeights, decode_weights, feed_static, refresh_weights
from .processing import HEADROOM, DrawParams, Rows, Tape, draw_and_record

DECODE_LOOPS = ("eager", "static", "compiled", "cuda_graph")  # `decode_loop`, besides "auto"
SMALLEST_BUCKET = 8  # rows below which compaction stops (a step's cost no longer falls with rows)
# Compiled steps kept per decode step: one per (shape, bucket); torch's default of 8 would stop a
# fullgraph compile with an error.
RECOMPILE_LIMIT = 64
KEPT_SHAPES = 2  # training's and evaluation's; a third evicts the oldest


def resolve_decode_loop(requested: str, device: torch.device) -> str:
    """`decode_loop` for this device: auto is cuda_graph on a GPU and eager on a CPU, where the
    compiled step was measured no faster than the eager loop (benchmarks/decode_loops.py)."""
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


def buckets_of(B: int) -> list[int]:
    """The row counts a step runs at: B, then halving down to SMALLEST_BUCKET."""
    sizes = [B]
    while sizes[-1] // 2 >= SMALLEST_BUCKET and sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


@dataclass
class DecodeState:
    """Every buffer of the static step over B slots: the KV cache and what each slot feeds, the rows'
    state (`Rows`, by slot) and the tape (`Tape`, by output row). `view(b)`: the first b slots."""

    keys: list[torch.Tensor]  # per layer [B, kv, S, d], compute dtype (separate tensors: written in place)
    values: list[torch.Tensor]  # per layer [B, kv, S, d]
    key_mask: torch.Tensor  # [B, S] bool: True where a real key has been written
    position: torch.Tensor  # [B] long: rotary position of the token fed next
    token: torch.Tensor  # [B] long: the token fed next (the last one drawn)
    rows: Rows  # by slot: ids [B, S] (read by the repetition penalty), finished, row, column
    uniform: torch.Tensor  # [T, B] float32: the uniform number of each draw, by output row
    step: torch.Tensor  # [1] long: index t of the token drawn next
    slot: torch.Tensor  # [1] long: KV slot of the token fed next
    tape: Tape  # by output row

    def view(self, b: int) -> DecodeState:
        """The first b slots (views: the same memory)."""
        rows = Rows(**{f.name: getattr(self.rows, f.name)[:b] for f in fields(Rows)})
        return replace(
            self,
            keys=[k[:b] for k in self.keys],
            values=[v[:b] for v in self.values],
            key_mask=self.key_mask[:b],
            position=self.position[:b],
            token=self.token[:b],
            rows=rows,
        )

    def compact(self, b: int, bucket: int) -> None:
        """Gather the unfinished slots among the first b to the front, then pad them to `bucket` slots
        with finished ones (which draw padding and write nothing the rollout reads)."""
        order = torch.argsort(self.rows.finished[:b].to(torch.int8), stable=True)[:bucket]  # live first
        per_row = [getattr(self.rows, f.name) for f in fields(Rows)]
        for buffer in (*self.keys, *self.values, self.key_mask, self.position, self.token, *per_row):
            buffer[:bucket] = buffer[:b].index_select(0, order)


def static_step(w: DecodeWeights, p: DrawParams, s: DecodeState) -> None:
    """Feed the last token, draw the next: the whole step, in place (a captured graph's outputs would
    be overwritten at its next replay, so it returns nothing)."""
    logits = feed_static(w, s.keys, s.values, s.key_mask, s.position, s.token, s.slot)  # [b, V]
    s.rows.ids.index_copy_(1, s.slot, s.token[:, None])  # the fed token joins what the penalty reads
    u = s.uniform.index_select(0, s.step)[0].index_select(0, s.rows.row)  # [b]
    s.token.copy_(draw_and_record(logits, p, s.rows, u, s.tape))
    s.position.add_(1)
    s.step.add_(1)
    s.slot.add_(1)


@dataclass(frozen=True)
class _Shape:
    B: int
    S: int  # KV capacity
    T: int
    dtype: torch.dtype
    draw: DrawParams


def static_shape(params: Any, Lp: int, B: int, dtype: torch.dtype, draw: DrawParams) -> _Shape:
    """The buffers' shape for a rollout of B rows of prompts Lp wide. The KV capacity is fixed by
    max_prompt_length when set, else Lp rounded up to a multiple of 64 (few distinct shapes)."""
    T = params.max_completion_length
    longest = params.max_prompt_length or -(-Lp // 64) * 64
    return _Shape(B, max(longest, Lp) + T - 1, T, dtype, draw)


@dataclass
class _Buffers:
    state: DecodeState
    steps: dict[int, Any] = field(default_factory=dict)  # bucket rows -> step (compiled or graph replay)


class StaticSteps:
    """The static step for one lean model in one mode: "static" (as it is), "compiled"
    (`torch.compile(fullgraph=True)`) or "cuda_graph" (compiled, captured once per bucket, replayed).
    Weight copies, buffers, compiled steps and graphs are kept for the last KEPT_SHAPES shapes."""

    def __init__(self, backend: Any, mode: str) -> None:
        self.backend, self.mode = backend, mode
        self.weights: dict[tuple[torch.dtype, int], DecodeWeights] = {}
        self.buffers: dict[_Shape, _Buffers] = {}
        self.pool: Any = None  # the CUDA graphs' memory pool

    def prepare(self, shape: _Shape) -> tuple[DecodeWeights, _Buffers]:
        key = (shape.dtype, shape.S)
        if key not in self.weights:
            self.weights[key] = decode_weights(
                self.backend.decoder, self.backend.head, shape.dtype, shape.S + HEADROOM
            )
        weights = self.weights[key]
        refresh_weights(weights, self.backend.decoder, self.backend.head)
        if shape not in self.buffers:
            if len(self.buffers) >= KEPT_SHAPES:
                self.buffers.pop(next(iter(self.buffers)))  # the oldest
            with torch.inference_mode(False):  # ordinary tensors, usable in and out of inference mode
                self.buffers[shape] = _Buffers(_allocate(weights, shape))
        return weights, self.buffers[shape]

    def step(self, w: DecodeWeights, p: DrawParams, buffers: _Buffers, b: int) -> Any:
        """The step over the first b slots, made on first use."""
        if b in buffers.steps:
            return buffers.steps[b]
        view = buffers.state.view(b)
        if self.mode == "static":
            step = lambda: static_step(w, p, view)  # noqa: E731
        else:
            compiled = torch.compile(static_step, fullgraph=True, dynamic=False)

            def step() -> None:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # noqa: SLF001
                    compiled(w, p, view)

        if self.mode == "cuda_graph":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            step = _capture(step, buffers.state, self.pool)
        buffers.steps[b] = step
        return step


def _allocate(w: DecodeWeights, shape: _Shape) -> DecodeState:
    device, B, S, T = w.embed.device, shape.B, shape.S + HEADROOM, shape.T + HEADROOM
    _, kv, d = w.shape
    long = {"dtype": torch.long, "device": device}
    zeros = lambda: torch.zeros(B, kv, S, d, dtype=shape.dtype, device=device)  # noqa: E731
    return DecodeState(
        keys=[zeros() for _ in w.layers],
        values=[zeros() for _ in w.layers],
        key_mask=torch.zeros(B, S, dtype=torch.bool, device=device),
        position=torch.zeros(B, **long),
        token=torch.zeros(B, **long),
        rows=Rows(
            ids=torch.zeros(B, S, **long),
            finished=torch.zeros(B, dtype=torch.bool, device=device),
            row=torch.arange(B, device=device),
            column=torch.zeros(B, **long),
        ),
        uniform=torch.ones(T, B, dtype=torch.float32, device=device),
        step=torch.zeros(1, **long),
        slot=torch.zeros(1, **long),
        tape=Tape.empty(B, shape.T, shape.draw, device),
    )


def _warm_up(step: Any, state: DecodeState, stream: Any = None) -> None:
    """Run `step` twice (on `stream` if given: a CUDA graph's warm-up, which also compiles it), then
    put back every buffer but the KV cache (the KV slots it wrote are masked again and rewritten
    before they are read). The buffers have HEADROOM extra tokens and slots for a warm-up at the end."""
    kept = [state.key_mask, state.position, state.token, state.step, state.slot]
    kept += [getattr(state.rows, f.name) for f in fields(Rows)] + [
        getattr(state.tape, f.name) for f in fields(Tape)
    ]
    saved = [t.clone() for t in kept]
    for _ in range(HEADROOM):
        if stream is None:
            step()
        else:
            with torch.cuda.stream(stream):
                step()
    for tensor, value in zip(kept, saved, strict=True):
        tensor.copy_(value)


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
