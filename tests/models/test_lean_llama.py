"""The lean Llama forward (models.lean_llama) equals transformers' forward: full sequences with left
padding, incremental decoding through its preallocated KV cache, grouped-query attention, LoRA;
the KV sampler's lean path draws the same tokens as its transformers path."""

from __future__ import annotations

import pytest
import torch

from grpokit.models import (
    LeanBackend,
    TransformersBackend,
    backend_of,
    build_policy,
    lean_decoder,
    lm_head_of,
)
from grpokit.models.lean_llama import LeanLlamaDecoder, packing_pays


def _policy(kv_heads: int | None = None, seed: int = 0):
    model = build_policy(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=40, dropout=0.0, seed=seed, intermediate_size=96
    )
    if kv_heads is not None:  # grouped-query attention: rebuild with fewer key/value heads
        from transformers import LlamaForCausalLM

        config = model.config
        config.num_key_value_heads = kv_heads
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def _ids_and_mask(b: int = 3, L: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (b, L), generator=g)
    mask = torch.ones(b, L, dtype=torch.long)
    mask[0, :3] = 0  # left padding of different widths
    mask[1, :1] = 0
    return ids * mask, mask


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_full_forward_equals_transformers(kv_heads):
    model = _policy(kv_heads)
    decoder = lean_decoder(model)
    assert isinstance(decoder, LeanLlamaDecoder)
    ids, mask = _ids_and_mask()
    with torch.no_grad():
        expected = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()  # padded positions are never read
    torch.testing.assert_close(ours[real], expected[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_cached_decoding_equals_one_full_forward(kv_heads):
    model = _policy(kv_heads)
    decoder = lean_decoder(model)
    ids, mask = _ids_and_mask(L=10)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        cache = decoder.new_cache(3, 12, expected)
        parts = [
            decoder(
                ids[:, a:b], key_mask=mask[:, :b].bool(), position_ids=positions[:, a:b], cache=cache
            ).last_hidden_state
            for a, b in [(0, 6), (6, 7), (7, 8), (8, 10)]  # a prefill, then token by token and a pair
        ]
    assert cache.length == 10
    ours = torch.cat(parts, dim=1)
    real = mask.bool()
    torch.testing.assert_close(ours[real], expected[real], rtol=1e-5, atol=1e-5)


def test_gradients_equal_transformers():
    model = _policy().double().train()
    twin = _policy().double().train()
    ids, mask = _ids_and_mask()
    weights = torch.randn(3, 9, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = weights * mask[..., None]
    (lean_decoder(model)(input_ids=ids, attention_mask=mask).last_hidden_state * weights).sum().backward()
    (twin.model(input_ids=ids, attention_mask=mask).last_hidden_state * weights).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        if b.grad is None:  # the LM head is not part of the decoder
            assert a.grad is None, name
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_unsupported_models_keep_their_own_forward():
    model = _policy()
    model.config.attention_dropout = 0.1  # dropout inside attention: not covered
    assert lean_decoder(model) is None
    backend = backend_of(model)
    assert backend.head is not None and not isinstance(backend, LeanBackend)  # transformers' decoder


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 0.7, "top_k": 5}, {"temperature": 0.0}])
def test_lean_and_transformers_backends_draw_the_same_tokens(kwargs):
    from grpokit.models import char_tokenizer
    from grpokit.rollout import Decoder, SamplingParams

    tok = char_tokenizer("0123456789+=")
    model = build_policy(hidden_size=64, num_layers=2, num_heads=4, vocab_size=len(tok), dropout=0.0, seed=3)
    params = SamplingParams(num_generations=4, max_completion_length=8, seed=5, **kwargs)
    prompts = ["12+3=", "7+8=", "99+99="]  # different lengths: left padding
    assert isinstance(backend_of(model), LeanBackend)
    lean = Decoder(backend_of(model), tok).sample(prompts, params)
    # transformers' forward and DynamicCache
    plain = Decoder(TransformersBackend(model, lm_head_of(model)), tok).sample(prompts, params)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    torch.testing.assert_close(lean.sampling_logps, plain.sampling_logps, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("T", "kv_heads", "packed"), [(1, None, False), (4, None, True), (4, 2, True), (30, 2, False)]
)
def test_shared_prefix_equals_full_rows_in_values_and_gradients(T, kv_heads, packed):
    """Each of P left-padded prompts shared by G completions (some ending early): the prompt is run
    once per group (short completions: packed with its group's completions into one row), and the
    states that score the completion tokens and every parameter's gradient equal those of running
    each full row on its own."""
    P, G = 2, 3
    assert (T > 1 and packing_pays(5, T, G)) == packed  # both routes are covered
    model, twin = _policy(kv_heads).double().train(), _policy(kv_heads).double().train()
    prefix, prefix_mask = _ids_and_mask(b=P, L=5, seed=3)
    prefix_mask[1, :2] = 0
    prefix = prefix * prefix_mask
    g = torch.Generator().manual_seed(4)
    suffix = torch.randint(3, 40, (P * G, T), generator=g)
    suffix_mask = torch.ones(P * G, T, dtype=torch.bool)
    if T > 1:
        suffix_mask[1, T - 1 :] = False  # a completion that ended early
    shared = lean_decoder(model).shared_prefix(prefix, prefix_mask, suffix, suffix_mask, G)  # [P·G, T, H]
    full_ids = torch.cat([prefix.repeat_interleave(G, 0), suffix], dim=1)
    full_mask = torch.cat([prefix_mask.bool().repeat_interleave(G, 0), suffix_mask], dim=1)
    full = twin.model(input_ids=full_ids, attention_mask=full_mask.long()).last_hidden_state[:, 4 : 4 + T]
    real = suffix_mask  # states at padding after a completion's end are never read
    torch.testing.assert_close(shared[real], full[real], rtol=1e-10, atol=1e-12)
    weights = torch.randn(P * G, T, 64, dtype=torch.float64, generator=g) * real[..., None]
    (shared * weights).sum().backward()
    (full * weights).sum().backward()
    # Llama's RMSNorm takes its statistics in float32 even in a float64 model (transformers does the
    # same), so gradients summed over the G rows in another order agree to float32 round-off only
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        if b.grad is None:
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6 * float(b.grad.abs().max()), msg=name)


