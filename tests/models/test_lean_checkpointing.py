"""Activation checkpointing in the lean forward (`gradient_checkpointing: true`): the training forward
stays lean on every route (one pass, the prompt once per group, prompt and completions packed, the
padding-free pass), gives the same log-probs, entropies and gradients as without checkpointing, and
autograd keeps only what the forecast counts for it."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models import LeanBackend, ModelShape, StepShape, backend_of, lean_decoder
from grpokit.models.backend import padding_free_pays
from grpokit.models.memory_forecast import activation_bytes, forward_passes, layer_bytes
from tests.helpers import small_llama

V, H, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 300, 64, 3, 4, 2, 96


def llama(dtype: torch.dtype = torch.float64, bias: bool = False) -> torch.nn.Module:
    return small_llama((V, H, LAYERS, HEADS, KV_HEADS, INTERMEDIATE), bias=bias).to(dtype).train()


def batch_of(G: int, b: int, Lp: int, T: int, lengths: list[int] | None = None) -> types.SimpleNamespace:
    """b rows in groups of G sharing a left-padded prompt of Lp tokens; completions of T slots, row r
    attending to its first lengths[r] (all T when None)."""
    g = torch.Generator().manual_seed(1)
    prompt_mask = torch.ones(b // G, Lp, dtype=torch.bool)
    prompt_mask[0, :2] = False  # the first prompt is left-padded
    completion_mask = torch.ones(b, T, dtype=torch.bool)
    if lengths is not None:
        completion_mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return types.SimpleNamespace(
        prompt_ids=torch.randint(3, V, (b // G, Lp), generator=g).repeat_interleave(G, 0),
        prompt_mask=prompt_mask.repeat_interleave(G, 0),
        completion_ids=torch.randint(3, V, (b, T), generator=g) * completion_mask,
        completion_mask=completion_mask,
        completion_attention=None,
    )


def logps_and_grads(model: torch.nn.Module, batch: types.SimpleNamespace, G: int):
    tokenizer = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = PolicyEngine.create(model, tokenizer, EngineSpec(group_size=G))
    model.zero_grad(set_to_none=True)
    b = batch.completion_ids.shape[0]
    out = engine.logps(batch, slice(0, b), entropy=True)
    weights = torch.randn(out.logps.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mask = batch.completion_mask
    ((out.logps * weights)[mask].sum() + out.entropy[mask].sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logps.detach(), out.entropy.detach(), grads


ROUTES = [  # G, b, Lp, T, completion lengths, passes
    pytest.param(1, 2, 5, 7, None, 1, id="one-pass"),
    pytest.param(4, 4, 3, 20, None, 2, id="prompt-once-per-group"),
    pytest.param(2, 4, 5, 7, None, 1, id="prompt-and-completions-packed"),
    pytest.param(2, 4, 4, 40, [40, 9, 23, 1], None, id="padding-free"),
]


@pytest.mark.parametrize(("G", "b", "Lp", "T", "lengths", "passes"), ROUTES)
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qkv-bias"])
def test_checkpointed_lean_forward_gives_the_same_logps_entropies_and_gradients(
    G, b, Lp, T, lengths, passes, bias
):
    plain, checkpointed = llama(bias=bias), llama(bias=bias)
    checkpointed.gradient_checkpointing_enable()
    backend = backend_of(checkpointed)
    assert isinstance(backend, LeanBackend)  # checkpointing keeps the lean forward
    assert lean_decoder(checkpointed).checkpoints()
    batch = batch_of(G, b, Lp, T, lengths)
    if lengths is not None:  # the padding-free pass is taken
        assert padding_free_pays(batch.completion_mask)
    else:
        assert not padding_free_pays(batch.completion_mask)
        step = StepShape(rows=b, micro_batch_size=b, prompt_length=Lp, completion_length=T, group_size=G)
        assert len(forward_passes(ModelShape.of(checkpointed), step)) == passes
    logps, entropy, grads = logps_and_grads(plain, batch, G)
    logps_c, entropy_c, grads_c = logps_and_grads(checkpointed, batch, G)
    # the same operations on the same inputs, run twice: float64 round-off at most (in practice equal)
    mask = batch.completion_mask
    torch.testing.assert_close(logps_c[mask], logps[mask], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy_c[mask], entropy[mask], rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_c.keys() and len(grads) == len(list(plain.parameters()))
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_checkpointing_applies_only_where_gradients_are_recorded():
    model = llama()
    model.gradient_checkpointing_enable()
    decoder = lean_decoder(model)
    assert decoder.checkpoints()
    with torch.no_grad():
        assert not decoder.checkpoints()  # frozen passes and decoding keep nothing to recompute
    model.gradient_checkpointing_disable()
    assert not decoder.checkpoints()


def held_after_forward(model: torch.nn.Module, batch: types.SimpleNamespace, G: int) -> int:
    """Bytes the training forward leaves allocated for the backward (everything it allocated and did not
    free: what autograd saves, what checkpointed layers keep, the outputs), as the CPU allocator reports
    them to the profiler; after one forward to warm up (the rotary table is made once)."""
    from torch.profiler import ProfilerActivity, profile

    tokenizer = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = PolicyEngine.create(model, tokenizer, EngineSpec(group_size=G))
    b = batch.completion_ids.shape[0]
    engine.logps(batch, slice(0, b), entropy=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = engine.logps(batch, slice(0, b), entropy=True)
    assert kept.logps.requires_grad  # (held until here)
    return sum(event.self_cpu_memory_usage for event in prof.events())


@pytest.mark.parametrize(("G", "b", "Lp", "T", "lengths", "passes"), ROUTES[:3])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_what_the_forward_keeps_is_what_the_forecast_counts(G, b, Lp, T, lengths, passes, checkpointing):
    """The forecast's activations, less the one layer's that exist only while it is recomputed, against
    the bytes the real training forward leaves allocated."""
    model = llama(dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable()
    batch = batch_of(G, b, Lp, T, lengths)
    held = held_after_forward(model, batch, G)
    shape = ModelShape.of(model)
    step = StepShape(
        rows=b,
        micro_batch_size=b,
        prompt_length=Lp,
        completion_length=T,
        group_size=G,
        gradient_checkpointing=checkpointing,
    )
    forecast = activation_bytes(shape, step)
    if checkpointing:  # one layer's saved tensors exist only while it runs again in the backward
        forecast -= sum(layer_bytes(shape, step, p, True) for p in forward_passes(shape, step))
    # within 1e-3, and 1 KiB for the int64 token ids and index tensors, counted per token by the
    # forecast while the passes share or slice some of them (a few hundred bytes here)
    assert abs(forecast - held) <= 1e-3 * held + 1024, (forecast, held)
    if checkpointing:  # what it is for: here a seventh to a half of what the plain forward keeps
        plain = activation_bytes(shape, replace(step, gradient_checkpointing=False))
        assert held < plain / 2, (held, plain)
