"""The inputs every command resolves alike (train, sft, eval, doctor, the Python API): what a run
trains and evaluates on (`resolve_data`: rows, reward functions, the episodes' environment, lengths),
the checks of those inputs against the model (context, prompts per step), the policy placed on its
device, and the held-out evaluation. GRPO's own set-up is train/grpo_setup.py."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config.plan import DataSpec, EpisodeSpec, Evaluation, ModelSpec, RewardSpec
from ..data import (
    ANSWER_FORMATS,
    DataError,
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
    with_system_prompt,
)
from ..engine import EngineSpec, PolicyEngine
from ..envs import BUILTIN_TOOLS, EnvironmentSpec, tool_environment
from ..models import Precision, enable_fast_matmul, place
from . import distributed
from .evaluation import EvalTask, evaluate


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

    def eval_task(self, count: int | None = None) -> EvalTask:
        """The (first `count`) held-out rows, scored by the reward functions as in training."""
        return EvalTask(
            self.eval_rows[:count],
            reward_funcs=self.reward_funcs,
            reward_weights=self.reward_weights,
            is_correct=self.is_correct,
            max_prompt_length=self.max_prompt_length,
            max_completion_length=self.max_completion_length,
        )


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
    return evaluate(engine, data.eval_task(), settings, should_stop)


def evaluator(
    engine: PolicyEngine, data: RunData, settings: Evaluation, should_stop: Callable[[], bool] | None = None
) -> Callable[[], dict[str, float]]:
    """`held_out_metrics` with the training engine ({} without held-out rows)."""

    def run() -> dict[str, float]:
        if not data.eval_rows:
            return {}
        return held_out_metrics(engine, data, settings, should_stop)

    return run
