"""Rewards that hang or misbehave, and updates that would destroy the weights.

* a reward function gets `reward_timeout` seconds a batch (an error naming it, or its rows unscorable),
  and SIGTERM while one runs ends the run within seconds with a checkpoint of the step before;
* what a reward function returns: numpy scalars and bools accepted as TRL takes them, an integer too
  large for a float or a SystemExit refused with one line, all-None steps warned about;
* an update that makes a weight non-finite is rolled back (weights, optimizer state, schedule bit for
  bit) and counted as skipped; the skip guard never names non-finite weights as good.
"""

from __future__ import annotations

import copy
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from grpokit.data import DataError
from grpokit.rewards import CallRules, RewardFunctionError, score_completions
from grpokit.rewards.scoring import ScoringStopped
from grpokit.train.grpo import refuse_destroyed_weights, train_grpo
from grpokit.train.optim import apply_update, update_stays_finite
from grpokit.train.run import TooManySkips
from tests.helpers import read_metrics, read_steps
from tests.test_reliability import TINY
from tests.train.helpers import ones_reward, tiny_config


def _returning(*values):
    def my_reward(prompts, completions, **_):
        return list(values)

    return my_reward


def sleepy(prompts, completions, **_):
    time.sleep(30)  # far past any timeout a test sets: it is abandoned, never waited for
    return [1.0] * len(completions)


def _exits(prompts, completions, **_):
    sys.exit(3)


def _exits_on_b(prompts, completions, **_):
    if "b" in completions:
        sys.exit(3)
    return [1.0] * len(completions)


def _sleeps_in_evaluation(prompts, completions, **_):
    if len(completions) == 4:  # tiny_config: 4 held-out prompts, 16 completions a training step
        time.sleep(30)
    return ones_reward(prompts, completions)


def _destroyed_module():
    module = torch.nn.Linear(2, 1)
    with torch.no_grad():
        module.weight.fill_(float("nan"))
    return module


# (case id, callable taking tmp_path, error class, text the message must contain)
BAD_REWARD_INPUTS = [
    (
        "reward hangs past reward_timeout",
        lambda t: score_completions([sleepy], ["p"], ["c"], rules=CallRules(timeout=0.2)),
        RewardFunctionError,
        "reward function 'sleepy' did not return within reward_timeout=0.2 s for a batch of 1 completions",
    ),
    (
        "reward hangs in evaluation",
        lambda t: train_grpo(tiny_config(t, reward_timeout=0.2), reward_funcs=[_sleeps_in_evaluation]),
        RewardFunctionError,
        "'_sleeps_in_evaluation' did not return within reward_timeout=0.2 s for a batch of 4",
    ),
    (
        "reward integer too large for a float",
        lambda t: score_completions([_returning(1.0, 10**400)], ["p"] * 2, ["a", "b"]),
        RewardFunctionError,
        "reward function 'my_reward' returned an integer of 1329 bits for row 1 (completion 'b'), too large",
    ),
    (
        "reward beyond float32",
        lambda t: score_completions([_returning(1e39)], ["p"], ["a"]),
        RewardFunctionError,
        "'my_reward' returned 1e+39 for row 0 (completion 'a'), beyond the range of float32",
    ),
    (
        "reward numpy infinity",
        lambda t: score_completions([_returning(np.float32("inf"))], ["p"], ["a"]),
        RewardFunctionError,
        "'my_reward' returned inf for row 0",
    ),
    (
        "reward numpy string",
        lambda t: score_completions([_returning(np.str_("good"))], ["p"], ["a"]),
        RewardFunctionError,
        "'my_reward' returned 'good' (str) for row 0",
    ),
    (
        "reward numpy vector per row",
        lambda t: score_completions([_returning(np.array([1.0, 2.0]))], ["p"], ["a"]),
        RewardFunctionError,
        "'my_reward' returned array([1., 2.]) (ndarray) for row 0",
    ),
    (
        "reward calls sys.exit",
        lambda t: score_completions([_exits], ["p"], ["a"]),
        RewardFunctionError,
        "reward function '_exits' raised SystemExit(3) (it asked the process to exit)",
    ),
    (
        "reward calls sys.exit, unscorable",
        lambda t: score_completions(
            [_exits_on_b], ["p"] * 2, ["a", "b"], rules=CallRules(on_error="unscorable")
        ),
        RewardFunctionError,
        "reward function '_exits_on_b' raised SystemExit(3)",
    ),
    (
        "reward calls sys.exit on a worker thread",
        lambda t: score_completions([_exits], ["p"], ["a"], rules=CallRules(timeout=5.0)),
        RewardFunctionError,
        "reward function '_exits' raised SystemExit(3)",
    ),
    (
        "dataset smaller than one step",
        lambda t: train_grpo(
            tiny_config(t, task=None),
            reward_funcs=[ones_reward],
            train_rows=[{"prompt": f"{i}+1="} for i in range(3)],
        ),
        DataError,
        "the training rows has 3 training rows but prompts_per_step=4: a step would draw the same prompt",
    ),
    (
        "learning rate that destroys every update",
        lambda t: train_grpo(_infinite_lr(t), reward_funcs=[ones_reward]),
        TooManySkips,
        "3 consecutive updates had a non-finite loss or gradient norm, or made the weights non-finite "
        "and were undone (the last at step 3); training stopped and checkpoint-3 holds the last good",
    ),
    (
        "weights non-finite before the skip guard trips",
        lambda t: refuse_destroyed_weights(_destroyed_module(), _one_process(), 3, 7),
        TooManySkips,
        "3 consecutive updates were skipped (the last at step 7) and the policy's weights themselves are "
        "not finite",
    ),
]


