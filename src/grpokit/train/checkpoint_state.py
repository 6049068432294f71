"""What a checkpoint's state.pt may hold, checked before a resume uses any of it.

state.pt is read with weights_only=True (tensors and plain values, never code), and a resume then
trusts what it read: a value of the wrong type or out of range would surface later as a traceback
deep in the optimizer, an IndexError in the data order, or a run that says it finished 10^9 steps.
`state_problem` parses the state through one schema (`TrainingState`: the types and ranges a grpokit
run writes) and then against the run that resumes it (`fit_problem`: the checkpoint's own step, the
number of training prompts, the optimizer's parameters and hyperparameters, the schedule's fields),
and says the first problem in one phrase ("prompts.position is 1000000000000, past the 40 training
prompts"); the caller raises it as a CheckpointError. The manifest (checkpoint.py) detects damage;
this detects a state that was edited, or written for another run.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

PYTHON_MT_WORDS = 625  # random.getstate()[1]: the Mersenne Twister's 624 words and its index (≤ 624)
MAX_COUNT = 2**62  # far beyond any real step, epoch or position, and below what int64 holds
SHOWN_CHARS = 60  # the most characters of a bad value an error repeats


def _byte_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise ValueError("must be a 1-D uint8 tensor (a generator's state)")
    return value


def _torch_generator(value: Any) -> torch.Tensor:
    value = _byte_tensor(value)
    expected = torch.get_rng_state().numel()
    if value.numel() != expected:
        raise ValueError(f"must hold {expected} bytes (torch's CPU generator state), not {value.numel()}")
    return value


def _mt_index(words: list[int]) -> list[int]:
    if words[-1] > PYTHON_MT_WORDS - 1:
        raise ValueError(f"must end with the generator's index (0 to {PYTHON_MT_WORDS - 1}), not {words[-1]}")
    return words


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None else _finite(value)


def _tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"must be a tensor, not a {type(value).__name__}")
    return value


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Finite = Annotated[float, AfterValidator(_finite)]
Tensor = Annotated[Any, AfterValidator(_tensor)]
Word = Annotated[int, Field(ge=0, lt=2**32)]


class _Strict(BaseModel):
    # strict: no coercion (a string "3" is not a step, True is not 1); keys a version of grpokit adds
    # and this one does not read are let through
    model_config = ConfigDict(strict=True, extra="ignore", arbitrary_types_allowed=True, frozen=True)


class RngState(_Strict):
    """checkpoint.rng_state: torch's CPU generator, Python's, and the GPUs' (when saved on one)."""

    torch: Annotated[Any, AfterValidator(_torch_generator)]
    python: Annotated[
        list[Word], Field(min_length=PYTHON_MT_WORDS, max_length=PYTHON_MT_WORDS), AfterValidator(_mt_index)
    ]
    python_pos: Finite | None  # (random.getstate()[2]: the next Gaussian draw kept, if any)
    cuda: list[Annotated[Any, AfterValidator(_byte_tensor)]] | None = None


class CurriculumState(_Strict):
    """data.curriculum.Curriculum.state_dict: each prompt's pool (0 active, 1 solved, 2 failed) and
    streak, the bounds it learned and its visit count."""

    pool: list[Annotated[int, Field(ge=0, le=2)]]
    streak: list[Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)]]
    low: Finite | None
    high: Finite | None
    visits: Count


class PromptsState(_Strict):
    """data.prompts.PromptSampler.state_dict: where the data order stands."""

    epoch: Count
    position: Count
    curriculum: CurriculumState | None = None


class EntropyState(_Strict):
    """The entropy bonus's control: its coefficient (≥ 0) and the last step's mean token entropy (None
    before a first step)."""

    coef: Annotated[float, Field(ge=0.0), AfterValidator(_finite)]
    last_entropy: Annotated[float | None, Field(ge=0.0), AfterValidator(_finite_or_none)] = None


class TrainingState(_Strict):
    """Everything a resume reads from state.pt (checkpoint.training_state and the loops' extras). The
    optimizer is absent from an FSDP checkpoint's (its state lives in the shards)."""

    step: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any]
    prompts: PromptsState
    rng: RngState
    eval_before: dict[str, float]
    reference: dict[str, Tensor] | None = None
    entropy_control: EntropyState | None = None


def shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def _first_error(error: ValidationError) -> str:
    """The first thing pydantic found, as "rng.python_pos must be ... (got 700)"."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "the state"
    message = first["msg"]
    message = message[len("Value error, ") :] if message.startswith("Value error, ") else message
    got = "" if first["type"] == "missing" else f" (got {shown(first.get('input'))})"
    return f"{where}: {message[0].lower()}{message[1:]}{got}"


def parse_state(state: Any) -> tuple[TrainingState | None, str | None]:
    """(the parsed state, None), or (None, what is wrong) for a state no grpokit run writes."""
    if not isinstance(state, dict):
        return None, f"holds a {type(state).__name__}, not a training state"
    try:
        return TrainingState.model_validate(state), None
    except ValidationError as error:
        return None, _first_error(error)


# ----------------------------------------------------------------------------- against the run


def fit_problem(parsed: TrainingState, step: int, optimizer: Any, scheduler: Any, sampler: Any) -> str | None:
    """What in a parsed state does not fit the run resuming it (None: it fits): `step` the checkpoint's
    directory names; `optimizer` None under FSDP (its shards are checked as they load)."""
    if parsed.step != step:
        return f"step is {parsed.step}, but this is checkpoint-{step}"
    prompts, size = parsed.prompts, len(sampler.rows)
    if prompts.position >= size:
        return f"prompts.position is {prompts.position}, past the {size} training prompts"
    curriculum = getattr(sampler, "curriculum", None)
    if curriculum is not None and prompts.curriculum is not None:
        held = prompts.curriculum
        if len(held.pool) != curriculum.size or len(held.streak) != curriculum.size:
            return (
                f"prompts.curriculum holds {len(held.pool)} pools and {len(held.streak)} streaks for "
                f"{curriculum.size} training prompts"
            )
    problem = _structure_problem("scheduler", parsed.scheduler, scheduler.state_dict())
    if problem is None and optimizer is not None:
        problem = _optimizer_problem(parsed.optimizer, optimizer) or _schedule_count_problem(parsed)
    return problem


def _schedule_count_problem(parsed: TrainingState) -> str | None:
    """The schedule steps with the optimizer (once per update; a skipped update steps neither), so its
    count is never past the optimizer's own (AdamW's `step`): an edited `last_epoch` would otherwise
    resume at a learning rate the run never reached."""
    counts = [
        float(values["step"])
        for values in (parsed.optimizer or {}).get("state", {}).values()
        if isinstance(values, dict) and isinstance(values.get("step"), torch.Tensor)
    ]
    if not counts:
        return None
    updates = max(counts)
    for key, most in (("last_epoch", updates), ("_step_count", updates + 1)):
        counted = parsed.scheduler.get(key)
        if isinstance(counted, int) and counted > most:
            return f"scheduler.{key} is {counted}, past the optimizer's {int(updates)} updates"
    return None


def reference_problem(
    stored: dict[str, torch.Tensor] | None, expected: dict[str, torch.Tensor]
) -> str | None:
    """Whether a synced reference's weights fit the reference model (None: they do, or none was saved)."""
    if stored is None:
        return None
    missing = sorted(set(expected) - set(stored))
    if missing:
        return f"reference has no {missing[0]} (and {len(missing) - 1} more tensors of this model)"
    for name, tensor in stored.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            shape = tuple(expected[name].shape)
            return f"reference.{name} has shape {tuple(tensor.shape)}, this model's {shape}"
    return None


