"""Setting up a GRPO run: what it trains on (`resolve_data`), the policy engine, optimizer and step
parameters (`build_trainee`), the supervised warm start, evaluation, and checkpoints. The loop that
uses them is train/grpo.py; one step is train/grpo_step.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import GRPOConfig, to_yaml
from ..data import (
    DataError,
    PromptSampler,
    answer_checker,
    data_alphabet,
    get_task,
    has_answers,
    load_prompts,
    render_prompt,
    require_answers,
    require_demonstrations,
    sft_rows,
)
from ..engine import EngineSpec, PolicyEngine, Wrapping
from ..envs import BUILTIN_TOOLS, EnvironmentSpec, tool_environment
from ..models import Precision, enable_fast_matmul, make_reference, place
from ..rollout import SamplingParams
from . import distributed
from .checkpoint import restore_distributed, save_distributed
from .evaluation import evaluate
from .grpo_step import StepParams, Update
from .metrics import write_sft_metrics
from .optim import make_optimizer, make_scheduler
from .run import Emit, StopSignals
from .sft import SFTResult, run_sft


@dataclass(frozen=True)
class RunData:
    """What the run trains and evaluates on, resolved from the arguments or the config."""

    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_funcs: list[Callable[..., Any]]
    is_correct: Callable[[str, dict[str, Any]], bool] | None
    alphabet: str | None  # of the tiny model's character tokenizer: the task's, or the data's own
    max_prompt_length: int | None
    max_completion_length: int
    train_source: str = "the training rows"  # how errors name the data
    eval_source: str = "the held-out rows"
    environment: EnvironmentSpec | None = None  # multi-turn episodes (tools or your environment), or None


def resolve_environment(cfg: GRPOConfig, task: Any) -> EnvironmentSpec | None:
    """The episodes' environment: `environment` (your factory), else `tools` (None: the task's), else
    None (single-turn completions)."""
    from ..rewards import load_reward_reference

    if cfg.environment is not None:
        factory = load_reward_reference(
            cfg.environment,
            label=f"environment {cfg.environment!r}",
            signature="a class or function returning an object with reset(row) and step(text)",
        )
        return EnvironmentSpec(
            factory,
            max_turns=cfg.max_turns,
            stop_strings=tuple(getattr(factory, "stop_strings", ())),  # a class attribute, if any
            name=getattr(factory, "__name__", cfg.environment),
        )
    names = cfg.tools if cfg.tools is not None else list(task.tools if task is not None else ())
    if not names:
        return None
    tools = []
    for name in names:
        if name in BUILTIN_TOOLS:
            tools.append(BUILTIN_TOOLS[name])
        elif ":" not in name:
            raise ValueError(
                f"tools: {name!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}); name your own "
                "function as FILE.py:NAME or package.module:NAME"
            )
        else:
            tools.append(load_reward_reference(name, label=f"tools entry {name!r}", signature="a function"))
    fixed = task.tool_call_format if task is not None else None
    if fixed and cfg.tool_call_format not in (None, fixed):
        raise ValueError(
            f"task {task.name} writes its tool calls as {fixed} (its alphabet and answers are built for "
            f"it); leave tool_call_format unset, not {cfg.tool_call_format}"
        )
    fmt = cfg.tool_call_format or fixed or "hermes"
    return tool_environment(tools, fmt, max_turns=cfg.max_turns, timeout=cfg.tool_timeout)


def configured_rewards(
    cfg: GRPOConfig, task: Any, device: torch.device | None = None, episodic: bool = False
) -> list[Callable[..., Any]]:
    """The reward functions the config names (`reward_funcs`), or the task's reward. A reward model
    goes to its entry's `device`, else the policy's (`device`; None: the config's)."""
    from ..rewards import (
        RewardModelFunction,
        env_reward,
        exact_answer,
        format_tags,
        load_reward_reference,
        math_answer,
    )

    if cfg.reward_funcs is None:
        if task is not None:
            return [task.reward]
        return [env_reward] if episodic else []  # what the episodes' environment paid
    builtins: dict[str, Any] = {
        "env": env_reward,
        "exact_answer": exact_answer,
        "math_answer": math_answer,
        "format_tags": format_tags,
    }
    if task is not None:
        builtins["task"] = task.reward
    funcs = []
    for spec in cfg.reward_funcs:
        if "model" in spec:
            funcs.append(
                RewardModelFunction.from_path(
                    spec["model"],
                    batch_size=int(spec.get("batch_size", 64)),
                    device=spec.get("device") or device or cfg.device,
                )
            )
        elif "python" in spec:  # your own function, by reference (FILE.py:NAME or package.module:NAME)
            funcs.append(load_reward_reference(spec["python"]))
        elif spec["builtin"] in builtins:
            funcs.append(builtins[spec["builtin"]])
        else:
            raise ValueError(f"unknown builtin reward {spec['builtin']!r}; valid: {', '.join(builtins)}.")
    return funcs


def correctness_reward(is_correct: Callable[[str, dict[str, Any]], bool]) -> Callable[..., Any]:
    """1.0 for a completion `is_correct` accepts, else 0.0: the reward of an evaluation without one."""

    def correct(prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
        return [1.0 if is_correct(c, row) else 0.0 for c, row in zip(completions, rows, strict=True)]

    return correct


def _own_data(
    cfg: GRPOConfig,
    task: Any,
    train_rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    is_correct: Any,
    environment: EnvironmentSpec | None,
) -> tuple[str | None, Any]:
    """(alphabet, is_correct) for data that is not a built-in task's: the tiny model's tokenizer over
    the data's own characters, and the exact answer (after strip) when the rows have an answer column;
    in multi-turn episodes, the answer is the transcript's final answer (after the last tool response)."""
    if task is not None:
        return task.alphabet, is_correct
    if is_correct is None and has_answers(eval_rows or train_rows, cfg.answer_column):
        is_correct = answer_checker(cfg.answer_column)
        if environment is not None:
            exact, final = is_correct, environment.final_answer
            is_correct = lambda completion, row: exact(final(completion), row)  # noqa: E731
    alphabet = None
    if cfg.model == "tiny":
        alphabet = data_alphabet(
            train_rows,
            eval_rows,
            prompt_column=cfg.prompt_column,
            answer_column=cfg.answer_column,
            extra="".join(environment.markers) if environment is not None else "",
        )
    return alphabet, is_correct


def resolve_data(
    cfg: GRPOConfig,
    train_rows: Any,
    eval_rows: Any,
    reward_funcs: Any,
    is_correct: Any,
    *,
    require_rewards: bool = True,
    device: torch.device | None = None,
    environment: EnvironmentSpec | None = None,
) -> RunData:
    """What the run trains on: the arguments where given, else the config's task or dataset.
    `environment` (Python API) replaces what the config's tools / environment would make."""
    task = get_task(cfg.task, seed=cfg.seed, num_eval=cfg.num_eval_prompts) if cfg.task else None
    train_source, eval_source = "the training rows", "the held-out rows"
    if train_rows is None:
        if task is None and cfg.dataset is None:
            raise ValueError("nothing to train on: set task or dataset in the config, or pass train rows.")
        train_rows = task.train if task else load_prompts(cfg.dataset, prompt_column=cfg.prompt_column)
        train_source = f"task {cfg.task!r}" if task else str(cfg.dataset)
    if eval_rows is None:
        eval_rows = task.eval if task else []
        eval_source = f"task {cfg.task!r} (held out)" if task else eval_source
        if task is None and cfg.eval_dataset:
            eval_rows = load_prompts(cfg.eval_dataset, prompt_column=cfg.prompt_column)
            eval_source = str(cfg.eval_dataset)
    train_rows, eval_rows = list(train_rows), list(eval_rows)[: cfg.num_eval_prompts]
    environment = environment or resolve_environment(cfg, task)
    if cfg.sft_steps and environment is not None:
        require_demonstrations(train_rows[: cfg.sft_examples], train_source)  # say it now, not after loading
    elif cfg.sft_steps:  # the warm start learns the answers: say so now, not after loading a model
        require_answers(
            train_rows[: cfg.sft_examples],
            cfg.answer_column,
            source=train_source,
            purpose=f"the supervised warm start (sft_steps={cfg.sft_steps})",
        )
    alphabet, is_correct = _own_data(cfg, task, train_rows, eval_rows, is_correct, environment)
    funcs = list(reward_funcs or configured_rewards(cfg, task, device, episodic=environment is not None))
    if not funcs and not require_rewards and is_correct is not None:
        funcs = [correctness_reward(is_correct)]  # evaluation alone: 1.0 for a right answer, else 0.0
    if not funcs:
        raise ValueError("no reward functions: pass reward_funcs, or use a built-in task.")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(cfg.reward_weights)} weights for {len(funcs)} reward functions."
        )
    return RunData(
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_funcs=funcs,
        is_correct=is_correct or (task.is_correct if task else None),
        alphabet=alphabet,
        max_prompt_length=cfg.max_prompt_length or (task.max_prompt_length if task else None),
        max_completion_length=cfg.max_completion_length or _task_completion_length(task, environment),
        train_source=train_source,
        eval_source=eval_source,
        environment=environment,
    )