def _one_process():
    from grpokit.train.distributed import Dist

    return Dist()


def _infinite_lr(tmp_path):
    """learning_rate=inf, past the config's validation (model_copy does not validate)."""
    cfg = tiny_config(tmp_path, max_steps=6, max_consecutive_skips=3, micro_batch_size=16)
    return cfg.model_copy(update={"learning_rate": float("inf")})


@pytest.mark.parametrize(
    ("case", "call", "error", "text"), BAD_REWARD_INPUTS, ids=[c[0] for c in BAD_REWARD_INPUTS]
)
def test_bad_reward_input_gets_one_clear_error(tmp_path, case, call, error, text):
    with pytest.raises(error) as caught:
        call(tmp_path)
    assert isinstance(caught.value, error)
    assert text in str(caught.value), str(caught.value)


# ----------------------------------------------------------------------------- timeouts and stops


def test_a_hung_batch_is_unscorable_with_on_error_unscorable():
    """The hung function's rows are NaN and counted; the other function still scores its rows."""
    began = time.monotonic()
    scores = score_completions(
        [sleepy, ones_reward],
        ["p"] * 3,
        ["1", "11", "2"],
        rules=CallRules(on_error="unscorable", timeout=0.2),
    )
    assert time.monotonic() - began < 5  # the 30 s call was abandoned, not waited for
    assert scores.num_failed == 3
    assert torch.isnan(scores.rewards_per_func[:, 0]).all()
    assert scores.rewards.tolist() == [1.0, 1.0, 0.0]  # ones_reward alone


def test_a_timeout_covers_the_row_by_row_retry():
    """A function that raises on the batch (for row 0) is retried row by row within the same
    deadline: row 0 and the rows the time does not reach are unscorable and counted, and the whole
    call returns soon after the timeout."""

    def slow_rows(prompts, completions, **_):
        if "x" in completions:
            raise ValueError("cannot score x")
        time.sleep(0.15)
        return [1.0] * len(completions)

    began = time.monotonic()
    scores = score_completions(
        [slow_rows], ["p"] * 8, ["x"] + ["c"] * 7, rules=CallRules(on_error="unscorable", timeout=0.5)
    )
    assert time.monotonic() - began < 3  # 7 rows of 0.15 s would take 1.05 s
    scored = (~torch.isnan(scores.rewards)).sum().item()
    assert math.isnan(scores.rewards[0].item()) and 0 < scored < 7 and scores.num_failed == 8 - scored


def test_a_stop_request_abandons_a_running_reward_function():
    flag = {"stop": False}
    began = time.monotonic()

    def stop_soon():
        flag["stop"] = time.monotonic() - began > 0.3
        return flag["stop"]

    with pytest.raises(ScoringStopped, match="while reward function 'sleepy' was running"):
        score_completions(
            [sleepy], ["p"], ["c"], rules=CallRules(should_stop=stop_soon)
        )  # no timeout: waits for stops
    assert time.monotonic() - began < 3


