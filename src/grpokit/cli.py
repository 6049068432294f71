"""Command line: parse, validate, dispatch. No training logic lives here.

    grpokit train [CONFIG.yaml] [key=value ...]    GRPO (no config: the built-in addition preset)
    grpokit sft [CONFIG.yaml] [key=value ...]      supervised warm start
    grpokit eval [CONFIG.yaml] [key=value ...]     held-out accuracy / reward of `model`
    grpokit report RUN_DIR                         PNG plots and an HTML page of a run
    grpokit export CHECKPOINT OUT_DIR              a plain model directory (LoRA adapters merged)
    grpokit serve-reward FUNCTION --port N         a reward function over HTTP ({url: ...} entries)
    grpokit serve-policy MODEL [--port N] [k=v]    a policy behind an OpenAI-compatible API
    grpokit print-config [CONFIG.yaml] [k=v ...]   every resolved value of a train config
    grpokit demo                                   a toy GRPO run in seconds
    grpokit reward [CONFIG.yaml] [key=value ...]   a Bradley–Terry reward model (eval-reward: evaluate one)

CONFIG may also name a built-in preset: `addition` (the default of train), `rlhf_addition`,
`reward_addition` (the default of reward), `reward_addition_rlhf`.

Errors that a user can fix (config, data, reward functions, a device the machine lacks, missing
files, a full disk, a read-only filesystem, missing permissions) print one line that names the culprit
and the fix, exit code 2; `--debug` shows the traceback instead. Any other exception is a bug and
shows its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

PRESET = "addition.yaml"
REWARD_PRESET = "reward_addition.yaml"


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG.yaml] key=value ... -> (config path or None, overrides)."""
    return (items[0], items[1:]) if items and "=" not in items[0] else (None, items)


def _config(schema: Any, preset_name: str, items: list[str]) -> Any:
    """CONFIG.yaml plus overrides; with no CONFIG, the built-in preset plus overrides. CONFIG may
    also name a built-in preset (`rlhf_addition`), when no such file exists."""
    return _config_and_preset(schema, preset_name, items)[0]


def _config_and_preset(schema: Any, preset_name: str, items: list[str]) -> tuple[Any, Any]:
    """`_config`'s config, and the `config.applied.Preset` it was loaded from (None: a file)."""
    from .config import ConfigError, GRPOConfig, load_config, parse_overrides
    from .config.applied import preset_of
    from .config.trl_names import BATCH_NAMES

    path, overrides = _split_args(items)
    if path is not None and not Path(path).exists() and _preset(path).is_file():
        path, preset_name = None, _preset(path).name
    if path is None:
        preset = resources.files("grpokit.presets").joinpath(preset_name)
        given = parse_overrides(overrides)
        with resources.as_file(preset) as preset_path:
            try:
                cfg = load_config(schema, preset_path, overrides)
            except ConfigError:
                # the preset's micro_batch_size, which the user did not set, adapts to the step's rows
                # they changed (the largest divisor, as when unset); a value they set is refused
                if schema is not GRPOConfig or {"micro_batch_size", *BATCH_NAMES} & set(given):
                    raise
                cfg = load_config(schema, preset_path, overrides, unset={"micro_batch_size"})
                given = {**given, "micro_batch_size": cfg.micro_batch_size}  # (not the preset's now)
        return cfg, preset_of(preset_name.removesuffix(".yaml"), given)
    return load_config(schema, path, overrides), None


def _preset(name: str) -> Any:
    """The built-in preset file a bare name refers to (`addition` -> presets/addition.yaml)."""
    return resources.files("grpokit.presets").joinpath(f"{name.removesuffix('.yaml')}.yaml")


def presets() -> list[str]:
    """Names of the built-in presets."""
    folder = resources.files("grpokit.presets")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _train_config(items: list[str]) -> Any:
    from .config import GRPOConfig

    return _config(GRPOConfig, PRESET, items)


def _stopped(result: Any) -> int:
    """The shell's exit code for the signal that stopped the run (its line was printed by the
    progress display, as in the Python API)."""
    import signal

    return 128 + int(getattr(signal, result.stopped_by, signal.SIGTERM))