def check_step_prompts(cfg: GRPOConfig, data: RunData) -> None:
    """Training only, before any work: a step draws `prompts_per_step` prompts from the shuffled rows,
    continuing into the next epoch when the rows run out, so with fewer rows than that one step would
    hold the same prompt twice (two groups of one prompt, that prompt weighed double). Refused, with
    the fix."""
    rows, wanted = len(data.train_rows), cfg.prompts_per_step
    if rows < wanted:
        raise DataError(
            f"{data.train_source} has {rows} training row{'s' * (rows != 1)} but prompts_per_step={wanted}: "
            "a step would draw the same prompt more than once. Lower prompts_per_step to at most "
            f"{rows} (prompts_per_step·num_generations must stay divisible by micro_batch_size), "
            "or add rows."
        )


def _task_completion_length(task: Any, environment: EnvironmentSpec | None) -> int:
    if task is None:
        return 256
    if environment is None and task.max_completion_length_without_tools:
        return task.max_completion_length_without_tools  # a tool task with its tools switched off
    return task.max_completion_length


def check_context(cfg: GRPOConfig, model: Any, tokenizer: Any, data: RunData) -> None:
    """Prompt + completion must fit the model's context; say which numbers to change if not."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is None:
        return
    tools = data.environment.tool_schemas if data.environment is not None else None
    rendered = (render_prompt(r[cfg.prompt_column], tokenizer, tools) for r in data.train_rows[:2000])
    longest = data.max_prompt_length or max(
        (len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered), default=0
    )
    if longest + data.max_completion_length > context:
        raise ValueError(
            f"prompts of up to {longest} tokens plus max_completion_length={data.max_completion_length} "
            "exceed "
            f"the model's context of {context} tokens; lower max_prompt_length or max_completion_length."
        )


def sampling_params(cfg: GRPOConfig, data: RunData) -> SamplingParams:
    """How completions are drawn during training (the per-step seed is set by the step)."""
    return SamplingParams(
        num_generations=cfg.num_generations,
        max_completion_length=data.max_completion_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
        max_prompt_length=data.max_prompt_length,
        prompt_truncation=cfg.prompt_truncation,
    )


def engine_spec(cfg: GRPOConfig, device: torch.device) -> EngineSpec:
    return EngineSpec(
        device=device,
        precision=precision_of(cfg),
        decode_loop=cfg.decode_loop,
        fused_logps=cfg.fused_logps,
        temperature=cfg.temperature,  # > 0: the config refuses greedy training
        group_size=cfg.num_generations,
    )


def precision_of(cfg: GRPOConfig) -> Precision:
    return Precision.of(cfg.dtype, cfg.master_weights)


def place_policy(cfg: GRPOConfig, model: Any, d: distributed.Dist) -> Any:
    """The policy on this rank's device, its weights in the master dtype (TF32 on for a GPU)."""
    enable_fast_matmul(d.device)
    return place(model, d.device, precision_of(cfg))


