"""Command line: parse, validate, dispatch. No logic lives here.

grpokit demo [--steps N] [--loss-type dapo] ...   a GRPO run on a toy task, in seconds
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from .train.toy_demo import ToyConfig, run

    cfg = ToyConfig(**{f.name: getattr(args, f.name) for f in fields(ToyConfig)})
    console = Console()
    table = Table(
        title=f"GRPO on the toy digits task ({cfg.loss_type}, P={cfg.num_prompts}, G={cfg.num_generations})"
    )
    # metric name -> column header (TRL's metric names; headers short enough for an 80-column terminal)
    headers = {
        "reward": "reward",
        "frac_reward_zero_std": "zero-std groups",
        "kl": "kl",
        "clip_ratio/region_mean": "clipped",
        "loss": "loss",
        "greedy_accuracy": "accuracy",
    }
    columns = ["step", *headers]
    for header in ["step", *headers.values()]:
        table.add_column(header, justify="right")
    every = max(1, cfg.steps // 10)
    with Progress(
        TextColumn("training"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("train", total=cfg.steps, status="")

        def on_step(step: int, metrics: dict[str, float]) -> None:
            bar.update(task, advance=1, status=f"reward {metrics['reward']:.3f}")
            if step % every == 0 or step == cfg.steps:
                table.add_row(str(step), *(f"{metrics.get(name, float('nan')):.4f}" for name in columns[1:]))

        result = run(cfg, on_step)
    console.print(table)
    console.print(
        f"greedy accuracy (all four digits right): {100 * result['accuracy_before']:.1f}% before, "
        f"{100 * result['accuracy_after']:.1f}% after {cfg.steps} steps"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .ops import LOSS_TYPES

    parser = argparse.ArgumentParser(
        prog="grpokit", description="Group Relative Policy Optimization for language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run GRPO on a toy task in seconds (exercises grpokit.ops)")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--num-prompts", type=int, default=16)
    demo.add_argument("--num-generations", type=int, default=8)
    demo.add_argument("--num-iterations", type=int, default=2)
    demo.add_argument("--loss-type", choices=list(LOSS_TYPES), default="dapo")
    demo.add_argument("--beta", type=float, default=0.04)
    demo.add_argument("--epsilon", type=float, default=0.2)
    demo.add_argument("--epsilon-high", type=float, default=0.28)
    demo.add_argument("--learning-rate", type=float, default=0.3)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
