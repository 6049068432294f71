"""Calling reward functions, checking what they return, and combining them.

Every failure names the function and, where it can, the row and the completion, so a user sees
"reward function 'my_reward' returned 'yes' for row 3" rather than a traceback from torch.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..ops import combine_rewards


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something that is not one score per completion."""


@dataclass(frozen=True)
class RewardScores:
    names: list[str]  # [R] reward function names
    rewards_per_func: torch.Tensor  # [B, R] float32, NaN = unscorable
    rewards: torch.Tensor  # [B] weighted NaN-aware sum (ops.combine_rewards)
    num_failed: int  # rows scored unscorable because a function raised (on_error="unscorable")

    def metrics(self) -> dict[str, torch.Tensor]:
        """TRL's names: rewards/<name>/mean and /std (NaN-ignoring, Bessel std)."""
        out: dict[str, torch.Tensor] = {}
        for i, name in enumerate(self.names):
            column = self.rewards_per_func[:, i]
            valid = column[~torch.isnan(column)]
            out[f"rewards/{name}/mean"] = valid.mean() if valid.numel() else torch.tensor(float("nan"))
            out[f"rewards/{name}/std"] = valid.std() if valid.numel() > 1 else torch.tensor(float("nan"))
        return out


def reward_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Call with the keyword arguments the function accepts (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(**kwargs)


def _preview(text: Any, limit: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _to_score(name: str, row: int, value: Any, completion: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = type(value).__name__
        raise RewardFunctionError(
            f"reward function {name!r} returned {value!r} ({kind}) for row {row} "
            f"(completion {_preview(completion)}); "
            "return a float, or None when the completion cannot be scored."
        )
    if not math.isfinite(value):
        raise RewardFunctionError(
            f"reward function {name!r} returned {value} for row {row} (completion {_preview(completion)}); "
            "return a finite float, or None when the completion cannot be scored."
        )
    return float(value)


def _find_failing_row(
    fn: Callable[..., Any], kwargs: dict[str, Any], size: int
) -> tuple[int, BaseException] | None:
    for row in range(size):
        one = {k: (v[row : row + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}
        try:
            _call(fn, one)
        except Exception as error:  # noqa: BLE001 - any exception of user code is reported
            return row, error
    return None


def _score_one(
    fn: Callable[..., Any], kwargs: dict[str, Any], size: int, completions: Sequence[Any], on_error: str
) -> tuple[list[float], int]:
    name = reward_name(fn)
    try:
        values = _call(fn, kwargs)
    except Exception as error:  # noqa: BLE001
        failing = _find_failing_row(fn, kwargs, size)
        if on_error == "unscorable" and failing is not None:
            return _score_rowwise(fn, kwargs, size, completions)
        where = (
            f" on row {failing[0]} (completion {_preview(completions[failing[0]])}): {failing[1]!r}"
            if failing
            else f": {error!r}"
        )
        raise RewardFunctionError(f"reward function {name!r} raised{where}") from error
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise RewardFunctionError(
            f"reward function {name!r} returned {got} for {size} completions; return one per completion."
        )
    return [_to_score(name, i, v, completions[i]) for i, v in enumerate(values)], 0


def _score_rowwise(
    fn: Callable[..., Any], kwargs: dict[str, Any], size: int, completions: Sequence[Any]
) -> tuple[list[float], int]:
    scores, failed = [], 0
    for row in range(size):
        one = {k: (v[row : row + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}
        try:
            value = _call(fn, one)
        except Exception:  # noqa: BLE001 - configured to count, not stop
            scores.append(math.nan)
            failed += 1
            continue
        scores.append(
            _to_score(
                reward_name(fn),
                row,
                value[0] if isinstance(value, (list, tuple)) else value,
                completions[row],
            )
        )
    return scores, failed


def score_completions(
    reward_funcs: Sequence[Callable[..., Any]],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    columns: dict[str, Sequence[Any]] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    weights: Sequence[float] | None = None,
    on_error: Literal["raise", "unscorable"] = "raise",
) -> RewardScores:
    """Score B completions with R reward functions and combine them.

    Each function is called once for the batch as f(prompts=…, completions=…, completion_ids=…,
    **columns) with lists of length B (functions without **kwargs get the arguments they name).
    on_error="raise" stops at the first failure with a message naming the function and the row;
    "unscorable" scores the rows a function raised on as None (NaN) and counts them.
    """
    if not reward_funcs:
        raise ValueError("no reward functions: give at least one.")
    size = len(completions)
    if len(prompts) != size:
        raise ValueError(
            f"{len(prompts)} prompts for {size} completions: repeat each prompt once per completion."
        )
    weights = [1.0] * len(reward_funcs) if weights is None else list(weights)
    if len(weights) != len(reward_funcs):
        raise ValueError(
            f"{len(weights)} reward weights for {len(reward_funcs)} reward functions; give one each."
        )
    kwargs: dict[str, Any] = {"prompts": list(prompts), "completions": list(completions)}
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    for key, values in (columns or {}).items():
        if key in kwargs:
            continue
        if len(values) != size:
            raise ValueError(f"column {key!r} has {len(values)} values for {size} completions.")
        kwargs[key] = list(values)
    table, failed = [], 0
    for fn in reward_funcs:
        scores, n_failed = _score_one(fn, kwargs, size, completions, on_error)
        table.append(scores)
        failed += n_failed
    rewards_per_func = torch.tensor(table, dtype=torch.float32).T.reshape(size, len(reward_funcs))  # [B, R]
    return RewardScores(
        names=[reward_name(fn) for fn in reward_funcs],
        rewards_per_func=rewards_per_func,
        rewards=combine_rewards(rewards_per_func, weights),
        num_failed=failed,
    )
