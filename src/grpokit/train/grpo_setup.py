"""Setting up a GRPO run: what it trains on (`resolve_data`), the policy engine, optimizer and step
parameters (`build_trainee`), the supervised warm start, evaluation, and checkpoints. The loop that
uses them is train/grpo.py; one step is train/grpo_step.py. Each function takes the parts of the
run's plan (`config.plan`) it reads, never the whole config."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config.plan import (
    DataSpec,
    EpisodeSpec,
    Evaluation,
    GRPOPlan,
    ModelSpec,
    RewardSpec,
    StepSpec,
    TeacherSpec,
    TraineeSpec,
    WarmStart,
)
from ..data import (
    ANSWER_FORMATS,
    CurriculumRule,
    DataError,
    PromptSampler,
    answer_checker,
    data_alphabet,
    dataset_splits,
    get_task,
    has_answers,
    is_dataset_name,
    load_prompts,
    render_prompt,
    require_answers,
    require_demonstrations,
    sft_rows,
    with_system_prompt,
)
from ..engine import EngineSpec, PolicyEngine, Wrapping
from ..envs import BUILTIN_TOOLS, EnvironmentSpec, tool_environment
from ..models import (
    ModelShape,
    Precision,
    embedding_refusal,
    enable_fast_matmul,
    load_model_config,
    load_tokenizer,
    make_reference,
    place,
)
from ..rollout import SamplingParams
from . import distributed
from .checkpoint import (
    CheckpointError,
    SaveTo,
    TrainingParts,
    restore_distributed,
    save_distributed,
    state_error,
)
from .evaluation import EvalTask, evaluate
from .events import EventKind
from .in_flight import InFlightBounds
from .metrics import write_sft_metrics
from .optim import make_optimizer, make_scheduler
from .run import Emit, StopSignals, policy_and_tokenizer
from .sft import SFTHooks, SFTResult, run_sft
from .trainee import EntropyControl, StepParams, Trainee, Update


@dataclass(frozen=True)
class UserInputs:
    """What a caller of the Python API passed in place of what the config would make (None: the
    config's): the policy and its tokenizer, rows, reward functions, the exact-answer check and
    the episodes' environment (an `envs.EnvironmentSpec`)."""

    model: Any = None
    tokenizer: Any = None
    train_rows: Sequence[dict[str, Any]] | None = None
    eval_rows: Sequence[dict[str, Any]] | None = None
    reward_funcs: Sequence[Callable[..., Any]] | None = None
    is_correct: Callable[[str, dict[str, Any]], bool] | None = None
    environment: EnvironmentSpec | None = None


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
    chat_template_kwargs: dict[str, Any] | None = None  # what the chat template is rendered with
    reward_weights: tuple[float, ...] | None = None  # of reward_funcs (None: 1 each), as in training


def resolve_environment(spec: EpisodeSpec, task: Any) -> EnvironmentSpec | None:
    """The episodes' environment: `environment` (your factory), else `tools` (None: the task's), else
    None (single-turn completions)."""
    from ..rewards import load_reward_reference

    if spec.environment is not None:
        factory = load_reward_reference(
            spec.environment,
            label=f"environment {spec.environment!r}",
            signature="a class or function returning an object with reset(row) and step(text)",
        )
        return EnvironmentSpec(
            factory,
            max_turns=spec.max_turns,
            stop_strings=tuple(getattr(factory, "stop_strings", ())),  # a class attribute, if any
            name=getattr(factory, "__name__", spec.environment),
            observation_role=getattr(factory, "observation_role", "user"),  # None: plain-text observations
        )
    names = spec.tools if spec.tools is not None else list(task.tools if task is not None else ())
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
    if fixed and spec.tool_call_format not in (None, fixed):
        raise ValueError(
            f"task {task.name} writes its tool calls as {fixed} (its alphabet and answers are built for "
            f"it); leave tool_call_format unset, not {spec.tool_call_format}"
        )
    fmt = spec.tool_call_format or fixed or "hermes"
    return tool_environment(tools, fmt, max_turns=spec.max_turns, timeout=spec.tool_timeout)


def configured_rewards(
    spec: RewardSpec, task: Any, device: torch.device | None = None, episodic: bool = False
) -> list[Callable[..., Any]]:
    """The reward functions the config names (`reward_funcs`), or the task's reward. A reward model
    goes to its entry's `device`, else the policy's (`device`; None: the config's)."""
    from ..rewards import RemoteReward, RewardModelFunction, env_reward, load_reward_reference, named_reward

    if spec.funcs is None:
        if task is not None:
            return [task.reward]
        return [env_reward] if episodic else []  # what the episodes' environment paid
    funcs = []
    for entry in spec.funcs:
        if "model" in entry:
            funcs.append(
                RewardModelFunction.from_path(
                    entry["model"],
                    batch_size=int(entry.get("batch_size", 64)),
                    device=entry.get("device") or device or spec.device,
                    revision=entry.get("revision"),
                )
            )
        elif "python" in entry:  # your own function, by reference (FILE.py:NAME or package.module:NAME)
            funcs.append(load_reward_reference(entry["python"]))
        elif "url" in entry:  # a reward server; the entry's other keys are RemoteReward's (config-checked)
            funcs.append(RemoteReward(**entry))
        else:  # a built-in reward's name ("task": the task's own)
            task_reward = task.reward if task is not None else None
            funcs.append(named_reward(entry["builtin"], task_reward, spec.max_completion_length))
    return funcs


def correctness_reward(is_correct: Callable[[str, dict[str, Any]], bool]) -> Callable[..., Any]:
    """1.0 for a completion `is_correct` accepts, else 0.0: the reward of an evaluation without one."""

    def correct(prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        rows = [
            {k: v[i] for k, v in columns.items() if isinstance(v, list)} for i in range(len(completions))
        ]  # (TRL's trainer_state, log_metric: no column)
        return [1.0 if is_correct(c, row) else 0.0 for c, row in zip(completions, rows, strict=True)]

    correct.takes_text = True  # type: ignore[attr-defined]  # is_correct reads text, also with conversations
    return correct


def _own_data(
    spec: DataSpec,
    task: Any,
    train_rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    is_correct: Any,
    environment: EnvironmentSpec | None,
) -> tuple[str | None, Any]:
    """(alphabet, is_correct) for data that is not a built-in task's: the tiny model's tokenizer over
    the data's own characters, and, when the rows have an answer column, correctness as the answer
    format judges it (`answer_judge`; raw: the exact answer, after strip); in multi-turn episodes,
    the answer is the transcript's final answer (after the last tool response)."""
    if task is not None:
        return task.alphabet, is_correct
    if is_correct is None and has_answers(eval_rows or train_rows, spec.answer_column):
        is_correct = answer_checker(spec.answer_column, answer_judge(spec.answer_format))
        if environment is not None:
            exact, final = is_correct, environment.final_answer
            is_correct = lambda completion, row: exact(final(completion), row)  # noqa: E731
    alphabet = None
    if spec.tiny_model:
        alphabet = data_alphabet(
            train_rows,
            eval_rows,
            prompt_column=spec.prompt_column,
            answer_column=spec.answer_column,
            extra="".join(environment.markers) if environment is not None else "",
        )
    return alphabet, is_correct


def answer_judge(answer_format: str) -> Callable[[str, Any], bool] | None:
    """Whether a completion gives a (bare) answer under `answer_format`: its built-in reward pays 1.0
    (gsm8k: the number after the completion's last '####'), so that accuracy counts what the reward
    pays; None: the exact answer."""
    from ..rewards import BUILTIN_REWARDS

    name = ANSWER_FORMATS[answer_format].judge
    if name is None:
        return None
    reward = BUILTIN_REWARDS[name]
    return lambda completion, answer: reward([""], [completion], answer=[answer])[0] == 1.0


def _dataset_rows(spec: DataSpec, source: str, split: str) -> tuple[list[dict[str, Any]], str]:
    """(rows, how errors name them) of `split` of a dataset (a file has no splits: all its rows)."""
    rows = load_prompts(
        source,
        prompt_column=spec.prompt_column,
        split=split,
        dataset_config=spec.dataset_config,
        answer_column=spec.answer_column,
        answer_format=spec.answer_format,
    )
    return rows, f"{source} (split {split})" if is_dataset_name(source) else str(source)


def _held_out_rows(spec: DataSpec) -> tuple[list[dict[str, Any]], str | None]:
    """The held-out rows of the config's own data: eval_dataset's (its dataset_test_split, if a hub
    dataset or directory), else `dataset`'s dataset_test_split when it has one (the default 'test'
    may be absent: no held-out rows; a split named otherwise must exist), else none."""
    if spec.eval_dataset:
        return _dataset_rows(spec, spec.eval_dataset, spec.dataset_test_split)
    if spec.dataset is None or not is_dataset_name(spec.dataset):
        return [], None
    split = spec.dataset_test_split  # the default ("test") may be absent: then no held-out rows
    optional = split == DataSpec.dataset_test_split
    if optional and split not in dataset_splits(spec.dataset, spec.dataset_config):
        return [], None
    return _dataset_rows(spec, spec.dataset, spec.dataset_test_split)


def _rows(spec: DataSpec, task: Any, given: UserInputs, evaluate_only: bool) -> tuple[Any, str, Any, str]:
    """(training rows, how errors name them, held-out rows, their name) for `resolve_data`."""
    train_source, eval_source = "the training rows", "the held-out rows"
    train_rows, eval_rows = given.train_rows, given.eval_rows
    if task is None and evaluate_only and train_rows is None:
        if spec.dataset is None and not spec.eval_dataset:
            raise ValueError("nothing to evaluate on: set task, or eval_dataset (or dataset).")
        train_rows, (eval_rows, held_out) = [], _held_out_rows(spec)
        if held_out is None:  # no held-out rows: the dataset's training split is evaluated on
            eval_rows, held_out = _dataset_rows(spec, str(spec.dataset), spec.dataset_train_split)
        eval_source = held_out
    if train_rows is None:
        if task is None and spec.dataset is None:
            raise ValueError("nothing to train on: set task or dataset in the config, or pass train rows.")
        if task is not None:
            train_rows, train_source = task.train, f"task {spec.task!r}"
        else:
            train_rows, train_source = _dataset_rows(spec, spec.dataset, spec.dataset_train_split)
    if eval_rows is None and task is not None:
        eval_rows, eval_source = task.eval, f"task {spec.task!r} (held out)"
    elif eval_rows is None:
        eval_rows, held_out = _held_out_rows(spec)
        eval_source = held_out or eval_source
    return train_rows, train_source, eval_rows, eval_source


def _conversational(rows: list[dict[str, Any]], prompt_column: str) -> bool:
    """Whether the prompts are conversations (message lists), which go through the chat template."""
    return bool(rows) and isinstance(rows[0].get(prompt_column), list)


def resolve_data(
    spec: DataSpec,
    episodes: EpisodeSpec,
    rewards: RewardSpec,
    given: UserInputs = UserInputs(),
    *,
    require_rewards: bool = True,
    evaluate_only: bool = False,
    device: torch.device | None = None,
) -> RunData:
    """What the run trains on: what the caller `given` where given, else the config's task or
    dataset. `given.environment` (Python API) replaces what the config's tools / environment make.
    Training, `grpokit sft` and `grpokit eval` all resolve their data here; `evaluate_only` (eval):
    no training rows from a dataset, whose held-out rows are `_held_out_rows`, else its training split."""
    task = get_task(spec.task, seed=spec.seed, num_eval=spec.num_eval_prompts) if spec.task else None
    train_rows, train_source, eval_rows, eval_source = _rows(spec, task, given, evaluate_only)
    train_rows, eval_rows = list(train_rows), list(eval_rows)[: spec.num_eval_prompts]
    if spec.system_prompt:  # every prompt opened by it, as a conversation (through the chat template)
        train_rows = with_system_prompt(train_rows, spec.prompt_column, spec.system_prompt)
        eval_rows = with_system_prompt(eval_rows, spec.prompt_column, spec.system_prompt)
    environment = given.environment or resolve_environment(episodes, task)
    if environment is not None and _conversational(train_rows or eval_rows, spec.prompt_column):
        environment = environment.for_chat(spec.chat_template_kwargs)  # turns through the chat template
    learned = train_rows[: spec.sft_examples]
    if spec.answers_for is not None and environment is not None:
        require_demonstrations(learned, train_source)  # say it now, not after loading
    elif spec.answers_for is not None:  # a warm start learns the answers: say so now, not after loading
        require_answers(
            learned,
            spec.answer_column,
            source=train_source,
            purpose=spec.answers_for,
            otherwise=spec.answers_otherwise,
        )
    alphabet, is_correct = _own_data(spec, task, train_rows, eval_rows, given.is_correct, environment)
    episodic = environment is not None
    funcs = list(given.reward_funcs or configured_rewards(rewards, task, device, episodic=episodic))
    if not funcs and not require_rewards and is_correct is not None:
        funcs = [correctness_reward(is_correct)]  # evaluation alone: 1.0 for a right answer, else 0.0
    if not funcs:
        raise ValueError("no reward functions: pass reward_funcs, or use a built-in task.")
    from ..rewards import answers_from, renamed_rewards

    funcs = [answers_from(fn, spec.answer_column) for fn in funcs]  # built-ins read answer_column
    if rewards.weights is not None and len(rewards.weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(rewards.weights)} weights for {len(funcs)} reward functions."
        )
    renamed = renamed_rewards(funcs)  # two of one name: the later ones' metrics get a suffix (said once)
    if renamed is not None:
        logging.getLogger("grpokit").warning(renamed)
    return RunData(
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_funcs=funcs,
        is_correct=is_correct or (task.is_correct if task else None),
        alphabet=alphabet,
        max_prompt_length=spec.max_prompt_length or (task.max_prompt_length if task else None),
        max_completion_length=spec.max_completion_length or _task_completion_length(task, environment),
        train_source=train_source,
        eval_source=eval_source,
        environment=environment,
        chat_template_kwargs=spec.chat_template_kwargs,
        reward_weights=None if rewards.weights is None else tuple(rewards.weights),
    )


def check_step_prompts(prompts_per_step: int, data: RunData) -> None:
    """Training only, before any work: a step draws `prompts_per_step` prompts from the shuffled rows,
    continuing into the next epoch when the rows run out, so with fewer rows than that one step would
    hold the same prompt twice (two groups of one prompt, that prompt weighed double). Refused, with
    the fix."""
    rows, wanted = len(data.train_rows), prompts_per_step
    if rows < wanted:
        raise DataError(
            f"{data.train_source} has {rows} training row{'s' * (rows != 1)} but prompts_per_step={wanted}: "
            "a step would draw the same prompt more than once. Lower prompts_per_step to at most "
            f"{rows} (prompts_per_step·num_generations must stay divisible by micro_batch_size), "
            "or add rows."
        )


def check_gkd_answers(step: StepSpec, data: RunData) -> None:
    """loss_type=gkd with lmbda < 1 learns some steps from the dataset's answers: every training row
    needs one (answer_column). Refused before any work, naming the column and the fix."""
    # (seq_kd: the teacher writes the demonstrations)
    if not step.loss.variant.demonstrations or step.lmbda >= 1.0 or step.seq_kd:
        return
    column = step.answer_column
    missing = [i for i, row in enumerate(data.train_rows) if row.get(column) is None]
    if missing:
        have = ", ".join(sorted(data.train_rows[missing[0]])) or "none"
        raise DataError(
            f"loss_type=gkd with lmbda={step.lmbda:g} learns {1 - step.lmbda:.0%} of its steps from the "
            f"dataset's answers, but {data.train_source} row {missing[0]} has no {column!r} column "
            f"({len(missing)} rows lack it; its columns: {have}). Set answer_column to the column that "
            "holds the answers, seq_kd=true to learn from the teacher's samples instead, or lmbda=1 to learn "
            "from the student's samples only."
        )


def check_same_vocabulary(policy: torch.nn.Module, teacher: PolicyEngine, teacher_name: str) -> None:
    """loss_type=gkd compares whole next-token distributions: the two heads must have one row per token
    of the same vocabulary (tokenizers equal is checked on loading; heads may still be padded apart,
    as Qwen2.5's 0.5B–3B and 7B are), and the teacher's must be a plain linear head over its hidden
    states, so that its pass keeps [B, T, H] states and never [B, T, V] logits."""
    if not teacher.fused:
        raise ValueError(
            f"teacher_model={teacher_name!r} gives loss_type=gkd no hidden states and plain LM head to form "
            "its logits from in chunks (fused_logps=false, or a head that rescales its logits), so its pass "
            "would hold every position's whole distribution; use loss_type=opd, or fused_logps=true"
        )
    ours = policy.get_output_embeddings().weight.shape[0]
    theirs = teacher.module.get_output_embeddings().weight.shape[0]
    if ours != theirs:
        raise ValueError(
            f"teacher_model={teacher_name!r} scores {theirs} tokens and the policy {ours}: loss_type=gkd "
            "compares the two models' whole next-token distributions, so their output layers must be the "
            "same size; use loss_type=opd (it compares the written tokens only) or a teacher of that size"
        )


def _task_completion_length(task: Any, environment: EnvironmentSpec | None) -> int:
    if task is None:
        return 256
    if environment is None and task.max_completion_length_without_tools:
        return task.max_completion_length_without_tools  # a tool task with its tools switched off
    return task.max_completion_length


def check_context(prompt_column: str, model: Any, tokenizer: Any, data: RunData) -> None:
    """Prompt + completion must fit the model's context; say which numbers to change if not."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is None:
        return
    tools = data.environment.tool_schemas if data.environment is not None else None
    kwargs = data.chat_template_kwargs
    rendered = (render_prompt(r[prompt_column], tokenizer, tools, kwargs) for r in data.train_rows[:2000])
    longest = data.max_prompt_length or max(
        (len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered), default=0
    )
    completion = data.max_completion_length
    if longest + completion > context:
        limit = " (max_prompt_length)" if data.max_prompt_length else ""
        raise ValueError(
            f"prompts of up to {longest} tokens{limit} plus max_completion_length={completion} make "
            f"{longest + completion} tokens, more than the model's context of {context} "
            f"(max_position_embeddings); set {fitting_lengths(context, longest, completion)}."
        )


def fitting_lengths(context: int, prompt: int, completion: int) -> str:
    """The settings that make prompts of `prompt` tokens and completions fit `context` tokens: a shorter
    completion when that leaves one, else prompts cut to what the completion leaves, else both halved."""
    if prompt < context:
        return f"max_completion_length={context - prompt} (or lower max_prompt_length)"
    if completion < context:
        return f"max_prompt_length={context - completion} (prompts cut from the left)"
    return f"max_prompt_length={context // 2} and max_completion_length={context - context // 2}"


def tiny_context(prompt_column: str, data: RunData) -> int:
    """The context the tiny model is built with. It is built here, so it is made to fit: four times
    the prompt (64 when unlimited) and completion lengths, and at least the longest training or
    held-out prompt (its tokenizer has one token per character) plus a completion."""
    rows = [*data.train_rows, *data.eval_rows]
    chars = max((len(str(row.get(prompt_column, ""))) for row in rows), default=0)
    longest = data.max_prompt_length or chars
    completion = data.max_completion_length
    return max(4 * ((data.max_prompt_length or 64) + completion), longest + completion)


def sampling_params(sampling: SamplingParams, data: RunData) -> SamplingParams:
    """The plan's sampling with the data's lengths: how completions are drawn during training (the
    per-step seed is set by the step)."""
    return replace(
        sampling, max_completion_length=data.max_completion_length, max_prompt_length=data.max_prompt_length
    )


def precision_of(spec: ModelSpec | EngineSpec) -> Precision:
    return Precision.of(spec.dtype, spec.master_weights)


def place_policy(precision: Precision, model: Any, d: distributed.Dist) -> Any:
    """The policy on this rank's device, its weights in the master dtype (TF32 on for a GPU)."""
    enable_fast_matmul(d.device)
    return place(model, d.device, precision)


def probe_engine(
    settings: EngineSpec, model: Any, tokenizer: Any, data: RunData, device: torch.device
) -> PolicyEngine:
    """An engine over `model` that only generates, configured as training's (the warm-start probe,
    `grpokit eval`): no reference, not wrapped."""
    return PolicyEngine.create(model, tokenizer, settings, device=device, environment=data.environment)


def curriculum_rule(step: StepSpec) -> CurriculumRule | None:
    """The prompt sampler's curriculum (data/curriculum.py), when the config turns it on."""
    return CurriculumRule(step.curriculum_patience, step.curriculum_revisit) if step.curriculum else None


def build_trainee(
    spec: TraineeSpec, model: Any, tokenizer: Any, data: RunData, d: distributed.Dist | None = None
) -> Trainee:
    """The reference copy (beta ≠ 0), DDP/FSDP wrapping, the engine, AdamW and its schedule.
    `model` is already placed (`place_policy`)."""
    d = d or distributed.Dist()
    placement = spec.placement
    precision = precision_of(spec.engine)
    reference = make_reference(model, spec.step.loss.beta)  # a plain copy, before any wrapping
    wrapped = distributed.wrap(
        d, model, placement.strategy, cpu_offload=placement.fsdp_cpu_offload, compute_dtype=precision.compute
    )
    sharded = d.enabled and placement.strategy == "fsdp"
    if reference is not None and sharded:
        reference = distributed.wrap(
            d,
            reference,
            "fsdp",
            cpu_offload=placement.fsdp_cpu_offload,
            trainable=False,
            compute_dtype=precision.compute,
        )
    # DDP wraps, FSDP2 shards in place: either way the whole forward runs. FSDP runs every rank's
    # forward passes in lockstep: the decode loop's early exit is collective
    lockstep = (lambda done: not distributed.any_rank(d, not done)) if sharded else None
    engine = PolicyEngine.create(
        distributed.unwrap(wrapped),
        tokenizer,
        spec.engine,
        device=d.device,
        reference=reference,
        wrapping=Wrapping(wrapped, lockstep) if d.enabled else None,
        environment=data.environment,
    )
    optimizer = make_optimizer(wrapped.parameters(), spec.optimizer)
    return Trainee(
        engine=engine,
        update=Update(optimizer, make_scheduler(optimizer, spec.optimizer)),
        params=StepParams.of(spec.step, sampling_params(spec.sampling, data), d.world_size),
        prompts=PromptSampler(
            data.train_rows,
            spec.step.prompts_per_step,
            seed=spec.step.seed,
            curriculum=curriculum_rule(spec.step),
            shuffle=spec.step.shuffle_dataset,
        ),
        entropy=None if spec.step.entropy is None else EntropyControl(spec.step.entropy),
    )


def teacher_tokenizer_refusal(name: str, tokenizer: Any, teacher_tokenizer: Any) -> str | None:
    """Why teacher `name` cannot teach a policy of `tokenizer` (its tokenizer differs: another
    vocabulary, or other eos or pad ids), in one line; None when it can."""
    mine, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    special = [
        (a, getattr(tokenizer, a), getattr(teacher_tokenizer, a)) for a in ("eos_token_id", "pad_token_id")
    ]
    different = [f"{what} {ours} vs {its}" for what, ours, its in special if ours != its]
    if mine == theirs and not different:
        return None
    detail = (
        f"vocabularies of {len(mine)} and {len(theirs)} tokens" if mine != theirs else ", ".join(different)
    )
    return (
        f"teacher_model={name!r} has another tokenizer than the policy ({detail}): on-policy "
        "distillation compares the two models' log-probs of the same token ids, so the teacher must "
        "share the policy's tokenizer; pick a teacher of the same family"
    )


def teacher_refusal(
    plan: GRPOPlan, tokenizer: Any, policy: ModelShape, teacher: ModelShape | None
) -> str | None:
    """What `train` would refuse in the teacher, found without loading its weights: another tokenizer,
    an embedding with fewer rows than its tokenizer has ids (no loss type can use it), or for
    loss_type=gkd an output layer of another size. None when it can teach (or there is none)."""
    if plan.teacher is None or teacher is None:
        return None
    spec = plan.teacher.model
    theirs = load_tokenizer(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    refusal = teacher_tokenizer_refusal(spec.name, tokenizer, theirs)
    if refusal is None:  # (config.vocab_size: its embedding's rows, as loading would find them)
        refusal = embedding_refusal(f"teacher_model={spec.name!r}", teacher.vocab_size, theirs)
    if (
        refusal is None
        and plan.trainee.step.loss.variant.teacher == "distributions"
        and teacher.vocab_size != policy.vocab_size
    ):
        # (both embed every id of the tokenizer here: opd, which scores the written tokens only, works)
        refusal = (
            f"teacher_model={spec.name!r}: its output layer scores {teacher.vocab_size} tokens and the "
            f"policy's {policy.vocab_size}: "
            "loss_type=gkd compares whole next-token distributions; use loss_type=opd or a teacher of "
            "that size"
        )
    return refusal


def teacher_shape(plan: GRPOPlan) -> ModelShape | None:
    """loss_type=opd or gkd: the teacher's shape from its config alone (not loading it);
    None without a teacher."""
    if plan.teacher is None:
        return None
    spec = plan.teacher.model
    config = load_model_config(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    return ModelShape.from_config(config)


def load_teacher(
    spec: TeacherSpec, tokenizer: Any, settings: EngineSpec, d: distributed.Dist
) -> PolicyEngine:
    """loss_type=opd's teacher: loaded as the policy is (a hub id or a directory), frozen, in the policy's
    precision, on `spec.device` or the policy's, behind an engine that only scores. A teacher whose
    tokenizer differs from the policy's is refused: on-policy distillation compares the two models'
    log-probs of the same token ids."""
    model, teacher_tokenizer = policy_and_tokenizer(spec.model, None, 0)
    refusal = teacher_tokenizer_refusal(spec.model.name, tokenizer, teacher_tokenizer)
    if refusal is not None:
        raise ValueError(refusal)
    device = torch.device(spec.device) if spec.device is not None else d.device
    model = model.to(device=device, dtype=precision_of(settings).master).eval()
    model.requires_grad_(False)
    return PolicyEngine.create(model, tokenizer, settings, device=device)


SFT_PROBE_ROWS, SFT_PROBE_EVERY = 256, 10


def warm_start_goal(
    spec: WarmStart, engine: PolicyEngine, data: RunData, probed: list[float]
) -> Callable[[int], bool] | None:
    """With sft_target_accuracy: every SFT_PROBE_EVERY steps, greedy accuracy of `engine` (over the
    model being warmed up) on the first SFT_PROBE_ROWS training prompts (never held-out ones),
    appended to `probed`; True once it reaches the target. Stopping at a measured accuracy, not a
    step count, makes GRPO start from the same place whatever the seed or the CPU's float round-off
    (a warm start's accuracy climbs steeply, so where a fixed step count lands is not reproducible
    across machines)."""
    target = spec.target_accuracy
    if target is None:
        return None
    if data.is_correct is None:
        raise ValueError(
            "sft_target_accuracy needs an exact accuracy to measure: use a built-in task, or rows with an "
            "answer column; or unset sft_target_accuracy to run sft_steps."
        )
    probe = EvalTask(
        data.train_rows[:SFT_PROBE_ROWS],
        reward_funcs=[correctness_reward(data.is_correct)],  # accuracy is all it needs
        is_correct=data.is_correct,
        max_prompt_length=data.max_prompt_length,
        max_completion_length=data.max_completion_length,
    )
    settings = Evaluation(prompt_column=spec.prompt_column, batch_size=spec.probe_batch_size)

    def done(step: int) -> bool:
        if step % SFT_PROBE_EVERY:
            return False
        metrics = evaluate(engine, probe, settings)
        engine.module.train()
        probed.append(metrics["accuracy"])
        return metrics["accuracy"] >= target

    return done


@dataclass(frozen=True)
class Hooks:
    """What a phase of a run reports to and is stopped by: `emit` (on_event on rank 0), the stop
    signals, and the CPU-thread governor (None: none)."""

    emit: Emit
    stop: StopSignals
    threads: Any = None


def warm_start(
    spec: WarmStart, engine: PolicyEngine, data: RunData, d: distributed.Dist, hooks: Hooks, output_dir: Path
) -> SFTResult:
    """The supervised warm start (sft_steps) of `engine`'s model, identical on every rank; its losses go
    to output_dir/sft_metrics.jsonl, and with sft_target_accuracy it ends once a probe of training
    prompts is solved (greedy, through `engine`)."""
    emit, stop, threads = hooks.emit, hooks.stop, hooks.threads
    emit(EventKind.SFT_START, 0, {})
    probed: list[float] = []
    goal = warm_start_goal(spec, engine, data, probed)

    def sft_step(step: int, loss: float) -> None:
        emit(EventKind.SFT_STEP, step, {"loss": loss})
        note = threads.tick() if threads is not None else None  # fewer CPU threads under load
        if note:
            emit(EventKind.WARNING, step, {"message": note})

    warm = run_sft(
        engine.module,
        engine.tokenizer,
        sft_rows(
            data.train_rows[: spec.examples],
            engine.tokenizer,
            spec.prompt_column,
            spec.answer_column,
            environment=data.environment,  # multi-turn: whole episodes, the policy's turns learned
            template_kwargs=data.chat_template_kwargs,
            answer_format=spec.answer_format,  # gsm8k: the worked solutions
        ),
        spec.schedule,
        SFTHooks(
            on_step=sft_step,
            should_stop=lambda: distributed.any_rank(d, stop.signal is not None),
            done=None if goal is None else lambda s: distributed.any_rank(d, goal(s)),  # ranks agree
        ),
        precision=engine.precision,
    )
    if d.is_main:
        write_sft_metrics(output_dir, warm.losses)
    if probed:
        emit(EventKind.SFT_DONE, len(warm.losses), {"probe_accuracy": probed[-1], "reached": warm.reached})
    return warm


def held_out_metrics(
    engine: PolicyEngine,
    data: RunData,
    settings: Evaluation,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Greedy accuracy and reward on the held-out rows (and pass@k), `settings.batch_size` rows a
    pass, sampled by `engine`: what a run reports as eval/ and the `eval` command prints. Reward
    functions run as in training: within `reward_timeout`, and a `should_stop` that turns True
    abandons the evaluation (`rewards.scoring.ScoringStopped`)."""
    task = EvalTask(
        data.eval_rows,
        reward_funcs=data.reward_funcs,
        reward_weights=data.reward_weights,
        is_correct=data.is_correct,
        max_prompt_length=data.max_prompt_length,
        max_completion_length=data.max_completion_length,
    )
    return evaluate(engine, task, settings, should_stop)


def evaluator(
    engine: PolicyEngine, data: RunData, settings: Evaluation, should_stop: Callable[[], bool] | None = None
) -> Callable[[], dict[str, float]]:
    """`held_out_metrics` with the training engine ({} without held-out rows)."""

    def run() -> dict[str, float]:
        if not data.eval_rows:
            return {}
        return held_out_metrics(engine, data, settings, should_stop)

    return run


def _parts(trainee: Trainee) -> TrainingParts:
    engine, update = trainee.engine, trainee.update
    return TrainingParts(
        engine.train_module,
        engine.tokenizer,
        update.optimizer,
        update.scheduler,
        trainee.prompts,
        engine.reference if trainee.params.spec.reference_sync is not None else None,
    )


def save(
    trainee: Trainee, strategy: str, to: SaveTo, d: distributed.Dist, step: int, eval_before: dict[str, float]
) -> None:
    """checkpoint-<step>: weights, optimizer, schedule, data position, RNG (and a synced reference)."""
    engine = trainee.engine
    extra = {}
    if engine.reference is not None and trainee.params.spec.reference_sync is not None:
        extra["reference"] = distributed.full_state_dict(d, engine.reference)
    if trainee.entropy is not None:
        extra["entropy_control"] = trainee.entropy.state_dict()
    if trainee.rollout is not None:  # max_staleness: the batches in flight after this step
        extra["rollout"] = trainee.rollout.state_dict(step)
    save_distributed(d, strategy, to, step, _parts(trainee), eval_before, extra)


def restore(
    trainee: Trainee, strategy: str, d: distributed.Dist, checkpoint: Path
) -> tuple[int, dict[str, float]]:
    """Weights, optimizer, schedule, data position and RNG from `checkpoint`: (step, eval_before)."""
    engine = trainee.engine
    state = restore_distributed(d, strategy, checkpoint, _parts(trainee))
    if engine.reference is not None and "reference" in state:
        distributed.unwrap(engine.reference).load_state_dict(state["reference"])  # (checked: its shapes)
    if trainee.entropy is not None and "entropy_control" in state:
        trainee.entropy.load_state_dict(state["entropy_control"])
    if trainee.rollout is not None:  # max_staleness: the batches in flight, checked against this run
        problem = trainee.rollout.load_state_dict(state.get("rollout"), _in_flight_bounds(trainee, state))
        if problem is not None:
            raise CheckpointError(state_error(checkpoint, problem))
    return int(state["step"]), {k: float(v) for k, v in state["eval_before"].items()}


def _in_flight_bounds(trainee: Trainee, state: dict[str, Any]) -> InFlightBounds:
    """What this run expects of the batches in flight of the checkpoint `state` came from."""
    params, module = trainee.params, distributed.unwrap(trainee.engine.train_module)
    embedding = getattr(module, "get_input_embeddings", lambda: None)()
    vocab = getattr(embedding, "num_embeddings", None) or len(trainee.engine.tokenizer)
    return InFlightBounds(
        step=int(state["step"]),
        max_staleness=trainee.rollout.max_staleness,
        every=trainee.rollout.every,
        rows=params.prompts_per_rank * params.sampling.num_generations,
        vocab=vocab,
        prompts=len(trainee.prompts.rows),
    )
