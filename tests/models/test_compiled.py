"""torch_compile (engine/compiled.py): the compiled training passes compute the eager passes' numbers
to float32 round-off, on a bounded number of bucketed shapes, and what they cannot take is refused in
one line.

Tolerance. The compiled pass runs the same float32 operations as the eager one on shapes padded to a
bucket; its kernels may sum in another order (inductor fuses and reorders reductions; padded widths
change how matrix products are blocked). A float32 sum of n terms reordered moves by at most about
n·ε·Σ|terms| (ε = 2^-24 ≈ 6e-8 per rounding); the widest sums here are the head's log-sum-exp over V = 14
logits and the attention/MLP products of width ≤ 64, of terms of order 1 through 2 layers, so
log-probs of magnitude ≤ log V ≈ 2.6 move by well under 64·6e-8·4 ≈ 1.5e-5: 2e-5 absolute bounds them
(measured: 5e-7). Gradients are sums over the batch's B·T = 72 tokens as well, relative to their
largest entry: 1e-4 (measured: 6e-7)."""

from __future__ import annotations

import copy

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.engine import EngineSpec, PolicyEngine, Wrapping
from grpokit.engine.compiled import compile_refusal, compiles, width_bucket
from grpokit.models.backend import backend_of
from grpokit.rollout import SamplingParams
from grpokit.train.batch import Batch
from tests.models.test_engine import G, tiny_policy

LOGPS_TOL, GRAD_TOL = 2e-5, 1e-4  # see the module's docstring


def test_width_buckets_are_few_and_waste_at_most_a_third():
    widths = range(1, 4097)
    buckets = {n: width_bucket(n) for n in widths}
    assert all(n <= b and b % 4 == 0 for n, b in buckets.items())
    assert all(b <= max(n + 3, n * 4 / 3) for n, b in buckets.items())  # 3 tokens, or a third
    for k in range(5, 12):  # at most four buckets between two powers of two, past 16
        assert len({b for n, b in buckets.items() if 2**k < n <= 2 ** (k + 1)}) == 4
    assert len(set(buckets.values())) == 4 + 4 * 8  # 4, 8, 12, 16, then four in each octave to 4096


def test_auto_is_the_measured_default_of_each_device():
    assert compiles(True, torch.device("cpu")) and not compiles(False, torch.device("cpu"))
    assert not compiles("auto", torch.device("cpu"))  # measured: benchmarks/RESULTS.md


def batch_of(engine: PolicyEngine, T: int, seed: int = 1) -> Batch:
    params = SamplingParams(num_generations=G, max_completion_length=T, seed=seed)
    prompts = ["12+3=", "7+45=", "1+1="]
    rollout = engine.generate(prompts, params)
    B = rollout.completion_ids.shape[0]
    return Batch(
        prompt_ids=rollout.prompt_ids,
        prompt_mask=rollout.prompt_mask,
        completion_ids=rollout.completion_ids,
        completion_mask=rollout.completion_mask,
        advantages=torch.linspace(-1, 1, B),
        sampling_logps=rollout.sampling_logps,
        prompts=[p for p in prompts for _ in range(G)],
        completions=rollout.completions,
        rewards=torch.zeros(B),
    )


def passes(engine: PolicyEngine, batch: Batch, rows: slice) -> dict[str, torch.Tensor]:
    """The training pass's log-probs, entropies and gradients of a loss of both, and the reference's."""
    engine.module.zero_grad(set_to_none=True)
    stats = engine.logps(batch, rows, entropy=True)
    mask = batch.completion_mask[rows]
    (
        torch.where(mask, stats.logps * batch.advantages[rows, None] + 0.1 * stats.entropy, 0.0).sum()
    ).backward()
    out = {"logps": stats.logps.detach(), "entropy": stats.entropy.detach()}
    out |= {f"grad.{n}": p.grad.clone() for n, p in engine.module.named_parameters()}
    out["reference"] = engine.frozen_logps(batch, 4, reference=True)
    out["mask"] = mask
    return out


def compare(eager: dict[str, torch.Tensor], compiled: dict[str, torch.Tensor]) -> None:
    mask = eager["mask"]
    for key in ("logps", "entropy"):
        gap = (eager[key] - compiled[key]).abs()[mask]
        assert gap.max() <= LOGPS_TOL, (key, gap.max())
    gap = (eager["reference"] - compiled["reference"]).abs()[eager["reference"] != 0]
    assert gap.max() <= LOGPS_TOL
    for key in [k for k in eager if k.startswith("grad.")]:
        scale = eager[key].abs().max().clamp(min=1e-12)
        assert (eager[key] - compiled[key]).abs().max() / scale <= GRAD_TOL, key


