"""The static-shape decode step (`rollout/static_decode.py`), run by the one decode loop: the same tokens
and log-probs as the eager step (and, greedy, as transformers' generate), with finished rows compacted
away; compiled whole with `torch.compile(fullgraph=True)` on this CPU's inductor."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from grpokit.models import backend_of
from grpokit.rollout import Decoder, LoopControl, SamplingParams, resolve_decode_loop
from grpokit.rollout.static_decode import buckets_of

from .reference_generate import reference_generate
from .test_sampler import EOS

PROMPTS = ["12+3=", "7+8=", "1=", "45+67="]  # prompts of different lengths: left padding


@contextlib.contextmanager
def eos_bias(model, bias: float):
    """An LM head with a bias that favours EOS (rows then end at different lengths). A bias, not a
    forward hook: the static step multiplies by the head's weight and bias, never calls the module."""
    plain = model.lm_head
    head = torch.nn.Linear(plain.in_features, plain.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(plain.weight)
        head.bias.zero_()
        head.bias[EOS] = bias
    model.lm_head = head
    try:
        yield
    finally:
        model.lm_head = plain


def _sample(model, tok, loop: str, params: SamplingParams, prompts=PROMPTS, check_every=None):
    sampler = Decoder(backend_of(model), tok, loop, control=LoopControl(check_every=check_every))
    return sampler, sampler.sample(prompts, params)


def _steps(sampler) -> dict:
    """The steps the sampler's static loop made, by bucket of rows (its one shape)."""
    (buffers,) = sampler._static.buffers.values()  # noqa: SLF001
    return buffers.steps


def _assert_same(ours, eager):
    assert torch.equal(ours.completion_ids, eager.completion_ids)
    assert torch.equal(ours.completion_mask, eager.completion_mask) and torch.equal(
        ours.truncated, eager.truncated
    )
    # float32: the same products in another grouping (stacked q/k/v, the full KV capacity)
    torch.testing.assert_close(ours.sampling_logps, eager.sampling_logps, rtol=0, atol=1e-5)
    assert ours.completions == eager.completions


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"seed": 3},
        {"seed": 4, "temperature": 0.7, "top_k": 6, "top_p": 0.8},
        {"seed": 5, "repetition_penalty": 1.3, "min_p": 0.05},
    ],
)
def test_static_step_equals_the_eager_loop(tiny_policy, kwargs):
    """On a CPU the same uniform numbers in the same order, so even sampled tokens match the eager loop."""
    model, tok = tiny_policy
    params = SamplingParams(num_generations=3, max_completion_length=8, **kwargs)
    _, eager = _sample(model, tok, "eager", params)
    _, static = _sample(model, tok, "static", params)
    _assert_same(static, eager)
    if params.temperature == 0.0:
        generate = reference_generate(model, tok, PROMPTS, params)
        assert torch.equal(static.completion_ids, generate.completion_ids)


def test_finished_rows_are_compacted_away(tiny_policy):
    """32 rows that end at different lengths: the step runs on 32, then 16, then 8 rows, and every row's
    tokens and log-probs are those of the eager loop (the compacted rows write to their own rows)."""
    model, tok = tiny_policy
    assert buckets_of(32) == [32, 16, 8] and buckets_of(12) == [12] and buckets_of(8) == [8]
    params = SamplingParams(num_generations=8, max_completion_length=14, seed=2)
    with eos_bias(model, 1.5):
        _, eager = _sample(model, tok, "eager", params)
        sampler, static = _sample(model, tok, "static", params)
        ran = sorted(_steps(sampler))  # the buckets the step ran at
    lengths = eager.completion_mask.sum(-1)
    assert lengths.min() < 5 and eager.truncated.any()  # rows end early and late: compaction has work
    assert ran == [8, 16, 32], ran
    _assert_same(static, eager)


@pytest.mark.slow
def test_compiled_step_is_one_graph_and_equals_the_eager_loop(tiny_policy):
    """`torch.compile(fullgraph=True)` (inductor, here on the CPU): any graph break is an error. Greedy
    against transformers' generate, sampled with repetition penalty and top-p against the eager loop,
    through compaction (16 rows, then 8); a second rollout reuses the compiled steps."""
    model, tok = tiny_policy
    greedy = SamplingParams(num_generations=2, max_completion_length=10, temperature=0.0)  # 8 rows: 1 graph
    sampler, compiled = _sample(model, tok, "compiled", greedy)
    assert torch.equal(
        compiled.completion_ids, reference_generate(model, tok, PROMPTS, greedy).completion_ids
    )
    params = SamplingParams(
        num_generations=4, max_completion_length=12, seed=9, repetition_penalty=1.2, top_p=0.9
    )
    with eos_bias(model, 1.5):
        _, eager = _sample(model, tok, "eager", params)
        sampler, compiled = _sample(model, tok, "compiled", params)
        again = sampler.sample(PROMPTS, params)
        assert len(_steps(sampler)) > 1  # compacted: more than one bucket compiled
    _assert_same(compiled, eager)
    _assert_same(again, eager)


