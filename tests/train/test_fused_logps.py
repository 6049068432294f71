"""The trainer's fused log-probs (decoder hidden states + LM head through ops.linear_logps) equal the
logits path in value and in the gradient of every parameter, and are used only where exact."""

from __future__ import annotations

import copy

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models import build_policy, char_tokenizer, lm_head_of
from grpokit.train.batch import Batch

TOKENIZER = char_tokenizer("0123456789+=")


def _engine(model, temperature: float, fused: bool, group_size: int = 1) -> PolicyEngine:
    engine = PolicyEngine.create(
        model,
        TOKENIZER,
        EngineSpec(fused_logps=fused, temperature=temperature, group_size=group_size),
    )
    assert engine.fused == fused  # the backend asked for is the one used
    return engine


def completion_stats(model, batch, rows, temperature, *, fused, with_entropy, group_size=1):
    return _engine(model, temperature, fused, group_size).logps(batch, rows, entropy=with_entropy)


def frozen_logps(model, batch, micro, temperature, fused):
    return _engine(model, temperature, fused).frozen_logps(batch, micro)


def _batch(V: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    B, Lp, T = 6, 5, 4
    prompt_mask = torch.ones(B, Lp, dtype=torch.bool)
    prompt_mask[0, :2] = False  # left padding
    prompt_mask[3, :1] = False
    completion_mask = torch.ones(B, T, dtype=torch.bool)
    completion_mask[1, 2:] = False  # finished early
    return Batch(
        prompt_ids=torch.randint(3, V, (B, Lp), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, V, (B, T), generator=g) * completion_mask,
        completion_mask=completion_mask,
        advantages=torch.randn(B, generator=g),
        sampling_logps=torch.zeros(B, T),
        prompts=[""] * B,
        completions=[""] * B,
        rewards=torch.zeros(B),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_fused_and_logits_paths_agree_in_values_and_every_gradient(temperature):
    model = build_policy(
        hidden_size=32, num_layers=2, num_heads=4, vocab_size=40, seed=1, dropout=0.0
    ).double()
    twin = copy.deepcopy(model)
    assert lm_head_of(model) is not None
    batch = _batch(40)
    rows = slice(0, 6)
    fused = completion_stats(model, batch, rows, temperature, fused=True, with_entropy=True)
    plain = completion_stats(twin, batch, rows, temperature, fused=False, with_entropy=True)
    # positions after a completion's end are padding: their values are never read (the loss masks
    # them) and the two forwards may differ there, so compare and weight the real tokens only
    real = batch.completion_mask
    torch.testing.assert_close(fused.logps[real], plain.logps[real], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.entropy[real], plain.entropy[real], rtol=1e-12, atol=1e-12)
    weights = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * real
    ((fused.logps + 0.1 * fused.entropy) * weights).sum().backward()
    ((plain.logps + 0.1 * plain.entropy) * weights).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    frozen = frozen_logps(model, batch, 4, temperature, fused=True)
    expected = frozen_logps(twin, batch, 4, temperature, fused=False)
    torch.testing.assert_close(frozen[real], expected[real], rtol=1e-12, atol=1e-12)
    assert not frozen.is_inference()  # computed in inference mode, returned usable by autograd


def test_models_that_rescale_their_logits_use_the_logits_path():
    model = build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=20, seed=0)
    model.config.logit_scale = 0.5  # Cohere-style scaling after the head: not hidden · Wᵀ
    assert lm_head_of(model) is None
    model.config.logit_scale = 1.0
    model.config.final_logit_softcapping = 30.0  # Gemma-style soft-capping
    assert lm_head_of(model) is None
    model.config.final_logit_softcapping = None
    assert lm_head_of(model) is not None
    model.lm_head = torch.nn.Sequential(model.lm_head)  # not a plain linear head
    assert lm_head_of(model) is None


def test_lora_policy_exposes_its_base_head():
    pytest.importorskip("peft")
    from grpokit.models import apply_lora

    model = apply_lora(
        build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=20, seed=0, dropout=0.0), r=4
    )
    batch = _batch(20)
    for p in model.parameters():  # make the adapters matter
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    fused = completion_stats(model, batch, slice(0, 6), 1.0, fused=True, with_entropy=False).logps
    plain = completion_stats(model, batch, slice(0, 6), 1.0, fused=False, with_entropy=False).logps
    real = batch.completion_mask
    torch.testing.assert_close(fused[real], plain[real], rtol=1e-5, atol=1e-6)
    # the engine's reference of a LoRA policy: the same model with its adapters off
    ref_fused = _engine(model, 1.0, fused=True).frozen_logps(batch, 6, reference=True)
    ref_plain = _engine(model, 1.0, fused=False).frozen_logps(batch, 6, reference=True)
    torch.testing.assert_close(ref_fused[real], ref_plain[real], rtol=1e-5, atol=1e-6)
    assert (ref_fused - fused.detach()).abs().max() > 1e-3  # the adapters were really switched off


def test_groups_sharing_a_prompt_run_it_once_with_the_same_result():
    """Rows in whole groups of G with one prompt: the trainer runs each prompt once
    (`shared_prefix`); log-probs, entropies and gradients equal the row-by-row path."""
    from unittest import mock

    from grpokit.models.lean_llama import LeanLlamaDecoder

    model = build_policy(
        hidden_size=32, num_layers=2, num_heads=4, vocab_size=40, seed=1, dropout=0.0
    ).double()
    twin = copy.deepcopy(model)
    batch = _batch(40)
    G = 3
    batch.prompt_ids[:] = batch.prompt_ids[::G].repeat_interleave(G, 0)  # groups of 3 share a prompt
    batch.prompt_mask[:] = batch.prompt_mask[::G].repeat_interleave(G, 0)
    calls = []
    original = LeanLlamaDecoder.shared_prefix

    def counted(self, *args, **kwargs):
        calls.append(args[-1])
        return original(self, *args, **kwargs)

    with mock.patch.object(LeanLlamaDecoder, "shared_prefix", counted):
        grouped = completion_stats(
            model, batch, slice(0, 6), 1.0, fused=True, with_entropy=True, group_size=G
        )
        alone = completion_stats(twin, batch, slice(0, 6), 1.0, fused=True, with_entropy=True, group_size=1)
        odd = completion_stats(twin, batch, slice(0, 4), 1.0, fused=True, with_entropy=False, group_size=G)
    assert calls == [G]  # only the first call had whole groups (G = 1, and 4 rows of groups of 3, do not)
    real = batch.completion_mask
    torch.testing.assert_close(grouped.logps[real], alone.logps[real], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grouped.entropy[real], alone.entropy[real], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(odd.logps[real[:4]], alone.logps[:4][real[:4]], rtol=1e-10, atol=1e-12)
    weights = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * real
    (grouped.logps * weights).sum().backward()
    (alone.logps * weights).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        # float32 RMSNorm statistics (as in transformers) bound the agreement, see test_lean_llama
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6 * float(b.grad.abs().max()), msg=name)