def test_a_stop_request_does_not_abandon_a_fast_function():
    scores = score_completions([ones_reward], ["p"], ["11"], rules=CallRules(should_stop=lambda: True))
    assert scores.rewards.tolist() == [1.0]


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_keyboard_interrupt_from_a_reward_function_is_not_swallowed(timeout):
    def interrupted(prompts, completions, **_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_completions([interrupted], ["p"], ["c"], rules=CallRules(timeout=timeout))


# ----------------------------------------------------------------------------- what a reward returns


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_numpy_scalars_0d_arrays_and_bools_are_scores_as_in_trl(timeout):
    """TRL builds torch.tensor(values, dtype=float32) with None -> nan: numpy scalars and 0-d arrays
    are their value, a bool is 1.0 / 0.0. A [B] numpy array is one score per completion."""
    values = [np.float32(0.5), np.float64(0.25), np.int64(3), np.bool_(True), np.array(2.0)]
    values += [True, False, None]
    scores = score_completions([_returning(*values)], ["p"] * 8, ["c"] * 8, rules=CallRules(timeout=timeout))
    got = scores.rewards_per_func[:, 0].tolist()
    assert got[:7] == [0.5, 0.25, 3.0, 1.0, 2.0, 1.0, 0.0] and math.isnan(got[7])
    array = score_completions([_returning(*[])], [], [])  # (no rows: nothing to score)
    assert array.rewards.numel() == 0
    vector = lambda prompts, completions, **_: np.array([1.5, 2.5])  # noqa: E731
    as_array = score_completions([vector], ["p"] * 2, ["a", "b"])
    assert as_array.rewards.tolist() == [1.5, 2.5]


def test_a_reward_function_that_scores_nothing_is_warned_about_once(tmp_path):
    def abstains(prompts, completions, **_):
        return [None] * len(completions)

    events = []
    train_grpo(
        tiny_config(tmp_path, max_steps=3),
        reward_funcs=[abstains],
        on_event=lambda kind, step, data: events.append((kind, step, data)),
    )
    warnings = [(step, data["message"]) for kind, step, data in events if kind == "warning"]
    assert len(warnings) == 1, warnings  # once per function and run, though every step was unscored
    step, message = warnings[0]
    assert step == 1 and "reward function 'abstains' scored none of the step's completions" in message
    assert "the step learned nothing" in message


# ----------------------------------------------------------------------------- updates that destroy weights


def _trained_one_step(lr: float = 0.1):
    """A Linear with AdamW state after one ordinary update, and fresh gradients for the next."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    apply_update(model, opt, sched, torch.tensor(1.0), 1.0)
    model(torch.arange(3.0)[None]).sum().backward()
    return model, opt, sched


def _optimizer_state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in opt.param_groups[0]["params"]]


@pytest.mark.parametrize("lr", [float("inf"), 1e38])
def test_an_update_that_destroys_the_weights_is_rolled_back_bit_for_bit(lr):
    """lr=inf makes every weight NaN; lr=1e38 overflows them to inf: both are undone, and the weights,
    the optimizer state (its step count included) and the schedule are exactly as before."""
    model, opt, sched = _trained_one_step()
    for group in opt.param_groups:
        group["lr"] = lr
    weights = [p.detach().clone() for p in model.parameters()]
    state, epoch = _optimizer_state(opt), sched.last_epoch
    assert not update_stays_finite(opt, 1.0)  # the guarded (copying) path is taken
    out = apply_update(model, opt, sched, torch.tensor(1.0), 1.0)
    assert out["skipped_update"] == 1.0 and out["update_rolled_back"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    for before, p in zip(state, opt.param_groups[0]["params"], strict=True):
        assert before.keys() == opt.state[p].keys()
        assert all(torch.equal(before[k], opt.state[p][k]) for k in before)
    assert sched.last_epoch == epoch and all(p.grad is None for p in model.parameters())


def test_the_first_update_rolled_back_leaves_no_optimizer_state():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=float("inf"), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    out = apply_update(model, opt, sched, torch.tensor(1.0), 1.0)
    assert out["update_rolled_back"] == 1.0 and not opt.state and sched.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_ordinary_update_is_proven_finite_and_equals_a_plain_adamw_step():
    """The usual case takes no copy (the bound proves the step finite) and changes nothing in what
    the step computes: bitwise the weights of an unguarded AdamW step."""
    model, opt, sched = _trained_one_step(lr=1e-2)
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (loading would share the moments)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        b.grad = a.grad.clone()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert update_stays_finite(opt, 1.0)
    out = apply_update(model, opt, sched, torch.tensor(1.0), 1.0)
    twin_opt.step()
    assert out["skipped_update"] == 0.0 and out["update_rolled_back"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_run_whose_every_update_is_destroyed_stops_with_finite_named_weights(tmp_path):
    from safetensors.torch import load_file

    cfg = _infinite_lr(tmp_path)
    with pytest.raises(TooManySkips, match="checkpoint-3 holds the last good weights"):
        train_grpo(cfg, reward_funcs=[ones_reward])
    run = Path(cfg.output_dir)
    weights = load_file(run / "checkpoint-3" / "model.safetensors")
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    rows = read_metrics(run)
    trained = [r for r in rows if "loss" in r]
    assert [r["update_rolled_back"] for r in trained] == [1.0, 1.0, 1.0]
    assert [r["skipped_update"] for r in trained] == [1.0, 1.0, 1.0]
    # nothing moved: the named checkpoint holds the starting weights, bit for bit
    start = tiny_config(tmp_path / "start", max_steps=1, save_steps=1, learning_rate=1e-30)
    train_grpo(start.model_copy(update={"learning_rate": 0.0}), reward_funcs=[ones_reward])
    initial = load_file(Path(start.output_dir) / "checkpoint-1" / "model.safetensors")
    assert all(torch.equal(initial[k], weights[k]) for k in initial)


# ----------------------------------------------------------------------------- SIGTERM while a reward hangs

HANGING_REWARD = """
import time
from pathlib import Path

COUNT = Path({count!r})
HANG = Path({hang!r})
HANGING = Path({hanging!r})


def hangs_from_step_3(prompts, completions, **_):
    if len(completions) == 16:  # a training step (evaluation scores 4 completions)
        calls = int(COUNT.read_text()) + 1 if COUNT.exists() else 1
        COUNT.write_text(str(calls))
        if calls >= 3 and HANG.exists():
            HANGING.write_text("")
            while True:
                time.sleep(1)
    return [c.count("1") / max(len(c), 1) for c in completions]
"""


def _reward_file(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    folder = tmp_path / name
    folder.mkdir()
    hang, hanging = folder / "hang", folder / "hanging"
    code = HANGING_REWARD.format(count=str(folder / "count"), hang=str(hang), hanging=str(hanging))
    (folder / "reward.py").write_text(code)
    return folder / "reward.py", hang, hanging


def _train(out: Path, reward: Path, steps: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpokit",
            "train",
            f"output_dir={out}",
            f"max_steps={steps}",
            *TINY,
            "save_steps=0",  # no periodic checkpoints: the one on SIGTERM must be written
            f"reward_funcs=[{{python: {reward}:hangs_from_step_3}}]",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_sigterm_while_a_reward_hangs_saves_the_step_before_and_exits(tmp_path):
    reward, hang, hanging = _reward_file(tmp_path, "hanging")
    hang.write_text("")
    out = tmp_path / "run"
    process = _train(out, reward, 6)
    try:
        deadline = time.time() + 240
        while not hanging.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert hanging.exists(), process.stderr.read() if process.poll() is not None else "no hang"
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        process.kill()  # (a no-op once it has exited; never leave a hung run behind)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert took < 15, took  # a checkpoint write and the exit (seconds on a loaded 2-core machine)
    assert "stopped by SIGTERM after step 2: checkpoint-2 saved" in stdout and "resume=true" in stdout
    assert "step 3 abandoned" in stdout
    assert (out / "checkpoint-2" / "state.pt").is_file() and not (out / "checkpoint-3").exists()


@pytest.mark.slow
def test_resuming_after_an_abandoned_step_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    reward, hang, hanging = _reward_file(tmp_path, "interrupted")
    hang.write_text("")
    out = tmp_path / "run"
    process = _train(out, reward, 4)
    try:
        while not hanging.exists() and process.poll() is None:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    hang.unlink()  # the same reward, no longer hanging
    resumed = _train(out, reward, 4, "resume=true")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr

    straight_reward, _, _ = _reward_file(tmp_path, "straight")  # never hangs: no hang file
    straight = _train(tmp_path / "straight", straight_reward, 4)
    _, stderr = straight.communicate(timeout=300)
    assert straight.returncode == 0, stderr
    from safetensors.torch import load_file

    a = load_file(out / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "straight" / "checkpoint-4" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_steps(out)] == [1, 2, 3, 4]  # no step lost or doubled


def test_a_stop_during_step_1_leaves_nothing_to_resume_and_the_same_call_starts_over(tmp_path):
    """SIGTERM while step 1's reward runs: no previous step to save. The run says so (as a stop during
    set-up does), and leaves nothing that would make the same call refuse to start again."""
    import os

    def terminates_then_hangs(prompts, completions, **_):
        if len(completions) == 16:  # step 1's batch (evaluation scores 4 completions)
            os.kill(os.getpid(), signal.SIGTERM)  # StopSignals notes it on the main thread
            time.sleep(30)
        return ones_reward(prompts, completions)

    cfg = tiny_config(tmp_path, max_steps=2)
    events = []
    began = time.monotonic()
    on_event = lambda kind, step, data: events.append((kind, data))  # noqa: E731
    result = train_grpo(cfg, reward_funcs=[terminates_then_hangs], on_event=on_event)
    assert time.monotonic() - began < 20  # not the 30 s the reward sleeps
    assert result.stopped_by == "SIGTERM" and result.steps == 0 and result.phase == "step 1"
    assert ("stopped", {"signal": "SIGTERM", "phase": "step 1", "output_dir": cfg.output_dir}) in events
    run = Path(cfg.output_dir)
    assert not list(run.glob("checkpoint-*")) and not (run / "metrics.jsonl").exists()
    again = train_grpo(cfg, reward_funcs=[ones_reward])  # the same command starts over
    assert again.steps == 2 and (run / "checkpoint-2").is_dir()


# ----------------------------------------------------------------------------- review fixes


def test_an_epsilon_that_rounds_to_zero_in_float32_is_not_taken_as_proof():
    """AdamW's kernels hold ε in float32: 1e-46 is 0 there, and an element whose gradient stayed 0
    computes 0/0 = NaN. The proof must not vouch for that step; the guard rolls it back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9, eps=1e-46, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[1.0, 0.0, 0.0, 0.0]])).sum().backward()  # the weight's other columns get 0
    assert not update_stays_finite(opt, 1.0)
    out = apply_update(model, opt, sched, torch.tensor(1.0), 1.0)
    assert out["update_rolled_back"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_clipping_switched_off_with_a_huge_max_grad_norm_is_still_proven():
    """max_grad_norm=1e20 (clipping off) bounds the gradient by its own norm: no copy every step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 4)).sum().backward()
    assert not update_stays_finite(opt, 1e20)  # the bound alone could not prove it
    import grpokit.train.optim as optim_module

    copies = []
    real_backup = optim_module._backup
    optim_module._backup = lambda o: copies.append(1) or real_backup(o)
    try:
        out = apply_update(model, opt, sched, torch.tensor(1.0), 1e20)
    finally:
        optim_module._backup = real_backup
    assert out["skipped_update"] == 0.0 and copies == []


def test_a_timeout_while_looking_for_the_failing_row_makes_the_batch_unscorable():
    def batch_raises_rows_hang(prompts, completions, **_):
        if len(completions) > 1:
            raise ValueError("batch")
        time.sleep(5)
        return [1.0]

    began = time.monotonic()
    scores = score_completions(
        [batch_raises_rows_hang],
        ["p"] * 4,
        ["a", "b", "c", "d"],
        rules=CallRules(on_error="unscorable", timeout=0.3),
    )
    assert time.monotonic() - began < 3
    assert torch.isnan(scores.rewards).all() and scores.num_failed == 4


def test_no_call_is_started_once_the_time_is_up():
    """Past the deadline the row-by-row retry starts nothing: no pile of abandoned threads."""
    import threading

    calls = []

    def slow(prompts, completions, **_):
        calls.append(1)
        if len(completions) > 1:
            raise ValueError("batch")
        time.sleep(0.2)
        return [1.0]

    alive = threading.active_count()
    scores = score_completions(
        [slow], ["p"] * 50, ["c"] * 50, rules=CallRules(on_error="unscorable", timeout=0.3)
    )
    assert scores.num_failed >= 48 and len(calls) <= 4  # the batch, then the rows the 0.3 s reached
    time.sleep(0.3)
    assert threading.active_count() <= alive + 1
