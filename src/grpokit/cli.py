"""Command line: parse, validate, dispatch. No training logic lives here.

    grpokit train [CONFIG.yaml] [key=value ...]    GRPO (no config: the built-in addition preset)
    grpokit sft [CONFIG.yaml] [key=value ...]      supervised warm start
    grpokit eval [CONFIG.yaml] [key=value ...]     held-out accuracy / reward of `model`
    grpokit report RUN_DIR                         PNG plots and an HTML page of a run
    grpokit export CHECKPOINT OUT_DIR              a plain model directory (LoRA adapters merged)
    grpokit serve-reward FUNCTION --port N         a reward function over HTTP ({url: ...} entries)
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
import re
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
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _config(schema: Any, preset_name: str, items: list[str]) -> Any:
    """CONFIG.yaml plus overrides; with no CONFIG, the built-in preset plus overrides. CONFIG may
    also name a built-in preset (`rlhf_addition`), when no such file exists."""
    return _config_and_preset(schema, preset_name, items)[0]


def _config_and_preset(schema: Any, preset_name: str, items: list[str]) -> tuple[Any, Any]:
    """`_config`'s config, and the `config.applied.Preset` it was loaded from (None: a file)."""
    from .config import load_config, parse_overrides
    from .config.applied import preset_of

    path, overrides = _split_args(items)
    if path is not None and not Path(path).exists() and _preset(path).is_file():
        path, preset_name = None, _preset(path).name
    if path is None:
        preset = resources.files("grpokit.presets").joinpath(preset_name)
        with resources.as_file(preset) as preset_path:
            cfg = load_config(schema, preset_path, overrides)
        return cfg, preset_of(preset_name.removesuffix(".yaml"), parse_overrides(overrides))
    return load_config(schema, path, overrides), None


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


def _stopped(result: Any) -> int:
    """The shell's exit code for the signal that stopped the run (its line was printed by the
    progress display, as in the Python API)."""
    import signal

    return 128 + int(getattr(signal, result.stopped_by, signal.SIGTERM))


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def _shutdown(device: str = "auto") -> None:
    from .train import distributed

    distributed.shutdown(distributed.init(device))


def _placement(cfg: Any) -> tuple[Any, Any]:
    """The torch device a config's `device` names (TF32 matmuls there on a GPU) and its precision
    (`dtype`, `master_weights`; float32 for a config without them)."""
    from .models import Precision, enable_fast_matmul, resolve_device

    device = resolve_device(cfg.device)
    enable_fast_matmul(device)
    return device, Precision.of(getattr(cfg, "dtype", "float32"), getattr(cfg, "master_weights", "float32"))


def _console() -> Any:
    from rich.console import Console

    return Console()


def _cmd_print_config(args: argparse.Namespace) -> int:
    """The values a train run applies (those chosen for model: tiny included), each one that is not the
    default under a comment saying where it came from: the preset, yours, or chosen for model=tiny."""
    from .config import GRPOConfig
    from .config.applied import annotated_yaml, applied

    cfg, preset = _config_and_preset(GRPOConfig, PRESET, args.items)
    print(annotated_yaml(applied(cfg, preset)), end="")
    return 0


def _run_reported(cfg: Any, train: Any) -> tuple[Any, Any, int | None]:
    """Run `train(cfg, on_event=...)` with a progress display on rank 0. Returns (console, result,
    exit code): the code is set when the command is already done (a non-zero rank, or a stop by
    signal, whose line is printed here); None means rank 0 finished and prints its summary."""
    from .config import GRPOConfig
    from .config.applied import applied
    from .config.plan import display
    from .train.progress import RichReporter

    console = _console()
    main_rank = _rank() == 0  # under torchrun only rank 0 talks
    shown = applied(cfg).config if isinstance(cfg, GRPOConfig) else cfg  # sft_steps chosen for tiny, say
    with RichReporter(console, display(shown), enabled=cfg.progress and main_rank) as reporter:
        result = train(cfg, on_event=reporter.on_event)
    _shutdown(cfg.device)
    if not main_rank:
        return console, result, 0
    if result.stopped_by:
        return console, result, _stopped(result)
    return console, result, None


