"""Asynchronous GRPO against the synchronous loop (issue 40), side by side in one run: the main job
(`python3 -m grpokit train`), and the main job with a reward that takes 100 ms a batch (a stand-in
for a sandbox or a remote judge: benchmarks/slow_reward.py), each synchronous and with
max_staleness=1, over seeds. The runs go one after the other, never two at once.

    python benchmarks/async_vs_sync.py [--seeds 0,1,2] [--cases main,slow_reward]
        [--runs /tmp/async_vs_sync] [--out benchmarks/results/async_vs_sync.json] [-- key=value ...]

For each run: the command's wall time, held-out greedy accuracy before and after GRPO, and the GRPO
loop's time (the steps' step_time). For each synchronous run, the ideal the overlap could reach:
Σ over steps of max(sampling + scoring, reference + update), the loop with generation and scoring
hidden behind the update, or the update behind them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOW_REWARD = f"reward_funcs=[{{python: {ROOT / 'benchmarks' / 'slow_reward.py'}:exact_answer_slowly}}]"
CASES = {"main": [], "slow_reward": [SLOW_REWARD]}
MODES = {"sync": [], "async": ["max_staleness=1"]}


def summarise(run_dir: Path, wall: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    ideal = sum(
        max(
            r.get("timing/sampling", 0.0) + r.get("timing/scoring", 0.0),
            r.get("timing/reference", 0.0) + r.get("timing/update", 0.0),
        )
        for r in steps
    )
    return {
        "wall_s": round(wall, 1),
        "loop_s": round(sum(r["step_time"] for r in steps), 1),
        "ideal_loop_s": round(ideal, 1),  # (meaningful for the synchronous runs)
        "before": evals[0],
        "after": evals[-1],
        "queue_wait_s": round(sum(r.get("async/queue_wait_s", 0.0) for r in steps), 1),
        "worker_wait_s": round(sum(r.get("async/worker_wait_s", 0.0) for r in steps), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--cases", default="main,slow_reward")
    parser.add_argument("--runs", default="/tmp/async_vs_sync")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_vs_sync.json"))
    parser.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = parser.parse_args(argv)
    results: dict = {"command": " ".join(sys.argv), "runs": {}}
    for case in args.cases.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            for mode, extra in MODES.items():
                out = Path(args.runs) / f"{case}_{mode}_s{seed}"
                command = [sys.executable, "-m", "grpokit", "train", f"output_dir={out}", f"seed={seed}"]
                command += ["progress=false", "overwrite=true", *CASES[case], *extra, *args.overrides]
                began = time.perf_counter()
                subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                figures = summarise(out, time.perf_counter() - began)
                results["runs"][f"{case}/{mode}/{seed}"] = figures
                print(case, mode, seed, figures, flush=True)
    for case in args.cases.split(","):
        pairs = [
            (results["runs"][f"{case}/sync/{s}"], results["runs"][f"{case}/async/{s}"])
            for s in args.seeds.split(",")
        ]
        results[case] = {
            "wall_ratio_median": round(statistics.median(a["wall_s"] / s["wall_s"] for s, a in pairs), 3),
            "loop_ratio_median": round(statistics.median(a["loop_s"] / s["loop_s"] for s, a in pairs), 3),
            "ideal_loop_ratio_median": round(
                statistics.median(s["ideal_loop_s"] / s["loop_s"] for s, _ in pairs), 3
            ),
            "accuracy_after_points_async_minus_sync": [
                round(100 * (a["after"] - s["after"]), 1) for s, a in pairs
            ],
        }
        print(case, results[case], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