@dataclass(frozen=True)
class Trainee:
    """What the loop trains with: the policy engine, what updates it, the step's parameters and the
    training prompts in order."""

    engine: PolicyEngine
    update: Update
    params: StepParams
    prompts: PromptSampler


def build_trainee(
    cfg: GRPOConfig, model: Any, tokenizer: Any, data: RunData, d: distributed.Dist | None = None
) -> Trainee:
    """The reference copy (beta ≠ 0), DDP/FSDP wrapping, the engine, AdamW and its schedule.
    `model` is already placed (`place_policy`)."""
    d = d or distributed.Dist()
    precision = precision_of(cfg)
    reference = make_reference(model, cfg.beta)  # a plain copy, before any wrapping
    wrapped = distributed.wrap(
        d, model, cfg.strategy, cpu_offload=cfg.fsdp_cpu_offload, compute_dtype=precision.compute
    )
    sharded = d.enabled and cfg.strategy == "fsdp"
    if reference is not None and sharded:
        reference = distributed.wrap(
            d,
            reference,
            "fsdp",
            cpu_offload=cfg.fsdp_cpu_offload,
            trainable=False,
            compute_dtype=precision.compute,
        )
    # DDP wraps, FSDP2 shards in place: either way the whole forward runs. FSDP runs every rank's
    # forward passes in lockstep: the decode loop's early exit is collective
    lockstep = (lambda done: not distributed.any_rank(d, not done)) if sharded else None
    engine = PolicyEngine.create(
        distributed.unwrap(wrapped),
        tokenizer,
        engine_spec(cfg, d.device),
        reference=reference,
        wrapping=Wrapping(wrapped, lockstep) if d.enabled else None,
        environment=data.environment,
    )
    optimizer = make_optimizer(wrapped.parameters(), cfg)
    return Trainee(
        engine=engine,
        update=Update(optimizer, make_scheduler(optimizer, cfg, cfg.max_steps * cfg.num_iterations)),
        params=StepParams.of(cfg, sampling_params(cfg, data), d.world_size),
        prompts=PromptSampler(data.train_rows, cfg.prompts_per_step, seed=cfg.seed),
    )


