"""Asynchronous GRPO (max_staleness): a rollout worker process samples and scores, with an exact
staleness (train/async_rollout.py)."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.train.grpo import train_grpo
from grpokit.train.rollout_worker import RolloutError, sampling_version
from tests.helpers import read_steps, tiny_run
from tests.train.helpers import ones_reward, tiny_config, weights

ASYNC_KEYS = ("async/", "timing/", "time", "step_time", "tokens_per_second")  # clocks, the async figures


@pytest.mark.slow  # three runs with worker processes
def test_several_workers_take_the_steps_in_turn_with_the_same_numbers(tmp_path, caplog):
    """rollout_workers=3 (k = 2: three batches sampled at once, step s by worker s mod 3): the one-worker
    run's metrics (clocks aside) and weights, bit for bit. Resumed from its step-5 checkpoint (two
    batches in flight, sampled by two different workers) with rollout_workers=2, it ends there too:
    how many workers sample changes no number, so a resume may change it. Then resumed past its end."""
    settings = dict(max_steps=10, save_steps=5, max_staleness=2, num_threads=1)
    one = tiny_config(tmp_path / "one", **settings)
    train_grpo(one, reward_funcs=[ones_reward])
    three = tiny_config(tmp_path / "three", rollout_workers=3, **settings)
    train_grpo(three, reward_funcs=[ones_reward])
    a, b = read_steps(one.output_dir), read_steps(three.output_dir)
    assert [r["async/weight_version"] for r in b] == [float(max(0, s - 3)) for s in range(1, 11)]
    assert [r["async/worker"] for r in b] == [float(s % 3) for s in range(1, 11)]
    assert _without_clocks(a) == _without_clocks(b)
    wa, wb = weights(Path(one.output_dir)), weights(Path(three.output_dir))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # as a run of 3 workers stopped after its step-5 checkpoint would leave it, resumed with 2
    stopped = tmp_path / "stopped" / "run"
    shutil.copytree(three.output_dir, stopped)
    shutil.rmtree(stopped / "checkpoint-10")
    resumed = three.model_copy(update={"output_dir": str(stopped), "rollout_workers": 2, "resume": True})
    train_grpo(resumed, reward_funcs=[ones_reward])
    assert _without_clocks(read_steps(stopped)) == _without_clocks(a)
    wc = weights(stopped)
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    # the run goes on past its end (max_steps raised): steps 11-12, which no run sampled, are sampled
    # with the checkpoint's weights (version 10, not 8 and 9: those are gone), said once; none is lost
    caplog.clear()
    train_grpo(resumed.model_copy(update={"max_steps": 12}), reward_funcs=[ones_reward])
    rows = read_steps(stopped)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["async/weight_version"] for r in rows[10:]] == [10.0, 10.0]
    said = [r.getMessage() for r in caplog.records if "where it ended" in r.getMessage()]
    assert said == [
        "the run goes on past step 10, where it ended: steps 11-12, which no run sampled before, are "
        "sampled with the weights of step 10 (less than max_staleness=2 versions old, as async/staleness "
        "shows)"
    ]


def test_the_version_a_batch_is_sampled_with():
    """By hand: synchronous step s samples with version s − 1; k steps stale, max(0, s − 1 − k);
    with weights published every n steps, the newest published version at or before that."""
    assert [sampling_version(s, 0) for s in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [sampling_version(s, 2) for s in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    assert [sampling_version(s, 0, every=2) for s in range(1, 7)] == [0, 0, 2, 2, 4, 4]
    assert [sampling_version(s, 1, every=3) for s in range(1, 9)] == [0, 0, 0, 0, 3, 3, 3, 6]


def _without_clocks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(ASYNC_KEYS)} for r in rows]


# the synchronous runs async=0 must equal: the main options (a reference, two updates per batch); a
# multi-turn tool run (the calc tool, after a warm start that teaches calling it); dynamic sampling with
# the curriculum (drawing again, and the pools, in the worker)
SYNCHRONOUS_RUNS = {
    "main": dict(max_steps=20, beta=0.04, num_iterations=2),
    "tool": dict(
        task="tool_addition",
        max_steps=20,
        max_turns=3,
        sft_steps=15,
        sft_batch_size=32,
        max_completion_length=80,
    ),
    "dynamic_curriculum": dict(max_steps=10, dynamic_sampling=True, curriculum=True, max_resample_batches=3),
}


@pytest.mark.slow  # a worker process (seconds to start), many steps
@pytest.mark.parametrize("case", list(SYNCHRONOUS_RUNS))
def test_staleness_0_is_the_synchronous_run_bitwise(tmp_path, case):
    """max_staleness=0: every batch sampled in the worker with the weights of the step before, as the
    synchronous loop samples it: the same metrics (clocks aside) and weights, bit for bit."""
    # one CPU thread on both sides: a matrix product split over another number of threads rounds
    # differently (the worker computes on its own share of the threads)
    options = SYNCHRONOUS_RUNS[case]
    sync = tiny_config(tmp_path / "sync", save_steps=options["max_steps"], num_threads=1, **options)
    train_grpo(sync, reward_funcs=None if case == "tool" else [ones_reward])
    stale = sync.model_copy(update={"output_dir": str(tmp_path / "async" / "run"), "max_staleness": 0})
    train_grpo(stale, reward_funcs=None if case == "tool" else [ones_reward])
    a, b = read_steps(sync.output_dir), read_steps(stale.output_dir)
    n = options["max_steps"]
    assert [r["async/staleness"] for r in b] == [0.0] * n
    assert [r["async/weight_version"] for r in b] == [float(s - 1) for s in range(1, n + 1)]
    assert _without_clocks(a) == _without_clocks(b)
    if case == "tool":  # episodes of more than one turn (a tool called, well or not)
        assert max(r["env/turns"] for r in b) > 1
    if case == "dynamic_curriculum":  # drew again for groups with no spread, at some step
        assert max(r["num_generation_batches"] for r in b) > 1
    wa, wb = weights(Path(sync.output_dir)), weights(Path(stale.output_dir))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (tmp_path / "async" / "run" / ".rollout").exists()  # the weight files are removed


REWARD_FILE = """
def ones(prompts, completions, **columns):
    return [c.count("1") / max(len(c), 1) for c in completions]
