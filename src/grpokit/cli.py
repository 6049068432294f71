"""Command line: parse, validate, dispatch. No training logic lives here.

    grpokit train [CONFIG.yaml] [key=value ...]    GRPO (no config: the built-in addition preset)
    grpokit sft [CONFIG.yaml] [key=value ...]      supervised warm start
    grpokit eval [CONFIG.yaml] [key=value ...]     held-out accuracy / reward of `model`
    grpokit report RUN_DIR                         PNG plots and an HTML page of a run
    grpokit print-config [CONFIG.yaml] [k=v ...]   every resolved value of a train config
    grpokit demo                                   a toy GRPO run in seconds
    grpokit reward [CONFIG.yaml] [key=value ...]   a Bradley–Terry reward model (eval-reward: evaluate one)

CONFIG may also name a built-in preset: `addition` (the default of train), `rlhf_addition`,
`reward_addition` (the default of reward), `reward_addition_rlhf`.

Errors that a user can fix (config, data, reward functions, missing files) print one line that
names the culprit; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

PRESET = "addition.yaml"
REWARD_PRESET = "reward_addition.yaml"


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG.yaml] key=value ... -> (config path or None, overrides)."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _config(schema: Any, preset_name: str, items: list[str]) -> Any:
    """CONFIG.yaml plus overrides; with no CONFIG, the built-in preset plus overrides. CONFIG may
    also name a built-in preset (`rlhf_addition`), when no such file exists."""
    from .config import load_config

    path, overrides = _split_args(items)
    if path is not None and not Path(path).exists() and _preset(path).is_file():
        path, preset_name = None, _preset(path).name
    if path is None:
        preset = resources.files("grpokit.presets").joinpath(preset_name)
        with resources.as_file(preset) as preset_path:
            return load_config(schema, preset_path, overrides)
    return load_config(schema, path, overrides)


def _preset(name: str) -> Any:
    """The built-in preset file a bare name refers to (`addition` -> presets/addition.yaml)."""
    stem = name.removesuffix(".yaml")
    return resources.files("grpokit.presets").joinpath(f"{stem}.yaml")


def presets() -> list[str]:
    """Names of the built-in presets."""
    folder = resources.files("grpokit.presets")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _train_config(items: list[str]) -> Any:
    from .config import GRPOConfig

    return _config(GRPOConfig, PRESET, items)


def _stopped(console: Any, result: Any) -> int:
    """The clear line after SIGINT / SIGTERM, and the shell's exit code for that signal."""
    import signal

    console.print(
        f"stopped by {result.stopped_by} after step {result.steps}: checkpoint-{result.steps} saved in "
        f"{result.output_dir}; run the same command with resume=true to continue."
    )
    return 128 + int(getattr(signal, result.stopped_by, signal.SIGTERM))


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def _shutdown() -> None:
    from .train import distributed

    distributed.shutdown(distributed.init())


def _console() -> Any:
    from rich.console import Console

    return Console()


def _cmd_print_config(args: argparse.Namespace) -> int:
    from .config import to_yaml

    print(to_yaml(_train_config(args.items)), end="")
    return 0


def _run_reported(cfg: Any, train: Any) -> tuple[Any, Any, int | None]:
    """Run `train(cfg, on_event=...)` with a progress display on rank 0. Returns (console, result,
    exit code): the code is set when the command is already done (a non-zero rank, or a stop by
    signal, whose line is printed here); None means rank 0 finished and prints its summary."""
    from .train.progress import RichReporter

    console = _console()
    main_rank = _rank() == 0  # under torchrun only rank 0 talks
    with RichReporter(console, cfg, enabled=cfg.progress and main_rank) as reporter:
        result = train(cfg, on_event=reporter.on_event)
    _shutdown()
    if not main_rank:
        return console, result, 0
    if result.stopped_by:
        return console, result, _stopped(console, result)
    return console, result, None