@pytest.mark.parametrize("where", ["q_proj", "mlp", "down_proj"])
def test_hooks_on_inner_modules_are_honoured(where):
    """The lean forward calls plain linear layers' arithmetic directly; a module that carries a hook
    is called as a module, so the hook still sees and changes its output."""
    model = _policy()
    layer = model.model.layers[1]
    module = {"q_proj": layer.self_attn.q_proj, "mlp": layer.mlp, "down_proj": layer.mlp.down_proj}[where]
    module.register_forward_hook(lambda mod, args, out: out * 3.0)
    ids, mask = _ids_and_mask()
    with torch.no_grad():
        expected = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = lean_decoder(model)(input_ids=ids, attention_mask=mask).last_hidden_state
        unhooked = LeanLlamaDecoder(_policy().model)(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(ours[real], expected[real], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours[real], unhooked[real], atol=1e-3)  # the hook did change the result


def test_rms_norm_matches_llamas_in_values_and_gradients():
    """The float32 norm (one reduction, hand-written backward) equals transformers' LlamaRMSNorm to
    float32 round-off, values and gradients, and passes gradcheck in float64."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from grpokit.models.lean_llama import _rms_norm, _RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x = (torch.randn(3, 5, 48, generator=g) * 4).requires_grad_()
    twin = x.detach().clone().requires_grad_()
    weights = torch.randn(3, 5, 48, generator=g)
    ours, expected = _rms_norm(norm.weight, norm.variance_epsilon, x), norm(twin)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    (ours * weights).sum().backward()
    grad_w = norm.weight.grad.clone()
    norm.weight.grad = None
    (expected * weights).sum().backward()
    torch.testing.assert_close(x.grad, twin.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_w, norm.weight.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the gradient-free route gives the same values
        torch.testing.assert_close(_rms_norm(norm.weight, norm.variance_epsilon, x), ours, rtol=0, atol=0)
    x64 = torch.randn(2, 3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    w64 = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-6), (x64, w64))


def test_a_lone_padded_token_attends_to_itself():
    """A one-token row whose only position is padding (attention mask 0) attends to itself, as the
    longer masks do (never an all-masked row, whose output kernels define differently: NaN on some,
    zeros on this CPU): its states equal those of the same token unmasked, and stay finite."""
    model = _policy()
    decoder = lean_decoder(model)
    ids = torch.tensor([[5], [7]])
    masked = decoder(input_ids=ids, attention_mask=torch.tensor([[1], [0]])).last_hidden_state
    unmasked = decoder(input_ids=ids, attention_mask=torch.tensor([[1], [1]])).last_hidden_state
    torch.testing.assert_close(masked, unmasked, rtol=0, atol=0)
    masked.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
