"""The whole RLHF chain on a CPU: train a Bradley–Terry reward model on the built-in addition
preferences, then run GRPO whose only reward is that model, and report the task's held-out greedy
accuracy before and after GRPO (the reward model never sees the accuracy check).

    python benchmarks/rlhf_addition.py [--out benchmarks/results/rlhf_addition.json]

The same chain from the command line:
    python -m grpokit reward output_dir=runs/rm
    python -m grpokit train output_dir=runs/rlhf "reward_funcs=[{model: runs/rm/checkpoint-300}]"
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> int:
    from grpokit.cli import PRESET, REWARD_PRESET, _config
    from grpokit.config import GRPOConfig, RewardConfig
    from grpokit.train.grpo import train_grpo
    from grpokit.train.reward import train_reward

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/rlhf_addition.json")
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rm_cfg = _config(
            RewardConfig, REWARD_PRESET, [f"output_dir={tmp}/rm", "progress=false", "save_steps=0"]
        )
        rm = train_reward(rm_cfg)
        reward_model = f"{tmp}/rm/checkpoint-{rm_cfg.max_steps}"
        grpo_cfg = _config(GRPOConfig, PRESET, [f"output_dir={tmp}/rlhf", "progress=false", "save_steps=0"])
        grpo_cfg = grpo_cfg.model_copy(update={"reward_funcs": [{"model": reward_model}]})
        result = train_grpo(GRPOConfig.model_validate(grpo_cfg.model_dump()))
    summary = {
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
