"""The CPU-thread governor: pinned counts stay pinned; in auto mode the count follows the cores other
processes leave free, only after CONFIRM windows agree, and never changes for a run alone."""

from __future__ import annotations

import pytest
import torch

from grpokit.train import threads
from grpokit.train.threads import ThreadGovernor
from tests.helpers import read_steps


class FakeMachine:
    """A machine of `cores` cores where this process uses `own` cores' worth of CPU and the others
    `others`, advanced one window at a time."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = 100.0, 5000.0, 40.0
        self.others, self.own_rate = 0.0, 2.0

    def read(self):
        return (self.wall, self.busy, self.own)

    def advance(self, seconds: float = 1.0) -> None:
        self.wall += seconds
        self.own += self.own_rate * seconds
        self.busy += (self.own_rate + self.others) * seconds


def _governor(machine: FakeMachine, monkeypatch, most: int = 2) -> tuple[ThreadGovernor, list[int]]:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: most)
    monkeypatch.setattr(torch, "get_num_threads", lambda: most)
    calls: list[int] = []
    governor = ThreadGovernor.start(None, "cpu", read=machine.read, set_threads=calls.append)
    return governor, calls


def test_alone_the_count_never_changes(monkeypatch):
    machine = FakeMachine()
    machine.others = 0.3  # a shell, a test harness polling: less than a core
    governor, calls = _governor(machine, monkeypatch)
    for _ in range(20):
        machine.advance()
        assert governor.tick() is None
    assert governor.current == 2 and calls == []


def test_a_competing_process_takes_a_thread_after_two_windows_and_gives_it_back(monkeypatch):
    machine = FakeMachine()
    governor, calls = _governor(machine, monkeypatch)
    machine.others = 1.9  # another run on 2 threads
    machine.advance()
    assert governor.tick() is None and governor.current == 2  # one window is not enough
    machine.advance()
    message = governor.tick()
    assert governor.current == 1 and calls == [1]
    assert "about 1.9 of this machine's 2 cores" in message and "num_threads=2" in message
    machine.others, machine.own_rate = 1.0, 1.0  # both on one thread now: each holds its core
    for _ in range(5):
        machine.advance()
        assert governor.tick() is None
    assert governor.current == 1
    machine.others = 0.0  # the other run ended
    machine.advance()
    governor.tick()
    machine.advance()
    assert governor.tick() == "the CPU is free again: back to 2 CPU threads."
    assert calls == [1, 2]


def test_a_brief_burst_changes_nothing(monkeypatch):
    machine = FakeMachine()
    governor, calls = _governor(machine, monkeypatch)
    for others in (1.5, 0.0, 1.5, 0.0, 1.5, 0.1):
        machine.others = others
        machine.advance()
        governor.tick()
    assert calls == [] and governor.current == 2


def test_readings_closer_than_a_window_are_not_taken(monkeypatch):
    machine = FakeMachine()
    governor, calls = _governor(machine, monkeypatch)
    machine.others = 2.0
    for _ in range(10):  # 10 ticks within half a second: no window has passed
        machine.advance(0.05)
        governor.tick()
    assert calls == []


def test_the_cores_left_on_a_larger_machine(monkeypatch):
    machine = FakeMachine()
    governor, calls = _governor(machine, monkeypatch, most=8)
    machine.own_rate, machine.others = 8.0, 2.8  # three cores held (0.8 of the third counts)
    for _ in range(2):
        machine.advance()
        governor.tick()
    assert calls == [5]


def test_a_pinned_count_is_set_and_never_changed(monkeypatch):
    machine = FakeMachine()
    calls: list[int] = []
    governor = ThreadGovernor.start(3, "cpu", read=machine.read, set_threads=calls.append)
    machine.others = 2.0
    for _ in range(4):
        machine.advance()
        governor.tick()
    assert calls == [3] and governor.current == 3


@pytest.mark.parametrize(("device", "env"), [("cuda", None), ("cpu", "2")])
def test_no_adaptation_on_a_gpu_or_when_the_environment_pins_threads(monkeypatch, device, env):
    machine = FakeMachine()
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    governor = ThreadGovernor.start(None, device, read=machine.read, set_threads=lambda n: None)
    assert not governor.adaptive


def test_the_real_load_reading_is_consistent():
    """On Linux the machine's busy time includes this process's own CPU time."""
    first = threads.read_load()
    if first is None:
        pytest.skip("no /proc/stat here")
    sum(i * i for i in range(2_000_000))  # burn some CPU
    second = threads.read_load()
    busy, own = second[1] - first[1], second[2] - first[2]
    assert own > 0 and busy >= own - 0.05  # clock ticks are 10 ms: allow a few of rounding


def test_num_threads_pins_torch_threads_for_the_run_and_is_restored(tmp_path):
    """The count a run computes with is the option's (seen from inside a reward function), logged
    as cpu_threads, and the caller's count is back once the run returns."""

    from grpokit.train.grpo import train_grpo
    from tests.train.helpers import tiny_config

    seen: list[int] = []

    def counting(prompts, completions, **_):
        seen.append(torch.get_num_threads())
        return [0.0] * len(completions)

    before = torch.get_num_threads()
    wanted = 3 if before != 3 else 2
    result = train_grpo(tiny_config(tmp_path, max_steps=2, num_threads=wanted), reward_funcs=[counting])
    assert seen and set(seen) == {wanted}
    assert torch.get_num_threads() == before
    assert [r["cpu_threads"] for r in read_steps(result.output_dir)] == [wanted, wanted]


def test_the_suite_pins_threads_so_that_no_run_in_a_test_adapts():
    """tests/conftest.py pins every test's thread count (OMP_NUM_THREADS, torch's count): a run in auto
    mode then never reads the machine's load, so another pytest-xdist worker, or any other process, can
    neither change a test run's arithmetic nor make it say "other processes are using ... cores"."""
    import os

    assert os.environ["OMP_NUM_THREADS"] == str(torch.get_num_threads())
    with ThreadGovernor.start(None, "cpu") as governor:
        assert not governor.adaptive and governor.tick() is None


def test_a_run_under_a_competing_load_says_so_once_and_logs_its_threads(tmp_path, monkeypatch):
    """A run in auto mode on a simulated 2-core machine where another process holds about 1.9 cores
    throughout (each load reading one window after the last): after two windows it computes on one
    thread, says so once as a warning, logs cpu_threads at each step, and hands the caller its count back."""
    from grpokit.train.grpo import train_grpo
    from tests.train.helpers import ones_reward, tiny_config

    machine = FakeMachine()
    machine.others = 1.9

    def reading():
        machine.advance()
        return machine.read()

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "read_load", reading)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the count a run alone takes on this machine
    events: list = []
    try:
        result = train_grpo(
            tiny_config(tmp_path, max_steps=4),
            reward_funcs=[ones_reward],
            on_event=lambda *e: events.append(e),
        )
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    said = [(step, data["message"]) for kind, step, data in events if kind == "warning"]
    # the readings after steps 1 and 2 both ask for one thread: the change comes after step 2
    assert [step for step, _ in said] == [2]
    assert said[0][1].startswith(
        "other processes are using about 1.9 of this machine's 2 cores: running on 1"
    )
    assert [r["cpu_threads"] for r in read_steps(result.output_dir)] == [2, 2, 1, 1]
    assert after == 2