def _console() -> Any:
    from rich.console import Console

    return Console()


def _cmd_print_config(args: argparse.Namespace) -> int:
    """The values a train run applies (those chosen for model: tiny included), each one that is not the
    default under a comment saying where it came from: the preset, yours, or chosen for model=tiny."""
    import yaml

    from .config import ConfigError, GRPOConfig, RewardConfig
    from .config.applied import annotated_yaml, applied

    try:
        cfg, preset = _config_and_preset(GRPOConfig, PRESET, args.items)
    except ConfigError:  # a reward model's config (a reward_* preset, or a file of its options)?
        try:
            reward = _config(RewardConfig, REWARD_PRESET, args.items)
        except ConfigError:
            reward = None
        if reward is None:
            raise  # (the train config's own error: print-config is for train configs first)
        print("# a reward model's config (grpokit reward): every value it applies")
        print(yaml.safe_dump(reward.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    print(annotated_yaml(applied(cfg, preset)), end="")
    return 0


def _reported(display: Any, run: Any, device: str, summary: Any) -> int:
    """A run with the progress display (`train.progress.run_reported`): its exit code (a stop by signal:
    the signal's, its line printed by the display), and on rank 0 its `summary(result)` line."""
    from .train.progress import run_reported

    console = _console()
    result = run_reported(console, display, run, device)
    if result is None:  # a rank other than 0
        return 0
    if result.stopped_by:
        return _stopped(result)
    line = summary(result)
    if line is not None:
        console.print(line)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .config import GRPOConfig
    from .config.applied import applied
    from .config.plan import display
    from .train.grpo import train_grpo
    from .train.progress import grpo_summary

    cfg, preset = _config_and_preset(GRPOConfig, PRESET, args.items)
    if preset is not None and _split_args(args.items)[0] is None:  # no CONFIG given: said, not silent
        print(
            f"the built-in {preset.name} preset with your overrides (output_dir {cfg.output_dir}); give a "
            "CONFIG.yaml or another preset to start elsewhere (grpokit print-config shows every value)"
        )
    shown = display(applied(cfg).config)  # sft_steps chosen for tiny, say
    run = lambda on_event: train_grpo(cfg, preset=preset, on_event=on_event)  # noqa: E731
    return _reported(shown, run, cfg.device, grpo_summary)


def _cmd_sft(args: argparse.Namespace) -> int:
    from .config import SFTConfig, load_config
    from .config.plan import sft_plan
    from .train.progress import SFTLines, sft_summary
    from .train.sft_run import train_sft

    path, overrides = _split_args(args.items)
    console = _console()
    result = train_sft(sft_plan(load_config(SFTConfig, path, overrides)), on_event=SFTLines(console).on_event)
    if result.stopped_by:
        return _stopped(result)
    console.print(sft_summary(result))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import json

    from .config.plan import eval_plan
    from .train.eval_run import evaluate_policy

    plan = eval_plan(_train_config(args.items))
    print(json.dumps(evaluate_policy(plan, server=args.server), indent=2))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    """The pre-flight of a train config: a table of findings; exit 1 on a fatal one."""
    from .config import GRPOConfig
    from .models import parse_bytes
    from .train.doctor import checkup

    cfg, preset = _config_and_preset(GRPOConfig, PRESET, args.items)
    gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    console = _console()
    with console.status("grpokit doctor: loading, probing the rewards, sampling a few groups..."):
        report = checkup(cfg, preset, groups=args.groups, gpu_memory=gpu_memory)
    report.show(console, f"grpokit doctor: {cfg.output_dir}")
    return 1 if report.fatal else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .models.hf import export_model

    checkpoint, out = Path(args.checkpoint), Path(args.out_dir)
    merged = " (LoRA adapters merged)" if export_model(checkpoint, out) else ""
    print(f"exported {checkpoint} to {out}{merged}")
    return 0


def _cmd_serve_reward(args: argparse.Namespace) -> int:
    """A reward function served over HTTP for `{url: ...}` reward entries (rewards/serving.py has the
    contract), until Ctrl-C or SIGTERM."""
    from .rewards.serving import ServeCommand, serve_command

    serve_command(ServeCommand(**{f.name: getattr(args, f.name) for f in fields(ServeCommand)}))
    return 0


def _cmd_reward(args: argparse.Namespace) -> int:
    from .config import RewardConfig
    from .config.plan import display
    from .train.progress import reward_summary
    from .train.reward import train_reward

    cfg = _config(RewardConfig, REWARD_PRESET, args.items)
    run = lambda on_event: train_reward(cfg, on_event=on_event)  # noqa: E731
    return _reported(display(cfg), run, cfg.device, reward_summary)


def _cmd_serve_policy(args: argparse.Namespace) -> int:
    """The policy behind an OpenAI-compatible generation API (serve/policy.py has the contract)."""
    from .config.plan import eval_plan
    from .serve.policy import ServePolicyCommand, serve_policy

    command = ServePolicyCommand(**{f.name: getattr(args, f.name) for f in fields(ServePolicyCommand)})
    command.check()  # before anything is loaded
    serve_policy(command, eval_plan(_train_config([*args.items, f"model={args.model}"])))
    return 0


def _http_options(parser: argparse.ArgumentParser) -> None:
    """What a grpokit server gives its clients at most, and where it listens (net/server.py)."""
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--api-key",
        help="require the header 'Authorization: Bearer API_KEY' on every request (default: the "
        "environment variable GRPOKIT_API_KEY, which keeps the key out of the process list; unset: none)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=64.0,
        help="the largest request body, in MiB (default 64; larger: HTTP 413, unread)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's headers, and again its body (default 30; "
        "slower: the connection is closed, or HTTP 408)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="connections at once (default 64; beyond: HTTP 503, which clients try again)",
    )


def _cmd_eval_reward(args: argparse.Namespace) -> int:
    import json

    from .config import RewardConfig
    from .config.plan import reward_plan
    from .train.reward import evaluate_reward

    plan = reward_plan(_config(RewardConfig, REWARD_PRESET, args.items))
    print(json.dumps(evaluate_reward(plan), indent=2))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    page = write_report(args.run_dir, server=args.server, samples=args.samples)
    print(f"report written: {page}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .train.toy_demo import ToyConfig, run_shown

    run_shown(ToyConfig(**{f.name: getattr(args, f.name) for f in fields(ToyConfig)}), _console())
    return 0


GRPO_COMMANDS = ("train", "eval", "print-config", "doctor")  # the commands whose presets are GRPO configs


def help_preset(argv: Sequence[str]) -> dict[str, str]:
    """{command: NAME} for `grpokit COMMAND NAME ... --help` with NAME a built-in preset: that command's
    help shows NAME's values ({}: no help asked, or no preset named)."""
    words = [a for a in argv if a != "--debug"]
    if len(words) < 2 or words[0] not in GRPO_COMMANDS or not {"-h", "--help"} & set(words):
        return {}
    items, rest = [], iter(words[1:])
    for word in rest:
        if word.startswith("--") and "=" not in word and word != "--help":
            next(rest, None)  # an option's value (doctor --groups 4)
        elif not word.startswith("-"):
            items.append(word)
    first = items[0] if items else "="  # CONFIG is the first item, as _split_args reads it
    if "=" not in first and not Path(first).exists() and _preset(first).is_file():
        return {words[0]: first.removesuffix(".yaml")}
    return {}


def build_parser(named: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line; `named` ({command: preset}, `help_preset`): a command whose help shows the
    values of the preset named on its command line rather than of the one it runs without CONFIG."""
    from .config import GRPOConfig, RewardConfig, SFTConfig
    from .config.reference import EVAL_OPTIONS, options_help
    from .net.server import DEFAULT_MAX_BATCH_ROWS
    from .ops import LOSS_TYPES, POLICY_LOSS_TYPES

    parser = argparse.ArgumentParser(
        prog="grpokit", description="Group Relative Policy Optimization for language models."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    starts = {
        "train": "addition",
        "eval": "addition",
        "print-config": "addition",
        "reward": "reward_addition",
    }
    starts["eval-reward"] = "reward_addition"  # what each command runs without CONFIG
    starts["doctor"] = "addition"
    named = dict(named or {})
    available = ", ".join(presets())
    starts |= named
    for name, handler, text, schema in [
        ("train", _cmd_train, "GRPO training", GRPOConfig),
        ("sft", _cmd_sft, "supervised warm start on a task's answers", SFTConfig),
        ("eval", _cmd_eval, "evaluate `model` on held-out prompts", GRPOConfig),
        (
            "reward",
            _cmd_reward,
            "train a Bradley–Terry reward model",
            RewardConfig,
        ),
        (
            "eval-reward",
            _cmd_eval_reward,
            "pairwise accuracy and calibration of a reward model `model`",
            RewardConfig,
        ),
        ("print-config", _cmd_print_config, "show every resolved value of a train config", GRPOConfig),
    ]:
        cmd = sub.add_parser(
            name,
            help=text,
            description=text
            + (
                f". Without CONFIG: the built-in {starts[name]} preset, with your key=value overrides. "
                f"CONFIG may also name a built-in preset: {available}."
                if name in starts
                else ""
            ),
            epilog=options_help(
                schema, starts.get(name), named=name in named, only=EVAL_OPTIONS if name == "eval" else None
            ),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.add_argument(
            "items", nargs="*", metavar="[CONFIG.yaml] key=value", help="config file and overrides"
        )
        cmd.set_defaults(handler=handler)
        if name == "eval":
            cmd.add_argument(
                "--server",
                help="sample on this `grpokit serve-policy` server (http://HOST:PORT) instead of loading "
                "the model: its tokenizer is checked against MODEL's",
            )
    doctor = sub.add_parser(
        "doctor",
        help="pre-flight a train config: data, rewards, a few sampled groups, memory and time (no training)",
        description="Check a train config before running it: the data, each reward on reference, empty and "
        "garbage completions, K sampled groups (zero spread, truncation, length), a memory forecast and a "
        "step-time estimate. Exits 1 on a fatal finding.",
        epilog=options_help(GRPOConfig, starts["doctor"], named="doctor" in named),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("items", nargs="*", metavar="[CONFIG.yaml] key=value", help="as for train")
    doctor.add_argument("--gpu-memory", help="also forecast for a GPU of this size (80GiB, 24GB, ...)")
    doctor.add_argument("--groups", type=int, help="prompts to sample (default: prompts_per_step, ≤ 64)")
    doctor.set_defaults(handler=_cmd_doctor)
    export = sub.add_parser(
        "export",
        help="a checkpoint as a plain model directory (LoRA adapters merged into the weights)",
        description="Write CHECKPOINT as a plain model directory OUT_DIR that transformers' "
        "AutoModelForCausalLM.from_pretrained loads: safetensors weights (LoRA adapters merged into them), "
        "the tokenizer and its chat template; the optimizer state and run files stay behind.",
    )
    export.add_argument("checkpoint", help="a run's checkpoint-N directory (or its final/)")
    export.add_argument("out_dir", help="the model directory to write (created; must not hold files)")
    export.set_defaults(handler=_cmd_export)
    serve = sub.add_parser(
        "serve-reward",
        help="serve a reward function over HTTP, for reward_funcs entries {url: http://HOST:PORT/}",
        description='Serve FUNCTION f(prompts, completions, **columns) over HTTP: POST {"prompts": [...], '
        '"completions": [...], <column>: [...]} answers {"rewards": [...]}. Ctrl-C or SIGTERM stops.',
    )
    serve.add_argument(
        "function",
        help="FILE.py:FUNCTION, package.module:FUNCTION, package.module.FUNCTION or a built-in reward",
    )
    serve.add_argument("--port", type=int, required=True, help="the port (0: any free one, printed)")
    serve.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="calls of the function at once (default 1: one batch at a time)",
    )
    _http_options(serve)
    serve.set_defaults(handler=_cmd_serve_reward)
    policy = sub.add_parser(
        "serve-policy",
        help="serve a policy behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions)",
        description="Serve MODEL (a hub id, a directory or a checkpoint; key=value items as for eval: "
        "dtype, device, decode_loop...) through grpokit's engine: /health, /v1/models, /v1/completions, "
        "/v1/chat/completions, POST /update_weights, GET /weight_version. Ctrl-C or SIGTERM stops.",
    )
    policy.add_argument("model", help="the policy: a hub id, a model directory, a checkpoint, or tiny")
    policy.add_argument("items", nargs="*", help="CONFIG.yaml and key=value overrides, as for eval")
    policy.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: any free one)")
    policy.add_argument("--served-model-name", help="the name clients give as model (default: MODEL)")
    policy.add_argument(
        "--max-batch-rows",
        type=int,
        default=DEFAULT_MAX_BATCH_ROWS,
        help="completions one decode may hold, over the requests it batches "
        f"(default {DEFAULT_MAX_BATCH_ROWS})",
    )
    _http_options(policy)
    policy.set_defaults(handler=_cmd_serve_policy)
    report = sub.add_parser(
        "report",
        help="plots and an HTML page of a run directory",
        description="Write RUN_DIR/report/: a PNG per plot of the run's metrics (each y axis with its unit; "
        "alerts marked; a series at 0 throughout named in a note instead), the warm start's loss, a reward "
        "model's diagnostics, and index.html with the last evaluation, the alerts and the config.",
    )
    report.add_argument("run_dir", help="a run's output_dir (it holds metrics.jsonl)")
    report.add_argument(
        "--server",
        help="also show greedy completions of held-out prompts sampled on this `grpokit serve-policy` "
        "server (http://HOST:PORT)",
    )
    report.add_argument("--samples", type=int, default=8, help="with --server: how many prompts (default 8)")
    report.set_defaults(handler=_cmd_report)
    demo = sub.add_parser(
        "demo",
        help="run GRPO on a toy task in seconds (exercises grpokit.ops)",
        description="GRPO on a toy task in seconds, on grpokit.ops alone (no network, no tokenizer): a "
        "table of logits per prompt learns each prompt's 4-digit answer, (37·p + 11) mod 10000, scored by "
        "digits right; each step prints the reward. A check that a loss variant learns, and a reading aid "
        "for the math (train/toy_demo.py).",
    )
    demo.add_argument("--steps", type=int, default=60, help="GRPO steps (default 60)")
    demo.add_argument("--num-prompts", type=int, default=16, help="prompts per step (default 16)")
    demo.add_argument("--num-generations", type=int, default=8, help="G: completions per prompt (default 8)")
    demo.add_argument("--num-iterations", type=int, default=2, help="μ: updates per batch (default 2)")
    no_teacher = [t for t in POLICY_LOSS_TYPES if not LOSS_TYPES[t].needs_teacher]  # the toy demo has none
    demo.add_argument("--loss-type", choices=no_teacher, default="dapo")
    demo.add_argument("--beta", type=float, default=0.04)
    demo.add_argument("--epsilon", type=float, default=0.2)
    demo.add_argument("--epsilon-high", type=float, default=0.28)
    demo.add_argument("--learning-rate", type=float, default=0.3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv  # before the command or anywhere after it
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser(help_preset(argv))
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "items") and not any(word.startswith("-") for word in extra):
        args.items += extra  # key=value after an option (`MODEL --port 8001 dtype=bfloat16`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if debug:
        return args.handler(args)
    from .user_errors import one_line

    try:
        return args.handler(args)
    except KeyboardInterrupt as interrupt:  # a run's says which checkpoint is the last complete one
        print(f"grpokit {args.command}: {str(interrupt) or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return 130  # the shell's code for a command ended by SIGINT
    except Exception as error:  # noqa: BLE001 - a user's mistake is one line; a bug is raised again
        line = one_line(error, args.command)
        if line is None:
            raise
    print(f"grpokit {args.command}: error: {line}", file=sys.stderr)
    print("(run with --debug for the traceback)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
