"""ops.linear_logps: log-probs and entropies from hidden states and the LM head, chunk by chunk,
equal in value and gradient to token_logps(hidden @ weightᵀ + bias) and independent of the chunking."""

from __future__ import annotations

import pytest
import torch

from grpokit.ops import TokenLogps, linear_logps, token_logps_and_entropy


def _inputs(dtype: torch.dtype, B: int = 3, T: int = 7, H: int = 16, V: int = 53, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) / H**0.5).requires_grad_()
    bias = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    # random upstream gradients, so every row and both outputs carry a different weight
    g_logps = torch.randn(B, T, generator=g, dtype=dtype)
    g_entropy = torch.randn(B, T, generator=g, dtype=dtype)
    return hidden, weight, bias, ids, g_logps, g_entropy


def _grads(stats: TokenLogps, params, g_logps, g_entropy):
    objective = (stats.logps * g_logps).sum() + (stats.entropy * g_entropy).sum()
    return torch.autograd.grad(objective, params)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_values_and_gradients_equal_the_logits_path_in_float64(temperature, with_bias, chunk_size):
    hidden, weight, bias, ids, g_lp, g_h = _inputs(torch.float64)
    b = bias if with_bias else None
    params = (hidden, weight, bias) if with_bias else (hidden, weight)
    ours = linear_logps(
        hidden, weight, ids, temperature=temperature, bias=b, chunk_size=chunk_size, return_entropy=True
    )
    logits = hidden @ weight.T + (bias if with_bias else 0.0)  # [B, T, V]
    naive_lp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
    p = torch.softmax(logits / temperature, -1)
    naive_h = -(p * torch.log_softmax(logits / temperature, -1)).sum(-1)
    naive = TokenLogps(naive_lp, naive_h)
    torch.testing.assert_close(ours.logps, naive.logps, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.entropy, naive.entropy, rtol=1e-12, atol=1e-12)
    for a, c in zip(_grads(ours, params, g_lp, g_h), _grads(naive, params, g_lp, g_h), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("differentiated", ["logps", "entropy"])
def test_an_output_nothing_differentiates_changes_no_gradient(differentiated):
    """Training reports the entropy but never differentiates it (and a caller may differentiate the
    entropy alone): the backward then skips the other output's terms, and the gradients still equal
    the logits path's for the output that is differentiated."""
    hidden, weight, bias, ids, g_lp, g_h = _inputs(torch.float64)
    params = (hidden, weight, bias)
    ours = linear_logps(hidden, weight, ids, bias=bias, chunk_size=4, return_entropy=True)
    naive = token_logps_and_entropy(hidden @ weight.T + bias, ids)
    pick = (
        (lambda s: (s.logps * g_lp).sum()) if differentiated == "logps" else lambda s: (s.entropy * g_h).sum()
    )
    for a, c in zip(
        torch.autograd.grad(pick(ours), params), torch.autograd.grad(pick(naive), params), strict=True
    ):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_gradcheck_of_logps_and_entropy():
    hidden, weight, bias, ids, _, _ = _inputs(torch.float64, B=2, T=3, H=4, V=6)

    def f(h, w, b):
        out = linear_logps(h, w, ids, temperature=0.9, bias=b, chunk_size=2, return_entropy=True)
        return out.logps, out.entropy

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_float32_matches_within_1e5_relative():
    """The issue's bound: values and gradients within 1e-5 of the naive float32 computation."""
    hidden, weight, _, ids, g_lp, g_h = _inputs(torch.float32, B=4, T=32, H=64, V=1000)
    ours = linear_logps(hidden, weight, ids, return_entropy=True, chunk_size=17)
    naive = token_logps_and_entropy(hidden @ weight.T, ids)
    torch.testing.assert_close(ours.logps, naive.logps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.entropy, naive.entropy, rtol=1e-5, atol=1e-6)
    for a, c in zip(
        _grads(ours, (hidden, weight), g_lp, g_h), _grads(naive, (hidden, weight), g_lp, g_h), strict=True
    ):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs_accumulate_in_float32():
    hidden, weight, _, ids, _, _ = _inputs(torch.float32, H=32, V=200)
    h16, w16 = hidden.detach().bfloat16(), weight.detach().bfloat16()
    out = linear_logps(h16, w16, ids)
    assert out.dtype == torch.float32
    # the reference: the same bf16 GEMM result, reduced in float32
    expected = torch.log_softmax((h16 @ w16.T).float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_logps_only_and_weight_without_grad():
    hidden, weight, _, ids, g_lp, _ = _inputs(torch.float64)
    frozen = weight.detach()
    out = linear_logps(hidden, frozen, ids)
    assert isinstance(out, torch.Tensor) and out.shape == ids.shape
    (grad,) = torch.autograd.grad((out * g_lp).sum(), hidden)
    naive = torch.log_softmax(hidden @ frozen.T, -1).gather(-1, ids[..., None]).squeeze(-1)
    (expected,) = torch.autograd.grad((naive * g_lp).sum(), hidden)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_sliced_hidden_view_is_accepted():
    """The trainer passes hidden[:, :-1] (a non-contiguous view)."""
    hidden, weight, _, ids, _, _ = _inputs(torch.float64, T=8)
    view = hidden[:, :-1]
    out = linear_logps(view, weight, ids[:, :-1])
    naive = torch.log_softmax(view @ weight.T, -1).gather(-1, ids[:, :-1, None]).squeeze(-1)
    torch.testing.assert_close(out, naive, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight": torch.zeros(5, 3)}, "weight must be"),
        ({"ids": torch.zeros(2, 3, dtype=torch.long)}, "ids has shape"),
        ({"bias": torch.zeros(4)}, "bias must be"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = {
        "hidden": torch.zeros(2, 4, 8),
        "weight": torch.zeros(5, 8),
        "ids": torch.zeros(2, 4, dtype=torch.long),
    }
    args |= kwargs
    with pytest.raises(ValueError, match=message):
        linear_logps(args.pop("hidden"), args.pop("weight"), args.pop("ids"), **args)
