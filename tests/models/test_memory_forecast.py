"""The doctor's memory forecast (models.memory_forecast): its counts against hand arithmetic and against
what torch actually allocates (parameters, AdamW state, the KV cache, what autograd saves), the
micro-batch search, the size parser, and (slow) the whole forecast against a real run's peak RSS."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models import (
    ModelShape,
    StepShape,
    forecast_memory,
    largest_micro_batch,
    lean_decoder,
    parse_bytes,
)
from grpokit.models.memory_forecast import activation_bytes, forward_passes, head_bytes
from grpokit.ops.linear_logps import chunk_rows
from tests.helpers import small_llama

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "doctor_memory.py"
V, H, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 300, 64, 2, 4, 2, 96


def llama(tied: bool = False, kv_heads: int = KV_HEADS, layers: int = LAYERS) -> torch.nn.Module:
    return small_llama((V, H, layers, HEADS, kv_heads, INTERMEDIATE), tied=tied)


# by hand: per layer q and o 64·64 each, k and v 64·(2 heads · 16) each, the MLP 3·64·96, two norms 2·64
PER_LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64
UNTIED = 2 * V * H + LAYERS * PER_LAYER + H  # embedding, layers, final norm, head
TIED = V * H + LAYERS * PER_LAYER + H  # the head is the embedding: counted once


@pytest.mark.parametrize(("tied", "expected"), [(False, UNTIED), (True, TIED)])
def test_parameters_are_counted_exactly_and_tied_embeddings_once(tied, expected):
    model = llama(tied=tied)
    assert sum(p.numel() for p in model.parameters()) == expected  # the hand count is the model's
    shape = ModelShape.of(model)
    assert shape.num_parameters == expected and shape.trainable == expected
    assert shape.tied_embeddings is tied and (shape.num_kv_heads, shape.d) == (KV_HEADS, 16)
    assert ModelShape.from_config(model.config).num_parameters == expected  # without the weights
    assert shape.lean_forward  # a plain Llama: trained through lean_llama's forward


def test_from_config_counts_qwen2_biases_and_a_separate_head_dim():
    """Without the weights: Qwen2's q/k/v biases and tied head, Mistral's head_dim apart from H / h."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=V, hidden_size=H, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS)
    qwen = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common)
    mistral = MistralConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32, **common)
    biases = LAYERS * (64 + 2 * 32)  # q, k and v biases of every layer
    # q and o of 4 heads, k and v of 2, with d = 32 instead of 16
    wide = LAYERS * ((2 * 64 * 128 + 2 * 64 * 64) - (2 * 64 * 64 + 2 * 64 * 32))
    for config, model_class, expected in [
        (qwen, Qwen2ForCausalLM, TIED + biases),
        (mistral, MistralForCausalLM, UNTIED + wide),
    ]:
        assert ModelShape.from_config(config).num_parameters == expected
        assert ModelShape.of(model_class(config)).num_parameters == expected


def test_trainable_parameters_are_those_that_require_grad():
    model = llama()
    model.lm_head.requires_grad_(False)
    shape = ModelShape.of(model)
    assert (shape.num_parameters, shape.trainable_parameters) == (UNTIED, UNTIED - V * H)
    step = StepShape(rows=4, micro_batch_size=4, prompt_length=3, completion_length=5)
    forecast = forecast_memory(shape, step)
    assert forecast.weights == 4 * UNTIED  # every weight stored...
    assert forecast.gradients == 4 * (UNTIED - V * H)  # ...gradients and AdamW only for the trainable ones
    assert forecast.optimizer == 8 * (UNTIED - V * H)


