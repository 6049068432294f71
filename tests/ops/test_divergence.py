"""The generalised JSD of GKD (`ops.generalized_jsd`, issue 27): against a direct computation over
full distributions written out term by term, β = 0 and β = 1 as the forward and reverse KL, symmetric
at β = 0.5 under swapping the models, 0 where they agree, and its gradient by gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.ops import generalized_jsd


def _direct(s_logits: list[float], t_logits: list[float], beta: float) -> float:
    """Term by term in plain floats: P = softmax, M = (1 − β)·P_S + β·P_T."""

    def softmax(z):
        top = max(z)
        e = [math.exp(v - top) for v in z]
        return [v / sum(e) for v in e]

    ps, pt = softmax(s_logits), softmax(t_logits)

    def kl(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)

    if beta == 0.0:
        return kl(pt, ps)
    if beta == 1.0:
        return kl(ps, pt)
    m = [(1 - beta) * a + beta * b for a, b in zip(ps, pt, strict=True)]
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_it_equals_the_direct_computation_over_full_distributions(beta):
    student = [[0.3, -1.2, 2.0], [0.0, 0.0, 0.0]]  # 2 positions, 3 words
    teacher = [[1.5, 0.2, -0.7], [2.0, -2.0, 0.5]]
    out = generalized_jsd(torch.tensor(student), torch.tensor(teacher), beta=beta)
    assert out.shape == (2,) and out.dtype == torch.float32
    for i in range(2):
        assert out[i].item() == pytest.approx(_direct(student[i], teacher[i], beta), abs=1e-6)


def test_beta_0_and_1_are_the_forward_and_reverse_kl():
    g = torch.Generator().manual_seed(0)
    s, t = (
        torch.randn(4, 7, generator=g, dtype=torch.float64),
        torch.randn(4, 7, generator=g, dtype=torch.float64),
    )
    log_s, log_t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    forward = (log_t.exp() * (log_t - log_s)).sum(-1)  # KL(P_T ‖ P_S)
    reverse = (log_s.exp() * (log_s - log_t)).sum(-1)  # KL(P_S ‖ P_T)
    torch.testing.assert_close(generalized_jsd(s, t, beta=0.0), forward, rtol=0, atol=1e-12)
    torch.testing.assert_close(generalized_jsd(s, t, beta=1.0), reverse, rtol=0, atol=1e-12)
    assert not torch.allclose(forward, reverse)  # the two differ: the test can tell them apart
    # at β = 1/2 the divergence is the Jensen-Shannon one, the same whichever model is which
    torch.testing.assert_close(
        generalized_jsd(s, t, beta=0.5), generalized_jsd(t, s, beta=0.5), rtol=0, atol=1e-12
    )
    assert (generalized_jsd(s, t, beta=0.5) > 0).all()
    for beta in (0.0, 0.3, 1.0):
        assert generalized_jsd(s, s, beta=beta).abs().max() <= 1e-12  # 0 where they agree


def test_temperature_divides_both_models_logits():
    s, t = torch.tensor([[1.0, 2.0, 0.5]]), torch.tensor([[0.5, 0.0, 3.0]])
    torch.testing.assert_close(
        generalized_jsd(s, t, beta=0.3, temperature=2.0),
        generalized_jsd(s / 2, t / 2, beta=0.3),
        rtol=0,
        atol=1e-7,
    )


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_its_gradient_passes_gradcheck(beta):
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 5, generator=g, dtype=torch.float64).requires_grad_()
    t = torch.randn(3, 5, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: generalized_jsd(a, b, beta=beta), (s, t), eps=1e-6, atol=1e-7
    )


def test_bad_arguments_are_one_line():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(z, z, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be"):
        generalized_jsd(z, z, beta=0.5, temperature=0.0)
    with pytest.raises(ValueError, match="share the student's vocabulary"):
        generalized_jsd(z, torch.zeros(2, 4), beta=0.5)
