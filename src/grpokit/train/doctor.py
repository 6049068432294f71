"""`grpokit doctor`: the pre-flight. It takes the config `train` takes, trains nothing, and says
before any GPU hour is spent whether the run can learn:

1. config: the resolved run (model, data, geometry, loss), and what in it looks wrong;
2. data: rows, columns, prompt lengths in tokens, the share over max_prompt_length;
3. rewards: each function on the reference answers, on empty and on garbage completions, with its
   latency (a reward that never varies, returns None, or is slow, is flagged);
4. sampling: K groups drawn as step 1 would draw them (after the warm start, when there is one): the
   forecast share of zero-spread groups, the truncation share, the mean completion length;
5. memory: the forecast peak (`models.memory_forecast`) on this device and on a named one
   (`gpu_memory`), with the micro-batch that fits;
6. time: a step's estimate from the sampled tokens and one timed forward.

Each finding is ok, warn or fatal; the command exits non-zero on a fatal one. Nothing is written to
output_dir (the warm start's probe runs in a temporary directory).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import GRPOConfig
from ..config.applied import ASYNC, CHOSEN, Preset, applied
from ..config.plan import GRPOPlan, grpo_plan
from ..data import PromptSampler, columns_of, demonstration, render_prompt
from ..models import ModelShape, StepShape, forecast_memory, largest_micro_batch
from ..rewards import CallRules, reward_names, score_completions
from . import distributed
from .draw import sample_rollout, score_rollout
from .grpo_setup import Hooks, sampling_params, teacher_refusal, teacher_shape, warm_start
from .inputs import (
    UserInputs,
    check_context,
    place_policy,
    precision_of,
    probe_engine,
    resolve_data,
    tiny_context,
)
from .memory_check import StepSizes, step_memory_refusal
from .run import StopSignals, policy_and_tokenizer, seed_everything
from .trainee import StepParams

Level = Literal["ok", "warn", "fatal"]
SLOW_REWARD_SECONDS = 1.0  # per batch of a step's completions: above it, the reward is flagged slow
GARBAGE = "qz#@ xv~~ 7&&k ]]"  # a completion no reward should pay for


@dataclass(frozen=True)
class Finding:
    section: str  # config, data, rewards, sampling, memory, time
    item: str
    value: str
    level: Level = "ok"
    advice: str = ""


@dataclass
class Checkup:
    """What the doctor found, and the forecasts the tests and the README read."""

    findings: list[Finding] = field(default_factory=list)
    zero_spread: float | None = None  # forecast share of groups whose G rewards all agree
    truncated: float | None = None  # forecast share of completions cut at max_completion_length
    mean_length: float | None = None  # tokens
    memory_bytes: int | None = None  # the forecast peak on the configured device
    step_seconds: float | None = None  # the estimated seconds of one step on this machine
    prompt_tokens: int | None = None  # the longest prompt in tokens (as truncated)

    @property
    def fatal(self) -> bool:
        return any(f.level == "fatal" for f in self.findings)

    def add(self, section: str, item: str, value: Any, level: Level = "ok", advice: str = "") -> None:
        self.findings.append(Finding(section, item, str(value), level, advice))

    def show(self, console: Any, title: str) -> None:
        """The findings as a table on a rich `console`, then the verdict: fatal ones to fix first, or
        how to train."""
        from rich.table import Table

        table = Table(title=title, show_lines=False)
        for column in ("section", "check", "finding", "", "what to do"):
            table.add_column(column, overflow="fold")
        marks = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fatal": "[bold red]FATAL[/]"}
        for f in self.findings:
            table.add_row(f.section, f.item, f.value, marks[f.level], f.advice)
        console.print(table)
        fatal = sum(f.level == "fatal" for f in self.findings)
        warned = sum(f.level == "warn" for f in self.findings)
        if fatal:
            console.print(f"[bold red]{fatal} fatal finding(s)[/]: the run would fail; fix them first.")
        else:
            console.print(
                f"no fatal finding ({warned} warning(s)). Train with the same arguments: grpokit train ..."
            )


def _gib(num_bytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def checkup(
    cfg: GRPOConfig,
    preset: Preset | None = None,
    *,
    groups: int | None = None,
    gpu_memory: int | None = None,
    on_event: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> Checkup:
    """The pre-flight of `cfg` (module doc). `groups`: prompts to sample G completions for (None:
    prompts_per_step, at most 64). `gpu_memory`: bytes of a GPU to forecast for as well."""
    report = Checkup()
    baseline = _rss()  # this process before the model: the memory forecast's floor on a CPU
    plan = grpo_plan(cfg, preset)
    resolved = applied(cfg, preset)
    _config_section(report, resolved.config, plan)
    for why in (CHOSEN, ASYNC):  # values a run chooses where the config leaves them unset
        chosen = [f"{k}={getattr(resolved.config, k)}" for k, v in resolved.sources.items() if v == why]
        if chosen:
            report.add("config", why, ", ".join(chosen), advice="set them yourself to override")
    try:
        data = resolve_data(plan.data, plan.episodes, plan.rewards, UserInputs(), device=torch.device("cpu"))
    except (OSError, ValueError, ImportError) as error:  # a hub dataset offline, a missing column or file
        report.add("data", plan.data.dataset or "data", "cannot be read", "fatal", str(error).splitlines()[0])
        return report
    seed_everything(plan.seed)
    try:
        context = tiny_context(plan.data.prompt_column, data)
        model, tokenizer = policy_and_tokenizer(plan.model, data.alphabet, context)
    except (OSError, ValueError) as error:  # a hub id not in the cache offline, a bad directory
        report.add("config", "model", plan.model.name, "fatal", str(error).splitlines()[0])
        return report
    try:
        teacher = teacher_shape(plan)
        refusal = teacher_refusal(plan, tokenizer, ModelShape.of(model), teacher)
    except (OSError, ValueError) as error:  # a teacher not in the cache offline, a bad directory
        refusal = str(error).splitlines()[0]
    if refusal is not None:
        assert plan.teacher is not None
        report.add("config", "teacher_model", plan.teacher.model.name, "fatal", refusal)
        return report
    _data_section(report, plan, data, tokenizer)
    _rewards_section(report, plan, data)
    if plan.rollout.servers:  # (sampled there: each server answers, with this tokenizer)
        _servers_section(report, plan.rollout.servers, plan.rollout.request_timeout, tokenizer)
    check_context(plan.data.prompt_column, model, tokenizer, data)
    d = distributed.init(plan.trainee.placement.device)
    refusal = step_memory_refusal(  # sizes far beyond the device: sampling them would fail on allocation
        plan, ModelShape.of(model), report.prompt_tokens or 1, data.max_completion_length, d.device
    )
    if refusal is not None:
        report.add("memory", "one step", "far beyond this device", "fatal", refusal)
        return report
    model = place_policy(precision_of(plan.trainee.engine), model, d)
    engine = probe_engine(plan.trainee.engine, model, tokenizer, data, d.device)
    if plan.warm_start.schedule.steps:
        emit = on_event or (lambda kind, step, data: None)
        with tempfile.TemporaryDirectory() as scratch, StopSignals() as stop:
            warmed = warm_start(plan.warm_start, engine, data, d, Hooks(emit, stop), Path(scratch))
        report.add("sampling", "warm start", f"{len(warmed.losses)} supervised steps (as train runs them)")
    _sampling_section(report, plan, data, engine, groups)
    shapes = Shapes(ModelShape.of(model), teacher)
    _memory_section(report, plan, data, shapes, gpu_memory, d.device, baseline)
    return report


@dataclass(frozen=True)
class Shapes:
    """The shapes the memory forecast counts: the policy's, and a distillation teacher's (None: none)."""

    policy: ModelShape
    teacher: ModelShape | None = None


# ----------------------------------------------------------------------------- 1. config


# below it a randomly initialised tiny model barely moves (at 1e-6 an own-task run went 31% -> 31%)
TINY_SLOW_LR = 1e-5


def _config_section(report: Checkup, cfg: GRPOConfig, plan: GRPOPlan) -> None:
    step = plan.trainee.step
    G, P = cfg.num_generations, cfg.prompts_per_step
    report.add("config", "model", f"{cfg.model} on {plan.trainee.placement.device}, {cfg.dtype}")
    report.add("config", "data", cfg.dataset or f"task {cfg.task}")
    report.add(
        "config", "step", f"{P} prompts × {G} completions = {P * G} rows, micro-batch {step.micro_batch_size}"
    )
    report.add(
        "config",
        "loss",
        f"{cfg.loss_type}, β={cfg.beta:g}, μ={cfg.num_iterations}, lr={cfg.learning_rate:g}, "
        f"{cfg.max_steps} steps",
    )
    if G < 4:
        report.add(
            "config",
            "num_generations",
            G,
            "warn",
            "with fewer than 4 completions per prompt most groups agree and teach nothing; use 8 or more",
        )
    if cfg.model != "tiny" and not cfg.use_peft and cfg.learning_rate > 1e-4:
        report.add(
            "config",
            "learning_rate",
            f"{cfg.learning_rate:g}",
            "warn",
            "a pretrained model takes about 1e-6 to 1e-5 in GRPO (TRL: 1e-6); a rate this high can undo "
            "what it knows in a few steps (LoRA, use_peft=true, takes higher ones)",
        )
    if cfg.model == "tiny" and cfg.learning_rate < TINY_SLOW_LR:
        report.add(
            "config",
            "learning_rate",
            f"{cfg.learning_rate:g}",
            "warn",
            "model=tiny is built here with random weights, and at this rate it learns nothing in a few "
            "hundred steps (TRL's 1e-6 is for pretrained models); leave learning_rate unset (1e-4 is "
            "chosen) or set 1e-4",
        )
    if cfg.temperature < 0.5:
        report.add(
            "config",
            "temperature",
            cfg.temperature,
            "warn",
            "a low temperature makes the G completions alike (zero spread); 0.7-1.0 is usual for GRPO",
        )


# ----------------------------------------------------------------------------- 2. data


def _data_section(report: Checkup, plan: GRPOPlan, data: Any, tokenizer: Any) -> None:
    rows, column = data.train_rows, plan.data.prompt_column
    report.add("data", "rows", f"{len(rows)} training, {len(data.eval_rows)} held out ({data.train_source})")
    report.add("data", "columns", ", ".join(sorted(rows[0])) if rows else "(none)")
    sample = rows[:: max(1, len(rows) // 2000)]  # at most ~2000 prompts: a distribution, quickly
    lengths = sorted(
        len(tokenizer(render_prompt(r[column], tokenizer, None, data.chat_template_kwargs))["input_ids"])
        for r in sample
    )
    if not lengths:
        report.add("data", "prompts", "none", "fatal", "the training data has no rows")
        return
    p95 = lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))]
    limit = data.max_prompt_length
    report.prompt_tokens = lengths[-1] if limit is None else min(lengths[-1], limit)
    report.add(
        "data",
        "prompt tokens",
        f"min {lengths[0]}, median {statistics.median(lengths):g}, p95 {p95}, max {lengths[-1]}",
    )
    if limit is not None:
        over = sum(n > limit for n in lengths) / len(lengths)
        level: Level = "warn" if over > 0.05 else "ok"
        advice = "their start is cut off (prompt_truncation=left): raise max_prompt_length" if over else ""
        report.add("data", f"prompts over max_prompt_length={limit}", f"{100 * over:.1f}%", level, advice)


# ----------------------------------------------------------------------------- 3. rewards


def _servers_section(report: Checkup, urls: tuple[str, ...], timeout: float, tokenizer: Any) -> None:
    """rollout_server_urls: each server reachable and sampling with the trainer's tokenizer (else
    fatal, the one line a run would stop with), its weight version and round-trip time."""
    from ..engine.remote import RemotePolicy, RolloutServerError

    client = RemotePolicy((), tokenizer, min(timeout, 30.0))
    try:
        for url in urls:
            try:
                probe = client.probe(url.rstrip("/"))
            except RolloutServerError as error:
                report.add("servers", url, "cannot sample this run", "fatal", str(error))
                continue
            report.add(
                "servers",
                url,
                f"{probe.model!r} with the trainer's tokenizer; weight version {probe.version}; round trip "
                f"{1000 * probe.round_trip_s:.0f} ms",
            )
    finally:
        client.close()


def _rewards_section(report: Checkup, plan: GRPOPlan, data: Any) -> None:
    rows = data.train_rows[:16]
    column, answer = plan.data.prompt_column, plan.data.answer_column
    prompts = [r[column] for r in rows]
    probes = {"empty": [""] * len(rows), "garbage": [GARBAGE] * len(rows)}
    if rows and all(answer in r for r in rows):  # as a demonstration writes them (gsm8k: worked solutions)
        references = [demonstration(r, answer, plan.data.answer_format) for r in rows]
        probes = {"reference answers": references} | probes
    rules = CallRules(on_error="unscorable", timeout=plan.trainee.step.reward_timeout)
    for name, fn in zip(reward_names(data.reward_funcs), data.reward_funcs, strict=True):  # as training's
        means, seconds, unscored = {}, 0.0, 0
        for probe, completions in probes.items():
            began = time.perf_counter()
            scores = score_completions(
                [fn], prompts, completions, columns=columns_of(rows, column, repeat=1), rules=rules
            )
            seconds = max(seconds, time.perf_counter() - began)
            rewards = scores.rewards
            unscored += int(rewards.isnan().sum())
            means[probe] = float(torch.nanmean(rewards)) if not rewards.isnan().all() else float("nan")
        shown = ", ".join(f"{k} {v:.3g}" for k, v in means.items())
        level: Level = "ok"
        advice = ""
        finite = [v for v in means.values() if v == v]
        if not finite:
            level, advice = "fatal", "it scored none of the probes (None or an error each time)"
        elif max(finite) - min(finite) < 1e-9:
            level, advice = "warn", "it gives every probe the same score: GRPO learns nothing from a constant"
        elif "reference answers" in means and means["reference answers"] <= max(
            means["empty"], means["garbage"]
        ):
            level, advice = "warn", "the reference answers score no higher than empty or garbage completions"
        elif unscored:
            level, advice = "warn", f"{unscored} probe completions were unscored (None or an error)"
        report.add("rewards", name, shown, level, advice)
        per_step = seconds * plan.trainee.step.prompts_per_step * plan.trainee.sampling.num_generations / 16
        slow = per_step > SLOW_REWARD_SECONDS
        report.add(
            "rewards",
            f"{name} latency",
            f"{1000 * seconds:.1f} ms per 16 completions (~{per_step:.2f} s a step)",
            "warn" if slow else "ok",
            "slow: it will hold up every step; batch its work or serve it elsewhere" if slow else "",
        )


# ----------------------------------------------------------------------------- 4. sampling, 6. time


def _episodes_finding(report: Checkup, rollout: Any, warmed: bool) -> None:
    """Multi-turn episodes: turns and the environment's counts per episode; a tool environment whose
    policy never wrote a call (well formed or not) is flagged, since GRPO only reinforces calls it sees."""
    episodes = rollout.num_turns.numel()
    per_episode = {name: value / episodes for name, value in rollout.env_metrics.items()}
    counts = "".join(f", {value:.2f} {name}" for name, value in per_episode.items())
    silent = (
        "tool_calls" in per_episode and per_episode["tool_calls"] + per_episode.get("malformed_calls", 0) == 0
    )
    advice = (
        "the policy never wrote a tool call, so GRPO has no call to reinforce: "
        + (
            "the warm start did not teach it: more sft_steps, or demonstrations whose turns call a tool"
            if warmed
            else "warm start on worked episodes (sft_steps, a demonstration column)"
        )
        + ", or describe the tools in the prompt"
    )
    report.add(
        "sampling",
        "episodes",
        f"{float(rollout.num_turns.float().mean()):.2f} turns{counts} per episode ({episodes} episodes)",
        "warn" if silent else "ok",
        advice if silent else "",
    )


def _sampling_section(report: Checkup, plan: GRPOPlan, data: Any, engine: Any, groups: int | None) -> None:
    """K groups of the first K training rows, sampled and scored as a step draws them (draw.py's
    `sample_rollout` and `score_rollout`; a reward that raises leaves its rows unscored here)."""
    P = plan.trainee.step.prompts_per_step
    K = min(groups or min(P, 64), len(data.train_rows))
    spec = replace(plan.trainee.step, prompts_per_step=K, on_reward_error="unscorable")
    params = StepParams.of(spec, sampling_params(plan.trainee.sampling, data))
    G, d = params.sampling.num_generations, distributed.Dist(device=engine.device)
    first = PromptSampler(data.train_rows[:1], 1, shuffle=False)  # a warm-up: one-time costs
    short = replace(params.sampling, max_completion_length=2)
    sample_rollout(engine, first, StepParams.of(replace(spec, prompts_per_step=1), short), 1, d, 0)
    prompts = PromptSampler(data.train_rows[:K], K, shuffle=False)
    drawn, rollout, sampled = sample_rollout(engine, prompts, params, 1, d, 0)
    began = time.perf_counter()
    _, zero, metrics = score_rollout(rollout, drawn, data.reward_funcs, spec, G, None, 1)
    scored = time.perf_counter() - began
    report.zero_spread = float(zero.float().mean())
    report.truncated = float(rollout.truncated.float().mean())
    report.mean_length = float(rollout.completion_mask.sum(-1).float().mean())
    level: Level = "warn" if report.zero_spread > 0.5 else "ok"
    report.add(
        "sampling",
        "zero-spread groups",
        f"{100 * report.zero_spread:.0f}% of {K} groups",
        level,
        "GRPO cannot learn from these: warm start (sft_steps), raise temperature, or change the reward"
        if level == "warn"
        else "",
    )
    cut = report.truncated > 0.2
    report.add(
        "sampling",
        f"cut at max_completion_length={params.sampling.max_completion_length}",
        f"{100 * report.truncated:.0f}%",
        "warn" if cut else "ok",
        "raise max_completion_length, or mask_truncated_completions=true" if cut else "",
    )
    report.add(
        "sampling",
        "mean completion length",
        f"{report.mean_length:.1f} tokens (reward {float(metrics['reward']):.3g})",
    )
    if rollout.num_turns is not None:
        _episodes_finding(report, rollout, warmed=bool(plan.warm_start.schedule.steps))
    # time: sampling scales with the rows, the update is ~3 forwards (forward and backward) per iteration
    engine.frozen_logps(rollout, spec.micro_batch_size)  # warm-up
    began = time.perf_counter()
    engine.frozen_logps(rollout, spec.micro_batch_size)
    forward = time.perf_counter() - began
    scale = P / K
    passes = 3 * spec.num_iterations + (1 if spec.loss.beta else 0) + (1 if spec.num_iterations > 1 else 0)
    report.step_seconds = scale * (sampled + forward * passes)
    tokens = int(rollout.completion_mask.sum())
    report.add(
        "time",
        "step estimate",
        f"~{report.step_seconds:.2f} s a step ({tokens / sampled:.0f} sampled tokens/s here), "
        f"~{report.step_seconds * plan.run.max_steps / 60:.1f} min for {plan.run.max_steps} steps",
    )
    _async_finding(report, plan, scale * (sampled + scored), scale * forward * passes, engine.device)


def _async_finding(report: Checkup, plan: GRPOPlan, drawing: float, update: float, device: Any) -> None:
    """What asynchronous GRPO (max_staleness) changes, from the measured phases: sampling and scoring
    overlap the update, so a step takes about the longer of the two instead of their sum. On a CPU the
    worker takes half the threads, so each side runs slower than measured here: said, not modelled."""
    share = drawing / max(drawing + update, 1e-9)
    overlapped = max(drawing, update)
    shared = " if each kept its speed (on a CPU the two share the cores and each runs slower)" * (
        torch.device(device).type == "cpu"
    )
    k = plan.rollout.max_staleness  # (None: synchronous; the forecast says what async would change)
    if k is None:
        report.add(
            "time",
            "asynchronous",
            f"sampling and scoring are {100 * share:.0f}% of the step (~{drawing:.2f} s of "
            f"~{drawing + update:.2f} s): with max_staleness=1 a step would take about {overlapped:.2f} s"
            + shared,
        )
    elif k == 0:  # step s samples with the weights after step s − 1: nothing overlaps
        report.add(
            "time",
            "asynchronous",
            f"max_staleness=0: each batch waits for the update before it (the synchronous schedule in "
            f"another process): about {drawing + update:.2f} s a step; max_staleness=1 overlaps them",
        )
    else:  # up to min(rollout_workers, k + 1) batches sampled at once, each worker on hardware of its own
        at_once = min(plan.rollout.workers, k + 1)
        workers = f" by {at_once} workers at once" if at_once > 1 else ""
        report.add(
            "time",
            "asynchronous",
            f"max_staleness={k}: sampling and scoring (~{drawing:.2f} s{workers}) overlap the update "
            f"(~{update:.2f} s): about {max(drawing / at_once, update):.2f} s a step" + shared,
        )


# ----------------------------------------------------------------------------- 5. memory


def _memory_section(
    report: Checkup,
    plan: GRPOPlan,
    data: Any,
    shapes: Shapes,
    gpu_memory: int | None,
    device: torch.device,
    baseline: int,
) -> None:
    """The forecast peak (`models.forecast_memory`) on this device (with `baseline`, this process's
    memory before the model, on a CPU) and on a GPU of `gpu_memory` bytes, and the micro-batch that
    fits each."""
    spec = plan.trainee
    shape = shapes.policy
    step_shape = StepSizes.of(plan, data.max_completion_length).step_shape(plan, report.prompt_tokens or 1)
    teacher = shapes.teacher
    if (
        plan.teacher is not None
        and plan.teacher.device is not None
        and torch.device(plan.teacher.device) != device
    ):
        teacher = None  # teacher_device elsewhere: its weights and pass are not this device's
    # a GPU's default decode loop (CUDA graphs) keeps compute-dtype weight copies and its KV cache
    on_gpu = replace(step_shape, static_decode=spec.engine.decode_loop != "eager")
    here = on_gpu if device.type == "cuda" else step_shape
    budget, where = _device_budget(device)
    base = baseline if device.type != "cuda" else 0  # a GPU's free memory is already net of the context
    forecast = forecast_memory(shape, here, base, teacher)
    report.memory_bytes = forecast.total
    parts = ", ".join(
        f"{name} {_gib(getattr(forecast, name))}"
        for name in ("weights", "reference", "gradients", "optimizer", "activations", "kv_cache", "logits")
        + (("teacher", "teacher_states") if teacher is not None else ())
    )
    report.add("memory", "forecast parts", parts)
    targets = [(where, budget, here, base, "fatal")]
    if gpu_memory:
        targets.append((f"a GPU of {_gib(gpu_memory)}", gpu_memory, on_gpu, 0, "warn"))
    for label, limit, shape_of_step, floor, too_small in targets:
        if limit is None:
            continue
        fit = memory_fit(shape, shape_of_step, limit, floor, teacher)
        level = "ok" if fit.fits else too_small
        fitting = f"; micro_batch_size up to {fit.best} fits" if fit.best and fit.fits else ""
        report.add(
            "memory", f"peak on {label}", f"{_gib(fit.total)} of {_gib(limit)}{fitting}", level, fit.advice
        )


@dataclass(frozen=True)
class MemoryFit:
    """Whether a step's forecast peak fits a budget, the largest micro-batch that does, and what to do
    when it does not fit ("" when it does)."""

    total: int
    fits: bool
    best: int | None
    advice: str


def memory_fit(
    shape: ModelShape, step: StepShape, limit: int, floor: int, teacher: ModelShape | None
) -> MemoryFit:
    """The forecast peak of `step` against `limit` bytes; when it does not fit, the micro-batch that
    does and, with activation checkpointing off, whether switching it on would fit (at this micro-batch
    size, with the peak it would have)."""
    total = forecast_memory(shape, step, floor, teacher).total
    best = largest_micro_batch(shape, step, limit, floor, teacher)
    if total <= limit:
        return MemoryFit(total, True, best, "")
    options = [f"use micro_batch_size={best}"] if best else []
    if not step.gradient_checkpointing:
        checkpointed = forecast_memory(
            shape, replace(step, gradient_checkpointing=True), floor, teacher
        ).total
        if checkpointed <= limit:
            options.append(f"gradient_checkpointing=true (peak {_gib(checkpointed)})")
    if options:
        return MemoryFit(total, False, best, ", or ".join(options))
    advice = (
        "even micro_batch_size=1 does not fit: a smaller model, shorter completions, or more devices "
        "(strategy=fsdp)"
        + ("" if step.gradient_checkpointing else "; gradient_checkpointing=true does not fit either")
    )
    return MemoryFit(total, False, None, advice)


def _rss() -> int:
    """This process's resident memory now, in bytes (Linux; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _device_budget(device: torch.device) -> tuple[int | None, str]:
    """(bytes the run may use on `device`, its name): a GPU's free memory, or the RAM available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), torch.cuda.get_device_name(device)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable"), "this machine's RAM"
    except (OSError, ValueError, IndexError):
        return None, "this machine's RAM"