def _cmd_train(args: argparse.Namespace) -> int:
    from functools import partial

    from .config import GRPOConfig
    from .train.grpo import train_grpo

    cfg, preset = _config_and_preset(GRPOConfig, PRESET, args.items)
    console, result, code = _run_reported(cfg, partial(train_grpo, preset=preset))
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
    from .config import SFTConfig, load_config
    from .config.plan import sft_plan
    from .train.progress import SFTLines
    from .train.sft_run import train_sft

    path, overrides = _split_args(args.items)
    console = _console()
    result = train_sft(sft_plan(load_config(SFTConfig, path, overrides)), on_event=SFTLines(console).on_event)
    if result.stopped_by:
        return _stopped(result)
    if "accuracy" not in result.eval_after:
        console.print(f"saved to {result.saved} (no eval_dataset: no held-out accuracy)")
    else:
        console.print(
            f"held-out greedy accuracy {100 * result.eval_after['accuracy']:.1f}%; saved to {result.saved}"
        )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Greedy accuracy (exact answer: the task's, or an `answer` column's), mean reward of the config's
    reward_funcs (else the task's, else correctness) and pass@k, on the task's held-out prompts or
    on eval_dataset (else dataset's dataset_test_split, if it has one, else dataset)."""
    import json

    from .config.plan import grpo_plan
    from .models import place
    from .train.grpo_setup import held_out_metrics, precision_of, probe_engine, resolve_data, tiny_context
    from .train.run import check_known_characters, policy_and_tokenizer

    cfg = _train_config(args.items)
    plan = grpo_plan(cfg.model_copy(update={"sft_steps": 0}))  # evaluation trains nothing: no answers needed
    data = resolve_data(plan.data, plan.episodes, plan.rewards, require_rewards=False, evaluate_only=True)
    context = tiny_context(plan.data.prompt_column, data)  # model: tiny's, made to fit the prompts
    model, tokenizer = policy_and_tokenizer(plan.model, data.alphabet, context)
    device, _ = _placement(cfg)
    settings = plan.trainee.engine
    model = place(model, device, precision_of(settings))  # weights as training keeps them
    # a checkpoint's character tokenizer would read characters it never learned as <unk>
    check_known_characters(tokenizer, cfg.model, [(data.eval_source, data.eval_rows)], [cfg.prompt_column])
    engine = probe_engine(settings, model, tokenizer, data, device)  # sampling as training's engine does
    metrics = held_out_metrics(engine, data, plan.evaluation)
    print(json.dumps(metrics, indent=2))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    """The pre-flight of a train config: a table of findings; exit 1 on a fatal one."""
    from rich.table import Table

    from .config import GRPOConfig
    from .models import parse_bytes
    from .train.doctor import checkup

    cfg, preset = _config_and_preset(GRPOConfig, PRESET, args.items)
    gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    console = _console()
    with console.status("grpokit doctor: loading, probing the rewards, sampling a few groups..."):
        report = checkup(cfg, preset, groups=args.groups, gpu_memory=gpu_memory)
    table = Table(title=f"grpokit doctor: {cfg.output_dir}", show_lines=False)
    for column in ("section", "check", "finding", "", "what to do"):
        table.add_column(column, overflow="fold")
    marks = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fatal": "[bold red]FATAL[/]"}
    for f in report.findings:
        table.add_row(f.section, f.item, f.value, marks[f.level], f.advice)
    console.print(table)
    fatal = [f for f in report.findings if f.level == "fatal"]
    warned = sum(f.level == "warn" for f in report.findings)
    if fatal:
        console.print(f"[bold red]{len(fatal)} fatal finding(s)[/]: the run would fail; fix them first.")
        return 1
    console.print(f"no fatal finding ({warned} warning(s)). Train with the same arguments: grpokit train ...")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint as a plain model directory: LoRA adapters merged into the base weights, no
    optimizer or training state; `eval model=` and `train model=` load it."""
    from .models import ADAPTER_DIR, load_policy, save_policy

    checkpoint, out = Path(args.checkpoint), Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{str(out)!r} is not empty; export into a new directory.")
    loaded = load_policy(checkpoint)
    save_policy(loaded.model, loaded.tokenizer, out)
    merged = " (LoRA adapters merged)" if (checkpoint / ADAPTER_DIR).is_dir() else ""
    print(f"exported {checkpoint} to {out}{merged}")
    return 0


class _Terminated(Exception):  # noqa: N818 - a signal, not an error
    """SIGTERM while serving: stop as Ctrl-C does."""


def _check_serve_options(args: argparse.Namespace) -> None:
    """serve-reward's options, each refused in one line before anything is loaded or bound."""
    if "://" in args.function:
        raise ValueError(
            f"{args.function.strip()!r} is a URL: serve-reward serves a Python function (module:function "
            "or path/file.py:function); a URL already names a server: give it to training as {url: ...}"
        )
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a port (0 to 65535; 0: any free one)")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency {args.concurrency} must be at least 1")
    for option, value in (("--max-body-mb", args.max_body_mb), ("--request-timeout", args.request_timeout)):
        if not value > 0:
            raise ValueError(f"{option} {value:g} must be above 0")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections {args.max_connections} must be at least 1")


def _cmd_serve_reward(args: argparse.Namespace) -> int:
    """A reward function served over HTTP for `{url: ...}` reward entries (rewards/serving.py has the
    contract), until Ctrl-C or SIGTERM."""
    import os
    import signal

    from .rewards import RewardServer, named_reward, reward_name
    from .rewards.serving import API_KEY_ENV, ServeLimits, check_api_key, exposure_warning

    _check_serve_options(args)
    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    check_api_key(api_key)
    fn = named_reward(args.function.strip())
    try:
        server = RewardServer(
            fn,
            args.host,
            args.port,
            limits=ServeLimits(
                concurrency=args.concurrency,
                max_body_mb=args.max_body_mb,
                request_timeout=args.request_timeout,
                max_connections=args.max_connections,
            ),
            api_key=api_key,
        )
    except OSError as error:
        raise ValueError(
            f"cannot listen on {args.host}:{args.port}: {error.strerror or error}; choose another --port "
            "(0: any free one) or --host"
        ) from error

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    warning = exposure_warning(args.host, server.port, reward_name(fn), keyed=api_key is not None)
    if warning is not None:
        print(f"grpokit serve-reward: warning: {warning}", file=sys.stderr, flush=True)
    print(f"serving reward function {reward_name(fn)!r} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, _Terminated):
        print("stopped", flush=True)
    finally:
        server.close()
        signal.signal(signal.SIGTERM, previous)
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
    from .config.plan import reward_plan
    from .train.reward import evaluate_reward_model, preference_data, reward_model_and_tokenizer

    cfg = _config(RewardConfig, REWARD_PRESET, args.items)
    plan = reward_plan(cfg)
    _, eval_pairs, alphabet = preference_data(plan.pairs, [], None)
    if not eval_pairs:
        raise ValueError("no evaluation pairs: set task, or eval_dataset to a preference file.")
    model, tokenizer = reward_model_and_tokenizer(plan.model, alphabet, cfg.max_length)
    model = model.to(_placement(cfg)[0])  # inference only: stored in the compute dtype, no autocast
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
    from .config.reference import options_help
    from .ops import POLICY_LOSS_TYPES

    parser = argparse.ArgumentParser(
        prog="grpokit", description="Group Relative Policy Optimization for language models."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    presets = {
        "train": "addition",
        "eval": "addition",
        "print-config": "addition",
        "reward": "reward_addition",
    }
    presets["eval-reward"] = "reward_addition"  # what each command runs without CONFIG
    presets["doctor"] = "addition"
    named = dict(named or {})
    presets |= named
    for name, handler, text, schema in [
        ("train", _cmd_train, "GRPO training (no config: the built-in addition preset)", GRPOConfig),
        ("sft", _cmd_sft, "supervised warm start on a task's answers", SFTConfig),
        ("eval", _cmd_eval, "evaluate `model` on held-out prompts", GRPOConfig),
        (
            "reward",
            _cmd_reward,
            "train a Bradley–Terry reward model (no config: the addition preference preset)",
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
            description=text,
            epilog=options_help(schema, presets.get(name), named=name in named),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.add_argument(
            "items", nargs="*", metavar="[CONFIG.yaml] key=value", help="config file and overrides"
        )
        cmd.set_defaults(handler=handler)
    doctor = sub.add_parser(
        "doctor",
        help="pre-flight a train config: data, rewards, a few sampled groups, memory and time (no training)",
        description="Check a train config before running it: the data, each reward on reference, empty and "
        "garbage completions, K sampled groups (zero spread, truncation, length), a memory forecast and a "
        "step-time estimate. Exits 1 on a fatal finding.",
        epilog=options_help(GRPOConfig, presets["doctor"], named="doctor" in named),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("items", nargs="*", metavar="[CONFIG.yaml] key=value", help="as for train")
    doctor.add_argument("--gpu-memory", help="also forecast for a GPU of this size (80GiB, 24GB, ...)")
    doctor.add_argument("--groups", type=int, help="prompts to sample (default: prompts_per_step, ≤ 64)")
    doctor.set_defaults(handler=_cmd_doctor)
    export = sub.add_parser(
        "export", help="a checkpoint as a plain model directory (LoRA adapters merged into the weights)"
    )
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
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
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="calls of the function at once (default 1: one batch at a time)",
    )
    serve.add_argument(
        "--api-key",
        help="require the header 'Authorization: Bearer API_KEY' on every request (default: the "
        "environment variable GRPOKIT_API_KEY, which keeps the key out of the process list; unset: none)",
    )
    serve.add_argument(
        "--max-body-mb",
        type=float,
        default=64.0,
        help="the largest request body, in MiB (default 64; larger: HTTP 413, unread)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's headers, and again its body (default 30; "
        "slower: the connection is closed, or HTTP 408)",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="connections at once (default 64; beyond: HTTP 503, which clients try again)",
    )
    serve.set_defaults(handler=_cmd_serve_reward)
    report = sub.add_parser("report", help="plots and an HTML page of a run directory")
    report.add_argument("run_dir")
    report.set_defaults(handler=_cmd_report)
    demo = sub.add_parser("demo", help="run GRPO on a toy task in seconds (exercises grpokit.ops)")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--num-prompts", type=int, default=16)
    demo.add_argument("--num-generations", type=int, default=8)
    demo.add_argument("--num-iterations", type=int, default=2)
    no_teacher = [t for t in POLICY_LOSS_TYPES if t != "opd"]  # the toy demo has no teacher to distill from
    demo.add_argument("--loss-type", choices=no_teacher, default="dapo")
    demo.add_argument("--beta", type=float, default=0.04)
    demo.add_argument("--epsilon", type=float, default=0.2)
    demo.add_argument("--epsilon-high", type=float, default=0.28)
    demo.add_argument("--learning-rate", type=float, default=0.3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def _size(num_bytes: float) -> str:
    """A byte count as people read it: 12.0 MB (powers of 1000, as `df -H` shows them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"


def _free_space(path: str) -> str | None:
    """The free space of the filesystem `path` is on, measured at its nearest existing parent (the
    file that could not be written may not exist, nor its directory); None when even that fails."""
    import shutil

    place = Path(path).absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        return _size(shutil.disk_usage(place).free)
    except OSError:
        return None


def environment_error(error: OSError, command: str) -> str | None:
    """The one line for an OSError that the machine or the user's paths caused (a full disk, a
    read-only filesystem, missing permissions, a file where a directory belongs, a run already in
    output_dir), naming the path and what to do; None for any other OSError, which then shows its
    traceback as a bug would."""
    import errno

    path = error.filename
    where = repr(str(path)) if path is not None else "a file"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if error.errno == errno.ENOSPC else "disk quota exceeded"
        free = _free_space(path) if path is not None else None
        room = f" ({free} free on that filesystem)" if free else ""
        kept = " Earlier checkpoints are kept." if command in ("train", "reward") else ""  # they checkpoint
        return f"{what} writing {where}{room}; free some space or choose another output_dir.{kept}"
    if error.errno == errno.EROFS:
        return f"{where} is on a read-only filesystem; choose a path on a writable one (output_dir=...)."
    if error.errno == errno.ENAMETOOLONG:
        return f"the file name {where} is too long for its filesystem; choose a shorter path."
    if isinstance(error, PermissionError):
        return f"permission denied on {where}; give this user access to it, or choose another path."
    if isinstance(error, IsADirectoryError):
        return f"{where} is a directory where a file is expected; give the path of a file."
    if isinstance(error, NotADirectoryError):
        return f"{where} is not a directory (it, or a folder on its path, is a file); choose another path."
    if isinstance(error, (FileNotFoundError, FileExistsError)):
        if error.errno is None:  # raised by grpokit with a message that names the path and the fix
            return str(error)
        if isinstance(error, FileExistsError):
            return f"{where} already exists; remove it or choose another path."
        return f"{where} does not exist; check the path."
    return None


def host_memory_error(error: RuntimeError) -> str | None:
    """The one line for the host's allocator refusing a tensor (None for any other RuntimeError, a bug):
    a size far beyond the machine's memory, usually from max_completion_length, num_generations or
    num_eval_prompts; nothing has been written by then (a run refuses such sizes before its directory)."""
    found = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", str(error))
    if found is None:
        return None
    gib = int(found.group(1)) / 2**30
    return (
        f"out of host memory: a tensor of {gib:,.1f} GiB could not be allocated; lower "
        "max_completion_length, num_generations, prompts_per_step, num_eval_prompts or micro_batch_size "
        "(`grpokit doctor` forecasts a step's memory); a run it stopped continues with resume=true from "
        "its last checkpoint, or starts again with overwrite=true"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(help_preset(argv)).parse_args(argv)
    if args.debug:
        return args.handler(args)
    import torch

    from .config import ConfigError
    from .data import DataError
    from .rewards import RewardFunctionError
    from .train.grpo_step import OutOfDeviceMemory, first_line
    from .train.run import TooManySkips

    try:
        return args.handler(args)
    except (
        ConfigError,
        DataError,
        RewardFunctionError,
        TooManySkips,
        OutOfDeviceMemory,
        ValueError,
    ) as error:
        line = str(error)  # ValueError: a DeviceError (device=cuda without a GPU) among others
    except torch.OutOfMemoryError as error:  # outside a training step (warm start, a reward model...)
        line = (
            f"out of device memory ({first_line(error)}); lower micro_batch_size (rows per forward and "
            "backward, and per evaluation call) or set gradient_checkpointing=true; `grpokit doctor` "
            "forecasts the peak"
        )
    except OSError as error:
        found = environment_error(error, args.command)
        if found is None:
            raise
        line = found
    except RuntimeError as error:  # the host's allocator refusing (torch raises no OutOfMemoryError there)
        line = host_memory_error(error)
        if line is None:
            raise
    except KeyboardInterrupt as interrupt:  # a run's says which checkpoint is the last complete one
        print(f"grpokit {args.command}: {str(interrupt) or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return 130  # the shell's code for a command ended by SIGINT
    print(f"grpokit {args.command}: error: {line}", file=sys.stderr)
    print("(run with --debug for the traceback)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
