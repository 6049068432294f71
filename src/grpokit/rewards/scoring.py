"""Calling reward functions, checking what they return, and combining them.

Every failure names the function and, where it can, the row and the completion, so a user sees
"reward function 'my_reward' returned 'yes' for row 3" rather than a traceback from torch.

A reward function is user code that may hang (a network call, a solver, a deadlock). With a `timeout`
or a `should_stop` check it runs on a daemon worker thread while the caller waits in short slices:
a batch that takes longer than `timeout` seconds is an error naming the function (or, with
on_error="unscorable", its rows are unscorable), and a stop request (SIGTERM) abandons the batch
within a slice (`ScoringStopped`). Python cannot kill a thread: the hung call is left behind, and
being a daemon thread it does not keep the interpreter from exiting (ThreadPoolExecutor's workers
would: they are joined at exit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..ops import combine_rewards


class RewardFunctionError(ValueError):
    """A reward function raised, hung past its timeout, or returned something that is not one score
    per completion."""


class ScoringStopped(Exception):  # noqa: N818 - a request, not an error of the user's
    """A stop was requested (`should_stop`) while a reward function was running: the batch was
    abandoned, the call left running on its daemon thread. The caller decides what a stop means."""


WAIT_SLICE = 0.1  # seconds between looks at `should_stop` while a reward function runs


@dataclass(frozen=True)
class RunState:
    """TRL's `trainer_state` argument of a reward function, the field it reads: how many steps the run
    has finished (the batch being scored is step global_step + 1's); None when the scoring is no
    training step's (a held-out evaluation, the doctor)."""

    global_step: int | None


@dataclass(frozen=True)
class CallRules:
    """The rules reward calls run under. on_error="raise" stops at the first failure with a message
    naming the function and the row; "unscorable" scores the rows a function raised on as None (NaN)
    and counts them. timeout: seconds each function may take on the batch (a row-by-row retry
    included); past it, a RewardFunctionError naming the function, or with "unscorable" all its rows
    NaN (counted). should_stop: looked at every WAIT_SLICE seconds while a function runs; True raises
    ScoringStopped. With a timeout or should_stop, functions run on a daemon worker thread (see the
    module docstring); without, on the caller's. state: what functions get as TRL's trainer_state
    (None: RunState(None), scoring outside a training step)."""

    on_error: Literal["raise", "unscorable"] = "raise"
    timeout: float | None = None
    should_stop: Callable[[], bool] | None = None
    state: RunState | None = None


@dataclass(frozen=True)
class RewardScores:
    names: list[str]  # [R] reward function names
    rewards_per_func: torch.Tensor  # [B, R] float32, NaN = unscorable
    rewards: torch.Tensor  # [B] weighted NaN-aware sum (ops.combine_rewards)
    num_failed: int  # rows scored unscorable because a function raised (on_error="unscorable")
    logged: dict[str, float] = field(default_factory=dict)  # log_metric's values, each name's mean
    extra: dict[str, list[Any]] = field(default_factory=dict)  # log_extra's columns, [B] each

    def metrics(self) -> dict[str, torch.Tensor]:
        """TRL's names: rewards/<name>/mean and /std (NaN-ignoring, Bessel std); logged/<name>: what the
        functions logged with log_metric (TRL's key is <name>)."""
        out: dict[str, torch.Tensor] = {f"logged/{k}": torch.tensor(v) for k, v in self.logged.items()}
        for i, name in enumerate(self.names):
            column = self.rewards_per_func[:, i]
            valid = column[~torch.isnan(column)]
            out[f"rewards/{name}/mean"] = valid.mean() if valid.numel() else torch.tensor(float("nan"))
            out[f"rewards/{name}/std"] = valid.std() if valid.numel() > 1 else torch.tensor(float("nan"))
        return out


def reward_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def reward_names(reward_funcs: Sequence[Callable[..., Any]]) -> list[str]:
    """The names the functions' metrics and errors go by (rewards/<name>/mean): each `reward_name`, and
    a name given before gets the first free suffix, `_2`, `_3`... (reward_funcs=[exact_answer,
    exact_answer] with two weights, or two files' `reward`), so that no function's metrics overwrite
    another's. Made from the whole list, once every name is known: training, evaluation and the doctor
    name each function alike."""
    names = [reward_name(fn) for fn in reward_funcs]
    taken, out = set(names), []
    for index, name in enumerate(names):
        if name in names[:index]:
            suffix = 2
            while f"{name}_{suffix}" in taken:
                suffix += 1
            name = f"{name}_{suffix}"
            taken.add(name)
        out.append(name)
    return out


def renamed_rewards(reward_funcs: Sequence[Callable[..., Any]]) -> str | None:
    """The line that says which functions `reward_names` renamed (None: no two share a name), said once
    when a run, an evaluation or the doctor resolves its reward functions."""
    pairs = [
        f"{name!r} as {unique!r}"
        for name, unique in zip(map(reward_name, reward_funcs), reward_names(reward_funcs), strict=True)
        if name != unique
    ]
    if not pairs:
        return None
    return (
        f"reward functions share a name: the later ones are reported as {', '.join(pairs)} "
        "(rewards/<name>/mean); give each function a name of its own (__name__, or a url entry's name) "
        "to choose them."
    )


def call_reward(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Call with the keyword arguments the function accepts (all of them if it takes **kwargs), as the
    scorer calls every reward function (a reward server calls its function the same way). An `async`
    function (TRL takes them) is run to its result here, on an event loop of its own."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    result = fn(**kwargs)
    return _awaited(result) if inspect.iscoroutine(result) else result


def _awaited(coroutine: Any) -> Any:
    """An async reward's result: on a new event loop, or, where this thread already runs one (a
    notebook's), on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop running here: the usual case
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _preview(text: Any, limit: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "…")


@dataclass(frozen=True)
class _Limits:
    """How long one function may take on one batch: `deadline` (time.monotonic(); None: no limit),
    shared by the batch call and any row-by-row retry, and the stop check (None: none)."""

    timeout: float | None
    deadline: float | None
    should_stop: Callable[[], bool] | None

    @classmethod
    def start(cls, timeout: float | None, should_stop: Callable[[], bool] | None) -> _Limits:
        return cls(timeout, None if timeout is None else time.monotonic() + timeout, should_stop)


# what one call of a reward function came to: ("ok", value) | ("error", exception) | ("timeout", None)
_Outcome = tuple[str, Any]


def _invoke(name: str, fn: Callable[..., Any], kwargs: dict[str, Any], limits: _Limits) -> _Outcome:
    """Call `fn`, within `limits`. Every exception of the user's code is returned, SystemExit included
    (a reward function that exits must not end the run as a success); KeyboardInterrupt is re-raised:
    it is the user's Ctrl-C (or their own code asking for one), never the function's failure."""
    if limits.deadline is not None and time.monotonic() >= limits.deadline:
        return "timeout", None  # no time left: the function is not even started
    kwargs = _own_copy(kwargs)
    if limits.deadline is None and limits.should_stop is None:  # nothing to enforce: on this thread
        try:
            return "ok", call_reward(fn, kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - reported with the function's name
            return "error", error
    box: list[_Outcome] = []

    def work() -> None:
        try:
            box.append(("ok", call_reward(fn, kwargs)))
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            box.append(("error", error))

    worker = threading.Thread(target=work, name=f"reward-{name}", daemon=True)
    worker.start()
    if not _finished(name, worker, limits):
        return "timeout", None  # the call is abandoned: a daemon thread, it never blocks the exit
    outcome = box[0]
    if outcome[0] == "error" and isinstance(outcome[1], KeyboardInterrupt):
        raise outcome[1]
    return outcome


def _own_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of one call, the function's own: each deep-copied (a conversation's messages are
    dicts), so that a function that edits its prompts, completions or a column in place changes
    nothing the next function, a row-by-row retry or the step reads. The token ids, lists of ints,
    are copied a list each (deepcopy would visit every int: 50 ms for 512 rows of 300 tokens, this
    1 ms; the prompts, completions and columns of 512 conversational rows deep-copy in about 5 ms).
    A value deepcopy refuses (an object of the user's own in a column) is shared, in a list of its own."""
    out = {}
    for key, value in kwargs.items():
        if key == "completion_ids":  # (score_completions made them: lists of ints)
            out[key] = [list(ids) for ids in value]
            continue
        try:
            out[key] = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an uncopyable object: its list is still the call's own
            out[key] = list(value) if isinstance(value, list) else value
    return out


def _finished(name: str, worker: threading.Thread, limits: _Limits) -> bool:
    """Wait for `worker` in slices of WAIT_SLICE: True when it ended, False at the deadline;
    ScoringStopped when `limits.should_stop` says so meanwhile."""
    while True:
        left = None if limits.deadline is None else limits.deadline - time.monotonic()
        worker.join(WAIT_SLICE if left is None else max(0.0, min(WAIT_SLICE, left)))
        if not worker.is_alive():
            return True
        if limits.should_stop is not None and limits.should_stop():
            raise ScoringStopped(f"stopped while reward function {name!r} was running")
        if limits.deadline is not None and time.monotonic() >= limits.deadline:
            return False


def _exited(name: str, error: BaseException) -> RewardFunctionError:
    """A reward function called sys.exit (or raised another BaseException that is not an error)."""
    return RewardFunctionError(
        f"reward function {name!r} raised {error!r} (it asked the process to exit): a reward function "
        "must return its scores; raise an exception for a completion it cannot score, or return None."
    )


def _timed_out(name: str, limits: _Limits, size: int) -> RewardFunctionError:
    return RewardFunctionError(
        f"reward function {name!r} did not return within reward_timeout={limits.timeout:g} s for a batch "
        f"of {size} completions (the call was abandoned); raise reward_timeout (null: no limit), make the "
        "function bound its own work, or set on_reward_error=unscorable to score such batches None."
    )


def as_number(value: Any) -> Any:
    """A one-element torch tensor, a numpy scalar or a 0-d numpy array as the Python number it holds;
    anything else unchanged. (TRL turns a function's list into torch.tensor(..., dtype=float32), so
    it takes all of these; numpy is found by duck typing, never imported.)"""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()  # np.float32 -> float, np.int64 -> int, np.bool_ -> bool, 0-d array -> its item
    return value


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _to_score(name: str, row: int, value: Any, completion: Any) -> float:
    """One row's score as a float; None -> NaN (unscorable). A bool counts 1.0 / 0.0, as in TRL
    (torch.tensor([True, False], dtype=torch.float32) == [1.0, 0.0])."""
    if value is None:
        return math.nan
    value = as_number(value)
    where = f"for row {row} (completion {_preview(completion)})"
    if not isinstance(value, (int, float)):  # bool is an int
        kind = type(value).__name__
        raise RewardFunctionError(
            f"reward function {name!r} returned {value!r} ({kind}) {where}; "
            "return a float, or None when the completion cannot be scored."
        )
    try:
        score = float(value)
    except OverflowError:  # an int beyond float's range (its digits are not shown: there may be millions)
        raise RewardFunctionError(
            f"reward function {name!r} returned an integer of {value.bit_length()} bits {where}, too large "
            "for a float; return a finite float, or None when the completion cannot be scored."
        ) from None
    if not math.isfinite(score):
        raise RewardFunctionError(
            f"reward function {name!r} returned {score} {where}; "
            "return a finite float, or None when the completion cannot be scored."
        )
    if abs(score) > FLOAT32_MAX:  # rewards are float32 tensors: it would become inf there
        raise RewardFunctionError(
            f"reward function {name!r} returned {score:g} {where}, beyond the range of float32 "
            f"(±{FLOAT32_MAX:.3g}) that rewards are computed in; scale it down, or return None when the "
            "completion cannot be scored."
        )
    return score


def _rows(kwargs: dict[str, Any], row: int) -> dict[str, Any]:
    """The arguments of one row: every list cut to its `row`-th item (a list of one)."""
    return {k: (v[row : row + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}


def _find_failing_row(
    name: str, fn: Callable[..., Any], kwargs: dict[str, Any], size: int, limits: _Limits
) -> tuple[int, BaseException] | str | None:
    """The first row the function raises on alone (None: none does; "timeout": the time ran out
    looking)."""
    for row in range(size):
        kind, value = _invoke(name, fn, _rows(kwargs, row), limits)
        if kind == "timeout":
            return "timeout"
        if kind == "error":
            return row, value
    return None


def _score_one(
    name: str,
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    size: int,
    completions: Sequence[Any],
    on_error: str,
    limits: _Limits,
) -> tuple[list[float], int]:
    kind, values = _invoke(name, fn, kwargs, limits)
    if kind == "timeout":
        if on_error == "unscorable":  # every row of the batch is unscorable, and counted
            return [math.nan] * size, size
        raise _timed_out(name, limits, size)
    if kind == "error":
        return _failed_batch(name, fn, kwargs, completions, on_error, limits, values)
    if isinstance(values, torch.Tensor) or (type(values).__module__ == "numpy" and hasattr(values, "tolist")):
        values = values.tolist()  # a [B] tensor or numpy array (a 0-d one becomes a scalar: refused below)
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise RewardFunctionError(
            f"reward function {name!r} returned {got} for {size} completions; return one per completion."
        )
    return [_to_score(name, i, v, completions[i]) for i, v in enumerate(values)], 0


def _failed_batch(
    name: str,
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    completions: Sequence[Any],
    on_error: str,
    limits: _Limits,
    error: BaseException,
) -> tuple[list[float], int]:
    """The function raised `error` on the whole batch: the error naming the row it raises on alone
    (or with on_error="unscorable", those rows None and counted)."""
    size = len(completions)
    if not isinstance(error, Exception):  # SystemExit and kin: never a row's failure
        raise _exited(name, error) from error
    if isinstance(error, RewardFunctionError):  # the function's own account of the batch (a reward
        if on_error == "unscorable":  # server that failed): no row to look for, its line says it all
            return [math.nan] * size, size
        raise error
    failing = _find_failing_row(name, fn, kwargs, size, limits)
    if failing == "timeout":  # the batch raised and the search for its row ran out of time
        if on_error == "unscorable":
            return [math.nan] * size, size
        failing = None
    if failing is not None and not isinstance(failing[1], Exception):
        raise _exited(name, failing[1]) from failing[1]
    if on_error == "unscorable" and failing is not None:
        return _score_rowwise(name, fn, kwargs, size, completions, limits)
    where = (
        f" on row {failing[0]} (completion {_preview(completions[failing[0]])}): {failing[1]!r}"
        if failing
        else f": {error!r}"
    )
    raise RewardFunctionError(f"reward function {name!r} raised{where}") from error


def _score_rowwise(
    name: str,
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    size: int,
    completions: Sequence[Any],
    limits: _Limits,
) -> tuple[list[float], int]:
    """on_error="unscorable": each row alone; rows that raise, or that the time left does not reach,
    are NaN and counted."""
    scores, failed = [], 0
    for row in range(size):
        kind, value = _invoke(name, fn, _rows(kwargs, row), limits)
        if kind == "error" and not isinstance(value, Exception):
            raise _exited(name, value) from value
        if kind != "ok":  # configured to count, not stop
            scores.append(math.nan)
            failed += 1
            continue
        scores.append(
            _to_score(name, row, value[0] if isinstance(value, (list, tuple)) else value, completions[row])
        )
    return scores, failed


def _conversational(prompts: Sequence[Any]) -> bool:
    """Whether the prompts are conversations (lists of {"role", "content"} messages), as TRL decides."""
    first = prompts[0] if len(prompts) else None
    return isinstance(first, list) and all(isinstance(m, dict) and "role" in m for m in first)


def _texts_and_conversations(completions: Sequence[Any]) -> tuple[list[str], list[list[dict]] | None]:
    """Completions as text, and as messages when given as episodes' messages (the text of an episode is
    its last policy turn, its answer); None when given as text."""
    if all(isinstance(c, str) for c in completions):
        return list(completions), None
    conversations = [[dict(m) for m in c] for c in completions]
    last = (
        next((str(m.get("content", "")) for m in reversed(c) if m.get("role") == "assistant"), "")
        for c in conversations
    )
    return list(last), conversations


def _arguments(
    prompts: Sequence[Any],
    completions: list[Any],
    columns: dict[str, Sequence[Any]] | None,
    completion_ids: Sequence[Sequence[int]] | None,
) -> dict[str, Any]:
    """What every function is called with: the prompts, completions, token ids and the data's columns
    (a column named as one of the others is not passed), each a list of B."""
    size = len(completions)
    kwargs: dict[str, Any] = {"prompts": list(prompts), "completions": list(completions)}
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    for key, values in (columns or {}).items():
        if key in kwargs:
            continue
        if len(values) != size:
            raise ValueError(f"column {key!r} has {len(values)} values for {size} completions.")
        kwargs[key] = list(values)
    return kwargs


_UNSCORABLE_SAID: set[tuple[str, ...]] = set()  # the reward functions warned about, in this process


def _say_unscorable(rewards_per_func: torch.Tensor, kwargs: dict[str, Any], names: list[str]) -> None:
    """TRL's warning, through logging, when every function returned None for a row: the first such row's
    arguments (the row is unscorable: it gets no reward and advantage 0). Once per process for a set of
    functions (TRL's says it every batch; a run whose environment often pays nothing would repeat it)."""
    rows = torch.isnan(rewards_per_func).all(dim=1).nonzero().flatten().tolist()
    if not rows or tuple(names) in _UNSCORABLE_SAID:
        return
    _UNSCORABLE_SAID.add(tuple(names))
    row = {k: v[rows[0]] for k, v in kwargs.items() if isinstance(v, list)}
    logging.getLogger("grpokit.rewards").warning(
        "All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at least one "
        "reward function returns a valid reward (%d of %d rows unscorable, None or a failure under "
        "on_reward_error=unscorable: no reward, advantage 0).",
        row,
        len(rows),
        rewards_per_func.shape[0],
    )


def score_completions(
    reward_funcs: Sequence[Callable[..., Any]],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    columns: dict[str, Sequence[Any]] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    weights: Sequence[float] | None = None,
    rules: CallRules = CallRules(),
) -> RewardScores:
    """Score B completions with R reward functions and combine them.

    Each function is called once for the batch as f(prompts=…, completions=…, completion_ids=…,
    **columns) with lists of length B (functions without **kwargs get the arguments they name), under
    `rules` (`CallRules`: what a failure, a hang or a stop request does). `prompts` are the rows' own:
    text, or conversations (message lists); with conversations a function gets each completion as
    TRL passes it, [{"role": "assistant", "content": text}], unless it reads text (`takes_text`).
    As TRL's, each function also gets `trainer_state` (`rules.state`; without one, RunState(None)),
    `log_metric(name, value)` (the step's metrics get the mean of each name's values as logged/<name>)
    and `log_extra(column, values)` (B values beside the completions logged).
    A completion may itself be given as messages (a multi-turn episode through the chat template: the
    policy's turns and the observations); functions then get those messages, as TRL gives a
    tool-calling episode, or, reading text, the last policy turn.
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
    completions, conversations = _texts_and_conversations(completions)
    kwargs = _arguments(prompts, completions, columns, completion_ids)
    logged: dict[str, list[float]] = {}
    extra: dict[str, list[Any]] = {}
    kwargs["log_metric"] = lambda name, value: logged.setdefault(str(name), []).append(float(value))
    kwargs["log_extra"] = lambda column, values: extra.__setitem__(str(column), list(values))
    kwargs["trainer_state"] = RunState(global_step=None) if rules.state is None else rules.state
    # TRL's contract: with conversational prompts, a completion is [{"role": "assistant", "content": text}]
    # (grpokit's own functions, marked `takes_text`, read the text)
    as_turns = None  # TRL's contract, below
    if _conversational(prompts):
        as_turns = conversations or [[{"role": "assistant", "content": c}] for c in completions]
    table, failed = [], 0
    names = reward_names(reward_funcs)
    for name, fn in zip(names, reward_funcs, strict=True):
        limits = _Limits.start(rules.timeout, rules.should_stop)  # each function: the whole timeout
        given = (
            kwargs
            if as_turns is None or getattr(fn, "takes_text", False)
            else kwargs | {"completions": as_turns}
        )
        scores, n_failed = _score_one(name, fn, given, size, completions, rules.on_error, limits)
        table.append(scores)
        failed += n_failed
    rewards_per_func = torch.tensor(table, dtype=torch.float32).T.reshape(size, len(reward_funcs))  # [B, R]
    _say_unscorable(rewards_per_func, kwargs, names)
    return RewardScores(
        names=names,
        rewards_per_func=rewards_per_func,
        rewards=combine_rewards(rewards_per_func, weights),
        num_failed=failed,
        logged={name: math.fsum(values) / len(values) for name, values in logged.items()},
        extra=extra,
    )
