"""token_logps / selective_log_softmax / entropy_from_logits against the naive definitions."""

from __future__ import annotations

import pytest
import torch

from grpokit.ops import (
    completion_logits,
    completion_logps,
    entropy_from_logits,
    selective_log_softmax,
    sequence_logps,
    token_logps,
    token_logps_and_entropy,
)
from grpokit.ops import logprobs as logprobs_module


def naive_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)


def naive_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_naive_for_every_dtype(gen, dtype, temperature):
    logits = (torch.randn(3, 5, 50, generator=gen) * 4).to(dtype)
    ids = torch.randint(0, 50, (3, 5), generator=gen)
    out = token_logps_and_entropy(logits, ids, temperature)
    # The reference is float64 on the same (already rounded) inputs, so only float32
    # accumulation error separates them: 1e-5 for every input dtype.
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert out.logps.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.logps.double(), naive_logps(logits, ids, temperature), rtol=0, atol=tol)
    torch.testing.assert_close(out.entropy.double(), naive_entropy(logits, temperature), rtol=0, atol=tol)
    torch.testing.assert_close(token_logps(logits, ids, temperature), out.logps)
    torch.testing.assert_close(entropy_from_logits(logits, temperature), out.entropy)


def test_selective_log_softmax_equals_di_engine_methods(gen):
    """DI-engine's naive_method, efficient_method and less_efficient_method give one value."""
    logits = torch.randn(4, 8, 1000, generator=gen)
    action = torch.randint(0, 1000, (4, 8), generator=gen)
    naive = torch.gather(torch.log_softmax(logits, -1), -1, action[..., None]).squeeze(-1)
    categorical = torch.distributions.Categorical(logits=logits).log_prob(action)
    ours = selective_log_softmax(logits, action)
    torch.testing.assert_close(ours, naive, rtol=0, atol=1e-5)  # DI's own fp32 tolerance
    torch.testing.assert_close(ours, categorical, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_gradcheck_float64(gen, temperature):
    logits = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 9, (2, 3), generator=gen)
    w_lp = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    w_h = torch.randn(2, 3, generator=gen, dtype=torch.float64)

    def both(x):
        out = token_logps_and_entropy(x, ids, temperature)
        return (out.logps * w_lp).sum() + (out.entropy * w_h).sum()

    assert torch.autograd.gradcheck(both, (logits,))
    assert torch.autograd.gradcheck(lambda x: (token_logps(x, ids, temperature) * w_lp).sum(), (logits,))
    assert torch.autograd.gradcheck(lambda x: (entropy_from_logits(x, temperature) * w_h).sum(), (logits,))


def test_gradient_matches_naive_in_bfloat16(gen):
    base = torch.randn(2, 4, 64, generator=gen)
    ids = torch.randint(0, 64, (2, 4), generator=gen)
    x = base.to(torch.bfloat16).requires_grad_()
    token_logps(x, ids).sum().backward()
    ref = base.to(torch.bfloat16).double().requires_grad_()
    naive_logps(ref, ids).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    # the gradient is rounded to bfloat16 (8 mantissa bits): relative 2^-8
    torch.testing.assert_close(x.grad.double(), ref.grad, rtol=2**-8, atol=1e-3)


def test_chunking_is_exact(gen, monkeypatch):
    """Many tiny chunks (one row each) give the same values and gradients as one chunk."""
    logits = torch.randn(3, 6, 40, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 40, (3, 6), generator=gen)

    def run():
        x = logits.clone().requires_grad_()
        out = token_logps_and_entropy(x, ids, 0.9)
        (out.logps.sum() + 2 * out.entropy.sum()).backward()
        return out.logps, out.entropy, x.grad

    whole = run()
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 1)
    pieces = run()
    for a, b in zip(whole, pieces, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_sliced_view_is_not_copied_and_shift_is_right(gen):
    """completion_logps scores ids[:, Lp:] with logits[:, Lp-1:-1], without copying the slice."""
    B, Lp, T, V = 2, 3, 4, 11
    logits = torch.randn(B, Lp + T, V, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (B, Lp + T), generator=gen)
    view = completion_logits(logits, Lp)
    assert view.data_ptr() == logits[:, Lp - 1].data_ptr() and view.shape == (B, T, V)
    expected = torch.stack(
        [
            torch.log_softmax(logits[:, Lp - 1 + t], -1).gather(-1, ids[:, Lp + t, None]).squeeze(-1)
            for t in range(T)
        ],
        dim=1,
    )
    torch.testing.assert_close(completion_logps(logits, ids, Lp), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="prompt_length"):
        completion_logps(logits, ids, 0)


def test_sequence_logps_is_masked_sum():
    logps = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.25, -8.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    torch.testing.assert_close(sequence_logps(logps, mask), torch.tensor([-3.0, -8.75]))


def test_uniform_logits_hand_computed():
    """Constant logits over V tokens: every log-prob is −log V and the entropy is log V."""
    V = 7
    logits = torch.zeros(2, 3, V)
    ids = torch.tensor([[0, 3, 6], [1, 2, 5]])
    torch.testing.assert_close(
        token_logps(logits, ids), torch.full((2, 3), -torch.log(torch.tensor(7.0)).item())
    )
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.full((2, 3), torch.log(torch.tensor(7.0)).item())
    )


def test_inputs_are_not_modified(gen):
    logits = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3), generator=gen)
    before, version = logits.detach().clone(), logits._version
    token_logps_and_entropy(logits, ids, 0.5).logps.sum().backward()
    assert logits._version == version
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)


def test_bad_arguments_raise_clear_errors(gen):
    logits = torch.randn(2, 3, 5, generator=gen)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logps(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"ids has shape \(2, 4\)"):
        token_logps(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="bool"):
        sequence_logps(torch.zeros(2, 3), torch.ones(2, 3))