@pytest.mark.parametrize(("T", "check_every"), [(2, 1), (9, 8), (5, 4)])
def test_a_graph_warm_up_at_the_last_token_stays_in_bounds_and_changes_nothing(
    tiny_policy, monkeypatch, T, check_every
):
    """A CUDA graph is warmed up by running the step (twice) before it is recorded; a bucket first used
    at the last token (T = 2, or a compaction at t = T − 1) warms up past it. Emulated on the CPU: the
    capture replaced by the same warm-up and restore around the plain step; the rollout must equal the
    eager loop's, and no write may leave the buffers (an IndexError here, a device assert on a GPU)."""
    from grpokit.rollout import static_decode

    monkeypatch.setattr(
        static_decode, "_capture", lambda step, state, pool: (static_decode._warm_up(step, state), step)[1]
    )
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)  # the step as it is: compiling is tested above
    model, tok = tiny_policy
    params = SamplingParams(num_generations=8, max_completion_length=T, seed=4)
    with eos_bias(model, 2.0):
        _, eager = _sample(model, tok, "eager", params, check_every=check_every)
        sampler, graphed = _sample(model, tok, "cuda_graph", params, check_every=check_every)
    _assert_same(graphed, eager)
    if T > 2:
        assert len(_steps(sampler)) > 1  # a bucket was first used after a compaction


def test_the_step_follows_the_weights_after_an_update(tiny_policy):
    """The step multiplies by stacked copies of the weights: they are refreshed before every rollout, so
    after an optimizer step the static loop still equals the eager one (which reads the parameters)."""
    model, tok = copy.deepcopy(tiny_policy[0]), tiny_policy[1]  # the fixture is shared: not changed
    params = SamplingParams(num_generations=2, max_completion_length=6, seed=1)
    sampler, _ = _sample(model, tok, "static", params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    _, eager = _sample(model, tok, "eager", params)
    _assert_same(sampler.sample(PROMPTS, params), eager)


def test_log_probs_equal_a_forward_pass_under_bfloat16_autocast(tiny_policy):
    """Mixed precision: the step keeps bfloat16 copies of the matrices and a bfloat16 KV cache, the
    residual stream and norms in float32, as autocast does. The recorded log-probs match a float32
    forward pass to bfloat16 round-off: 8 bits of mantissa, 4e-3 relative, on logits of order 1 (measured
    1-2e-3 over seeds 0-3, the same as the eager loop under autocast)."""
    from grpokit.ops import completion_logps

    model, tok = tiny_policy
    params = SamplingParams(num_generations=4, max_completion_length=8, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sampler, r = _sample(model, tok, "static", params)
    assert next(iter(sampler._static.buffers.values())).state.keys[0].dtype == torch.bfloat16  # noqa: SLF001
    assert next(iter(sampler._static.weights.values())).layers[0].qkv_weight.dtype == torch.bfloat16  # noqa: SLF001
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], dim=1).long()
    with torch.no_grad():
        logps = completion_logps(model(ids, attention_mask=mask).logits, ids, r.prompt_ids.shape[1], 1.0)
    gap = torch.where(r.completion_mask, logps - r.sampling_logps, 0.0).abs().max()
    assert 0 < gap < 1e-2, gap


def test_stop_strings_and_unsupported_models_use_the_eager_loop(tiny_policy):
    model, tok = tiny_policy
    params = SamplingParams(num_generations=2, max_completion_length=6, seed=1, stop_strings=("3",))
    sampler, r = _sample(model, tok, "static", params)
    assert sampler._static is None  # noqa: SLF001
    _, eager = _sample(model, tok, "eager", params)
    assert torch.equal(r.completion_ids, eager.completion_ids)


def test_decode_loop_is_resolved_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_decode_loop("auto", cpu) == "eager" and resolve_decode_loop("auto", cuda) == "cuda_graph"
    assert resolve_decode_loop("compiled", cpu) == "compiled"
    with pytest.raises(ValueError, match="needs a CUDA device.*decode_loop=compiled"):
        resolve_decode_loop("cuda_graph", cpu)
    from grpokit.config import GRPOConfig

    # one decode loop: the removed `sampler` option is one line naming it and the fix
    with pytest.raises(ValueError, match="sampler was removed.*delete sampler from the config"):
        GRPOConfig(sampler="hf", decode_loop="compiled")
