"""An asynchronous run's checkpoint holds the batches in flight (train/in_flight.py): as tensors and plain
values, read with weights_only=True and checked against the resuming run before any is used. A crafted
or damaged one runs nothing and is one line; a worker's failure names the step it failed at."""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from grpokit.train.checkpoint import CheckpointError, write_manifest
from grpokit.train.grpo import train_grpo
from grpokit.train.in_flight import InFlightBounds, in_flight_problem, plain_problem
from grpokit.train.rollout_worker import RolloutError
from tests.helpers import read_steps
from tests.train.helpers import ones_reward, tiny_config

pytestmark = pytest.mark.xdist_group("async_untrusted")  # one saved run, built once per worker


class _Payload:
    """Unpickling this creates `marker`: what a crafted payload would do to run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Any:
    """A max_staleness=1 run of 4 steps, checkpoints every 2: checkpoint-2 holds step 3's batch."""
    config = tiny_config(tmp_path_factory.mktemp("async"), max_steps=4, save_steps=2, max_staleness=1)
    train_grpo(config, reward_funcs=[ones_reward])
    return config


def _stopped_at_2(saved: Any, tmp_path: Path) -> tuple[Any, Path]:
    """The saved run as a run stopped after checkpoint-2 leaves it: (its config to resume, the state)."""
    run = tmp_path / "run"
    shutil.copytree(saved.output_dir, run)
    shutil.rmtree(run / "checkpoint-4")
    return saved.model_copy(
        update={"output_dir": str(run), "resume": True}
    ), run / "checkpoint-2" / "state.pt"


