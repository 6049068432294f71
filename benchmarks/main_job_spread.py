"""The main job (`python3 -m grpokit train`, the README's first command), or another preset
(`--preset chain`), over seeds and CPU instruction sets: held-out greedy accuracy before and after
GRPO for every run, and the worst gain, which is what the README promises.

    python benchmarks/main_job_spread.py [--preset NAME] [--seeds 0 1 2 3 4 42] [--isa best default avx2]
        [--runs /tmp/main_job_spread] [--out benchmarks/results/main_job_spread.json] [--collect]

Each run is the command in its own process with `seed=S` (and `ATEN_CPU_CAPABILITY` set to the
instruction set, unset for `best`), into RUNS/<isa>_s<seed>, with its wall time (process start to
exit). `--collect` only reads runs already there. An instruction set the CPU lacks is run by torch at
its best available one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def summarise(run_dir: Path) -> dict:
    """Accuracy before/after GRPO, the warm start's length, and wall time, from a run's files."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    sft = (run_dir / "sft_metrics.jsonl").read_text().splitlines()
    timing = run_dir / "wall_seconds.txt"
    return {
        "before": evals[0][1],
        "after": evals[-1][1],
        "gain_points": round(100 * (evals[-1][1] - evals[0][1]), 1),
        "curve": evals,
        "sft_steps_taken": len(sft),
        "wall_seconds": float(timing.read_text()) if timing.is_file() else None,
    }


def run(run_dir: Path, seed: int, isa: str, preset: str | None) -> None:
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if isa != "best":
        env["ATEN_CPU_CAPABILITY"] = isa
    began = time.perf_counter()
    cmd = [sys.executable, "-m", "grpokit", "train", *([preset] if preset else [])]
    cmd += [f"output_dir={run_dir}", "overwrite=true"]
    subprocess.run([*cmd, "progress=false", f"seed={seed}"], env=env, check=True, capture_output=True)
    (run_dir / "wall_seconds.txt").write_text(f"{time.perf_counter() - began:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default=None, help="a built-in preset (default: the main job's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 42])
    parser.add_argument("--isa", nargs="+", default=["best", "default", "avx2"])
    parser.add_argument("--runs", default="/tmp/main_job_spread")
    parser.add_argument("--out", default="benchmarks/results/main_job_spread.json")
    parser.add_argument("--collect", action="store_true", help="only read runs already in --runs")
    args = parser.parse_args()
    results = {}
    for isa in args.isa:
        for seed in args.seeds:
            run_dir = Path(args.runs) / f"{isa}_s{seed}"
            if not args.collect:
                run(run_dir, seed, isa, args.preset)
            if (run_dir / "metrics.jsonl").is_file():
                results[f"{isa}_s{seed}"] = summarise(run_dir)
                r = results[f"{isa}_s{seed}"]
                print(
                    f"{isa:8s} seed {seed:2d}: {100 * r['before']:.1f}% -> {100 * r['after']:.1f}% "
                    f"({r['gain_points']:+.1f}) after {r['sft_steps_taken']} warm-start steps, "
                    f"{r['wall_seconds']} s",
                    flush=True,
                )
    gains = [r["gain_points"] for r in results.values()]
    summary = {
        "runs": len(gains),
        "worst_gain_points": min(gains),
        "median_gain_points": statistics.median(gains),
        "before_range": [
            min(r["before"] for r in results.values()),
            max(r["before"] for r in results.values()),
        ],
        "after_range": [min(r["after"] for r in results.values()), max(r["after"] for r in results.values())],
    }
    summary["longest_wall_seconds"] = max((r["wall_seconds"] or 0) for r in results.values())
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
