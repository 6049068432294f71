"""Before a run writes anything: is one step's size anywhere near what the device can hold?

`num_generations=100000` or `max_completion_length=1e8` is a typo or a misunderstanding, not a run:
sampled as asked, the first step asks the allocator for tens of gigabytes to terabytes and fails with
an allocator's error (on a CPU a RuntimeError, no torch.OutOfMemoryError), after the run directory
was written, so that the corrected command meets an earlier run. `step_memory_refusal` forecasts the
memory one step's rollout holds (`models.memory_forecast`: the KV cache of every row sampled at once,
prompts_per_step × num_generations rows of prompt + max_completion_length tokens, and a decode step's
[B, V] buffers) and refuses, before the run directory is written, when that alone is more than MARGIN
times the device's whole memory (a GPU's, or the machine's RAM): no realistic setting comes near, and
a setting a little too large is left to the doctor's forecast. Weights, gradients and optimizer state
are not counted (LoRA, FSDP and a teacher elsewhere change them; the option sizes do not), nor the
update's micro-batch (micro_batch_size, gradient checkpointing and auto_find_batch_size bound it): the
check only ever under-counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config.plan import GRPOPlan
from ..models import ModelShape, Precision, StepShape, forecast_memory, largest_micro_batch
from ..models.memory_forecast import MemoryForecast

MARGIN = 2  # refused when the sizes alone need more than MARGIN × the device's total memory
# what each option is compared with when the line names the culprit: a usual setting
USUAL = {"num_generations": 8, "prompts_per_step": 8, "max_completion_length": 1024}


@dataclass(frozen=True)
class StepSizes:
    """The options that size one step's rollout on one rank (prompts_per_step: this rank's share), and
    the micro-batch (the forecast's shape needs one)."""

    num_generations: int
    prompts_per_step: int
    max_completion_length: int
    micro_batch_size: int

    def step_shape(self, plan: GRPOPlan, prompt_tokens: int) -> StepShape:
        """The forecast's shape of a step of these sizes, as `grpokit doctor` counts it."""
        spec = plan.trainee
        precision = Precision.of(spec.engine.dtype, spec.engine.master_weights)  # as the run keeps them
        rows = self.prompts_per_step * self.num_generations
        return StepShape(
            rows=rows,
            micro_batch_size=min(self.micro_batch_size, rows),
            prompt_length=max(prompt_tokens, 1),  # the longest prompt (its padded width)
            completion_length=self.max_completion_length,
            reference=spec.step.loss.beta != 0.0,
            compute_bytes=torch.finfo(precision.compute).bits // 8,
            master_bytes=torch.finfo(precision.master).bits // 8,
            fused_logps=spec.engine.fused_logps,
            gradient_checkpointing=plan.model.gradient_checkpointing,
            group_size=self.num_generations,  # each prompt's pass shared by its G rows
            teacher_states=spec.step.loss.variant.teacher == "distributions",
        )

    @classmethod
    def of(cls, plan: GRPOPlan, max_completion_length: int, world_size: int = 1) -> StepSizes:
        """The run's own sizes, on one of `world_size` ranks."""
        step = plan.trainee.step
        return cls(
            num_generations=plan.trainee.sampling.num_generations,
            prompts_per_step=max(1, step.prompts_per_step // world_size),
            max_completion_length=max_completion_length,
            micro_batch_size=step.micro_batch_size,
        )


def rollout_bytes(forecast: MemoryForecast) -> int:
    """What the rollout's sizes alone hold: every row's KV cache and one decode step's [B, V] buffers."""
    return forecast.kv_cache + forecast.decode_logits


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """(the device's total memory in bytes, how the line names it): a GPU's whole memory, or the
    machine's RAM; None where it cannot be read (the check is then skipped)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"the {_gib(props.total_memory)} of {props.name}"
    if device.type != "cpu":
        return None, str(device)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None, "RAM"
    allowed = process_memory_limit()
    if allowed is not None and allowed < total:
        return allowed, f"the {_gib(allowed)} this process may use (its cgroup's or ulimit's limit)"
    return int(total), f"this machine's {_gib(total)} of RAM"


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def process_memory_limit() -> int | None:
    """The least of the limits set on this process's memory, in bytes: its cgroup's (v2 memory.max, or
    v1 memory.limit_in_bytes: a container's, a batch job's) and its address space's (`ulimit -v`);
    None when none is set."""
    import resource

    limits = []
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit() and int(text) < 2**60:  # "max", or v1's huge number: no limit
            limits.append(int(text))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft > 0:
        limits.append(int(soft))
    return min(limits) if limits else None


def step_memory_refusal(
    plan: GRPOPlan,
    shape: ModelShape,
    prompt_tokens: int,
    max_completion_length: int,
    device: torch.device,
    world_size: int = 1,
) -> str | None:
    """The one line refusing a step whose sizes alone are forecast to need more than MARGIN × the
    device's total memory (module docstring), naming the option that makes it so; None otherwise."""
    total, where = device_memory(device)
    if total is None:
        return None
    sizes = StepSizes.of(plan, max_completion_length, world_size)
    step = sizes.step_shape(plan, prompt_tokens)
    need = rollout_bytes(forecast_memory(shape, step))
    if need <= MARGIN * total:
        return None
    culprit = _culprit(plan, shape, prompt_tokens, sizes)
    return (
        f"{culprit}={getattr(sizes, culprit)}: one step's rollout is forecast to need {_gib(need)} (the KV "
        f"cache and decode buffers of prompts_per_step × num_generations = {sizes.prompts_per_step} × "
        f"{sizes.num_generations} rows{' on this rank' if world_size > 1 else ''} of up to "
        f"{step.prompt_length} + {step.completion_length} tokens), more than {MARGIN} × {where}; lower "
        f"{culprit} (`grpokit doctor` forecasts a step's memory)."
    )


def _culprit(plan: GRPOPlan, shape: ModelShape, prompt_tokens: int, sizes: StepSizes) -> str:
    """The option whose usual value (USUAL) shrinks the forecast most: the one to lower."""

    def need_with(option: str) -> int:
        usual = replace(sizes, **{option: min(getattr(sizes, option), USUAL[option])})
        return rollout_bytes(forecast_memory(shape, usual.step_shape(plan, prompt_tokens)))

    return min(USUAL, key=need_with)


def _gib(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1 (MiB to PiB)."""
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes / 2**20:.1f} MiB"


def longest_prompt(plan: GRPOPlan, tokenizer: Any, data: Any) -> int:
    """A run's longest prompt in tokens, as the forecast takes it: max_prompt_length when set, else the
    longest of the first 64 training prompts."""
    from ..data import render_prompt

    if data.max_prompt_length:
        return int(data.max_prompt_length)
    tools = data.environment.tool_schemas if data.environment is not None else None
    column, kwargs = plan.data.prompt_column, data.chat_template_kwargs
    texts = (render_prompt(r[column], tokenizer, tools, kwargs) for r in data.train_rows[:64])
    return max((len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts), default=1)


def check_step_memory(
    plan: GRPOPlan, model: Any, prompt_tokens: int, data: Any, device: torch.device, world_size: int
) -> None:
    """`step_memory_refusal` for a run about to start, as a ValueError (one line): the policy's shape,
    its longest prompt in tokens (`longest_prompt`) and the run's completion length."""
    refusal = step_memory_refusal(
        plan, ModelShape.of(model), prompt_tokens, data.max_completion_length, device, world_size
    )
    if refusal is not None:
        raise ValueError(refusal)


# the share of a GPU's memory the fitted micro-batch's forecast peak may take: the rest for the CUDA
# context, the allocator's fragmentation and what the forecast leaves out (the doctor's forecast was
# within 10% of the measured peak: benchmarks/RESULTS.md)
FIT = 0.8


@dataclass(frozen=True)
class FittedMicroBatch:
    """The micro-batch the memory forecast fits (`fitted_micro_batch`), and the line that says so."""

    micro_batch_size: int
    message: str


def fitted_micro_batch(
    plan: GRPOPlan,
    shape: ModelShape,
    teacher: ModelShape | None,
    prompt_tokens: int,
    max_completion_length: int,
    device: torch.device,
    world_size: int = 1,
) -> FittedMicroBatch | None:
    """micro_batch_size left unset, on a GPU: the largest divisor of this rank's rows whose forecast
    peak (`grpokit doctor`'s, with the GPU's decode loop) fits FIT of the GPU's whole memory (the same
    GPU fits the same one when a run resumes): fewer, larger passes than the config's default of at
    most 64 rows. None where the config's value stands: set in the config, on a CPU (whose passes gain
    little from size), or when no micro-batch fits (a step out of memory then halves it)."""
    spec = plan.trainee
    if not spec.step.micro_batch_fitted or device.type != "cuda":
        return None
    total, where = device_memory(device)
    if total is None:
        return None
    sizes = StepSizes.of(plan, max_completion_length, world_size)
    step = replace(sizes.step_shape(plan, prompt_tokens), static_decode=spec.engine.decode_loop != "eager")
    best = largest_micro_batch(shape, step, int(FIT * total), 0, teacher)
    if best is None:
        return None
    return FittedMicroBatch(
        best,
        f"micro_batch_size={best} (unset in the config): the largest divisor of this rank's {step.rows} "
        f"rows whose forecast peak fits {FIT:.0%} of {where}; set micro_batch_size to choose",
    )
