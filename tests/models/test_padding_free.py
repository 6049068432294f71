"""The padding-free packed pass (issue 28, point 2): the lean decoder's `padding_free` runs each
prompt once per group and only the completions' attended tokens, and equals the padded pass in
float32: the states, the loss of every loss type and every parameter's gradient, on ragged
completions, left-padded prompts, grouped-query attention and multi-turn masks; the backend takes
it where it pays (a measured share of padding) and never where it could not be exact."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models import backend_of, build_policy, char_tokenizer, lean_decoder
from grpokit.models.backend import PADDING_FREE_MIN_WIDTH, PADDING_FREE_SHARE, padding_free_pays
from grpokit.models.lean_llama import LeanLlamaDecoder
from grpokit.ops import POLICY_LOSS_TYPES, grpo_loss
from grpokit.train.batch import Batch

TOKENIZER = char_tokenizer("0123456789+=")
V = len(TOKENIZER)


def _policy(kv_heads: int | None = None):
    model = build_policy(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=V, dropout=0.0, seed=0, intermediate_size=96
    )
    if kv_heads is not None:  # grouped-query attention
        from transformers import LlamaForCausalLM

        model.config.num_key_value_heads = kv_heads
        torch.manual_seed(0)
        model = LlamaForCausalLM(model.config)
    return model.train()


def _work(P: int, G: int, lengths: list[int], Lp: int = 6, T: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prefix_mask = torch.ones(P, Lp, dtype=torch.bool)
    prefix_mask[0, :3] = False  # left padding of two widths
    prefix_mask[-1, :1] = False
    prefix = torch.randint(3, V, (P, Lp), generator=g) * prefix_mask
    suffix_mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]  # [P·G, T]
    suffix = torch.randint(3, V, (P * G, T), generator=g) * suffix_mask
    return prefix, prefix_mask, suffix, suffix_mask


def _grads_close(model, twin, rtol: float = 1e-5, atol: float | None = None) -> None:
    # float32 sums over another set of rows in another order: the two agree to round-off, within
    # rtol of each parameter's largest gradient (and within `atol` where given). rtol is 1e-5, not
    # 1e-6: a weight gradient sums ~B·T products of float32 values (eps 1.2e-7), and the worst entry
    # was 1.04e-6 of the largest on an AVX-512 machine, 7e-7 with ATEN_CPU_CAPABILITY=default. A wrong
    # mask or position moves them by O(1).
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        if b.grad is None:
            assert a.grad is None, name
            continue
        if atol is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=atol, msg=name)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=rtol * float(b.grad.abs().max()), msg=name)


@pytest.mark.parametrize(("G", "kv_heads"), [(1, None), (3, None), (3, 2), (2, 1)])
def test_padding_free_states_and_gradients_equal_the_padded_rows(G, kv_heads):
    """Completions of lengths 7 (full), 5, 3, 2, 1 and 0, prompts left-padded: every state that scores
    a completion token equals the one from the padded rows (each prompt repeated, all padded to
    Lp + T), and so does every parameter's gradient."""
    P = 6 // G
    lengths = [7, 3, 1, 5, 0, 2][: P * G]
    model, twin = _policy(kv_heads), _policy(kv_heads)
    prefix, prefix_mask, suffix, suffix_mask = _work(P, G, lengths)
    packed = lean_decoder(model).padding_free(prefix, prefix_mask, suffix, suffix_mask, G)  # [B, T, H]
    ids = torch.cat([prefix.repeat_interleave(G, 0), suffix], dim=1)
    mask = torch.cat([prefix_mask.repeat_interleave(G, 0), suffix_mask], dim=1)
    Lp, T = prefix.shape[1], suffix.shape[1]
    padded = lean_decoder(twin)(input_ids=ids, attention_mask=mask).last_hidden_state[:, Lp - 1 : Lp - 1 + T]
    scored = suffix_mask
    assert packed.shape == padded.shape
    torch.testing.assert_close(packed[scored], padded[scored], rtol=0, atol=1e-6)
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(2)) * scored[..., None]
    (packed * weights).sum().backward()
    (padded * weights).sum().backward()
    _grads_close(model, twin)


def test_completions_with_no_attended_input_are_scored_by_the_prompt_alone():
    """No completion token is an input (all empty): nothing to pack; token 0's state is the prompt's
    last, and the states after padding are 0."""
    model = _policy()
    prefix, prefix_mask, suffix, suffix_mask = _work(2, 2, [0, 0, 0, 0])
    packed = lean_decoder(model).padding_free(prefix, prefix_mask, suffix, suffix_mask, 2)
    ids = torch.cat([prefix.repeat_interleave(2, 0), suffix], dim=1)
    mask = torch.cat([prefix_mask.repeat_interleave(2, 0), suffix_mask], dim=1)
    padded = lean_decoder(model)(input_ids=ids, attention_mask=mask).last_hidden_state[:, 5:12]
    torch.testing.assert_close(packed[:, 0], padded[:, 0], rtol=0, atol=1e-6)
    assert packed[:, 1:].abs().max() == 0


