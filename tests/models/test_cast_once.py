"""Weights cast once (`PolicyEngine.weights_cast_once`): under mixed precision the lean forward's
matrices are cast to the compute dtype once per optimizer step (and once per frozen pass, once per
rollout), not at every pass; the passes give autocast's own numbers bit for bit, and the casts the
profiler counts drop by the ones saved."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.profiler import ProfilerActivity, profile

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models.lean_llama import WeightCopies
from tests.models.test_compiled import batch_of
from tests.models.test_engine import G, tiny_policy

LAYERS, MICRO = 2, 4
MATRICES = 7 * LAYERS  # q, k, v, o, gate, up, down in each layer


def engine(cast_once: bool, dtype: str = "bfloat16") -> PolicyEngine:
    model, tokenizer = tiny_policy(seed=3, layers=LAYERS)
    spec = EngineSpec(dtype=dtype, group_size=G)
    built = PolicyEngine.create(model, tokenizer, spec, reference=copy.deepcopy(model).requires_grad_(False))
    if not cast_once:  # autocast casting at every pass: what the engine did before
        built.weights_cast_once = lambda reference=False: contextlib.nullcontext()  # type: ignore[method-assign]
    return built


def step(e: PolicyEngine, batch) -> dict[str, torch.Tensor]:
    """An optimizer step's accumulation over three micro-batches, as update.py opens it, and the frozen
    passes: everything they compute."""
    e.module.zero_grad(set_to_none=True)
    out = {}
    with e.weights_cast_once():
        for start in range(0, 12, MICRO):
            stats = e.logps(batch, slice(start, start + MICRO), entropy=True)
            (stats.logps.sum() + 0.1 * stats.entropy.sum()).backward()
            out[f"logps.{start}"], out[f"entropy.{start}"] = stats.logps.detach(), stats.entropy.detach()
    out |= {f"grad.{n}": p.grad.clone() for n, p in e.module.named_parameters()}
    out["reference"] = e.frozen_logps(batch, MICRO, reference=True)
    out["old"] = e.frozen_logps(batch, MICRO)
    return out


def test_passes_with_weights_cast_once_equal_autocasts_bit_for_bit():
    per_pass, once = engine(cast_once=False), engine(cast_once=True)
    batch_a, batch_b = batch_of(per_pass, T=9), batch_of(once, T=9)  # sampled each way
    assert torch.equal(batch_a.completion_ids, batch_b.completion_ids)
    assert torch.equal(batch_a.sampling_logps, batch_b.sampling_logps)
    a, b = step(per_pass, batch_a), step(once, batch_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])
    ]


def weight_casts(e: PolicyEngine, batch) -> int:
    """aten::_to_copy calls of one `step` (after a warm-up)."""
    step(e, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(e, batch)
    return {x.key: x.count for x in prof.key_averages()}.get("aten::_to_copy", 0)


def test_each_matrix_is_cast_once_per_optimizer_step_and_per_frozen_pass():
    """Three micro-batches: the update casts each matrix once instead of three times, and each frozen
    pass (reference, old policy) once instead of once a micro-batch."""
    per_pass, once = engine(cast_once=False), engine(cast_once=True)
    batch = batch_of(per_pass, T=9)
    saved = weight_casts(per_pass, batch) - weight_casts(once, batch)
    micro_batches = 12 // MICRO
    assert saved == 3 * (micro_batches - 1) * MATRICES  # the update and the two frozen passes


def test_float32_passes_make_no_copies():
    e = engine(cast_once=True, dtype="float32")
    with e.weights_cast_once():  # nothing to cast: the context is empty
        assert all(layer.copies is None for layer in e.backend.decoder.layers)


def test_a_copy_is_made_once_and_reaches_its_weights_gradient():
    weight = torch.randn(3, 2, requires_grad=True)
    copies = WeightCopies(torch.bfloat16)
    first, second = copies(weight), copies(weight)
    assert first.dtype == torch.bfloat16 and torch.equal(first, weight.detach().bfloat16())
    assert len(copies._made) == 1  # noqa: SLF001 - one copy for both uses
    (first.float().sum() + 2 * second.float().sum()).backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.full((3, 2), 3.0))
    with torch.no_grad():
        assert copies(weight).grad_fn is None  # a frozen pass reads the copy itself