"""


@pytest.mark.slow  # a worker process (seconds to start), many steps
def test_every_batch_is_exactly_k_versions_old(tmp_path):
    """k = 2 over 50 steps: step s trains on a batch of version max(0, s − 3), so after the first 2
    steps every batch is exactly 2 versions old; the first step (version 0, the same seed) is the
    synchronous run's first step, the second is not (sampled with version 0, not 1). The reward is a
    file of the user's (`python: file.py:f`), loaded by the worker as by the trainer. (That such a run
    repeats itself bit for bit is what the resume tests below prove.)"""
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    rewards = [{"python": f"{tmp_path / 'my_rewards.py'}:ones"}]
    cfg = tiny_config(
        tmp_path / "a",
        max_steps=50,
        save_steps=50,
        max_staleness=2,
        num_threads=1,
        reward_funcs=rewards,
        rollout_device="cpu",  # (as chosen anyway on a CPU: the option's path, given)
    )
    train_grpo(cfg)
    rows = read_steps(cfg.output_dir)
    assert [r["async/weight_version"] for r in rows] == [float(max(0, s - 3)) for s in range(1, 51)]
    assert [r["async/staleness"] for r in rows[2:]] == [2.0] * 48
    assert "rewards/ones/mean" in rows[0]
    # (the same loss: k ≥ 1 takes the decoupled objective, sampling_correction=token_truncate)
    correction = "token_truncate"
    sync = tiny_config(
        tmp_path / "sync", max_steps=2, num_threads=1, sampling_correction=correction, reward_funcs=rewards
    )
    train_grpo(sync)
    first_two = _without_clocks(read_steps(sync.output_dir))
    assert first_two[0] == _without_clocks(rows)[0] and first_two[1] != _without_clocks(rows)[1]


def test_stale_batches_take_the_decoupled_objective_unless_told_otherwise():
    """max_staleness ≥ 1 with sampling_correction unset: token_truncate (each token weighted by the
    weights-before-the-update over the sampler's probability, capped), said in config.yaml; set
    explicitly, or at k = 0, or for vespo (its own weights), the value stays."""
    from grpokit.config.applied import ASYNC, annotated_yaml, applied

    resolved = applied(GRPOConfig(max_staleness=1))
    assert resolved.config.sampling_correction == "token_truncate"
    assert resolved.sources["sampling_correction"] == ASYNC
    assert f"# {ASYNC}, as unset (default: none)\nsampling_correction: token_truncate" in annotated_yaml(
        resolved
    )
    for kept in (
        {"max_staleness": 0},
        {"max_staleness": 1, "sampling_correction": "none"},
        {"loss_type": "vespo", "max_staleness": 1},
    ):
        assert applied(GRPOConfig(**kept)).config.sampling_correction == "none", kept


def test_a_lambda_reward_is_refused_in_one_line(tmp_path):
    cfg = tiny_config(tmp_path, max_staleness=1)
    with pytest.raises(
        ValueError, match=r"reward function '.*<lambda>' cannot be sent to the rollout worker"
    ):
        train_grpo(cfg, reward_funcs=[lambda prompts, completions, **_: [0.0] * len(completions)])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any work


@pytest.mark.parametrize("option", ["dynamic_sampling", "curriculum"])
def test_what_ranks_agree_on_through_collectives_is_refused_under_torchrun(option):
    from types import SimpleNamespace

    from grpokit.config.plan import grpo_plan
    from grpokit.train.async_rollout import check_rollout

    plan = grpo_plan(GRPOConfig(max_staleness=1, **{option: True}))
    step = plan.trainee.step
    data = SimpleNamespace(reward_funcs=[ones_reward], environment=None)  # (what it reads of RunData)
    check_rollout(plan.rollout, data, 1, step)  # one process: taken
    with pytest.raises(
        ValueError, match=rf"^{option} with max_staleness under torchrun is not supported yet"
    ):
        check_rollout(plan.rollout, data, 2, step)


def test_the_tasks_own_tools_with_rollout_servers_are_refused_before_any_work():
    """tool_addition's tools come from the task, not the config: refused once the data is resolved."""
    from types import SimpleNamespace

    from grpokit.config.plan import grpo_plan
    from grpokit.train.async_rollout import check_rollout

    plan = grpo_plan(GRPOConfig(max_staleness=1, rollout_server_urls=["http://127.0.0.1:9"]))
    data = SimpleNamespace(reward_funcs=[ones_reward], environment=object())  # (the task's tools)
    with pytest.raises(
        ValueError, match=r"^tools with rollout_server_urls is not supported: .* set tools=\[\]$"
    ):
        check_rollout(plan.rollout, data, 1, plan.trainee.step)
    check_rollout(
        plan.rollout, SimpleNamespace(reward_funcs=[ones_reward], environment=None), 1, plan.trainee.step
    )


def test_the_rollout_device_by_hand(monkeypatch):
    """Given, it is used; unset: the trainer's device on a CPU; on GPUs the first one no rank of the
    machine trains on (2 ranks on a 4-GPU machine: the workers on cuda:2 and cuda:3), else the trainer's
    GPU. A CUDA device the machine lacks is refused before any work."""
    from types import SimpleNamespace

    from grpokit.config.plan import grpo_plan
    from grpokit.train import distributed
    from grpokit.train.async_rollout import check_rollout, rollout_device

    cpu, gpu0 = torch.device("cpu"), torch.device("cuda", 0)
    assert rollout_device(None, cpu) == cpu and rollout_device("cpu", gpu0) == cpu
    assert rollout_device("cuda:3", cpu) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert rollout_device(None, gpu0) == torch.device("cuda", 1)  # one process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ranks = [distributed.Dist(rank=r, world_size=2, local_rank=r, device=gpu0) for r in (0, 1)]
    assert [rollout_device(None, gpu0, d) for d in ranks] == [torch.device("cuda", i) for i in (2, 3)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # no spare GPU: each rank's own
    assert [rollout_device(None, gpu0, d) for d in ranks] == [gpu0, gpu0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = grpo_plan(GRPOConfig(max_staleness=1, rollout_device="cuda:1"))
    data = SimpleNamespace(reward_funcs=[ones_reward], environment=None)
    with pytest.raises(ValueError, match=r"^rollout_device=cuda:1: this machine has 0 CUDA GPU\(s\)"):
        check_rollout(plan.rollout, data, 1, plan.trainee.step)


def raises_on_eval(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    raise RuntimeError("the judge is down")


@pytest.mark.slow  # a worker process
def test_a_run_that_fails_before_step_1_leaves_no_worker_behind(tmp_path, monkeypatch):
    """On an accelerator the worker process starts before the warm start (its imports overlap it); a
    run that ends before its loop (here the starting evaluation's reward raises) stops it: no process
    is left running."""
    import multiprocessing

    from grpokit.train import grpo

    monkeypatch.setattr(grpo, "spawns_early", lambda device, warm_starts: True)  # as on a GPU
    cfg = tiny_config(tmp_path, max_staleness=1, eval_steps=2, on_reward_error="raise")
    with pytest.raises(Exception, match="the judge is down"):
        train_grpo(cfg, reward_funcs=[raises_on_eval])
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 1, "use_peft": True}, "use_peft with max_staleness is not supported yet"),
        ({"weight_sync_steps": 2}, "weight_sync_steps is read only with max_staleness"),
        ({"max_staleness": 1, "weight_sync_steps": 0}, "weight_sync_steps"),
        ({"max_staleness": 1, "weight_sync_timeout": 0}, "weight_sync_timeout"),
        ({"max_staleness": 1, "rollout_device": "gpu"}, "rollout_device"),
        ({"rollout_device": "cpu"}, "rollout_device is read only with max_staleness"),
        ({"rollout_workers": 2}, "rollout_workers is read only with max_staleness"),
        ({"rollout_server_urls": ["http://a:1"]}, "rollout_server_urls is read only with max_staleness"),
        ({"max_staleness": 1, "rollout_server_urls": ["ftp://a"]}, "'ftp://a' is not an http.s. URL"),
        ({"max_staleness": 1, "rollout_server_urls": []}, "rollout_server_urls is empty"),
        ({"max_staleness": 1, "rollout_server_urls": ["http://a:1"] * 2}, "names a server twice"),
        (
            {"max_staleness": 1, "rollout_server_urls": ["http://a:1"], "rollout_workers": 2},
            "rollout_workers with rollout_server_urls is not supported: one worker updates",
        ),
        (
            {"max_staleness": 1, "rollout_server_urls": ["http://a:1"], "tools": ["calc"]},
            "tools with rollout_server_urls is not supported: multi-turn episodes .* run in process",
        ),
        ({"max_staleness": 1, "request_timeout": 0}, "request_timeout"),
        ({"max_staleness": 1, "rollout_workers": 0}, "rollout_workers"),
        (
            {"max_staleness": 1, "rollout_workers": 2, "curriculum": True},
            r"curriculum with rollout_workers=2 is refused: .* set rollout_workers=1 ",
        ),
        (
            {"max_staleness": 1, "rollout_workers": 2, "dynamic_sampling": True},
            "dynamic_sampling with rollout_workers=2 is refused",
        ),
    ],
)
def test_each_option_refuses_a_bad_value_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**overrides)