def _batch(G: int, multi_turn: bool) -> Batch:
    """3 prompts × G completions, ragged; with `multi_turn`, tool output inside some completions: attended
    by the forward (completion_attention) but not trained on (completion_mask)."""
    P, T = 3, 8
    lengths = [8, 5, 2, 7, 1, 4, 6, 3, 8][: P * G]
    prefix, prefix_mask, suffix, attention = _work(P, G, lengths, T=T, seed=3)
    mask = attention.clone()
    if multi_turn:
        mask[0, 2:4] = False  # an observation inside the transcript
        mask[1, 1:3] = False
    g = torch.Generator().manual_seed(4)
    return Batch(
        prompt_ids=prefix.repeat_interleave(G, 0),
        prompt_mask=prefix_mask.repeat_interleave(G, 0),
        completion_ids=suffix,
        completion_mask=mask,
        advantages=torch.randn(P * G, generator=g),
        sampling_logps=torch.zeros(P * G, T),
        prompts=[""] * (P * G),
        completions=[""] * (P * G),
        rewards=torch.zeros(P * G),
        completion_attention=attention if multi_turn else None,
    )


@pytest.mark.parametrize("loss_type", sorted(POLICY_LOSS_TYPES))
@pytest.mark.parametrize(("G", "multi_turn"), [(3, False), (3, True), (1, True)])
def test_loss_and_gradients_of_every_loss_type_equal_the_padded_pass(loss_type, G, multi_turn):
    """Through the engine (fused head, entropies): the padded routes (`shared_prefix` for whole groups,
    full rows otherwise) and the padding-free pass give the same loss and gradients, β > 0 and an
    old policy that differs, so that ratios, clipping and the KL term all act."""
    model = _policy(2)
    twin = copy.deepcopy(model)
    batch = _batch(G, multi_turn)
    g = torch.Generator().manual_seed(5)
    old = torch.randn(batch.completion_ids.shape, generator=g) * 0.1 - 2.5
    ref = torch.randn(batch.completion_ids.shape, generator=g) * 0.1 - 2.5
    results = {}
    for packing, module in (("always", model), ("never", twin)):
        engine = PolicyEngine.create(module, TOKENIZER, EngineSpec(group_size=G))
        engine.backend.packing = packing
        stats = engine.logps(batch, slice(0, batch.completion_ids.shape[0]), entropy=True)
        out = grpo_loss(
            stats.logps, batch.advantages, batch.completion_mask, old_logps=old, ref_logps=ref,
            entropies=stats.entropy.detach(), loss_type=loss_type, beta=0.04, max_completion_length=8,
        )  # fmt: skip
        out.loss.backward()
        results[packing] = out.loss.detach()
    torch.testing.assert_close(results["always"], results["never"], rtol=0, atol=1e-6)
    _grads_close(model, twin, atol=1e-6)  # the loss's gradients are ~1e-2 here: 1e-6 is the bound


def test_the_backend_packs_where_padding_pays_and_only_where_exact():
    """`auto` takes the padding-free pass when at most PADDING_FREE_SHARE of the completion slots are
    attended and completions are at least PADDING_FREE_MIN_WIDTH wide (both measured), the padded
    route (`shared_prefix` for whole groups) otherwise; never when an attended token follows padding
    (the pack assumes attended tokens first)."""
    assert (PADDING_FREE_SHARE, PADDING_FREE_MIN_WIDTH) == (0.9, 32)  # the cases below sit on either side
    W = PADDING_FREE_MIN_WIDTH
    assert padding_free_pays(torch.ones(10, W, dtype=torch.bool)) is False
    assert padding_free_pays(torch.arange(W)[None] < torch.tensor([W] * 9 + [W - 32])[:, None]) is True  # 90%
    assert padding_free_pays(torch.arange(W)[None] < torch.tensor([W] * 9 + [W - 31])[:, None]) is False
    narrow = torch.arange(W - 1)[None] < torch.tensor([W - 1] * 9 + [0])[:, None]  # 90%, one slot too narrow
    assert padding_free_pays(narrow) is False
    model = _policy()
    backend = backend_of(model)
    calls: list[str] = []

    def spy(name):
        original = getattr(LeanLlamaDecoder, name)

        def counted(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return mock.patch.object(LeanLlamaDecoder, name, counted)

    prefix, prefix_mask, suffix, suffix_mask = _work(2, 3, [W] * 6, T=W)
    rows_prefix, rows_mask = prefix.repeat_interleave(3, 0), prefix_mask.repeat_interleave(3, 0)
    ragged = torch.arange(W)[None] < torch.tensor([W, 2, 3, W, 1, 4])[:, None]
    holes = ragged.clone()
    holes[0, 2] = False  # attended tokens after a padding one
    with spy("shared_prefix"), spy("padding_free"):
        backend.hidden(rows_prefix, rows_mask, suffix, suffix_mask, 3)  # full length
        backend.hidden(rows_prefix, rows_mask, suffix, ragged, 3)
        backend.hidden(rows_prefix, rows_mask, suffix, holes, 3)
        backend.hidden(rows_prefix, rows_mask, suffix[:, : W - 1], ragged[:, : W - 1], 3)  # too narrow
        backend.hidden(rows_prefix[:5], rows_mask[:5], suffix[:5], ragged[:5], 3)  # not whole groups
        backend.packing = "never"
        backend.hidden(rows_prefix, rows_mask, suffix, ragged, 3)
    assert calls == [
        "shared_prefix",
        "padding_free",
        "shared_prefix",
        "shared_prefix",
        "padding_free",
        "shared_prefix",
    ]
