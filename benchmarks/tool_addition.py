"""`grpokit train tool_addition` with its `calc` tool and without (tools=[], the same task single-turn),
over seeds: held-out greedy accuracy before and after GRPO, and wall time.

    python benchmarks/tool_addition.py [--seeds 0 1 2] [--runs /tmp/tool_addition]
        [--out benchmarks/results/tool_addition.json] [--collect] [-- key=value ...]

Each run is the README's command in its own process, with `seed=S`, into RUNS/<tools|no_tools>_s<seed>;
`--collect` only reads runs already there. Accuracy is the final answer's (after the tool's response).
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

ARMS = {"tools": [], "no_tools": ["tools=[]"]}


def run(run_dir: Path, seed: int, arm: str, extra: list[str]) -> None:
    began = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "grpokit",
        "train",
        "tool_addition",
        f"output_dir={run_dir}",
        "overwrite=true",
    ]
    cmd += ["progress=false", f"seed={seed}", *ARMS[arm], *extra]
    subprocess.run(cmd, check=True, capture_output=True)
    (run_dir / "wall_seconds.txt").write_text(f"{time.perf_counter() - began:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", default="/tmp/tool_addition")
    parser.add_argument("--out", default="benchmarks/results/tool_addition.json")
    parser.add_argument("--collect", action="store_true", help="only read runs already in --runs")
    parser.add_argument("extra", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args()
    results = {}
    for arm in ARMS:
        for seed in args.seeds:
            run_dir = Path(args.runs) / f"{arm}_s{seed}"
            if not args.collect:
                run(run_dir, seed, arm, args.extra)
            results[f"{arm}_s{seed}"] = summarise(run_dir)
            r = results[f"{arm}_s{seed}"]
            print(
                f"{arm:9s} seed {seed}: {100 * r['before']:.1f}% -> {100 * r['after']:.1f}% "
                f"({r['gain_points']:+.1f} points), warm start {r['sft_steps_taken']} steps, "
                f"{r['wall_seconds']} s",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