SFT_PROBE_ROWS, SFT_PROBE_EVERY = 256, 10


def warm_start_goal(
    cfg: GRPOConfig,
    model: Any,
    tokenizer: Any,
    data: RunData,
    probed: list[float],
    precision: Precision | None = None,
) -> Callable[[int], bool] | None:
    """With sft_target_accuracy: every SFT_PROBE_EVERY steps, greedy accuracy on the first
    SFT_PROBE_ROWS training prompts (never held-out ones), appended to `probed`; True once it reaches
    the target. Stopping at a measured accuracy, not a step count, makes GRPO start from the same
    place whatever the seed or the CPU's float round-off (a warm start's accuracy climbs steeply, so
    where a fixed step count lands is not reproducible across machines)."""
    if cfg.sft_target_accuracy is None:
        return None
    if data.is_correct is None:
        raise ValueError(
            "sft_target_accuracy needs an exact accuracy to measure: use a built-in task, or rows with an "
            "answer column; or unset sft_target_accuracy to run sft_steps."
        )
    sampler = model
    probe = data.train_rows[:SFT_PROBE_ROWS]

    def done(step: int) -> bool:
        if step % SFT_PROBE_EVERY:
            return False
        metrics = evaluate(
            sampler,
            tokenizer,
            probe,
            reward_funcs=[correctness_reward(data.is_correct)],  # accuracy is all it needs
            is_correct=data.is_correct,
            prompt_column=cfg.prompt_column,
            max_prompt_length=data.max_prompt_length,
            max_completion_length=data.max_completion_length,
            batch_size=cfg.micro_batch_size,
            precision=precision,
            environment=data.environment,
        )
        model.train()
        probed.append(metrics["accuracy"])
        return metrics["accuracy"] >= cfg.sft_target_accuracy

    return done