def fails_at_step_3(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Raises from its third call on (the worker's third batch, and any retry of its rows)."""
    fails_at_step_3.calls = getattr(fails_at_step_3, "calls", 0) + 1
    if fails_at_step_3.calls >= 3:
        raise RuntimeError("the sandbox is down")
    return [0.0] * len(completions)


def hangs_at_step_2(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    hangs_at_step_2.calls = getattr(hangs_at_step_2, "calls", 0) + 1
    if hangs_at_step_2.calls == 2:
        time.sleep(3600)
    return [0.0] * len(completions)


def dies_once_at_step_5(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    """ones_reward, but the first worker to call it a 5th time dies there (kill -9 of the worker)."""
    dies_once_at_step_5.calls = getattr(dies_once_at_step_5, "calls", 0) + 1
    marker = Path(os.environ["GRPOKIT_TEST_MARKER"])
    if dies_once_at_step_5.calls == 5 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return ones_reward(prompts, completions, **kw)


@pytest.mark.slow  # three runs, each with a worker process
def test_a_run_whose_worker_was_killed_resumes_bitwise(tmp_path, monkeypatch):
    """The worker killed (SIGKILL) while it scores step 5's batch, which the checkpoint after step 4
    waits for (k = 1: it is in flight then): the run ends in one line, and resumed from its last
    checkpoint (with the batch in flight then) it ends where the uninterrupted run ends, bit for bit;
    weights published every 2 steps (weight_sync_steps) throughout. (The same reward function in
    both runs: its name is in the metrics; the uninterrupted run finds the marker already there.)"""
    settings = dict(max_steps=8, save_steps=2, max_staleness=1, weight_sync_steps=2, num_threads=1)
    (tmp_path / "never").touch()
    monkeypatch.setenv("GRPOKIT_TEST_MARKER", str(tmp_path / "never"))
    straight = tiny_config(tmp_path / "a", **settings)
    train_grpo(straight, reward_funcs=[dies_once_at_step_5])
    monkeypatch.setenv("GRPOKIT_TEST_MARKER", str(tmp_path / "killed"))
    killed = tiny_config(tmp_path / "b", **settings)
    with pytest.raises(RolloutError, match="the rollout worker died") as raised:
        train_grpo(killed, reward_funcs=[dies_once_at_step_5])
    assert (tmp_path / "killed").exists() and "the last checkpoint is" in str(raised.value)
    train_grpo(killed.model_copy(update={"resume": True}), reward_funcs=[dies_once_at_step_5])
    a, b = read_steps(straight.output_dir), read_steps(killed.output_dir)
    assert [r["step"] for r in b] == list(range(1, 9))
    # published every 2 steps: the newest version at or before s - 2
    assert [r["async/weight_version"] for r in b] == [0.0, 0.0, 0.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert _without_clocks(a) == _without_clocks(b)
    wa, wb = weights(Path(straight.output_dir)), weights(Path(killed.output_dir))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # a worker process each, and a timeout waited out
@pytest.mark.parametrize(
    "reward, said, saved",
    [
        (fails_at_step_3, "the rollout worker failed at step 3: RewardFunctionError", 2),
        (hangs_at_step_2, "sent no batch for step 2 within weight_sync_timeout=3 s", 1),
    ],
)
def test_a_worker_that_fails_hangs_or_dies_ends_the_run_in_one_line(tmp_path, reward, said, saved):
    """Never a hang: the trainer stops within weight_sync_timeout (+ a poll) and names what happened
    and the last checkpoint. (A worker that dies: test_a_run_whose_worker_was_killed_resumes_bitwise.)"""
    cfg = tiny_config(
        tmp_path, max_steps=4, max_staleness=0, weight_sync_timeout=3, reward_timeout=None, save_steps=1
    )
    began = time.monotonic()
    with pytest.raises(RolloutError, match=re.escape(said)) as raised:
        train_grpo(cfg, reward_funcs=[reward])
    assert time.monotonic() - began < 60  # a worker start, a step or two, the timeout: far less
    assert "\n" not in str(raised.value)
    if reward is fails_at_step_3:  # the worker's own traceback, as a note (a traceback, --debug, shows it)
        (note,) = raised.value.__notes__
        assert note.startswith("the rollout worker's traceback:\nTraceback") and "fails_at_step_3" in note
    assert f"the last checkpoint is {tmp_path / 'run' / f'checkpoint-{saved}'} (resume=true" in str(
        raised.value
    )


def _cli(out: Path, *extra: str) -> subprocess.Popen:
    settings = tiny_run(max_steps=8, save_steps=1, max_staleness=2, num_threads=1)
    command = [sys.executable, "-m", "grpokit", "train", f"output_dir={out}", *settings, *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # (the process ended meanwhile)
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """Whether process `pid` still runs: it exists and is no zombie (an orphan's exit is reaped by the
    machine's init, which in some containers never reaps)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


@pytest.mark.slow  # five command-line runs, each with a worker process
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
def test_kill_9_of_the_trainer_then_resume_is_bitwise(tmp_path):
    """`grpokit train max_staleness=2` killed with SIGKILL at 3 random points (each resumed run killed
    again): its worker exits by itself each time (its trainer is gone), and the last resume=true ends
    where the uninterrupted run ends, bit for bit, every step logged once."""
    from safetensors.torch import load_file

    straight = _cli(tmp_path / "a")
    _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err
    out, chance = tmp_path / "b", random.Random(5)
    for target in sorted(chance.sample(range(2, 8), 3)):  # steps logged when the kill comes
        process = _cli(out, *(["resume=true"] if (out / "metrics.jsonl").exists() else []))
        deadline = time.time() + 240
        workers: list[int] = []  # (a resumed run's worker starts with its loop, after the log is read)
        while (
            len(read_steps(out) if (out / "metrics.jsonl").exists() else []) < target or not workers
        ) and time.time() < deadline:
            assert process.poll() is None, process.stderr.read()
            workers = _children(process.pid)
            time.sleep(0.01)
        time.sleep(chance.random() * 0.2)  # anywhere in the next step, checkpoint writes included
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=60)
        gone = time.time() + 10
        while any(_running(w) for w in workers) and time.time() < gone:
            time.sleep(0.1)
        assert workers and not any(_running(w) for w in workers)  # no orphan left
    resumed = _cli(out, "resume=true")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    a = load_file(tmp_path / "a" / "checkpoint-8" / "model.safetensors")
    b = load_file(out / "checkpoint-8" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_steps(out)] == list(range(1, 9))


def test_sampling_weights_taken_in_the_update_equal_a_pass_before_it(tmp_path, monkeypatch):
    """One optimizer step per batch: the weights π_old / q come from the update's own forward instead of
    a no-grad pass before it (which a stale batch's decoupled objective would otherwise pay every step).
    Same weights, loss, metrics and trained weights as the pass before; the repetition penalty makes
    the sampler differ from the training forward, so the weights are not all 1 and some hit their cap."""
    from grpokit.train import before_update

    options = dict(
        max_steps=3,
        num_threads=1,
        repetition_penalty=1.5,
        sampling_correction="token_truncate",
        sampling_correction_max=1.05,
    )
    train_grpo(tiny_config(tmp_path / "in_update", **options), reward_funcs=[ones_reward])
    monkeypatch.setattr(before_update, "weights_in_update", lambda params, source: False)
    train_grpo(tiny_config(tmp_path / "pass_before", **options), reward_funcs=[ones_reward])
    a, b = read_steps(tmp_path / "in_update" / "run"), read_steps(tmp_path / "pass_before" / "run")
    assert max(r["sampling/importance_sampling_ratio/max"] for r in a) > 1.05  # the cap is reached
    for x, y in zip(a, b, strict=True):
        for key in (
            "loss",
            "grad_norm",
            "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max",
            "sampling/sampling_logp_difference/mean",
        ):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key
        assert y["timing/reference"] > 0 and set(x) == set(y)
    final_a, final_b = weights(tmp_path / "in_update" / "run"), weights(tmp_path / "pass_before" / "run")
    for name, tensor in final_a.items():
        torch.testing.assert_close(tensor, final_b[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two runs, one with a worker process
def test_a_reward_model_as_a_reward_scores_in_the_worker_as_in_the_trainer(tmp_path):
    """A trained reward model named in reward_funcs ({model: DIR}) goes to the worker with the other
    rewards and scores there: max_staleness=0 gives the synchronous run's rewards and weights, bitwise."""
    from grpokit.models import save_policy
    from tests.train.test_reward_model import TOK, tiny_rm

    save_policy(tiny_rm(), TOK, tmp_path / "rm")
    rewards = [{"model": str(tmp_path / "rm"), "batch_size": 8}, {"builtin": "task"}]
    sync = tiny_config(tmp_path / "sync", reward_funcs=rewards, max_steps=4, save_steps=4, num_threads=1)
    train_grpo(sync)
    stale = sync.model_copy(update={"output_dir": str(tmp_path / "async" / "run"), "max_staleness": 0})
    train_grpo(stale)
    a, b = read_steps(sync.output_dir), read_steps(stale.output_dir)
    assert _without_clocks(a) == _without_clocks(b) and b[-1]["async/weight_version"] == 3.0
    assert all(r["rewards/reward_model:rm/std"] > 0 for r in b)  # the model scored, not a constant
    wa, wb = weights(Path(sync.output_dir)), weights(Path(stale.output_dir))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
