"""grpokit on a CUDA GPU, with tiny models: run with `pytest -m gpu tests/gpu` on a machine with one.
Without CUDA every test here is skipped (and the default run, `-m 'not gpu'`, deselects them).

1. A GRPO run with device=cuda: its first steps equal the same run on the CPU (same completions,
   rewards, loss, gradient norm, entropy) and it ends at the same weights; the policy, its reference
   and the AdamW state live on the GPU during the run; and over 30 steps the sampled reward rises.
2. Resume across devices: a checkpoint written on the GPU resumes on the CPU and one written on the
   CPU resumes on the GPU, both ending at the weights of an uninterrupted run.
3. Reward-model training on cuda equals the CPU run step for step, and learns the preference task.
4. The decode loop (eager and CUDA-graph steps) on a GPU model returns its Rollout on the host, with
   the CPU's greedy completions.
5. dtype=bfloat16 on cuda: forward passes in bfloat16, the trainable weights and AdamW state float32.

How runs on two devices are made comparable (neither changes what is being tested):

* Random draws: each sampling call seeds a generator on the model's device, and CUDA's generator
  (Philox) yields other numbers than the CPU's (Mersenne Twister) for the same seed, so the same run
  on two devices samples different completions. The cross-device tests (`host_draws`) replace the
  decode loop's `uniforms` by numbers from a CPU generator with the device generator's seed, moved
  to the device: one stream of numbers on both devices, whichever step (eager or static) draws.
* Matmul precision: grpokit turns TF32 on for CUDA float32 matmuls (`enable_fast_matmul`: 10-bit
  mantissa, ~1e-3 relative error per product). These tests check placement, resume and precision
  handling, not TF32, so they run CUDA matmuls in full float32 (`full_float32`); what remains between
  the devices is the order of float32 reductions (~1e-6 relative).
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from grpokit.train.grpo import train_grpo
from tests.helpers import read_metrics, read_steps
from tests.train.helpers import ones_reward, tiny_config, weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]

CUDA = torch.device("cuda")
RUNS = (("host", "cpu"), ("gpu", "cuda"))  # (directory, device) of a run on each device
LR = 1e-2  # tiny_config's learning rate
# Tolerances, from two facts. (a) Every AdamW step moves each weight by about the learning rate
# whatever the size of its gradient (m̂/√v̂ ≈ ±1), so any real divergence between two runs (another
# sample, a lost or misplaced optimizer state, a step on stale weights, a wrong normaliser) shows as
# differences of order LR = 1e-2 in the weights and of order 1 in the step's metrics. (b) The same
# float32 computation on the CPU and the GPU differs only in the order of its reductions: ~1e-6
# relative in a loss or a norm, ~1e-7 absolute in a weight of these tiny models. WEIGHT_ATOL and
# METRIC_RTOL sit 100x above (b) and 100x below (a).
WEIGHT_ATOL = 1e-4
METRIC_RTOL = 1e-4


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def full_float32(monkeypatch):
    """CUDA float32 matmuls without TF32, for the whole test: grpokit's `enable_fast_matmul` (wherever
    a module imported it) does nothing, and both TF32 switches are off; restored afterwards."""
    import grpokit.cli
    import grpokit.train.grpo
    import grpokit.train.reward  # noqa: F401 - loaded, so that their imported names are patched too

    for name, module in list(sys.modules.items()):
        if name.startswith("grpokit") and hasattr(module, "enable_fast_matmul"):
            monkeypatch.setattr(module, "enable_fast_matmul", lambda device: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch builds warn about the legacy TF32 switches
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _tf32_on() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(torch.backends.cuda.matmul.allow_tf32)


@pytest.fixture
def host_draws(monkeypatch):
    """The decode loop's uniform numbers from a CPU generator seeded like the device's generator (see
    the module docstring): the same completions on the CPU and the GPU."""
    from grpokit.rollout import decode

    streams: dict[int, tuple[torch.Generator, torch.Generator]] = {}  # id(device gen) -> (it, host gen)

    def uniforms(shape, generator, device):
        host = None
        if generator is not None:
            if id(generator) not in streams:  # the generator is kept alive, so its id is not reused
                streams[id(generator)] = (generator, torch.Generator().manual_seed(generator.initial_seed()))
            host = streams[id(generator)][1]
        return torch.rand(shape, generator=host).to(device)

    monkeypatch.setattr(decode, "uniforms", uniforms)
    return streams


@pytest.fixture
def optimizer_steps():
    """What every optimizer step in the test saw, read by a global step post-hook: the devices and
    dtypes of the parameters it updated and of its floating-point state (AdamW's moments)."""
    seen: list[dict[str, set]] = []

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = [
            value
            for p in params
            for key, value in optimizer.state.get(p, {}).items()
            if key != "step" and torch.is_tensor(value) and value.is_floating_point()
        ]
        seen.append(
            {
                "param_devices": {p.device.type for p in params},
                "param_dtypes": {p.dtype for p in params},
                "state_devices": {v.device.type for v in state},
                "state_dtypes": {v.dtype for v in state},
            }
        )

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(hook)
    yield seen
    handle.remove()


@pytest.fixture
def engines(monkeypatch):
    """Every `PolicyEngine` a run makes (the object that holds the policy, its reference, device and
    precision), so that a test can look at them while the run goes on."""
    from grpokit.engine import engine as engine_module

    made: list[Any] = []
    create = engine_module.PolicyEngine.create.__func__

    def spy(cls, *args: Any, **kwargs: Any) -> Any:
        made.append(create(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engine_module.PolicyEngine, "create", classmethod(spy))
    return made


# ----------------------------------------------------------------------------- helpers


def _devices(module: Any) -> set[str]:
    return {p.device.type for p in module.parameters()}


def _placement(engines: list[Any]) -> dict[str, Any]:
    """Where the models of every engine the run has made are now: devices of the engines, of their
    policies and of their references (an engine without a reference adds none), their precisions."""
    assert engines, "the run made no PolicyEngine: the test cannot see where its models are"
    return {
        "engine": {e.device.type for e in engines},
        "policy": set().union(*(_devices(e.module) for e in engines)),
        "reference": set().union(*(_devices(e.reference) for e in engines if e.reference is not None)),
        "precision": {(e.precision.compute, e.precision.master) for e in engines},
        "tf32": _tf32_on(),
    }


def _assert_weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=key: f"{k}: {m}")


# ----------------------------------------------------------------------------- 1. GRPO on cuda


def test_grpo_on_cuda_equals_the_cpu_run_with_models_on_the_gpu(
    tmp_path, host_draws, engines, optimizer_steps
):
    """The same 3-step run (beta 0.04, so a reference is kept) on the CPU and on cuda: equal rewards
    and lengths at every step (the same completions), loss, gradient norm and entropy at step 1 within
    METRIC_RTOL, final weights within WEIGHT_ATOL. During the cuda run the policy, its reference and
    AdamW's moments are on the GPU."""
    rows, during = {}, []
    for name, device in RUNS:
        cfg = tiny_config(tmp_path / name, device=device, beta=0.04, max_steps=3)

        def watch(kind: str, step: int, data: dict[str, Any], name: str = name) -> None:
            if kind == "step" and name == "gpu":
                during.append(_placement(engines))

        optimizer_steps.clear()
        engines.clear()  # the engines of this run only
        train_grpo(cfg, reward_funcs=[ones_reward], on_event=watch)
        rows[name] = read_steps(tmp_path / name / "run")
    assert len(during) == 3 and not any(p["tf32"] for p in during), during
    for placed in during:
        assert placed["engine"] == placed["policy"] == placed["reference"] == {"cuda"}, placed
    assert len(optimizer_steps) == 3  # the cuda run's updates
    for seen in optimizer_steps:
        assert seen["param_devices"] == {"cuda"} and seen["state_devices"] == {"cuda"}, seen

    cpu, gpu = rows["host"], rows["gpu"]
    assert [r["step"] for r in gpu] == [1, 2, 3]
    for a, b in zip(cpu, gpu, strict=True):  # the same completions: computed on the host from the tokens
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
    assert abs(gpu[0]["kl"]) <= 1e-6  # the reference is a copy of the policy at step 1
    for key in ("loss", "grad_norm", "entropy"):
        assert gpu[0][key] == pytest.approx(cpu[0][key], rel=METRIC_RTOL, abs=1e-7), key
    assert cpu[0]["grad_norm"] > 0  # the comparison is not between two zeros
    _assert_weights_close(weights(tmp_path / "host" / "run"), weights(tmp_path / "gpu" / "run"))


def test_grpo_on_cuda_raises_the_reward_it_favours(tmp_path):
    """30 steps on the '1'-share reward, on the GPU with its defaults (TF32 included): the sampled
    reward rises (as tests/train/test_grpo_loop.py checks on the CPU)."""
    cfg = tiny_config(
        tmp_path, device="cuda", max_steps=30, prompts_per_step=8, micro_batch_size=32, learning_rate=3e-2
    )
    rewards = [r["reward"] for r in read_steps(train_grpo(cfg, reward_funcs=[ones_reward]).output_dir)]
    assert torch.isfinite(torch.tensor(rewards)).all()
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


# ----------------------------------------------------------------------------- 2. resume across devices


@pytest.mark.parametrize(("first", "second"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_from_one_device_resumes_on_the_other(tmp_path, host_draws, first, second):
    """4 steps straight on `first`, against: stopped at step 3 on `first` (last checkpoint: step 2),
    resumed with device=`second`. With two updates a step (old log-probs), a reference synced to the
    policy every step and saved in the checkpoint, the resumed run ends at the uninterrupted run's
    weights (within WEIGHT_ATOL: a lost optimizer state or a wrong step would be off by ~LR)."""
    extra = dict(beta=0.04, num_iterations=2, sync_ref_model=True, ref_model_sync_steps=1)
    straight = tiny_config(tmp_path / "a", device=first, max_steps=4, save_steps=2, **extra)
    train_grpo(straight, reward_funcs=[ones_reward])

    interrupted = tiny_config(tmp_path / "b", device=first, max_steps=4, save_steps=2, **extra)

    def stop_at_3(kind: str, step: int, data: dict[str, Any]) -> None:
        if kind == "step" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_grpo(interrupted, reward_funcs=[ones_reward], on_event=stop_at_3)
    events = []
    train_grpo(
        interrupted.model_copy(update={"resume": True, "device": second}),
        reward_funcs=[ones_reward],
        on_event=lambda kind, step, data: events.append((kind, step)),
    )
    assert ("resumed", 2) in events
    a, b = read_steps(tmp_path / "a" / "run"), read_steps(tmp_path / "b" / "run")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["reward"] for r in a] == [r["reward"] for r in b]  # the same completions after the resume
    _assert_weights_close(weights(tmp_path / "a" / "run"), weights(tmp_path / "b" / "run"))


# ----------------------------------------------------------------------------- 3. reward model


def _reward_config(tmp_path: Path, **overrides: Any) -> Any:
    """The reward-model tests' tiny config, with micro-batches of 4 (two per step: accumulation too)."""
    from tests.train.test_reward_model import reward_cfg

    return reward_cfg(tmp_path, **({"micro_batch_size": 4} | overrides))


def test_reward_model_on_cuda_equals_the_cpu_run(tmp_path, optimizer_steps):
    """Bradley–Terry training has no sampling: 3 steps on cuda equal the CPU's, loss and gradient norm
    at every step within METRIC_RTOL, weights within WEIGHT_ATOL / 10 (learning rate 1e-3 here), and
    held-out accuracy equal; the cuda run's parameters and AdamW moments are on the GPU."""
    from grpokit.train.reward import train_reward

    results, rows = {}, {}
    for name, device in RUNS:
        optimizer_steps.clear()
        results[name] = train_reward(_reward_config(tmp_path / name, device=device))
        rows[name] = read_steps(tmp_path / name / "rm")
    assert len(optimizer_steps) == 3
    for seen in optimizer_steps:
        assert seen["param_devices"] == {"cuda"} and seen["state_devices"] == {"cuda"}, seen
    for a, b in zip(rows["host"], rows["gpu"], strict=True):
        for key in ("loss", "grad_norm", "accuracy", "margin"):
            assert b[key] == pytest.approx(a[key], rel=METRIC_RTOL, abs=1e-7), (a["step"], key)
    assert results["gpu"].eval_after["accuracy"] == results["host"].eval_after["accuracy"]
    a, b = weights(tmp_path / "host" / "rm"), weights(tmp_path / "gpu" / "rm")
    # WEIGHT_ATOL is 10% of this run's learning rate (1e-3): seen on an H100, one weight in 256 moved
    # 3.3e-5 apart, an Adam step whose gradient is near 0 (m/sqrt(v) then follows rounding), while
    # a real divergence moves most weights by about the learning rate each step.
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=WEIGHT_ATOL)


def test_reward_model_learns_the_preference_task_on_cuda(tmp_path):
    """The built-in preset (0.66M parameters, 300 steps) on the GPU: held-out pairwise accuracy rises
    from about chance to at least 0.85 (measured on the CPU: 0.48 -> 0.9)."""
    from grpokit.cli import REWARD_PRESET, _config
    from grpokit.config import RewardConfig
    from grpokit.train.reward import train_reward

    overrides = [f"output_dir={tmp_path / 'rm'}", "progress=false", "save_steps=0", "device=cuda"]
    result = train_reward(_config(RewardConfig, REWARD_PRESET, overrides))
    assert 0.35 <= result.eval_before["accuracy"] <= 0.65
    assert result.eval_after["accuracy"] >= 0.85


# ----------------------------------------------------------------------------- 4. samplers


@pytest.mark.parametrize("loop", ["eager", "cuda_graph"])
def test_decoder_on_cuda_returns_the_cpu_greedy_rollout_on_the_host(loop):
    """Greedy completions of a 2-layer Llama, prompts of three lengths (left padding): the GPU model's
    Rollout has every tensor on the CPU, and the same tokens, masks and texts as the CPU model's;
    the sampling log-probs agree to float32 round-off."""
    from grpokit.models import backend_of, build_policy, char_tokenizer
    from grpokit.rollout import Decoder, SamplingParams

    tok = char_tokenizer("0123456789+=")
    model = build_policy(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        vocab_size=len(tok),
        dropout=0.0,
        max_seq_len=64,
        seed=0,
        intermediate_size=128,
    ).eval()
    prompts = ["1+2=", "12+34=", "999+1="]
    params = SamplingParams(num_generations=2, max_completion_length=8, temperature=0.0)
    on_cpu = Decoder(backend_of(model), tok).sample(prompts, params)
    on_gpu = Decoder(backend_of(copy.deepcopy(model).to(CUDA)), tok, loop).sample(prompts, params)
    for name in (
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "truncated",
        "sampling_logps",
    ):
        assert getattr(on_gpu, name).device.type == "cpu", name
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(on_gpu, name), getattr(on_cpu, name)), name
    assert on_gpu.completions == on_cpu.completions
    torch.testing.assert_close(on_gpu.sampling_logps, on_cpu.sampling_logps, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- 5. mixed precision


def test_bfloat16_on_cuda_keeps_float32_master_weights(tmp_path, engines, optimizer_steps):
    """dtype=bfloat16 with the default master_weights=float32: the engine computes in bfloat16 and
    stores float32; every update sees float32 parameters and float32 AdamW moments on the GPU; the
    checkpoint holds float32 weights and optimizer state (what an exact resume needs); metrics finite."""
    cfg = tiny_config(tmp_path, device="cuda", dtype="bfloat16", beta=0.04, max_steps=2)
    during = []
    train_grpo(
        cfg,
        reward_funcs=[ones_reward],
        on_event=lambda kind, step, data: during.append(_placement(engines)) if kind == "step" else None,
    )
    assert during and all(p["precision"] == {(torch.bfloat16, torch.float32)} for p in during), during
    assert all(p["policy"] == {"cuda"} for p in during)
    assert len(optimizer_steps) == 2
    for seen in optimizer_steps:
        assert seen["param_dtypes"] == {torch.float32} and seen["state_dtypes"] == {torch.float32}, seen
        assert seen["param_devices"] == {"cuda"} and seen["state_devices"] == {"cuda"}, seen
    saved = weights(tmp_path / "run")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    from grpokit.train.checkpoint import list_checkpoints

    state = torch.load(
        list_checkpoints(tmp_path / "run")[-1] / "state.pt", weights_only=True, map_location="cpu"
    )
    moments = [
        v
        for s in state["optimizer"]["state"].values()
        for k, v in s.items()
        if k != "step" and v.is_floating_point()
    ]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    for row in read_steps(tmp_path / "run"):
        for key in ("loss", "grad_norm", "entropy", "kl", "reward"):
            assert torch.isfinite(torch.tensor(row[key])), (row["step"], key)


# ----------------------------------------------------------------------------- 6. multi-turn episodes


def test_multi_turn_episodes_on_cuda_equal_the_cpu_ones(tmp_path):
    """Greedy tool episodes of a GPU model: the same transcripts, masks and turns as the CPU model's,
    returned on the host; then a tool_addition GRPO run on cuda trains with its episode metrics."""
    from grpokit.data.tasks import TOOL_ALPHABET
    from grpokit.envs import calc, tool_environment
    from grpokit.models import backend_of, build_policy, char_tokenizer
    from grpokit.rollout import Decoder, SamplingParams

    tok = char_tokenizer(TOOL_ALPHABET)
    model = build_policy(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=len(tok), dropout=0.0, max_seq_len=128, seed=0
    ).eval()
    spec = tool_environment([calc], "brackets", max_turns=3)
    prompts = ["1+2=", "12+34=", "999+1="]
    rows = [{"prompt": p} for p in prompts]
    params = SamplingParams(num_generations=2, max_completion_length=24, temperature=0.0)
    on_cpu = Decoder(backend_of(model), tok, environment=spec).sample(prompts, params, rows)
    on_gpu = Decoder(backend_of(copy.deepcopy(model).to(CUDA)), tok, environment=spec).sample(
        prompts, params, rows
    )
    for name in ("completion_ids", "completion_mask", "completion_attention", "num_turns", "truncated"):
        assert getattr(on_gpu, name).device.type == "cpu", name
        assert torch.equal(getattr(on_gpu, name), getattr(on_cpu, name)), name
    assert on_gpu.completions == on_cpu.completions
    torch.testing.assert_close(on_gpu.sampling_logps, on_cpu.sampling_logps, rtol=0, atol=1e-4)
    cfg = tiny_config(tmp_path, device="cuda", task="tool_addition", max_completion_length=None, max_turns=3)
    result = train_grpo(cfg)
    rows = read_metrics(result.output_dir)
    assert all("env/turns" in r for r in rows if "loss" in r)


# ----------------------------------------------------------------------------- 6. the padding-free pass


@pytest.mark.parametrize("autocast", [False, True])
def test_padding_free_on_cuda_equals_the_padded_pass(autocast):
    """The padding-free pass (issue 28) on CUDA, host inputs, ragged completions in groups of 3: the
    states that score completion tokens equal `shared_prefix`'s on the same GPU and precision.
    float32 with TF32 off: to 1e-5. Under bf16 autocast every matrix product rounds to 8 bits
    (3.9e-3 relative), and the two routes sum in another order, so they agree to bf16 round-off
    carried through two layers: a relative error of the whole tensor under 3e-2 (a wrong mask or
    position gives O(1))."""
    from grpokit.models import build_policy, lean_decoder

    model = build_policy(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=40, dropout=0.0, seed=0, intermediate_size=96
    ).to(CUDA)
    g = torch.Generator().manual_seed(1)
    P, G, Lp, T = 2, 3, 6, 40
    prefix_mask = torch.ones(P, Lp, dtype=torch.bool)
    prefix_mask[0, :2] = False
    prefix = torch.randint(3, 40, (P, Lp), generator=g) * prefix_mask
    lengths = torch.tensor([40, 3, 17, 1, 25, 9])
    suffix_mask = torch.arange(T)[None] < lengths[:, None]
    suffix = torch.randint(3, 40, (P * G, T), generator=g) * suffix_mask
    decoder = lean_decoder(model)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            packed = decoder.padding_free(prefix, prefix_mask, suffix, suffix_mask, G)
            padded = decoder.shared_prefix(prefix, prefix_mask, suffix, suffix_mask, G)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    scored = suffix_mask.to(CUDA)
    a, b = packed[scored].float(), padded[scored].float()
    if autocast:
        assert float((a - b).norm() / b.norm()) < 3e-2
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_peak_memory_metric_reads_the_gpu():
    from grpokit.models import memory_metrics

    x = torch.empty(2**20, device=CUDA)  # 4 MiB at least
    peak = memory_metrics(CUDA)["memory/max_allocated_gib"]
    assert peak >= 4 / 1024
    del x


def test_an_unset_micro_batch_is_fitted_to_the_gpu(tmp_path):
    """micro_batch_size unset on a GPU: the memory forecast fits it (train/memory_check.py). 32 prompts ×
    4 completions of the tiny model fit a GPU at once, past the config's default of 64 rows, and the
    run says so in one line."""
    from grpokit.config import GRPOConfig

    cfg = tiny_config(tmp_path, device="cuda", max_steps=1, prompts_per_step=32, num_generations=4)
    values = {k: v for k, v in cfg.model_dump(exclude_unset=True).items() if k != "micro_batch_size"}
    said: list[str] = []
    on_event = lambda kind, step, data: said.append(data.get("message", "")) if kind == "warning" else None  # noqa: E731
    train_grpo(GRPOConfig(**values), reward_funcs=[ones_reward], on_event=on_event)
    assert any(line.startswith("micro_batch_size=128 (unset in the config)") for line in said), said