def _edit(state_pt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit state.pt's batches in flight as an attacker would, and write the manifest to match."""
    state = torch.load(state_pt, weights_only=True)
    edit(state["rollout"])
    torch.save(state, state_pt)
    write_manifest(state_pt.parent)


def _batch(rollout: dict[str, Any]) -> dict[str, Any]:
    return rollout["in_flight_by_rank"][0][0]


def _saved_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda rollout: _batch(rollout).__setitem__(key, value)


def _set_in_batch(key: str, make: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda rollout: _batch(rollout)["batch"].__setitem__(key, make(_batch(rollout)["batch"][key]))


def _replace_first(value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda rollout: rollout["in_flight_by_rank"][0].__setitem__(0, value)


# (the damage, the edit, what the one line says)
DAMAGE = {
    "garbage bytes": (
        _replace_first(b"\x80\x04garbage"),
        "rollout batch 0: is b'\\x80\\x04garbage', not a batch",
    ),
    "a string": (_replace_first("a batch"), "rollout batch 0: is 'a batch', not a batch"),
    "an empty list": (
        lambda rollout: rollout.__setitem__("in_flight_by_rank", [[]]),
        "rollout holds 0 batches in flight, where a checkpoint at step 2 with max_staleness=1 holds 1",
    ),
    "a wrong step": (_set("step", 7), "rollout batch 0: step is 7, where step 3's batch is due"),
    "a wrong version": (_set("version", 2**40), "rollout batch 0: version is 1099511627776, where step 3"),
    "a float step": (_set("step", 3.0), "rollout batch 0: step is 3.0, not a count"),
    "ids past the vocabulary": (
        _set_in_batch("completion_ids", lambda ids: ids + 10**6),
        "rollout batch 0: batch.completion_ids holds ids outside the vocabulary [0, ",
    ),
    "negative ids": (
        _set_in_batch("prompt_ids", lambda ids: ids - 10**6),
        "rollout batch 0: batch.prompt_ids holds ids outside the vocabulary [0, ",
    ),
    "a float mask": (
        _set_in_batch("completion_mask", lambda mask: mask.float()),
        "rollout batch 0: batch.completion_mask is a torch.float32 tensor of shape (16, 4), not a bool "
        "tensor",
    ),
    "fewer rows": (
        _set_in_batch("rewards", lambda rewards: rewards[:3]),
        "rollout batch 0: batch.rewards is a torch.float32 tensor of shape (3,), not [B, ...]",
    ),
    "missing texts": (
        _set_in_batch("completions", lambda texts: texts[:-1]),
        "rollout batch 0: batch.completions is",
    ),
    "a sampler position past the data": (
        lambda rollout: _batch(rollout)["prompts_state"].__setitem__("position", 10**9),
        "rollout batch 0: prompts_state.position is 1000000000, past the",
    ),
    "no last step": (lambda rollout: rollout.pop("last_step"), "rollout.last_step is None, not a step"),
    "not a mapping": (lambda rollout: rollout.clear(), "rollout is {}, not the batches in flight"),
}


@pytest.mark.slow  # the saved run: a rollout worker process
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes(saved, tmp_path, damage):
    resume, state_pt = _stopped_at_2(saved, tmp_path)
    edit, said = DAMAGE[damage]
    _edit(state_pt, edit)
    before = {p: p.read_bytes() for p in Path(resume.output_dir).rglob("*") if p.is_file()}

    with pytest.raises(CheckpointError) as error:
        train_grpo(resume, reward_funcs=[ones_reward])

    message = str(error.value)
    assert "\n" not in message and said in message, message
    assert "checkpoint-2" in message and "cannot be resumed" in message
    after = {p: p.read_bytes() for p in Path(resume.output_dir).rglob("*") if p.is_file()}
    assert after == before  # the refusal leaves the directory byte for byte as it was


@pytest.mark.slow  # the saved run: a rollout worker process
def test_a_crafted_batch_in_flight_runs_no_code_on_resume(saved, tmp_path):
    """The probe's attack: step 3's batch replaced by the torch.save bytes of an object whose unpickling
    runs code, the manifest rewritten to match: one line, and the code never ran. The same object
    stored in place (not as bytes) is refused by weights_only, unread."""
    resume, state_pt = _stopped_at_2(saved, tmp_path)
    marker = tmp_path / "code-ran"
    for crafted, said in (
        (_saved_bytes(_Payload(marker)), "not a batch"),
        (_Payload(marker), "could run code"),
    ):
        _edit(state_pt, _replace_first(crafted))
        with pytest.raises(CheckpointError) as error:
            train_grpo(resume, reward_funcs=[ones_reward])
        assert not marker.exists()
        assert "\n" not in str(error.value) and said in str(error.value), str(error.value)


@pytest.mark.slow  # a rollout worker process, several steps
def test_an_intact_checkpoint_with_a_batch_in_flight_resumes_to_the_straight_run(saved, tmp_path):
    """The check passes what a run wrote: resumed from checkpoint-2 (step 3's batch in flight), the run
    ends with the straight run's rewards."""
    resume, _ = _stopped_at_2(saved, tmp_path)
    train_grpo(resume, reward_funcs=[ones_reward])
    straight, resumed = read_steps(saved.output_dir), read_steps(resume.output_dir)
    assert [r["reward"] for r in resumed] == [r["reward"] for r in straight]
    assert [r["async/weight_version"] for r in resumed] == [0.0, 0.0, 1.0, 2.0]


def test_the_schema_by_hand():
    """The fit against the run, on a batch made by hand: B = 2 rows, T = 3, vocabulary 10."""
    batch = {
        "prompt_ids": torch.tensor([[1, 2], [1, 2]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.bool),
        "completion_ids": torch.tensor([[3, 4, 0], [5, 0, 0]]),
        "completion_mask": torch.tensor([[True, True, False], [True, False, False]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "sampling_logps": torch.tensor([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]]),
        "rewards": torch.tensor([1.0, 0.0]),
        "completion_attention": None,
        "prompts": ["1+1=", "1+1="],
        "completions": ["2", "3"],
    }
    item = {
        "step": 5,
        "version": 3,
        "batch": batch,
        "metrics": {"reward": torch.tensor(0.5), "num_generation_batches": 1},
        "prompts_state": {"epoch": 0, "position": 2},
        "worker_wait_s": 0.0,
        "weight_load_s": 0.0,
        "worker": 0,
    }
    bounds = InFlightBounds(step=4, max_staleness=1, every=1, rows=2, vocab=10, prompts=8)
    assert plain_problem(item) is None
    assert in_flight_problem([item], 10, bounds) is None
    assert in_flight_problem([item], 4, bounds) == (
        "rollout holds 1 batches in flight, where a checkpoint at step 4 with max_staleness=1 holds 0"
    )
    assert in_flight_problem([item], 10, InFlightBounds(4, 1, 1, 2, vocab=5, prompts=8)) == (
        "rollout batch 0: batch.completion_ids holds ids outside the vocabulary [0, 5)"
    )
    assert in_flight_problem([item], 10, InFlightBounds(4, 1, 1, rows=4, vocab=10, prompts=8)) == (
        "rollout batch 0: batch has 2 rows, where this run's steps have 4"
    )
    # a batch sampled with version 2 is too stale for step 5 at k = 1 (it needs 3, or 4 after a resume)
    assert in_flight_problem([item | {"version": 2}], 10, bounds) == (
        "rollout batch 0: version is 2, where step 5 samples with 3 to 4"
    )
    nan = dict(batch, sampling_logps=torch.full((2, 3), float("nan")))
    assert plain_problem(item | {"batch": nan}) == "batch.sampling_logps holds NaN"
    per_token = dict(batch, advantages=torch.zeros(2, 3))  # per-token advantages: [B, T]
    assert plain_problem(item | {"batch": per_token}) is None
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    assert plain_problem(item | {"batch": dict(batch, prompts=[chat, chat])}) is None  # conversations
    broken = [{"role": "user", "content": object()}]
    assert plain_problem(item | {"batch": dict(batch, prompts=[chat, broken])}).startswith(
        "batch.prompts is [[{'role': 'system'"
    )
    assert plain_problem(item | {"batch": dict(batch, completions=["2", ["3"]])}) == (
        "batch.completions is ['2', ['3']], not 2 completions"
    )


def test_a_batch_crosses_the_pipe_as_plain_values_and_comes_back_equal():
    """to_plain -> bytes -> weights_only -> from_plain: the same tensors, texts and metrics; a user's
    numpy metric comes back as the Python number of the same value (weights_only reads no numpy)."""
    import numpy as np

    from grpokit.train.batch import Batch
    from grpokit.train.in_flight import Sampled, dumps, from_plain, loads, to_plain

    batch = Batch(
        prompt_ids=torch.tensor([[1, 2], [1, 2]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        completion_ids=torch.tensor([[3, 0], [4, 5]]),
        completion_mask=torch.tensor([[True, False], [True, True]]),
        advantages=torch.tensor([0.5, -0.5]),
        sampling_logps=torch.tensor([[-0.25, 0.0], [-1.0, -2.0]]),
        prompts=["1+1=", "1+1="],
        completions=["2", "11"],
        rewards=torch.tensor([1.0, 0.0]),
    )
    metrics = {"reward": torch.tensor(0.5), "env/calls": np.float32(1.5), "reward_errors": np.int64(0)}
    item = Sampled(4, 2, batch, metrics, {"epoch": 0, "position": 2}, 0.125, 0.25, worker=1)
    back = from_plain(loads(dumps(to_plain(item))))
    assert (
        back.step == 4 and back.version == 2 and back.worker == 1 and back.prompts_state == item.prompts_state
    )
    assert (back.worker_wait_s, back.weight_load_s) == (0.125, 0.25)
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "rewards"):
        assert torch.equal(getattr(back.batch, name), getattr(batch, name)) and (
            getattr(back.batch, name).dtype == getattr(batch, name).dtype
        )
    assert back.batch.prompts == batch.prompts and back.batch.completions == batch.completions
    assert back.batch.completion_attention is None
    assert back.metrics == {"reward": torch.tensor(0.5), "env/calls": 1.5, "reward_errors": 0}
    assert type(back.metrics["env/calls"]) is float and type(back.metrics["reward_errors"]) is int


CALLS = {"n": 0}


def fails_at_its_third_batch(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """A reward that raises on its third call in a process (the worker's third step)."""
    CALLS["n"] += 1
    if CALLS["n"] >= 3:
        raise RuntimeError("the judge is down")
    return ones_reward(prompts, completions)


@pytest.mark.slow  # a rollout worker process, several steps
def test_a_worker_failing_outside_its_scoring_thread_names_its_step(tmp_path):
    """With the curriculum the worker scores in its sampling loop (no scoring thread): a reward that
    raises at step 3 is said as step 3's failure (it was said as step 1's)."""
    config = tiny_config(tmp_path, max_steps=6, max_staleness=1, curriculum=True)
    with pytest.raises(RolloutError) as error:
        train_grpo(config, reward_funcs=[fails_at_its_third_batch])
    message = str(error.value)
    assert "\n" not in message and "the rollout worker failed at step 3:" in message, message
    assert "the judge is down" in message
