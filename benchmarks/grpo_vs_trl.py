"""grpokit's GRPO loop against TRL's GRPOTrainer on the same work, each trainer in its own child
process of one run (so that each one's peak resident memory can be read from the kernel), one
after the other on the same machine, from the same starting policy:

* `--setup addition` (default): the SFT-warmed 0.66M-parameter Llama of the main job, the addition
  task, 2 prompts × 8 generations of at most 4 tokens, beta 0.04, learning rate 1e-4, 60 steps,
  dapo loss, linear schedule. Also reports held-out greedy accuracy after training.
* `--setup v32k`: a 20.6M-parameter Llama (hidden 256, 4 layers, V = 32000, built from a config;
  the tokenizer is a character tokenizer over digits and 31,986 CJK characters), 2 prompts × 8
  generations of exactly 128 tokens (EOS is never drawn by a random model at this length in
  practice; both trainers cut at 128), a dense reward (the share of characters from a fixed set),
  beta 0.04, learning rate 1e-5, 12 steps.
* `--setup chain`: the chain preset's task and policy (sums of 8-16 digits worked step by step,
  completions of up to 128 tokens), warm-started as the preset does (stopped once a probe of training
  prompts is solved to its target), then 16 prompts × 8 generations a step in micro-batches of 64,
  the preset's beta and learning rate (held constant), dapo loss, 50 steps. Reports held-out greedy
  accuracy (200 prompts) before and after, as for addition.

Reports the median step time of each after a warm-up of 3 steps, with the spread, and each
process's peak RSS (VmHWM: imports, model and training together).

    python benchmarks/grpo_vs_trl.py [--setup addition|v32k|chain] [--steps N]
        [--torch-compile false|true|both] [--dtype float32|bfloat16] [--out FILE]

`--torch-compile both` runs grpokit twice, eager then with torch_compile=true (its first steps
compile: the warm-up of 3 steps keeps that out of the median), each against the same TRL run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

SETUPS = {  # name -> (steps, completion tokens, learning rate)
    "addition": (60, 4, 1e-4),
    "v32k": (12, 128, 1e-5),
    "chain": (50, 128, None),  # the chain preset's learning rate, beta, schedule, loss (chain_preset)
}
TASKS = {"addition": "addition", "v32k": "addition", "chain": "chain"}  # the task's prompts and rows
CJK = "".join(chr(0x4E00 + i) for i in range(32000 - 4 - 12))  # V = 32000 with digits, '+', '='


class ChainPreset(NamedTuple):
    """The chain preset's optimisation settings, which both trainers take (TRL's names)."""

    learning_rate: float
    beta: float
    lr_scheduler_type: str
    loss_type: str


def chain_preset() -> ChainPreset:
    from grpokit.config.applied import preset_values

    values = preset_values("chain")
    return ChainPreset(
        values["learning_rate"], values.get("beta", 0.0), values["lr_scheduler_type"], values["loss_type"]
    )


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def dense_reward(prompts, completions, **_):
    """The share of a completion's characters that come from the first 500 CJK characters."""
    chosen = set(CJK[:500])
    return [sum(ch in chosen for ch in c) / max(len(c), 1) for c in completions]


def warm_policy(directory: Path, seed: int) -> None:
    from grpokit.config.plan import SFTSchedule
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
    run_sft(model, tok, task.train, SFTSchedule(steps=400, batch_size=256, learning_rate=3e-3, seed=seed))
    save_policy(model, tok, directory)


def v32k_policy(directory: Path, seed: int) -> None:
    from grpokit.data import get_task
    from grpokit.models import build_policy, char_tokenizer, save_policy

    tok = char_tokenizer(get_task("addition").alphabet + CJK)
    assert len(tok) == 32000, len(tok)
    model = build_policy(
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        vocab_size=len(tok),
        dropout=0.0,
        max_seq_len=256,
        seed=seed,
        intermediate_size=1024,
    )
    save_policy(model, tok, directory)


