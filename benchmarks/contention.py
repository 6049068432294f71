"""The main job alone and beside one copy of itself, side by side: how much a run slows down when it
shares the CPU (a seed sweep, a test run beside a training run).

    python benchmarks/contention.py [--arms auto 2] [--copies 2] [--runs /tmp/contention]
        [--out benchmarks/results/contention.json] [-- extra key=value overrides]

For each arm (a `num_threads` setting: `auto` is the default, a number pins torch's intra-op threads;
`env:N` instead sets OMP_NUM_THREADS=N and leaves the option unset, which is how grpokit ran before
it had the option; `env:N:passive` also sets OMP_WAIT_POLICY=PASSIVE, idle OpenMP threads sleeping
at once instead of spin-waiting), the main job (`python3 -m grpokit train`, the README's first
command) runs once alone, then `--copies` copies start together, each into its own output_dir.
Reported per run: wall time, the median GRPO step time (`step_time` in metrics.jsonl) and held-out
accuracy before and after; per arm: each copy's wall time over the arm's alone time (the goal is at
most 2.5x) and the alone time over the `2` arm's alone time (how the arm runs alone against pinned
two threads).
Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def launch(run_dir: Path, arm: str, extra: list[str]) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ)
    cmd = [
        sys.executable,
        "-m",
        "grpokit",
        "train",
        f"output_dir={run_dir}",
        "overwrite=true",
        "progress=false",
    ]
    if arm.startswith("env:"):
        _, threads, *policy = arm.split(":")
        env["OMP_NUM_THREADS"] = threads
        if policy:
            env["OMP_WAIT_POLICY"] = policy[0].upper()
    else:
        cmd.append(f"num_threads={'null' if arm == 'auto' else arm}")
    process = subprocess.Popen(
        [*cmd, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return process, time.perf_counter()


def summary(run_dir: Path, wall: float, finished: bool = True) -> dict:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    steps = [r["step_time"] for r in rows if "step_time" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return {
        "wall_seconds": round(wall, 1),
        "finished": finished,  # False: stopped at --limit, `wall_seconds` is then a lower bound
        "grpo_steps_done": len(steps),
        "median_step_ms": round(1000 * statistics.median(steps), 1) if steps else None,
        "accuracy_before": evals[0] if evals else None,
        "accuracy_after": evals[-1] if evals else None,
    }


def run_together(runs: Path, arm: str, names: list[str], extra: list[str], limit: float) -> dict[str, dict]:
    """Start one run per name at once; a run still going after `limit` seconds is stopped there."""
    folder = {name: runs / f"{arm.replace(':', '')}_{name}" for name in names}
    started = {name: launch(folder[name], arm, extra) for name in names}
    out = {}
    for name, (process, began) in started.items():
        try:
            _, stderr = process.communicate(timeout=max(1.0, began + limit - time.perf_counter()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            out[name] = summary(folder[name], time.perf_counter() - began, finished=False)
            continue
        wall = time.perf_counter() - began
        if process.returncode != 0:
            raise SystemExit(f"{arm} {name} failed:\n{stderr[-2000:]}")
        out[name] = summary(folder[name], wall)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arms", nargs="+", default=["auto", "2"])
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--runs", default="/tmp/contention")
    parser.add_argument("--out", default="benchmarks/results/contention.json")
    parser.add_argument("--limit", type=float, default=900, help="seconds before a run is stopped")
    parser.add_argument("extra", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "arms": {},
    }
    for arm in args.arms:
        alone = run_together(runs, arm, ["alone"], args.extra, args.limit)["alone"]
        copies = run_together(runs, arm, [f"copy{i}" for i in range(args.copies)], args.extra, args.limit)
        slowdown = [c["wall_seconds"] / alone["wall_seconds"] for c in copies.values()]
        results["arms"][arm] = {
            "alone": alone,
            "together": copies,
            "slowdown_each": [round(s, 2) for s in slowdown],
        }
        print(arm, json.dumps(results["arms"][arm]), flush=True)
    if "2" in results["arms"]:
        pinned = results["arms"]["2"]["alone"]["wall_seconds"]
        for arm in results["arms"].values():
            arm["alone_vs_two_threads"] = round(arm["alone"]["wall_seconds"] / pinned, 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