def test_weights_gradients_and_adamw_state_are_what_torch_allocates():
    """float32: 4 bytes a weight, 4 a gradient, 8 of AdamW state (exp_avg, exp_avg_sq) per trainable
    parameter, and a reference copy of 4 a weight with β ≠ 0: the sizes of the real tensors after a
    step of grpokit's own optimizer."""
    from grpokit.config.plan import OptimizerSpec
    from grpokit.train.optim import make_optimizer

    model = llama()
    spec = OptimizerSpec(learning_rate=1e-3, total_updates=1)
    optimizer = make_optimizer(model.parameters(), spec)
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    optimizer.step()
    grads = sum(p.grad.nbytes for p in model.parameters())
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    step = StepShape(rows=4, micro_batch_size=2, prompt_length=3, completion_length=5, reference=True)
    forecast = forecast_memory(ModelShape.of(model), step)
    assert forecast.weights == sum(p.nbytes for p in model.parameters()) == 4 * UNTIED
    assert forecast.gradients == grads == 4 * UNTIED
    assert forecast.optimizer == state == 8 * UNTIED
    assert forecast.reference == 4 * UNTIED
    assert forecast_memory(ModelShape.of(model), replace(step, reference=False)).reference == 0


def test_kv_cache_is_the_decoders_own_cache():
    """2 · layers · kv_heads · head_dim · B · (Lp + T) · bytes: what the lean decoder allocates."""
    model = llama()
    B, Lp, T = 6, 5, 7
    expected = 2 * LAYERS * KV_HEADS * 16 * B * (Lp + T) * 4
    forecast = forecast_memory(
        ModelShape.of(model), StepShape(rows=B, micro_batch_size=2, prompt_length=Lp, completion_length=T)
    )
    assert forecast.kv_cache == expected
    cache = lean_decoder(model).new_cache(B, Lp + T)
    assert cache.keys.nbytes + cache.values.nbytes == expected
    half = StepShape(rows=B, micro_batch_size=2, prompt_length=Lp, completion_length=T, compute_bytes=2)
    assert forecast_memory(ModelShape.of(model), half).kv_cache == expected // 2  # bf16 under autocast


def shape_of(V: int, H: int, tied: bool = False) -> ModelShape:
    return ModelShape(
        vocab_size=V,
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=4 * H,
        tied_embeddings=tied,
        num_parameters=1000,
    )


def test_logits_chunk_bytes_of_the_fused_head():
    """V = 32000, H = 256: chunk_rows 131 (2**22 // V) rows of float32 logits; the forward keeps a chunk
    and its exponentials, the backward a chunk, the hidden states' gradient [b·T, H] and, when added
    to an existing gradient, the head's whole [V, H] float32 gradient."""
    assert chunk_rows(32000, 256) == 131
    chunk = 131 * 32000 * 4
    one = StepShape(rows=4, micro_batch_size=4, prompt_length=2, completion_length=64)  # 256 tokens
    assert head_bytes(shape_of(32000, 256), one) == max(2 * chunk, chunk + 256 * 256 * 4)
    two = replace(one, micro_batch_size=2)  # 128 tokens a micro-batch (one chunk of 128 rows), the
    # second adds to .grad
    assert head_bytes(shape_of(32000, 256), two) == 128 * 32000 * 4 + 128 * 256 * 4 + 32000 * 256 * 4
    tied = head_bytes(shape_of(32000, 256, tied=True), one)  # the embedding's gradient arrives later
    assert tied == chunk + 256 * 256 * 4 + 32000 * 256 * 4
    short = StepShape(rows=1, micro_batch_size=1, prompt_length=2, completion_length=10)  # 10 rows < 131
    assert head_bytes(shape_of(32000, 256), short) == max(2 * 10 * 32000 * 4, 10 * 32000 * 4 + 10 * 256 * 4)
    unfused = replace(one, fused_logps=False)  # [b, T + 1, V] logits and their gradient, 4 chunks
    assert head_bytes(shape_of(32000, 256), unfused) == 2 * 4 * 65 * 32000 * 4 + 4 * (1 << 21) * 4


