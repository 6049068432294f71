"""micro_batch_size left unset on a GPU: the memory forecast fits it (`memory_check.fitted_micro_batch`),
the largest divisor of the rank's rows whose forecast peak fits FIT of the GPU's memory; a value the
config sets, a CPU, and a GPU where nothing fits keep the config's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.config.plan import grpo_plan
from grpokit.models import ModelShape, forecast_memory
from grpokit.train import memory_check
from grpokit.train.memory_check import FIT, StepSizes, fitted_micro_batch
from tests.models.test_engine import tiny_policy

CUDA = torch.device("cuda")  # (only its type is read: the GPU's memory is the test's, below)
PROMPT, LENGTH = 12, 48


def plan_of(**values):
    return grpo_plan(
        GRPOConfig(model="tiny", task="addition", prompts_per_step=8, num_generations=8, **values)
    )


def gpu_of(monkeypatch, total: int) -> None:
    monkeypatch.setattr(memory_check, "device_memory", lambda device: (total, "a test GPU"))


def peak(plan, shape, micro: int, world_size: int = 1) -> int:
    """The forecast peak at `micro`, on the GPU's decode loop, as the fit computes it."""
    step = StepSizes.of(plan, LENGTH, world_size).step_shape(plan, PROMPT)
    step = replace(step, micro_batch_size=micro, static_decode=plan.trainee.engine.decode_loop != "eager")
    return forecast_memory(shape, step).total


def test_unset_means_fitted_and_set_means_kept():
    assert plan_of().trainee.step.micro_batch_fitted
    assert not plan_of(micro_batch_size=16).trainee.step.micro_batch_fitted


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_largest_divisor_whose_forecast_fits_is_taken(monkeypatch, world_size):
    plan, shape = plan_of(), ModelShape.of(tiny_policy()[0])
    rows = 64 // world_size
    # a GPU on which 16 rows fit FIT of its memory and 32 do not (each rank's rows: 64 or 32)
    total = int((peak(plan, shape, 16, world_size) + peak(plan, shape, 32, world_size)) / 2 / FIT)
    gpu_of(monkeypatch, total)
    fitted = fitted_micro_batch(plan, shape, None, PROMPT, LENGTH, CUDA, world_size)
    assert fitted is not None and fitted.micro_batch_size == 16
    assert peak(plan, shape, 16, world_size) <= FIT * total < peak(plan, shape, 32, world_size)
    assert f"divisor of this rank's {rows} rows" in fitted.message and "\n" not in fitted.message
    gpu_of(monkeypatch, 10**15)  # a GPU that holds anything: every row at once, past the default's 64
    huge = fitted_micro_batch(plan, shape, None, PROMPT, LENGTH, CUDA, world_size)
    assert huge is not None and huge.micro_batch_size == rows


def test_a_set_value_a_cpu_and_a_gpu_too_small_keep_the_configs(monkeypatch):
    shape = ModelShape.of(tiny_policy()[0])
    gpu_of(monkeypatch, 10**15)
    assert fitted_micro_batch(plan_of(micro_batch_size=8), shape, None, PROMPT, LENGTH, CUDA) is None
    assert fitted_micro_batch(plan_of(), shape, None, PROMPT, LENGTH, torch.device("cpu")) is None
    gpu_of(monkeypatch, 1000)  # 1 kB: not even one row
    assert fitted_micro_batch(plan_of(), shape, None, PROMPT, LENGTH, CUDA) is None


def test_a_run_trains_with_the_fitted_micro_batch_and_says_so(tmp_path, monkeypatch):
    """The wiring, on the CPU: where `fitted_micro_batch` fits one (as on a GPU), the trainee is built
    with it and the run says the line once; without one the config's stands."""
    from grpokit.train import grpo
    from grpokit.train.grpo import train_grpo
    from tests.train.helpers import ones_reward, tiny_config

    built: list[int] = []
    original = grpo.build_trainee

    def spy(spec, *args, **kwargs):
        built.append(spec.step.micro_batch_size)
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(grpo, "build_trainee", spy)
    line = "micro_batch_size=4 (unset in the config): a test's fit"
    fit = memory_check.FittedMicroBatch(4, line)
    monkeypatch.setattr(grpo, "fitted_micro_batch", lambda *args: fit)
    said: list[str] = []
    on_event = lambda kind, step, data: said.append(data["message"]) if kind == "warning" else None  # noqa: E731
    train_grpo(tiny_config(tmp_path, max_steps=1), reward_funcs=[ones_reward], on_event=on_event)
    assert built == [4] and said.count(line) == 1
    monkeypatch.setattr(grpo, "fitted_micro_batch", lambda *args: None)
    train_grpo(tiny_config(tmp_path / "b", max_steps=1), reward_funcs=[ones_reward])
    assert built[1] == tiny_config(tmp_path).micro_batch_size