def _structure_problem(where: str, stored: Any, current: Any) -> str | None:
    """Whether `stored` has the shape of `current` (a state_dict this run made): the same keys, the same
    kinds of values (a number for a number, a flag for a flag, lists and tuples of the same length),
    every number finite. The values themselves may differ: they are what the checkpoint restores."""
    if isinstance(current, dict):
        if not isinstance(stored, dict):
            return f"{where} is {shown(stored)}, not a mapping"
        missing = [key for key in current if key not in stored]
        if missing:
            return f"{where} has no {missing[0]!r}"
        pairs = [(f"{where}.{key}", stored[key], value) for key, value in current.items()]
    elif isinstance(current, (list, tuple)):
        if not isinstance(stored, (list, tuple)) or len(stored) != len(current):
            return f"{where} is {shown(stored)}, where this run has {len(current)} values"
        pairs = [(f"{where}.{i}", a, b) for i, (a, b) in enumerate(zip(stored, current, strict=True))]
    else:
        return _value_problem(where, stored, current)
    return next((p for p in (_structure_problem(*pair) for pair in pairs) if p), None)


def _value_problem(where: str, stored: Any, current: Any) -> str | None:
    """`_structure_problem` for one value: a flag, a number, a tensor or anything else."""
    if isinstance(current, bool) or current is None:  # a flag, or an unset one (`foreach`, `fused`)
        ok = stored is None or isinstance(stored, bool)
        return None if ok else f"{where} is {shown(stored)}, not true, false or unset"
    if isinstance(current, (int, float)):
        if isinstance(stored, bool) or not isinstance(stored, (int, float)) or not math.isfinite(stored):
            return f"{where} is {shown(stored)}, not a finite number"
        if isinstance(current, int) and not isinstance(stored, int):
            return f"{where} is {shown(stored)}, not a whole number"
        return f"{where} is {shown(stored)}, out of range" if not 0 <= stored <= MAX_COUNT else None
    if isinstance(current, torch.Tensor):
        fits = (
            isinstance(stored, torch.Tensor)
            and tuple(stored.shape) == tuple(current.shape)
            and stored.dtype.is_floating_point == current.dtype.is_floating_point
        )
        return None if fits else f"{where} is {shown(stored)}, where this run has {shown(current)}"
    return (
        None
        if type(stored) is type(current)
        else f"{where} is {shown(stored)}, not a {type(current).__name__}"
    )


def _optimizer_problem(stored: dict[str, Any] | None, optimizer: Any) -> str | None:
    """The optimizer's state against this run's optimizer: its parameter groups (hyperparameters of
    the same kinds, the same parameters), and each parameter's state (tensors shaped as the parameter,
    a scalar step count)."""
    if stored is None:
        return "optimizer is missing"
    current = optimizer.state_dict()
    problem = _structure_problem(
        "optimizer.param_groups", stored.get("param_groups"), current["param_groups"]
    )
    if problem:
        return problem
    for i, (group, held) in enumerate(zip(stored["param_groups"], current["param_groups"], strict=True)):
        if list(group["params"]) != list(held["params"]):
            held_params = shown(held["params"])
            return f"optimizer.param_groups.{i}.params is {shown(group['params'])}, not {held_params}"
    shapes = {
        index: tuple(p.shape)
        for group, held in zip(optimizer.param_groups, current["param_groups"], strict=True)
        for index, p in zip(held["params"], group["params"], strict=True)
    }
    per_param = stored.get("state")
    if not isinstance(per_param, dict):
        return f"optimizer.state is {shown(per_param)}, not a mapping"
    for index, values in per_param.items():
        if index not in shapes:
            return f"optimizer.state.{index} names no parameter of this run's optimizer"
        problem = _parameter_state_problem(f"optimizer.state.{index}", values, shapes[index])
        if problem:
            return problem
    return None


def _parameter_state_problem(where: str, values: Any, shape: tuple[int, ...]) -> str | None:
    """One parameter's optimizer state: floating-point tensors shaped as the parameter, and a scalar
    step count (AdamW's `step`)."""
    if not isinstance(values, dict):
        return f"{where} is {shown(values)}, not a mapping"
    for key, value in values.items():
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            return f"{where}.{key} is {shown(value)}, not a floating-point tensor"
        if key == "step":
            if value.numel() != 1 or not math.isfinite(float(value)) or float(value) < 0:
                return f"{where}.step is {shown(value)}, not a count of steps"
        elif tuple(value.shape) != shape:
            return f"{where}.{key} has shape {tuple(value.shape)}, its parameter {shape}"
    return None
