"""How many CPU threads torch's operations use, so that a run degrades gracefully on a shared CPU.

The cost it avoids (measured in benchmarks/RESULTS.md, "Sharing the CPU"): a small model's step is
thousands of tiny operations. With two intra-op threads per process and two processes on two
cores, every parallel operation of one process waits at OpenMP's barrier for a thread that the other
process holds the core of, and its idle threads spin-wait between operations, taking cycles the
other process needs: the main job's GRPO steps went from 0.07 s to about 1 s each.

`num_threads` (the config option):
* a number pins torch's intra-op threads to it for the whole run (as does OMP_NUM_THREADS, which
  torchrun sets): the same count, the same arithmetic, the same result bit for bit;
* None (auto) starts with torch's default (the cores it sees) and, on a CPU, watches how much of
  the machine other processes use (Linux's /proc/stat, against this process's own CPU time). When
  they hold a core or more for two windows in a row, it runs on the cores left (at least one), and
  back up once they have gone. Alone, nothing changes: a run uses torch's default count throughout
  and is bitwise the run it was. Under load the count changes, and with it the rounding of parallel
  reductions, so two runs of one seed agree in their last bits only if they ran with the same
  counts: pin `num_threads` for that. Each change is said once and logged as `cpu_threads`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

WINDOW_SECONDS = 1.0  # the shortest span a load reading covers: shorter ones are mostly noise
BUSY_CORES = 0.75  # other processes hold a core when they use at least this much of one on average
CONFIRM = 2  # windows in a row that must agree before the count changes (a brief burst does not)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; all of them where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def machine_busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (/proc/stat: all time but idle
    and iowait), or None where that is not known."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields_ = stat.readline().split()
    except OSError:
        return None
    if not fields_ or fields_[0] != "cpu":
        return None
    ticks = [int(v) for v in fields_[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, all of its threads (spin-waiting included)."""
    times = os.times()
    return times.user + times.system


Reading = tuple[float, float, float]  # (wall clock, machine busy seconds, this process's CPU seconds)


def read_load() -> Reading | None:
    busy = machine_busy_seconds()
    return None if busy is None else (time.monotonic(), busy, own_cpu_seconds())


@dataclass
class ThreadGovernor:
    """Sets torch's intra-op threads at the start of a run and, in auto mode on a CPU, follows the
    cores other processes leave free (`tick` once a step: it reads the load at most once a window)."""

    most: int  # the count a run alone uses: torch's default, capped by the usable cores
    adaptive: bool
    current: int
    # the load probe: this module's read_load, looked up when a governor is made (tests put a simulated
    # machine in its place, as tests/train/test_threads.py does)
    read: Callable[[], Reading | None] = field(default_factory=lambda: read_load)
    set_threads: Callable[[int], None] = torch.set_num_threads
    _last: Reading | None = None
    _wanted: int | None = None  # the count the last window asked for
    _agreeing: int = 0  # windows in a row that asked for it
    said: set[int] = field(default_factory=set)
    initial: int = field(default_factory=torch.get_num_threads)  # restored when the run ends

    def __enter__(self) -> ThreadGovernor:
        return self

    def __exit__(self, *exc: Any) -> None:
        """A Python caller's later work runs with the count it had before the run."""
        if self.current != self.initial:
            self.set_threads(self.initial)

    @classmethod
    def start(cls, num_threads: int | None, device: Any, **kwargs: Any) -> ThreadGovernor:
        """Pin `num_threads`, or (None) take torch's default and adapt on a CPU, unless the
        environment pins the count (OMP_NUM_THREADS, set by the user or torchrun)."""
        set_threads = kwargs.get("set_threads", torch.set_num_threads)
        if num_threads is not None:
            initial = torch.get_num_threads()
            set_threads(num_threads)
            return cls(num_threads, False, num_threads, initial=initial, **kwargs)
        most = max(1, min(torch.get_num_threads(), usable_cores()))
        adaptive = torch.device(device).type == "cpu" and "OMP_NUM_THREADS" not in os.environ and most > 1
        governor = cls(most, adaptive, most, **kwargs)
        if adaptive:
            governor._last = governor.read()
            governor.adaptive = governor._last is not None
        return governor

    def keep(self, count: int) -> None:
        """From now on run on `count` threads and stop adapting: the rest of the cores are lent to a
        process of the run's own (the rollout worker), whose load is no other program's."""
        self.adaptive, self.current = False, count
        self.set_threads(count)

    def tick(self) -> str | None:
        """After a step: a new reading once a window has passed; the count changes when CONFIRM
        windows in a row ask for the same other count. Returns a line to say when it changed."""
        if not self.adaptive:
            return None
        now = self.read()
        if now is None or self._last is None or now[0] - self._last[0] < WINDOW_SECONDS:
            return None
        wall, busy, own = (b - a for a, b in zip(self._last, now, strict=True))
        self._last = now
        others = max(0.0, (busy - own) / wall)  # cores' worth of CPU the rest of the machine used
        held = int(others + 1.0 - BUSY_CORES)  # cores the others hold: each used at least BUSY_CORES
        wanted = max(1, self.most - held)
        self._agreeing = self._agreeing + 1 if wanted == self._wanted else 1
        self._wanted = wanted
        if wanted == self.current or self._agreeing < CONFIRM:
            return None
        before, self.current = self.current, wanted
        self.set_threads(wanted)
        if wanted in self.said:
            return None
        self.said.add(wanted)
        if wanted < before:
            return (
                f"other processes are using about {others:.1f} of this machine's {self.most} cores: "
                f"running on {wanted} CPU thread(s) instead of {before} until they finish (two processes' "
                "threads on too few cores wait on each other). Results then differ in their last bits from a "
                f"run on {self.most}; set num_threads={self.most} to keep it, or num_threads=N to pin any "
                "count."
            )
        return f"the CPU is free again: back to {wanted} CPU threads."