def warm_start(
    cfg: GRPOConfig,
    model: Any,
    tokenizer: Any,
    data: RunData,
    d: distributed.Dist,
    stop: StopSignals,
    emit: Emit,
    threads: Any = None,
) -> SFTResult:
    """The supervised warm start (sft_steps), identical on every rank; its losses go to
    sft_metrics.jsonl, and with sft_target_accuracy it ends once a probe of training prompts is solved."""
    emit("sft_start", 0, {})
    probed: list[float] = []
    precision = precision_of(cfg)
    goal = warm_start_goal(cfg, model, tokenizer, data, probed, precision)

    def sft_step(step: int, loss: float) -> None:
        emit("sft_step", step, {"loss": loss})
        note = threads.tick() if threads is not None else None  # fewer CPU threads under load
        if note:
            emit("warning", step, {"message": note})

    warm = run_sft(
        model,
        tokenizer,
        sft_rows(
            data.train_rows[: cfg.sft_examples],
            tokenizer,
            cfg.prompt_column,
            cfg.answer_column,
            demonstrations=data.environment is not None,  # whole episodes, the policy's turns learned
            tools=data.environment.tool_schemas if data.environment is not None else None,
        ),
        steps=cfg.sft_steps,
        batch_size=cfg.sft_batch_size,
        learning_rate=cfg.sft_learning_rate,
        warmup_steps=cfg.sft_warmup_steps,
        seed=cfg.seed,
        on_step=lambda s, loss: sft_step(s, loss),
        should_stop=lambda: distributed.any_rank(d, stop.signal is not None),
        done=None if goal is None else lambda s: distributed.any_rank(d, goal(s)),  # ranks agree
        precision=precision,
    )
    if d.is_main:
        write_sft_metrics(Path(cfg.output_dir), warm.losses)
    if probed:
        emit("sft_done", len(warm.losses), {"probe_accuracy": probed[-1], "reached": warm.reached})
    return warm


def held_out_metrics(
    cfg: GRPOConfig,
    model_or_sampler: Any,
    tokenizer: Any,
    data: RunData,
    precision: Precision,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Greedy accuracy and reward on the held-out rows (and pass@k), `micro_batch_size` rows a pass:
    what a run reports as eval/ and the `eval` command prints. Reward functions run as in training:
    within `reward_timeout`, and a `should_stop` that turns True abandons the evaluation
    (`rewards.scoring.ScoringStopped`)."""
    return evaluate(
        model_or_sampler,
        tokenizer,
        data.eval_rows,
        reward_funcs=data.reward_funcs,
        is_correct=data.is_correct,
        prompt_column=cfg.prompt_column,
        max_prompt_length=data.max_prompt_length,
        max_completion_length=data.max_completion_length,
        pass_at_k=cfg.pass_at_k,
        temperature=cfg.temperature,
        seed=cfg.seed,
        on_reward_error=cfg.on_reward_error,
        reward_timeout=cfg.reward_timeout,
        should_stop=should_stop,
        batch_size=cfg.micro_batch_size,  # rows per forward pass, as in training
        precision=precision,
        environment=data.environment,
    )


def evaluator(
    cfg: GRPOConfig, trainee: Trainee, data: RunData, should_stop: Callable[[], bool] | None = None
) -> Callable[[], dict[str, float]]:
    """`held_out_metrics` with the training sampler ({} without held-out rows)."""
    engine = trainee.engine

    def run() -> dict[str, float]:
        if not data.eval_rows:
            return {}
        return held_out_metrics(cfg, engine, engine.tokenizer, data, engine.precision, should_stop)

    return run


def save(
    cfg: GRPOConfig, trainee: Trainee, d: distributed.Dist, step: int, eval_before: dict[str, float]
) -> None:
    """checkpoint-<step>: weights, optimizer, schedule, data position, RNG (and a synced reference)."""
    engine = trainee.engine
    extra = {}
    if engine.reference is not None and cfg.sync_ref_model:
        extra["reference"] = distributed.full_state_dict(d, engine.reference)
    save_distributed(
        d,
        cfg.strategy,
        Path(cfg.output_dir),
        step,
        engine.train_module,
        engine.tokenizer,
        trainee.update.optimizer,
        trainee.update.scheduler,
        trainee.prompts,
        eval_before,
        to_yaml(cfg),
        cfg.save_total_limit,
        extra,
    )


def restore(
    cfg: GRPOConfig, trainee: Trainee, d: distributed.Dist, checkpoint: Path
) -> tuple[int, dict[str, float]]:
    """Weights, optimizer, schedule, data position and RNG from `checkpoint`: (step, eval_before)."""
    engine = trainee.engine
    state = restore_distributed(
        d,
        cfg.strategy,
        checkpoint,
        engine.train_module,
        trainee.update.optimizer,
        trainee.update.scheduler,
        trainee.prompts,
    )
    if engine.reference is not None and "reference" in state:
        distributed.unwrap(engine.reference).load_state_dict(state["reference"])
    return int(state["step"]), {k: float(v) for k, v in state["eval_before"].items()}
