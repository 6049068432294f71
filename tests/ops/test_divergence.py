"""The generalised JSD of GKD (`ops.generalized_jsd`, issue 27): against a direct computation over
full distributions written out term by term, β = 0 and β = 1 as the forward and reverse KL, symmetric
at β = 0.5 under swapping the models, 0 where they agree, and its gradient by gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.ops import HeadStates, chunked_generalized_jsd, generalized_jsd


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


def _heads(N=11, H=5, V=13, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    student = HeadStates(
        torch.randn(N, H, generator=g, dtype=dtype).requires_grad_(),
        torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(),
        torch.randn(V, generator=g, dtype=dtype).requires_grad_(),
    )
    # the teacher: another hidden size, no bias, frozen
    teacher = HeadStates(
        torch.randn(N, 7, generator=g, dtype=dtype), torch.randn(V, 7, generator=g, dtype=dtype)
    )
    ids = torch.randint(0, V, (N,), generator=g)
    return student, teacher, ids


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("chunk_rows", [1, 4, 11, 64])
def test_chunked_from_hidden_states_equals_the_whole_logits_value_and_gradient(beta, chunk_rows):
    """GKD's loss from hidden states and heads, a chunk of positions at a time (re-formed in the backward
    pass), against the whole [N, V] logits through `generalized_jsd`: equal values, log-probs and
    gradients for the student's states, weight and bias, whatever the chunk size."""
    student, teacher, ids = _heads()
    out = chunked_generalized_jsd(student, teacher, ids, beta=beta, temperature=0.7, chunk_rows=chunk_rows)
    z_s = student.states @ student.weight.T + student.bias  # [N, V]
    z_t = teacher.states @ teacher.weight.T
    whole = generalized_jsd(z_s, z_t, beta=beta, temperature=0.7)  # [N]
    torch.testing.assert_close(out.per_token, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        out.student_logps, torch.log_softmax(z_s / 0.7, -1).gather(-1, ids[:, None]).squeeze(-1).detach()
    )
    torch.testing.assert_close(
        out.teacher_logps, torch.log_softmax(z_t / 0.7, -1).gather(-1, ids[:, None]).squeeze(-1)
    )
    assert not out.student_logps.requires_grad
    p = torch.softmax(z_s / 0.7, -1)
    torch.testing.assert_close(out.student_entropy, -(p * p.log()).sum(-1).detach(), rtol=0, atol=1e-12)
    weights = torch.linspace(0.5, 1.5, 11, dtype=torch.float64)  # a weighted sum, as a masked loss is
    inputs = (student.states, student.weight, student.bias)
    mine = torch.autograd.grad((out.per_token * weights).sum(), inputs)
    expected = torch.autograd.grad((whole * weights).sum(), inputs)
    for a, b in zip(mine, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_chunked_passes_gradcheck():
    student, teacher, _ = _heads(N=5, H=3, V=6, seed=3)

    def loss(states, weight, bias):
        heads = HeadStates(states, weight, bias)
        return chunked_generalized_jsd(heads, teacher, beta=0.4, chunk_rows=2).per_token.sum()

    assert torch.autograd.gradcheck(loss, (student.states, student.weight, student.bias), eps=1e-6, atol=1e-7)


def test_chunked_keeps_no_logits_for_the_backward_pass():
    """What autograd saves between the forward and backward passes holds no tensor of N·V elements
    (the whole logits) nor of chunk·V (a chunk's): each chunk's logits are re-formed when needed."""
    N, H, V = 64, 8, 512
    student, teacher, ids = _heads(N=N, H=H, V=V, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunked_generalized_jsd(student, teacher, ids, beta=0.5, chunk_rows=16)
    assert saved and max(saved) < 16 * V  # the largest is the [V, H] weight (4096 < 8192)
    out.per_token.sum().backward()
    assert student.weight.grad is not None and student.states.grad.shape == (N, H)
    # the same with the logits kept: the check above would see them
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        generalized_jsd(student.states @ student.weight.T, teacher.states @ teacher.weight.T, beta=0.5)
    assert max(saved) >= N * V


def test_chunked_from_logits_and_with_no_position():
    """No head: the states are the logits themselves; no position: empty results."""
    student, teacher, ids = _heads()
    z_s = (student.states @ student.weight.T).detach().requires_grad_()  # [N, V]
    z_t = teacher.states @ teacher.weight.T
    out = chunked_generalized_jsd(HeadStates(z_s), HeadStates(z_t), ids, beta=0.5, chunk_rows=3)
    torch.testing.assert_close(out.per_token, generalized_jsd(z_s, z_t, beta=0.5), rtol=0, atol=1e-12)
    out.per_token.sum().backward()
    assert z_s.grad is not None and z_s.grad.abs().sum() > 0
    empty = chunked_generalized_jsd(HeadStates(z_s[:0]), HeadStates(z_t[:0]), ids[:0], beta=0.5)
    assert empty.per_token.shape == (0,) and empty.teacher_logps.shape == (0,)
    # a micro-batch with no counted token (all truncated and masked): its loss, 0, still back-propagates,
    # every input's gradient 0 (a backward on one rank and not another would hang data parallelism)
    heads = HeadStates(student.states, student.weight, student.bias)
    none = chunked_generalized_jsd(heads.at(torch.zeros(11, dtype=torch.bool)), HeadStates(z_t[:0]), beta=0.5)
    none.per_token.sum().backward()
    for t in (student.states, student.weight, student.bias):
        assert t.grad is not None and (t.grad == 0).all()
