"""The difficulty curriculum (issue 27) on the main job (`python3 -m grpokit train`, the addition
preset): the same seeds with and without `curriculum=true`, at equal steps; for each run the mean
frac_reward_zero_std over training (and over the second epoch, the only steps where a prompt can have
been set aside), the held-out accuracy before GRPO and at the last evaluation, and the pools at the end.

    python benchmarks/curriculum_demo.py [--seeds 1 2 3] [--arms off on k2] [--set num_threads=1]
        [--runs /tmp/curriculum_demo] [--out benchmarks/results/curriculum_demo.json] [--collect]

Arms: `off` (the preset), `on` (curriculum=true with its defaults: patience 1, revisit 0.1) and `k2`
(curriculum_patience=2, which can set a prompt aside only after its second visit, in the second epoch,
and so never draws differently within the preset's 400 steps: bitwise the `off` run). Each run is the
README's command in its own process, one at a time, into RUNS/<arm>_s<seed>; `--collect` only reads
runs already there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "off": [],
    "on": ["curriculum=true"],
    "k2": ["curriculum=true", "curriculum_patience=2"],
}
TRAIN_ROWS, PROMPTS_PER_STEP = 9500, 32  # the preset: 10 000 sums less 500 held out; 32 prompts a step
SECOND_EPOCH = TRAIN_ROWS // PROMPTS_PER_STEP + 1  # the first step that draws from the second epoch


def summarise(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    zero = [r["frac_reward_zero_std"] for r in steps]
    later = [r["frac_reward_zero_std"] for r in steps if r["step"] >= SECOND_EPOCH]
    timing = run_dir / "wall_seconds.txt"
    return {
        "steps": len(steps),
        "frac_reward_zero_std_mean": statistics.fmean(zero),
        "frac_reward_zero_std_mean_second_epoch": statistics.fmean(later) if later else None,
        "accuracy_before": evals[0][1],
        "accuracy_final": evals[-1][1],
        "curve": evals,
        "pools_final": {k: v for k, v in steps[-1].items() if k.startswith("curriculum/")},
        "cpu_threads": sorted({r["cpu_threads"] for r in steps if "cpu_threads" in r}),  # the governor's
        "wall_seconds": float(timing.read_text()) if timing.is_file() else None,
    }


def run(run_dir: Path, seed: int, arm: str, extra: list[str]) -> None:
    began = time.perf_counter()
    cmd = [sys.executable, "-m", "grpokit", "train", f"output_dir={run_dir}", "overwrite=true"]
    cmd += ["progress=false", f"seed={seed}", *ARMS[arm], *extra]
    subprocess.run(cmd, env=dict(os.environ), check=True, capture_output=True)
    (run_dir / "wall_seconds.txt").write_text(f"{time.perf_counter() - began:.1f}")


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--runs", default="/tmp/curriculum_demo")
    parser.add_argument("--out", default="benchmarks/results/curriculum_demo.json")
    parser.add_argument("--collect", action="store_true", help="only read runs already in --runs")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="key=value overrides for every run, e.g. num_threads=1 (a thread count that does not follow "
        "other processes: each seed's arms then share their warm start bit for bit)",
    )
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for seed in args.seeds:
        for arm in args.arms:
            run_dir = Path(args.runs) / f"{arm}_s{seed}"
            if not args.collect:
                run(run_dir, seed, arm, args.set)
            if not (run_dir / "metrics.jsonl").is_file():
                continue
            r = results[f"{arm}_s{seed}"] = summarise(run_dir)
            print(
                f"{arm:4s} seed {seed}: zero-spread {r['frac_reward_zero_std_mean']:.3f} "
                f"(second epoch {r['frac_reward_zero_std_mean_second_epoch']:.3f}), accuracy "
                f"{100 * r['accuracy_before']:.1f}% -> {100 * r['accuracy_final']:.1f}% {r['pools_final']}",
                flush=True,
            )
    summary = {}
    for arm in args.arms:
        runs = [r for key, r in results.items() if key.startswith(f"{arm}_s")]
        if runs:
            summary[arm] = {
                key: statistics.fmean(r[key] for r in runs)
                for key in (
                    "frac_reward_zero_std_mean",
                    "frac_reward_zero_std_mean_second_epoch",
                    "accuracy_final",
                    "accuracy_before",
                )
            }
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": machine(),
        "arms": ARMS,
        "every_run": args.set,
        "summary": summary,
        "runs": results,
    }
    Path(args.out).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
