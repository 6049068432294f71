"""The whole RLHF chain on a CPU: train a Bradley–Terry reward model on the built-in addition
preferences (preset `reward_addition_rlhf`), then run GRPO whose only reward is that model (preset
`rlhf_addition`), and report the task's held-out greedy accuracy before and after GRPO. GRPO never
sees the task's answers or its accuracy check; the reward model saw right answers and slips on the
training prompts only.

    python benchmarks/rlhf_addition.py [--out benchmarks/results/rlhf_addition.json] [seed=N ...]

The same chain from the command line:
    python -m grpokit reward reward_addition_rlhf
    python -m grpokit train rlhf_addition
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _print_evals(kind: str, step: int, data: dict) -> None:
    if kind == "eval":
        accuracy = data.get("eval/accuracy", float("nan"))
        print(f"GRPO step {step}: held-out accuracy {accuracy:.3f}", flush=True)


def main() -> int:
    from grpokit.cli import _config
    from grpokit.config import GRPOConfig, RewardConfig
    from grpokit.train.grpo import train_grpo
    from grpokit.train.reward import train_reward

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/rlhf_addition.json")
    parser.add_argument("overrides", nargs="*", help="key=value for both configs (e.g. seed=7)")
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        quiet = ["progress=false", "save_steps=0", *args.overrides]
        rm_cfg = _config(RewardConfig, "reward_addition_rlhf.yaml", [f"output_dir={tmp}/rm", *quiet])
        rm = train_reward(rm_cfg)
        reward_model = f"{tmp}/rm/checkpoint-{rm_cfg.max_steps}"
        grpo_cfg = _config(
            GRPOConfig,
            "rlhf_addition.yaml",
            [f"output_dir={tmp}/rlhf", *quiet, f"reward_funcs=[{{model: {reward_model}}}]"],
        )
        result = train_grpo(grpo_cfg, on_event=_print_evals)
    summary = {
        "overrides": args.overrides,
        "reward_model_pairwise_accuracy": {
            "before": rm.eval_before["accuracy"],
            "after": rm.eval_after["accuracy"],
        },
        "task_accuracy_before_grpo": result.eval_before["accuracy"],
        "task_accuracy_after_grpo": result.eval_after["accuracy"],
        "seconds": time.perf_counter() - began,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