def engines(compiler: str, layers: int = 2, checkpointing: bool = False) -> tuple[PolicyEngine, PolicyEngine]:
    out = []
    for compiled in (False, True):
        model, tokenizer = tiny_policy(seed=3, layers=layers)
        model.model.gradient_checkpointing = checkpointing  # (what gradient_checkpointing_enable sets)
        spec = EngineSpec(group_size=G, torch_compile=compiled, torch_compile_backend=compiler)
        reference = copy.deepcopy(model).requires_grad_(False)
        out.append(PolicyEngine.create(model, tokenizer, spec, reference=reference))
    return out[0], out[1]


@pytest.mark.slow  # (compiling takes seconds; the fast tier compiles in the bucket test below)
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
# aot_eager: dynamo's trace and AOT autograd's backward; inductor: the generated kernels too
def test_compiled_passes_equal_the_eager_ones(compiler):
    eager, compiled = engines(compiler, layers=1 if compiler == "inductor" else 2)  # (inductor: compile time)
    batch = batch_of(eager, T=9)  # 12 rows of uneven lengths, prompts of unequal widths
    for rows in (slice(0, 12), slice(4, 8)):  # whole groups (prompt shared), and one group
        compare(passes(eager, batch, rows), passes(compiled, batch, rows))
    assert compiled.compiled is not None and eager.compiled is None
    # with gradients: 12 rows and 4 rows; frozen (the reference, 4 rows a pass): one; twice run, three
    assert compiled.compiled.graph_count == 3


@pytest.mark.slow
def test_compiled_passes_with_activation_checkpointing_equal_the_eager_ones():
    eager, compiled = engines("aot_eager", checkpointing=True)
    batch = batch_of(eager, T=9)
    compare(passes(eager, batch, slice(0, 12)), passes(compiled, batch, slice(0, 12)))


@pytest.mark.slow  # a run under torch.compile (3.7 s): the full suite runs it, the fast tier stays under 75 s
def test_a_run_compiles_one_graph_per_bucket_and_pass():
    """Completion widths 1..12 fall in three buckets (4, 8, 12): three graphs with gradients."""
    _, compiled = engines("aot_eager", layers=1)
    for T in range(1, 13):
        batch = batch_of(compiled, T=T, seed=T)
        T_real = batch.completion_ids.shape[1]
        stats = compiled.logps(batch, slice(0, 12), entropy=False)
        assert stats.logps.shape == (12, T_real)
    assert compiled.compiled is not None
    widths = {key[-1] for key in compiled.compiled.graphs}
    assert widths <= {4, 8, 12} and compiled.compiled.graph_count == len(compiled.compiled.graphs) <= 3


def test_what_compile_cannot_take_is_refused_in_one_line():
    model, tokenizer = tiny_policy()
    backend = backend_of(model)
    assert compile_refusal(backend, model, wrapped=False, episodes=False) is None
    refusals = {
        "torchrun": compile_refusal(backend, model, wrapped=True, episodes=False),
        "LoRA": compile_refusal(
            backend, type("Peft", (torch.nn.Module,), {"get_base_model": 1})(), False, False
        ),
        "multi-turn": compile_refusal(backend, model, wrapped=False, episodes=True),
        "Llama-family": compile_refusal(None, model, wrapped=False, episodes=False, compiler="inductor"),
        "not a torch.compile backend": compile_refusal(backend, model, False, False, compiler="tensorrt9"),
    }
    for culprit, line in refusals.items():
        assert line is not None and culprit in line and "\n" not in line and "torch_compile" in line
    spec = EngineSpec(group_size=G, torch_compile=True)
    with pytest.raises(ValueError, match="DDP or FSDP"):
        PolicyEngine.create(model, tokenizer, spec, wrapping=Wrapping(model))
    with pytest.raises(ValueError, match="fused_logps=true"):  # the logits route is not compiled
        PolicyEngine.create(model, tokenizer, EngineSpec(torch_compile=True, fused_logps=False))


def test_the_config_refuses_what_compile_does_not_read():
    with pytest.raises(ValueError, match="torch_compile_mode is read only with torch_compile"):
        GRPOConfig(torch_compile=False, torch_compile_mode="max-autotune")
    with pytest.raises(ValueError, match="torch_compile with loss_type=gkd is refused"):
        GRPOConfig(loss_type="gkd", teacher_model="x", beta=0.0, torch_compile=True)
    with pytest.raises(ValueError, match="torch_compile_backend"):
        GRPOConfig(torch_compile=True, torch_compile_backend="not a name")
