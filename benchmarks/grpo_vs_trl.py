"""grpokit's GRPO loop against TRL's GRPOTrainer, side by side in one process, on the same work:
the same SFT-warmed tiny policy, the addition task, 2 prompts × 8 generations, beta 0.04,
learning rate 1e-4, 60 steps, dapo loss, linear schedule. Reports held-out greedy accuracy after
training and the median step time of each (after a warm-up of 3 steps), with the spread.

    python benchmarks/grpo_vs_trl.py [--steps 60] [--out benchmarks/results/grpo_vs_trl.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def warm_policy(directory: Path, seed: int) -> None:
    from grpokit.data import get_task
    from grpokit.models import build_policy, char_tokenizer, save_policy
    from grpokit.train.sft import run_sft

    task = get_task("addition", seed=seed)
    tok = char_tokenizer(task.alphabet)
    model = build_policy(
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        vocab_size=len(tok),
        dropout=0.0,
        max_seq_len=40,
        seed=seed,
        intermediate_size=256,
    )
    run_sft(model, tok, task.train, steps=400, batch_size=256, learning_rate=3e-3, seed=seed)
    save_policy(model, tok, directory)


def held_out_accuracy(model, tok, seed: int) -> float:
    from grpokit.data import get_task
    from grpokit.train.evaluation import evaluate

    task = get_task("addition", seed=seed)
    return evaluate(
        model,
        tok,
        task.eval,
        reward_funcs=[task.reward],
        is_correct=task.is_correct,
        max_prompt_length=task.max_prompt_length,
        max_completion_length=task.max_completion_length,
    )["accuracy"]


def spread(times: list[float]) -> dict[str, float]:
    t = sorted(times[3:])  # the first steps pay for warm-up
    return {"median": statistics.median(t), "p10": t[len(t) // 10], "p90": t[(9 * len(t)) // 10], "n": len(t)}


def run_trl(start: Path, out: Path, steps: int, seed: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.data import get_task
    from grpokit.models import load_policy

    task = get_task("addition", seed=seed)
    policy = load_policy(start)
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

    def addition_reward(prompts, completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=16,
        num_generations=8,
        beta=0.04,
        learning_rate=1e-4,
        max_steps=steps,
        max_completion_length=task.max_completion_length,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        seed=seed,
        temperature=1.0,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=addition_reward,
        args=args,
        train_dataset=Dataset.from_list(task.train),
        processing_class=policy.tokenizer,
        callbacks=[Timer()],
    )
    torch.manual_seed(seed)
    trainer.train()
    return {"accuracy": held_out_accuracy(trainer.model, policy.tokenizer, seed), "step_time": spread(times)}


def run_grpokit(start: Path, out: Path, steps: int, seed: int) -> dict:
    from grpokit.config import GRPOConfig
    from grpokit.train.grpo import train_grpo

    cfg = GRPOConfig(
        output_dir=str(out),
        model=str(start),
        task="addition",
        seed=seed,
        prompts_per_step=2,
        num_generations=8,
        micro_batch_size=16,
        beta=0.04,
        learning_rate=1e-4,
        max_steps=steps,
        eval_steps=0,
        save_steps=0,
        log_completions_steps=0,
        progress=False,
        lr_scheduler_type="linear",
    )
    result = train_grpo(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r]
    return {
        "accuracy": result.eval_after["accuracy"],
        "accuracy_before": result.eval_before["accuracy"],
        "step_time": spread(times),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default="benchmarks/results/grpo_vs_trl.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "start"
        warm_policy(start, args.seed)
        ours = run_grpokit(start, Path(tmp) / "grpokit", args.steps, args.seed)
        trl = run_trl(start, Path(tmp) / "trl", args.steps, args.seed)
    result = {
        "steps": args.steps,
        "grpokit": ours,
        "trl": trl,
        "step_time_ratio": ours["step_time"]["median"] / trl["step_time"]["median"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
