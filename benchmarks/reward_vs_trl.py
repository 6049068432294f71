"""grpokit's reward-model step against TRL's RewardTrainer, side by side in one process: the same
0.66M-parameter Llama sequence classifier, the built-in addition preference pairs, 128 pairs per
step, learning rate 1e-3, 60 steps. Reports the median step time (steps 4..60) with the spread.

    python benchmarks/reward_vs_trl.py [--steps 60] [--out benchmarks/results/reward_vs_trl.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def spread(times: list[float]) -> dict[str, float]:
    t = sorted(times[3:])
    return {"median": statistics.median(t), "p10": t[len(t) // 10], "p90": t[(9 * len(t)) // 10], "n": len(t)}


def main() -> int:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import RewardConfig as TRLRewardConfig
    from trl import RewardTrainer as TRLRewardTrainer

    from grpokit.config import RewardConfig
    from grpokit.data import get_task, preference_pairs
    from grpokit.models import build_reward_model, char_tokenizer
    from grpokit.train.reward import train_reward

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="benchmarks/results/reward_vs_trl.json")
    args = parser.parse_args()
    task = get_task("addition", seed=42)
    pairs = preference_pairs(task, task.train, seed=42)
    tok = char_tokenizer(task.alphabet)

    def model():
        return build_reward_model(
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            vocab_size=len(tok),
            max_seq_len=64,
            seed=42,
            intermediate_size=256,
        )

    with tempfile.TemporaryDirectory() as tmp:
        cfg = RewardConfig(
            output_dir=f"{tmp}/ours",
            task=None,
            max_steps=args.steps,
            batch_size=128,
            micro_batch_size=128,
            learning_rate=1e-3,
            eval_steps=0,
            save_steps=0,
            progress=False,
            max_length=64,
        )
        train_reward(cfg, model=model(), tokenizer=tok, train_rows=pairs, eval_rows=[])
        rows = [json.loads(line) for line in Path(f"{tmp}/ours/metrics.jsonl").read_text().splitlines()]
        ours = spread([r["step_time"] for r in rows if "step_time" in r])

        times: list[float] = []

        class Timer(TrainerCallback):
            """Step end to step end: the whole iteration, data loading and collation included, as grpokit's
            step_time (TRL's on_step_begin fires after its dataloader has collated the batch)."""

            last = None

            def on_step_end(self, args, state, control, **kw):
                now = time.perf_counter()
                if self.last is not None:
                    times.append(now - self.last)
                self.last = now

        trl_args = TRLRewardConfig(
            output_dir=f"{tmp}/trl",
            per_device_train_batch_size=128,
            learning_rate=1e-3,
            max_steps=args.steps,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            logging_steps=10,
            max_length=64,
            dataloader_num_workers=0,
            gradient_checkpointing=False,
        )
        trainer = TRLRewardTrainer(
            model=model(),
            args=trl_args,
            train_dataset=Dataset.from_list(pairs),
            processing_class=tok,
            callbacks=[Timer()],
        )
        trainer.train()
        theirs = spread(times)
    result = {
        "steps": args.steps,
        "grpokit": ours,
        "trl": theirs,
        "step_time_ratio": ours["median"] / theirs["median"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
