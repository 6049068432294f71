"""An asynchronous run's batches in flight as tensors and plain values, and the schema they are read
back through.

A rollout worker hands each finished batch to the trainer, and a checkpoint holds the batches sampled
for the steps after it (async_rollout.py). Both carry them in one form: a dict of tensors, strings
and numbers (`to_plain`), serialised with torch.save and read back with `torch.load(weights_only=True)`,
so that neither a pipe nor a file can make the reader run code. `from_plain` builds the batch again,
and refuses a value that no grpokit run writes: `in_flight_problem` checks a checkpoint's batches
against the run resuming it (their steps and weight versions, row count, shapes, dtypes and
vocabulary bounds) and says the first problem in one phrase, which the caller raises as a
CheckpointError.
"""

from __future__ import annotations

import io
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

import torch

from .batch import Batch
from .checkpoint_state import PromptsState, shown

# the kind of each of Batch's tensors: "ids" int64, "mask" bool, "float" a floating dtype
TENSOR_KINDS = {
    "prompt_ids": "ids",
    "prompt_mask": "mask",
    "completion_ids": "ids",
    "completion_mask": "mask",
    "advantages": "float",
    "sampling_logps": "float",
    "rewards": "float",
    "completion_attention": "mask",  # (None for a single turn)
}
TEXTS = ("prompts", "completions")  # [B] each: a prompt is a text or a conversation (messages)
TIMES = ("worker_wait_s", "weight_load_s")


def sampling_version(step: int, max_staleness: int, every: int = 1) -> int:
    """The weight version step `step`'s batch is sampled with: max(0, step − 1 − k), rounded down to
    a version the trainer publishes (0 and every `every`-th)."""
    newest = max(0, step - 1 - max_staleness)
    return newest - newest % every


@dataclass(frozen=True)
class Sampled:
    """One step's batch from a rollout worker."""

    step: int
    version: int  # the weights it was sampled with
    batch: Batch  # on the host
    metrics: dict[str, Any]  # numbers and 0-d tensors (TRL's names)
    prompts_state: dict[str, Any]  # the prompt sampler's state after drawing it
    worker_wait_s: float  # the worker waiting for this version's weights
    weight_load_s: float  # the worker loading them
    worker: int = 0  # which worker sampled it (rollout_workers)


@dataclass(frozen=True)
class InFlightBounds:
    """What a resuming run expects of the batches its checkpoint holds."""

    step: int  # the checkpoint's step: the batches are those of steps step+1 … step+n
    max_staleness: int  # k: n = min(k, last_step − step)
    every: int  # weight_sync_steps
    rows: int  # B on this rank: prompts_per_rank × G
    vocab: int  # ids are in [0, vocab)
    prompts: int  # the number of training prompts (a sampler position is below it)


def to_plain(item: Sampled) -> dict[str, Any]:
    """`item` as tensors, strings and numbers (what torch.load(weights_only=True) reads back)."""
    batch = {f.name: getattr(item.batch, f.name) for f in fields(Batch)}
    return {
        "step": item.step,
        "version": item.version,
        "batch": {k: (list(v) if k in TEXTS else v) for k, v in batch.items()},
        "metrics": {name: _number(value) for name, value in item.metrics.items()},
        "prompts_state": item.prompts_state,
        "worker_wait_s": float(item.worker_wait_s),
        "weight_load_s": float(item.weight_load_s),
        "worker": item.worker,
    }


