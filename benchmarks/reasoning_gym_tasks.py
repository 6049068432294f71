"""reasoning-gym tasks (`task: reasoning_gym:NAME`) learned by the tiny Llama of the main job: the main
job's recipe (a supervised warm start on the generator's answers, at most 400 steps, that stops at 35%
of a training probe, then GRPO with the generator's own score as the reward) with 60 GRPO steps of 8
prompts, per task and seed.

    python benchmarks/reasoning_gym_tasks.py [--tasks chain_sum countdown] [--seeds 0]
        [--runs /tmp/reasoning_gym] [--out benchmarks/results/reasoning_gym.json] [--collect]

Needs `pip install reasoning-gym` (the `gym` extra). Accuracy counts answers the generator scores 1.0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from main_job_spread import summarise  # noqa: E402 - a sibling script, not a package

# the main job's recipe, made smaller: these prompts are 20-60 times longer than "12+34=" (2 CPU cores)
RECIPE = [
    "sft_steps=400",
    "sft_batch_size=32",
    "max_steps=60",
    "prompts_per_step=8",
    "micro_batch_size=64",
    "num_eval_prompts=100",
    "eval_steps=30",
    "save_steps=60",
    "progress=false",
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", nargs="+", default=["chain_sum", "countdown"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", default="/tmp/reasoning_gym")
    parser.add_argument("--out", default="benchmarks/results/reasoning_gym.json")
    parser.add_argument("--collect", action="store_true", help="only read runs already in --runs")
    args = parser.parse_args()
    results = {}
    for name in args.tasks:
        for seed in args.seeds:
            run_dir = Path(args.runs) / f"{name}_s{seed}"
            if not args.collect:
                began = time.perf_counter()
                cmd = [sys.executable, "-m", "grpokit", "train", f"task=reasoning_gym:{name}"]
                cmd += [f"output_dir={run_dir}", "overwrite=true", f"seed={seed}", *RECIPE]
                subprocess.run(cmd, check=True, capture_output=True)
                (run_dir / "wall_seconds.txt").write_text(f"{time.perf_counter() - began:.1f}")
            r = results[f"{name}_s{seed}"] = summarise(run_dir)
            rewards = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            evals = [x["eval/reward"] for x in rewards if "eval/reward" in x]
            r["reward_before"], r["reward_after"] = evals[0], evals[-1]
            print(
                f"{name:10s} seed {seed}: accuracy {100 * r['before']:.1f}% -> {100 * r['after']:.1f}%, "
                f"score {evals[0]:.3f} -> {evals[-1]:.3f}, warm start {r['sft_steps_taken']} steps, "
                f"{r['wall_seconds']} s",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