def _cmd_train(args: argparse.Namespace) -> int:
    from .train.grpo import train_grpo

    console, result, code = _run_reported(_train_config(args.items), train_grpo)
    if code is not None:
        return code
    before, after = result.eval_before.get("accuracy"), result.eval_after.get("accuracy")
    if before is not None and after is not None:
        console.print(
            f"held-out greedy accuracy: [bold]{100 * before:.1f}%[/] before GRPO → "
            f"[bold]{100 * after:.1f}%[/] "
            f"after {result.steps} steps ({100 * (after - before):+.1f} points). Run: {result.output_dir}"
        )
    else:
        console.print(f"done: {result.steps} steps, eval {result.eval_after}. Run: {result.output_dir}")
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from .config import SFTConfig, load_config, to_yaml
    from .data import get_task
    from .models import save_policy
    from .train import common
    from .train.evaluation import evaluate
    from .train.sft import run_sft

    path, overrides = _split_args(args.items)
    cfg = load_config(SFTConfig, path, overrides)
    task = get_task(cfg.task, seed=cfg.seed, num_eval=cfg.num_eval_prompts)
    common.seed_everything(cfg.seed)
    model, tokenizer = common.policy_and_tokenizer(
        cfg, task.alphabet, 4 * (task.max_prompt_length + task.max_completion_length)
    )
    console = _console()
    run_sft(
        model,
        tokenizer,
        task.train,
        steps=cfg.max_steps,
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        seed=cfg.seed,
        on_step=lambda s, loss: s % 100 == 0 and console.print(f"sft step {s}: loss {loss:.4f}"),
    )
    out = Path(cfg.output_dir) / "final"
    save_policy(model, tokenizer, out)
    (Path(cfg.output_dir) / "config.yaml").write_text(to_yaml(cfg))
    metrics = evaluate(
        model,
        tokenizer,
        task.eval,
        reward_funcs=[task.reward],
        is_correct=task.is_correct,
        max_prompt_length=task.max_prompt_length,
        max_completion_length=task.max_completion_length,
    )
    console.print(f"held-out greedy accuracy {100 * metrics['accuracy']:.1f}%; saved to {out}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import json

    from .data import get_task, load_prompts
    from .train import common
    from .train.evaluation import evaluate

    cfg = _train_config(args.items)
    task = get_task(cfg.task, seed=cfg.seed, num_eval=cfg.num_eval_prompts) if cfg.task else None
    rows = (
        task.eval if task else load_prompts(cfg.eval_dataset or cfg.dataset, prompt_column=cfg.prompt_column)
    )
    model, tokenizer = common.policy_and_tokenizer(cfg, task.alphabet if task else None, 256)
    metrics = evaluate(
        model,
        tokenizer,
        rows[: cfg.num_eval_prompts],
        reward_funcs=[task.reward] if task else [],
        is_correct=task.is_correct if task else None,
        prompt_column=cfg.prompt_column,
        max_prompt_length=cfg.max_prompt_length or (task.max_prompt_length if task else None),
        max_completion_length=cfg.max_completion_length or (task.max_completion_length if task else 256),
        pass_at_k=cfg.pass_at_k,
        temperature=cfg.temperature,
        seed=cfg.seed,
    )
    print(json.dumps(metrics, indent=2))
    return 0


def _cmd_reward(args: argparse.Namespace) -> int:
    from .config import RewardConfig
    from .train.reward import train_reward

    console, result, code = _run_reported(_config(RewardConfig, REWARD_PRESET, args.items), train_reward)
    if code is not None:
        return code
    before, after = result.eval_before.get("accuracy"), result.eval_after.get("accuracy")
    if before is not None and after is not None:
        console.print(
            f"held-out pairwise accuracy: [bold]{before:.3f}[/] → [bold]{after:.3f}[/] "
            f"after {result.steps} steps. Run: {result.output_dir}"
        )
    return 0


def _cmd_eval_reward(args: argparse.Namespace) -> int:
    import json

    from .config import RewardConfig
    from .train.reward import _pairs, evaluate_reward_model, reward_model_and_tokenizer

    cfg = _config(RewardConfig, REWARD_PRESET, args.items)
    _, eval_pairs, alphabet = _pairs(cfg, [], None)
    if not eval_pairs:
        raise ValueError("no evaluation pairs: set task, or eval_dataset to a preference file.")
    model, tokenizer = reward_model_and_tokenizer(cfg, alphabet)
    print(
        json.dumps(
            evaluate_reward_model(
                model,
                tokenizer,
                eval_pairs,
                max_length=cfg.max_length,
                batch_size=cfg.micro_batch_size,
                long_pairs="truncate",
            ),
            indent=2,
        )
    )
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    page = write_report(args.run_dir)
    print(f"report written: {page}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from .train.toy_demo import ToyConfig, run

    cfg = ToyConfig(**{f.name: getattr(args, f.name) for f in fields(ToyConfig)})
    console = _console()
    table = Table(
        title=f"GRPO on the toy digits task ({cfg.loss_type}, P={cfg.num_prompts}, G={cfg.num_generations})"
    )
    headers = {
        "reward": "reward",
        "frac_reward_zero_std": "zero-std groups",
        "kl": "kl",
        "clip_ratio/region_mean": "clipped",
        "loss": "loss",
        "greedy_accuracy": "accuracy",
    }
    for header in ["step", *headers.values()]:
        table.add_column(header, justify="right")
    every = max(1, cfg.steps // 10)
    with Progress(
        TextColumn("training"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("train", total=cfg.steps)

        def on_step(step: int, metrics: dict[str, float]) -> None:
            bar.update(task, advance=1)
            if step % every == 0 or step == cfg.steps:
                table.add_row(str(step), *(f"{metrics.get(name, float('nan')):.4f}" for name in headers))

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
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, handler, text in [
        ("train", _cmd_train, "GRPO training (no config: the built-in addition preset)"),
        ("sft", _cmd_sft, "supervised warm start on a task's answers"),
        ("eval", _cmd_eval, "evaluate `model` on held-out prompts"),
        (
            "reward",
            _cmd_reward,
            "train a Bradley–Terry reward model (no config: the addition preference preset)",
        ),
        ("eval-reward", _cmd_eval_reward, "pairwise accuracy and calibration of a reward model `model`"),
        ("print-config", _cmd_print_config, "show every resolved value of a train config"),
    ]:
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument(
            "items", nargs="*", metavar="[CONFIG.yaml] key=value", help="config file and overrides"
        )
        cmd.set_defaults(handler=handler)
    report = sub.add_parser("report", help="plots and an HTML page of a run directory")
    report.add_argument("run_dir")
    report.set_defaults(handler=_cmd_report)
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
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        return args.handler(args)
    from .config import ConfigError
    from .data import DataError
    from .rewards import RewardFunctionError
    from .train.common import TooManySkips

    try:
        return args.handler(args)
    except (
        ConfigError,
        DataError,
        RewardFunctionError,
        TooManySkips,
        FileNotFoundError,
        ValueError,
    ) as error:
        print(f"grpokit {args.command}: error: {error}", file=sys.stderr)
        print("(run with --debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