def _number(value: Any) -> Any:
    """A metric as weights_only reads it back: a tensor as it is, any other number (a numpy scalar from
    a user's environment, a flag) as a Python int or float of the same value."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if isinstance(value, numbers.Real) else value


def from_plain(state: Any) -> Sampled:
    """The Sampled `to_plain` made; ValueError (one phrase) for anything a run does not write."""
    problem = plain_problem(state)
    if problem is not None:
        raise ValueError(problem)
    batch = Batch(**{f.name: state["batch"].get(f.name) for f in fields(Batch)})
    return Sampled(
        state["step"],
        state["version"],
        batch,
        state["metrics"],
        state["prompts_state"],
        state["worker_wait_s"],
        state["weight_load_s"],
        state["worker"],
    )


def dumps(value: Any) -> bytes:
    """Plain values as bytes (torch.save: tensors by value, never shared memory, so a batch outlives
    the process that made it)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """What `dumps` wrote; tensors and plain values only (a payload that names code is refused with
    pickle.UnpicklingError, never run)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def plain_problem(state: Any) -> str | None:
    """Whether `state` has the form `to_plain` gives (None), else the first problem in one phrase:
    types, the batch's tensor kinds and shapes (B rows, the prompt width Lp and completion width T
    shared), B texts of each kind."""
    if not isinstance(state, dict):
        return f"is {shown(state)}, not a batch"
    for key in ("step", "version", "worker"):
        value = state.get(key)
        if type(value) is not int or value < 0:
            return f"{key} is {shown(value)}, not a count"
    for key in TIMES:
        value = state.get(key)
        if type(value) is not float or not math.isfinite(value):
            return f"{key} is {shown(value)}, not a finite number"
    problem = _metrics_problem(state.get("metrics"))
    if problem is not None:
        return problem
    if not isinstance(state.get("prompts_state"), dict):
        return f"prompts_state is {shown(state.get('prompts_state'))}, not a mapping"
    try:
        PromptsState.model_validate(state["prompts_state"])
    except ValueError as error:
        return f"prompts_state is not a sampler's state ({str(error).splitlines()[0]})"
    return _batch_problem(state.get("batch"))


def _metrics_problem(metrics: Any) -> str | None:
    if not isinstance(metrics, dict):
        return f"metrics is {shown(metrics)}, not a mapping"
    for name, value in metrics.items():
        number = type(value) in (int, float) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        if not isinstance(name, str) or not number:
            return f"metrics.{name} is {shown(value)}, not a number"
    return None


def _batch_problem(batch: Any) -> str | None:
    if not isinstance(batch, dict):
        return f"batch is {shown(batch)}, not a mapping"
    for name, kind in TENSOR_KINDS.items():
        value = batch.get(name)
        if value is None and name == "completion_attention":
            continue
        if not isinstance(value, torch.Tensor) or not _of_kind(value, kind):
            wanted = {"ids": "an int64", "mask": "a bool", "float": "a floating-point"}[kind]
            return f"batch.{name} is {shown(value)}, not {wanted} tensor"
    B, Lp = batch["prompt_ids"].shape if batch["prompt_ids"].dim() == 2 else (-1, -1)
    T = batch["completion_ids"].shape[1] if batch["completion_ids"].dim() == 2 else -1
    shapes = {
        "prompt_ids": [(B, Lp)],
        "prompt_mask": [(B, Lp)],
        "completion_ids": [(B, T)],
        "completion_mask": [(B, T)],
        "completion_attention": [(B, T)],
        "sampling_logps": [(B, T)],
        "advantages": [(B,), (B, T)],  # per sequence, or per token
        "rewards": [(B,)],
    }
    for name, allowed in shapes.items():
        value = batch.get(name)
        if value is not None and (B < 0 or T < 0 or tuple(value.shape) not in allowed):
            return f"batch.{name} is {shown(value)}, not [B, ...] as batch.prompt_ids and completion_ids"
    for name, fits in (("prompts", _is_prompt), ("completions", _is_text)):
        texts = batch.get(name)
        if not isinstance(texts, list) or len(texts) != B or not all(map(fits, texts)):
            return f"batch.{name} is {shown(texts)}, not {B} {name}"
    return "batch.sampling_logps holds NaN" if bool(batch["sampling_logps"].isnan().any()) else None


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_prompt(value: Any) -> bool:
    """A prompt as a batch holds it: a text, or a conversation (messages: mappings of names to plain
    values, such as {"role": "user", "content": "..."})."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(m, dict) and all(isinstance(k, str) and _is_plain(v) for k, v in m.items()) for m in value
    )


def _is_plain(value: Any) -> bool:
    """Text, a number, a flag or None, or lists and string-keyed mappings of them (a message's content
    may be a list of parts)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, list):
        return all(map(_is_plain, value))
    return isinstance(value, dict) and all(isinstance(k, str) and _is_plain(v) for k, v in value.items())


def _of_kind(tensor: torch.Tensor, kind: str) -> bool:
    if kind == "ids":
        return tensor.dtype == torch.int64
    if kind == "mask":
        return tensor.dtype == torch.bool
    return tensor.dtype.is_floating_point


def in_flight_problem(held: Any, last_step: Any, bounds: InFlightBounds) -> str | None:
    """Whether a checkpoint's batches in flight (`held`, one rank's list of `to_plain` dicts; `last_step`
    the last step of the run that saved it) fit the run resuming it (None), else the first problem:
    one batch for each of steps step+1 … min(step+k, last_step), in order, each sampled with a weight
    version the rule allows, with B rows of ids within the vocabulary and a sampler position within the
    training prompts."""
    if type(last_step) is not int or last_step < bounds.step:
        return f"rollout.last_step is {shown(last_step)}, not a step at or after {bounds.step}"
    if not isinstance(held, list):
        return f"rollout.in_flight_by_rank holds {shown(held)}, not a list of batches"
    expected = list(range(bounds.step + 1, min(bounds.step + bounds.max_staleness, last_step) + 1))
    if len(held) != len(expected):
        return (
            f"rollout holds {len(held)} batches in flight, where a checkpoint at step {bounds.step} with "
            f"max_staleness={bounds.max_staleness} holds {len(expected)}"
        )
    for index, (state, step) in enumerate(zip(held, expected, strict=True)):
        problem = plain_problem(state) or _fit_problem(state, step, bounds)
        if problem is not None:
            return f"rollout batch {index}: {problem}"
    return None


def _fit_problem(state: dict[str, Any], step: int, bounds: InFlightBounds) -> str | None:
    """One well-formed batch against the run: its step, its version, its rows, its ids."""
    if state["step"] != step:
        return f"step is {state['step']}, where step {step}'s batch is due"
    lowest = sampling_version(step, bounds.max_staleness, bounds.every)
    if not lowest <= state["version"] <= bounds.step:
        return f"version is {state['version']}, where step {step} samples with {lowest} to {bounds.step}"
    batch = state["batch"]
    if batch["prompt_ids"].shape[0] != bounds.rows:
        return f"batch has {batch['prompt_ids'].shape[0]} rows, where this run's steps have {bounds.rows}"
    for name in ("prompt_ids", "completion_ids"):
        ids = batch[name]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bounds.vocab):
            return f"batch.{name} holds ids outside the vocabulary [0, {bounds.vocab})"
    position = state["prompts_state"]["position"]
    if position >= bounds.prompts:
        return f"prompts_state.position is {position}, past the {bounds.prompts} training prompts"
    return None