def saved_for_backward(model, G: int, b: int, Lp: int, T: int, *, fused: bool = True, padded: bool = False):
    """Bytes of the distinct storages (parameters excepted) autograd saves in the engine's training
    forward over b rows: prompts of Lp tokens shared by groups of G rows, T completion tokens."""
    tokenizer = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = PolicyEngine.create(model, tokenizer, EngineSpec(fused_logps=fused, group_size=G))
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(b, Lp, dtype=torch.bool)
    if padded:
        prompt_mask[:, 0] = False
    batch = types.SimpleNamespace(
        prompt_ids=torch.randint(3, V, (b // G, Lp), generator=g).repeat_interleave(G, 0),
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, V, (b, T), generator=g),
        completion_mask=torch.ones(b, T, dtype=torch.bool),
        completion_attention=None,
    )
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.logps(batch, slice(0, b), entropy=True)
    return sum(saved.values())


@pytest.mark.parametrize(
    ("G", "b", "Lp", "T", "fused", "padded", "passes"),
    [
        (1, 2, 5, 7, True, False, 1),  # lean, one pass over prompt and completion
        (4, 4, 3, 20, True, False, 2),  # lean, each prompt once, then the completions after its keys
        (2, 4, 5, 7, True, False, 1),  # lean, prompt and completions packed in one row per group
        (1, 2, 5, 7, False, True, 1),  # transformers' forward (unfused logits), left-padded prompts
        (4, 4, 3, 20, False, True, 1),
    ],
)
def test_activations_are_what_autograd_saves(G, b, Lp, T, fused, padded, passes):
    """The forecast's activations (and, unfused, the logits the log-softmax keeps) against the bytes of
    every tensor autograd saves in the real training forward. Agreement to 1e-3: the int64 token ids
    of the two-pass and packed routes share or index storages the count takes apart (a few hundred
    bytes of 0.2-1 MB)."""
    model = llama(kv_heads=HEADS if not fused else KV_HEADS)
    step = StepShape(
        rows=b, micro_batch_size=b, prompt_length=Lp, completion_length=T, group_size=G, fused_logps=fused
    )
    shape = ModelShape.of(model)
    assert len(forward_passes(shape, step)) == passes
    expected = activation_bytes(shape, step) + (0 if fused else b * (T + 1) * V * 4)  # the kept logits
    got = saved_for_backward(model, G, b, Lp, T, fused=fused, padded=padded)
    assert abs(expected - got) <= 1e-3 * got, (expected, got)


def test_the_peak_is_the_largest_phase_plus_the_baseline():
    shape = ModelShape.of(llama())
    step = StepShape(rows=8, micro_batch_size=2, prompt_length=5, completion_length=7, reference=True)
    f = forecast_memory(shape, step, baseline_bytes=10**8)
    persistent = f.weights + f.reference + f.gradients + f.optimizer
    assert f.sampling == persistent + f.kv_cache + f.decode_logits
    assert f.update == persistent + max(f.activations + f.logits, f.held_gradients)
    assert f.total == 10**8 + max(f.sampling, f.reference_pass, f.update)
    assert f.peak_phase == "update"
    # many rows sampled, one trained at a time: the KV cache of all 64 rows (256 bytes a token) outgrows
    # one row's activations (6 KB a token), and sampling sets the peak
    wide = StepShape(rows=64, micro_batch_size=1, prompt_length=50, completion_length=500)
    wide = forecast_memory(shape, wide)
    assert wide.peak_phase == "sampling" and wide.total == wide.sampling


def test_a_distillation_teacher_adds_its_weights_its_pass_and_gkds_held_states():
    """loss_type=opd or gkd: the teacher's weights (N_T·m) stay all run; its gradient-free pass is the
    frozen-pass phase when it outgrows the reference's; gkd holds its hidden states [B, T, H_T] through
    the update. By hand, on a teacher twice the policy's depth."""
    policy, teacher = ModelShape.of(llama()), ModelShape.of(llama(layers=2 * LAYERS))
    step = StepShape(rows=8, micro_batch_size=2, prompt_length=5, completion_length=7)
    alone = forecast_memory(policy, step)
    opd = forecast_memory(policy, step, teacher=teacher)
    gkd = forecast_memory(policy, replace(step, teacher_states=True), teacher=teacher)
    assert alone.teacher == alone.teacher_states == alone.reference_pass == 0
    assert opd.teacher == teacher.num_parameters * 4 == (2 * V * H + 2 * LAYERS * PER_LAYER + H) * 4
    assert opd.sampling == alone.sampling + opd.teacher and opd.teacher_states == 0
    assert opd.update == alone.update + opd.teacher
    teacher_pass = forecast_memory(teacher, replace(step, reference=True)).frozen_pass  # its own shape
    assert (
        opd.reference_pass
        == alone.sampling - alone.kv_cache - alone.decode_logits + opd.teacher + teacher_pass
    )
    chunk = 10 * (2 * 7) * V * 4  # ten float32 buffers of one chunk: the micro-batch's 2·7 positions
    assert gkd.teacher_states == 8 * 7 * H * 4 + chunk  # B·T·H_T float32, and the loss's chunk
    assert gkd.update == opd.update + gkd.teacher_states and gkd.sampling == opd.sampling
    # the micro-batch search counts the teacher too
    budget = forecast_memory(policy, replace(step, micro_batch_size=8)).total
    assert largest_micro_batch(policy, step, budget) == 8
    assert largest_micro_batch(policy, step, budget, teacher=teacher) < 8


def test_largest_micro_batch_is_monotone_in_the_budget_and_none_when_nothing_fits():
    shape = ModelShape.of(llama())
    step = StepShape(rows=24, micro_batch_size=24, prompt_length=10, completion_length=64, group_size=4)
    totals = {m: forecast_memory(shape, replace(step, micro_batch_size=m)).total for m in (1, 2, 3, 4, 24)}
    assert totals[1] < totals[2] < totals[4] < totals[24]  # activations grow with the micro-batch
    assert largest_micro_batch(shape, step, totals[1] - 1) is None
    assert largest_micro_batch(shape, step, totals[1]) == 1
    assert largest_micro_batch(shape, step, totals[4]) == 4  # 4 fits, 6 (the next divisor) does not
    assert largest_micro_batch(shape, step, totals[24]) == 24
    found = [largest_micro_batch(shape, step, budget) for budget in range(totals[1], totals[24] + 1, 2**16)]
    assert found == sorted(found) and all(24 % m == 0 for m in found)
    baseline = 10**9  # the baseline counts against the budget
    assert largest_micro_batch(shape, step, totals[24], baseline_bytes=baseline) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("24GB", 24 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5gib", 3 * 2**29),
        ("64 KiB", 2**16),
        ("2TB", 2 * 10**12),
        ("1000", 1000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80G", "lots", "", "GiB", "-1GiB", "8 GiB extra"])
def test_parse_bytes_names_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"binary \(KiB, MiB, GiB, TiB\) or decimal \(KB, MB, GB, TB\)"):
        parse_bytes(text)


def test_step_shape_rejects_what_no_step_has():
    with pytest.raises(ValueError, match="micro_batch_size"):
        StepShape(rows=4, micro_batch_size=0, prompt_length=3, completion_length=5)
    with pytest.raises(ValueError, match="multiple of group_size"):
        StepShape(rows=6, micro_batch_size=2, prompt_length=3, completion_length=5, group_size=4)


@pytest.mark.slow
def test_forecast_is_within_25_percent_of_a_real_runs_peak_rss():
    """benchmarks/doctor_memory.py's small size (20.6M parameters, V = 32000) in a fresh process: two
    GRPO steps through train_grpo, the peak RSS before the final checkpoint against the forecast."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARK), "--child", "small"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["parameters"] == 20_580_608
    assert abs(row["ratio"] - 1) <= 0.25, row
    # the model's part dominates the process's own: the forecast is not the baseline alone
    assert row["forecast_bytes"] - row["baseline_bytes"] > 0.4 * row["baseline_bytes"]