def chain_policy(directory: Path, seed: int) -> None:
    """The chain preset's warm start (length_bias.py's: stopped at the preset's probe accuracy)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from length_bias import preset_config, tiny_policy, warmed_policy

    from grpokit.models import save_policy

    with tempfile.TemporaryDirectory() as scratch:
        warmed, tokenizer = warmed_policy(seed, Path(scratch))
        model, _ = tiny_policy(preset_config(seed, Path(scratch) / "unused"))
    model.load_state_dict(warmed["state"])
    save_policy(model, tokenizer, directory)


def chain_reward(prompts, completions, result, **_):
    from grpokit.data.tasks import chain_answer

    return [1.0 if chain_answer(c) == r else 0.0 for c, r in zip(completions, result, strict=True)]


def held_out_accuracy(model, tok, seed: int, setup: str = "addition") -> float:
    from grpokit.data import get_task
    from grpokit.engine import EngineSpec, PolicyEngine
    from grpokit.models.device import model_device
    from grpokit.train.evaluation import EvalTask, evaluate

    task = get_task(TASKS[setup], seed=seed)
    # greedy, as training samples
    engine = PolicyEngine.create(model, tok, EngineSpec(), device=model_device(model))
    judged = EvalTask(
        task.eval,
        reward_funcs=[task.reward],
        is_correct=task.is_correct,
        max_prompt_length=task.max_prompt_length,
        max_completion_length=task.max_completion_length,
    )
    return evaluate(engine, judged)["accuracy"]


def spread(times: list[float]) -> dict[str, float]:
    t = sorted(times[3:])  # the first steps pay for warm-up
    return {"median": statistics.median(t), "p10": t[len(t) // 10], "p90": t[(9 * len(t)) // 10], "n": len(t)}


def run_trl(
    start: Path, out: Path, steps: int, seed: int, setup: str = "addition", dtype: str = "float32"
) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.data import get_task
    from grpokit.models import load_policy

    task = get_task(TASKS[setup], seed=seed)
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

    _, tokens, lr = SETUPS[setup]
    # chain: 16 prompts × 8 a step, two micro-batches of 64, one optimizer step (TRL's generation batch
    # is per_device_train_batch_size × gradient_accumulation_steps), as the chain preset trains
    batches = {"per_device_train_batch_size": 16, "beta": 0.04}
    if setup == "chain":
        preset = chain_preset()
        lr = preset.learning_rate
        batches = {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 2, "beta": preset.beta}
        batches |= {"lr_scheduler_type": preset.lr_scheduler_type, "loss_type": preset.loss_type}
    args = GRPOConfig(
        output_dir=str(out),
        **batches,
        num_generations=8,
        learning_rate=lr,
        max_steps=steps,
        max_completion_length=tokens,
        use_cpu=True,
        bf16=dtype == "bfloat16",
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
        reward_funcs={"addition": addition_reward, "v32k": dense_reward, "chain": chain_reward}[setup],
        args=args,
        train_dataset=Dataset.from_list(task.train),
        processing_class=policy.tokenizer,
        callbacks=[Timer()],
    )
    torch.manual_seed(seed)
    trainer.train()
    result = {"step_time": spread(times)}
    if setup in ("addition", "chain"):
        result["accuracy"] = held_out_accuracy(trainer.model, policy.tokenizer, seed, setup)
    return result


def run_grpokit(
    start: Path,
    out: Path,
    steps: int,
    seed: int,
    setup: str = "addition",
    dtype: str = "float32",
    compiled: bool = False,
) -> dict:
    from grpokit.config import GRPOConfig
    from grpokit.data import get_task
    from grpokit.train.grpo import train_grpo

    _, tokens, lr = SETUPS[setup]
    task = get_task("addition", seed=seed)
    extra = {"task": "addition", "prompts_per_step": 2, "micro_batch_size": 16, "beta": 0.04}
    extra |= {"lr_scheduler_type": "linear"}
    if setup == "v32k":  # the task's prompts (passed below) with the dense reward
        extra |= {"task": None, "max_completion_length": tokens, "num_eval_prompts": 2}
    if setup == "chain":  # as the chain preset trains
        preset = chain_preset()
        lr = preset.learning_rate
        extra = {"task": "chain", "prompts_per_step": 16, "micro_batch_size": 64, "beta": preset.beta}
        extra |= {"lr_scheduler_type": preset.lr_scheduler_type, "loss_type": preset.loss_type}
        extra |= {"num_eval_prompts": 200}
    cfg = GRPOConfig(
        output_dir=str(out),
        model=str(start),
        seed=seed,
        num_generations=8,
        learning_rate=lr,
        max_steps=steps,
        eval_steps=0,
        save_steps=0,
        log_completions_steps=0,
        progress=False,
        torch_compile=compiled,
        dtype=dtype,
        **extra,
    )
    if setup != "v32k":
        result = train_grpo(cfg)
    else:  # the same prompts as TRL sees, the dense reward, no accuracy check
        result = train_grpo(cfg, reward_funcs=[dense_reward], train_rows=task.train, eval_rows=task.eval[:2])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r]
    out = {"step_time": spread(times)}
    if setup != "v32k":
        out |= {"accuracy": result.eval_after["accuracy"], "accuracy_before": result.eval_before["accuracy"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=sorted(SETUPS), default="addition")
    parser.add_argument("--steps", type=int, default=None, help="default: SETUPS' (60, 12, 50)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/grpo_vs_trl_<setup>.json")
    parser.add_argument(
        "--torch-compile",
        choices=["false", "true", "both"],
        default="false",
        help="grpokit's torch_compile; both: grpokit eager and compiled, each beside TRL in the one run",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="both trainers' compute precision (grpokit's dtype; TRL's bf16=true), float32 master weights",
    )
    parser.add_argument("--child", choices=["grpokit", "grpokit_compiled", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or SETUPS[args.setup][0]
    if args.child:  # one trainer in this process; its result and peak RSS on the last line
        with tempfile.TemporaryDirectory() as tmp:
            where = (Path(args.start), Path(tmp) / "run", steps, args.seed, args.setup, args.dtype)
            if args.child == "trl":
                result = run_trl(*where)
            else:
                result = run_grpokit(*where, compiled=args.child == "grpokit_compiled")
        print(json.dumps(result | {"peak_rss_bytes": peak_rss_bytes()}))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "start"
        {"addition": warm_policy, "v32k": v32k_policy, "chain": chain_policy}[args.setup](start, args.seed)
        ours = {"false": ["grpokit"], "true": ["grpokit_compiled"], "both": ["grpokit", "grpokit_compiled"]}
        for child in [*ours[args.torch_compile], "trl"]:
            cmd = [sys.executable, __file__, "--child", child, "--start", str(start), "--setup", args.setup]
            cmd += ["--steps", str(steps), "--seed", str(args.seed), "--dtype", args.dtype]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            results[child] = json.loads(done.stdout.strip().splitlines()[-1])
    trl = results["trl"]
    result = {"setup": args.setup, "steps": steps, "dtype": args.dtype} | results
    for child in ours[args.torch_compile]:  # (grpokit: the keys of before, eager; compiled: suffixed)
        suffix = "" if child == "grpokit" else "_compiled"
        result[f"step_time_ratio{suffix}"] = (
            results[child]["step_time"]["median"] / trl["step_time"]["median"]
        )
        result[f"peak_rss_ratio{suffix}"] = results[child]["peak_rss_bytes"] / trl["peak_rss_bytes"]
    out = Path(args.out or f"benchmarks/results/grpo_vs_trl_{args.setup}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
