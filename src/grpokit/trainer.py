"""`GRPOTrainer`: the Python entry point, a thin façade over `train.grpo.train_grpo`, called as TRL's is."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import AsyncGRPOConfig, GRPOConfig, trl_names
from .config.plan import display, loss_advice, model_spec
from .data import load_prompts
from .envs import EnvironmentSpec, tool_environment
from .rewards import RewardModelFunction, named_reward
from .train.events import EventKind
from .train.grpo import TrainResult, train_grpo
from .train.progress import reporting

TRL_EPOCHS = 3  # TrainingArguments' num_train_epochs: GRPOTrainer's run length when max_steps is unset

# TRL's parameters that grpokit has no use for (given other than None / (None, None) / []): what to do
_NOT_TAKEN = {
    "callbacks": "follow the run with trainer.train(on_event=f), f(kind, step, data) with each step's "
    "metrics, or read output_dir/metrics.jsonl",
    "optimizers": "grpokit builds AdamW and its schedule from the config: set learning_rate, weight_decay, "
    "adam_beta1, adam_beta2, adam_epsilon, lr_scheduler_type and warmup_steps",
    "quantization_config": "load the model quantized yourself and pass it with its tokenizer",
    "rollout_func": "grpokit samples with its own decode loop; for multi-turn episodes pass tools or "
    "environment_factory",
}

# peft LoraConfig options grpokit's adapters do not have (any value but peft's default is refused)
_LORA_FIXED = (
    "bias",
    "use_rslora",
    "use_dora",
    "modules_to_save",
    "layers_to_transform",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "init_lora_weights",
)


class GRPOTrainer:
    """GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=..., ...).train(): TRL 1.16's
    parameters in TRL's order, so that a TRL script runs with its import changed.

    model: a hub id or a local model directory (loaded here, as TRL does: `trainer.model` is the module,
        and its tokenizer is `processing_class` unless one is given), "tiny" (built by the run over the
        data's characters), or a loaded causal LM (its tokenizer loaded from where the model came from
        when no processing_class is given).
    reward_funcs: a function, a built-in reward's name ("exact_answer", "math_answer", "format_tags") or
        a reference to a function ("pkg.mod.f", "pkg.mod:f", "FILE.py:f"), a reward model (its hub id,
        its directory, or a loaded sequence-classification model, scored as TRL scores one), or a list
        of them; f(prompts, completions, **columns) -> list[float | None].
    reward_processing_classes: the reward models' tokenizers (TRL's: one, or one per reward function,
        None where the model's own is loaded).
    args: a GRPOConfig (or a dict of its fields; None: the defaults); its `task` is ignored: the data
        given here is used.
    train_dataset / eval_dataset: a datasets.Dataset, a list of dicts or a file path.
    peft_config: a peft LoraConfig: use_peft with its r, lora_alpha, lora_dropout and target_modules.
    callbacks, optimizers, quantization_config, rollout_func: TRL's, not taken; given, each is one
        error saying what to do instead.
    tools: plain functions the policy may call (multi-turn episodes, the config's tool_call_format,
        max_turns and tool_timeout); environment_factory: a class or function returning a fresh
        environment per episode (reset(row) / step(text), see grpokit.envs). TRL's names; at most one.
        With either, reward_funcs may be empty: the reward is then what the environment paid.
    is_correct: f(completion, row) -> bool, the held-out accuracy (default: the answer column's exact match).
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | dict[str, Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        *,
        tools: Sequence[Callable[..., Any]] | None = None,
        rollout_func: Callable[..., Any] | None = None,
        environment_factory: Callable[[], Any] | None = None,
        is_correct: Callable[[str, dict[str, Any]], bool] | None = None,
    ) -> None:
        given = {
            "callbacks": callbacks,
            "optimizers": optimizers,
            "quantization_config": quantization_config,
            "rollout_func": rollout_func,
        }
        _refuse_not_taken(given)
        cfg = args if isinstance(args, GRPOConfig) else GRPOConfig(**(args or {}))
        updates: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
        if (
            "max_steps" not in cfg.model_fields_set
            and cfg.num_train_epochs is None
            and train_dataset is not None
        ):
            updates["num_train_epochs"] = TRL_EPOCHS  # as TRL's: max_steps unset counts 3 passes over it
        if peft_config is not None:
            updates |= _lora_options(peft_config, model, cfg)
        if updates:  # validated as the config itself (a hub id, the LoRA options' ranges)
            cfg = type(cfg).model_validate(cfg.model_dump(exclude_unset=True) | updates)
        for line in loss_advice(cfg):  # TRL warns of these as its trainer is made
            trl_names.say(line)
        self.environment = _environment(cfg, tools, environment_factory)
        if isinstance(model, str) and model != "tiny":  # loaded here, as TRL does: trainer.model is it
            model, tokenizer = _loaded_for(cfg)
            processing_class = tokenizer if processing_class is None else processing_class
        elif isinstance(model, str):  # the tiny Llama is built over the data's characters, by the run
            model = None
        elif processing_class is None:  # TRL loads the tokenizer the model was loaded from
            processing_class = _tokenizer_of(model)
        if train_dataset is None and cfg.dataset is None:
            raise ValueError(
                "GRPOTrainer needs train_dataset: a datasets.Dataset, a list of dicts or a file."
            )
        if peft_config is not None and model is not None and cfg.sft_steps == 0:
            model = _with_adapters(model, cfg)  # as TRL's: trainer.model is the PeftModel
        self.config = cfg.model_copy(update={"task": None})
        self.args = self.config  # (TRL's name for the trainer's config)
        self.model, self.processing_class = model, processing_class
        self.reward_funcs = _reward_functions(
            reward_funcs, cfg.max_completion_length, reward_processing_classes
        )
        # TRL's: each reward model's tokenizer, None for a function
        self.reward_processing_classes = [
            func.tokenizer if isinstance(func, RewardModelFunction) else None for func in self.reward_funcs
        ]
        # TRL's: whether the model adds a router's load-balancing loss (MoE); grpokit adds none
        self.aux_loss_enabled = False
        reading = {  # a dataset name or directory: its split of dataset_config; answers by answer_format
            "prompt_column": cfg.prompt_column,
            "dataset_config": cfg.dataset_config,
            "answer_column": cfg.answer_column,
            "answer_format": cfg.answer_format,
        }
        self.train_rows = (
            None
            if train_dataset is None
            else load_prompts(train_dataset, split=cfg.dataset_train_split, **reading)
        )
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset  # (TRL's: as given)
        self._reading = reading
        # TRL's eval_dataset: one dataset, or named ones (a dict or DatasetDict): a run's held-out
        # metrics are over all their rows; evaluate() reports each under its name
        self.eval_sets = None if eval_dataset is None else self._eval_sets(eval_dataset)
        self.eval_rows = (  # None: the config's dataset and its held-out split, as `grpokit train`
            [row for rows in self.eval_sets.values() for row in rows]
            if self.eval_sets is not None
            else (None if train_dataset is None else [])
        )
        self.is_correct = is_correct
        self.state = _trainer_state()
        self.result: TrainResult | None = None  # grpokit's own account of the last train()

    def train(self, on_event: Callable[[str, int, dict[str, Any]], None] | None = None) -> Any:
        """Run; progress as on the command line when `config.progress` (unless `on_event` is given).
        -> TRL's TrainOutput (global_step, training_loss, metrics), through which grpokit's
        TrainResult reads too (output_dir, steps, eval_before, eval_after, stopped_by; also
        `trainer.result`). `trainer.state.log_history` holds each logged step's metrics under TRL's
        keys, each evaluation's as eval_<key>, and last the run's summary (train_loss: the mean of the
        logged steps' losses; train_runtime,
        train_samples_per_second, train_steps_per_second, epoch, step) with the last step's metrics."""
        history = _History(self.state, self._prompts_per_pass(), self.config.prompts_per_step)
        started = time.perf_counter()
        with reporting(display(self.config), on_event) as shown:

            def events(kind: str, step: int, data: dict[str, Any]) -> None:
                history.add(kind, step, data)
                if shown is not None:
                    shown(kind, step, data)
                elif kind == EventKind.WARNING:  # as with no display: to the grpokit logger
                    logging.getLogger("grpokit").warning("step %d: %s", step, data.get("message", ""))

            result = train_grpo(
                self.config,
                model=self.model,
                tokenizer=self.processing_class,
                reward_funcs=self.reward_funcs,
                train_rows=self.train_rows,
                eval_rows=self.eval_rows,
                is_correct=self.is_correct,
                on_event=events,
                environment=self.environment,
            )
        self.result = result
        return history.finish(result, time.perf_counter() - started, self.config)

    def _eval_sets(self, dataset: Any) -> dict[str, list[dict[str, Any]]]:
        """{name: rows} of an eval dataset: one dataset is {"": rows}; a mapping (TRL's dict of named
        eval datasets, a DatasetDict among them) names each."""
        split = self.config.dataset_test_split
        if isinstance(dataset, Mapping):
            return {
                str(name): load_prompts(part, split=split, **self._reading) for name, part in dataset.items()
            }
        return {"": load_prompts(dataset, split=split, **self._reading)}

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """TRL's: the held-out metrics of the model as it is now, on `eval_dataset` (else the trainer's),
        under `<prefix>_<key>` (a named dataset's under `<prefix>_<name>_<key>`), also appended to
        trainer.state.log_history. grpokit's held-out metrics: greedy accuracy (an answer column or
        is_correct), the reward functions' mean reward, pass@k, and the seconds it took (runtime); no
        eval loss (grpokit does not sample groups to evaluate). ignore_keys: TRL's, not used."""
        from .config.plan import grpo_plan
        from .train.eval_run import evaluate_given
        from .train.inputs import UserInputs

        if self.model is None:
            raise ValueError(
                "evaluate() needs a model: model='tiny' is built by train(), over the data; train first, "
                "or give a model."
            )
        sets = self._eval_sets(eval_dataset) if eval_dataset is not None else self.eval_sets
        if not sets:
            raise ValueError("evaluate() needs an eval_dataset: give one here or to GRPOTrainer.")
        plan = grpo_plan(self.config.model_copy(update={"sft_steps": 0}), model_given=True)
        metrics: dict[str, float] = {}
        for name, rows in sets.items():
            prefix = f"{metric_key_prefix}_{name}_" if name else f"{metric_key_prefix}_"
            began = time.perf_counter()
            given = UserInputs(
                self.model, self.processing_class, self.train_rows, rows, self.reward_funcs, self.is_correct,
                self.environment,
            )  # fmt: skip
            held = evaluate_given(plan, given)
            metrics |= {prefix + k: v for k, v in held.items()} | {
                prefix + "runtime": time.perf_counter() - began
            }
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """TRL's: the model as it is now (trained, after train()) with its tokenizer, through
        save_pretrained, into `output_dir` (default: args.output_dir), which `from_pretrained` then
        loads; a PeftModel saves its adapters, as TRL's. The run's checkpoints and its `final/` model
        are in output_dir already. `_internal_call`: TRL's, not used."""
        from .models import is_lora, save_policy

        if self.model is None:
            raise ValueError(
                "save_model() has no model to save: model='tiny' is built inside the run; its final model "
                f"is {self.config.output_dir}/final after train()."
            )
        where = Path(self.config.output_dir if output_dir is None else output_dir)
        if is_lora(self.model):  # the adapters (peft's own format), as TRL saves a PeftModel
            where.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(where, safe_serialization=True, save_embedding_layers=False)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(where)
            return
        save_policy(self.model, self.processing_class, where)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """TRL's, answered: a grpokit run uploads its final model itself when push_to_hub=true (with
        hub_model_id), at its end; without that, this says how in one line."""
        if self.config.push_to_hub:
            logging.getLogger("grpokit").warning(
                "push_to_hub(): the run uploaded its final model at its end (push_to_hub=true, "
                "hub_model_id=%s)",
                self.config.hub_model_id,
            )
            return
        raise ValueError(
            "grpokit's GRPOTrainer uploads at the end of train(): set push_to_hub=true and "
            "hub_model_id=ORG/NAME in its args (a login: `hf auth login` or HF_TOKEN)."
        )

    @property
    def entropy_coef(self) -> float:
        """TRL's: the entropy bonus's coefficient now (after the last step of train()), else the config's."""
        logged = [entry["entropy_coef"] for entry in self.state.log_history if "entropy_coef" in entry]
        return logged[-1] if logged else self.config.entropy_coef

    def get_high_entropy_mask(self, entropies: Any, mask: Any, threshold: float) -> Any:
        """TRL's: [B, T] bool, True where a valid token's entropy is at or above the `threshold`
        quantile of the valid tokens' entropies (the loss keeps the top 1 − threshold; TRL passes
        1 − top_entropy_quantile). Linear interpolation, as torch.quantile; no valid token: none."""
        from .ops import top_entropy_mask

        return top_entropy_mask(entropies, mask, 1.0 - threshold).bool()

    @staticmethod
    def get_off_policy_mask(
        advantages: Any,
        per_token_logps: Any,
        sampling_per_token_logps: Any,
        mask: Any,
        off_policy_threshold: float,
    ) -> Any:
        """TRL's: DeepSeek-V3.2's off-policy sequence mask, [B, 1] in the mask's dtype, 0 for a
        completion with a negative advantage whose mean log q − log π_θ over its valid tokens exceeds
        the threshold (what off_policy_mask_threshold applies in the loss)."""
        from .ops import off_policy_sequence_mask

        return off_policy_sequence_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )

    def _prompts_per_pass(self) -> int | None:
        return None if self.train_rows is None else len(self.train_rows)


def _trainer_state() -> Any:
    """transformers' TrainerState, as TRL's trainer keeps it (global_step, epoch, log_history)."""
    from transformers import TrainerState

    return TrainerState()


@functools.cache
def train_output_type() -> type:
    """grpokit's TrainOutput class (made on first use: transformers is imported only then)."""
    from transformers.trainer_utils import TrainOutput as Output

    class TrainOutput(Output):
        """TRL's TrainOutput (a named tuple: global_step, training_loss, metrics) through which
        grpokit's TrainResult's fields read too (`result.eval_after`, `result.output_dir`, ...)."""

        def __getattr__(self, name: str) -> Any:  # only names the tuple does not have
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(self.__dict__["run"], name)

    return TrainOutput


def _trl_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A logged step's metrics under TRL's keys: grpokit's are TRL's where TRL has the metric; what a
    reward function logged with log_metric is under its own name, and entropy_coef is the coefficient
    after the step (TRL logs it after its update)."""
    entry = {k.removeprefix("logged/"): v for k, v in data.items() if k not in ("step", "time")}
    if "entropy/next_coef" in data:
        entry["entropy_coef"] = data["entropy/next_coef"]
    return entry


class _History:
    """TRL's log_history, filled from the run's events: a logged step's metrics (TRL's keys, with
    step and epoch), an evaluation's as eval_<key>, and at the end the run's summary."""

    def __init__(self, state: Any, prompts_per_pass: int | None, prompts_per_step: int) -> None:
        self.state, self.prompts_per_pass, self.prompts_per_step = state, prompts_per_pass, prompts_per_step
        self.losses: list[float] = []
        self.last: dict[str, Any] = {}

    def epoch(self, step: int) -> float:
        if not self.prompts_per_pass or not self.prompts_per_step:
            return 0.0
        return step * self.prompts_per_step / self.prompts_per_pass

    def add(self, kind: str, step: int, data: dict[str, Any]) -> None:
        if kind == EventKind.STEP:
            entry = _trl_keys(data)
            if isinstance(entry.get("loss"), float) and math.isfinite(entry["loss"]):
                self.losses.append(entry["loss"])
            self.last = entry
            self.state.global_step = step
            self.state.epoch = self.epoch(step)
            self.state.log_history.append({**entry, "epoch": self.state.epoch, "step": step})
        elif kind == EventKind.EVAL and set(data) - {"step", "time", "eval/time"}:  # (no held-out data: none)
            entry = {"eval_" + k.removeprefix("eval/"): v for k, v in data.items() if k != "step"}
            self.state.log_history.append({**entry, "epoch": self.epoch(step), "step": step})

    def finish(self, result: TrainResult, seconds: float, cfg: GRPOConfig) -> Any:
        steps = result.steps
        self.state.global_step, self.state.max_steps = steps, cfg.max_steps
        self.state.epoch = self.epoch(steps)
        completions = steps * cfg.prompts_per_step * cfg.num_generations
        loss = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        metrics = {
            "train_runtime": round(seconds, 4),
            "train_samples_per_second": round(completions / seconds, 3) if seconds > 0 else 0.0,
            "train_steps_per_second": round(steps / seconds, 3) if seconds > 0 else 0.0,
            "train_loss": loss,
            "epoch": self.state.epoch,
        }
        last = {k: v for k, v in self.last.items() if k not in ("loss", "grad_norm", "learning_rate")}
        self.state.log_history.append({**last, **metrics, "step": steps})
        out = train_output_type()(steps, loss, metrics)
        out.__dict__["run"] = result
        return out


# TRL's AsyncGRPOTrainer parameters for its own transport (given other than None: what to do)
_ASYNC_NOT_TAKEN = {
    "rollout_worker": "grpokit's rollout worker is a process of its own, built from the config "
    "(max_staleness, weight_sync_steps, weight_sync_timeout, rollout_workers)",
    "weight_transfer": "grpokit publishes each weight version as a safetensors file the worker loads "
    "(train/async_rollout.py)",
}


class AsyncGRPOTrainer(GRPOTrainer):
    """AsyncGRPOTrainer(model, reward_funcs, args=AsyncGRPOConfig(...), train_dataset=...).train(): TRL's
    asynchronous trainer (trl.experimental.async_grpo, TRL 1.16) in TRL's parameter order, on grpokit's
    rollout worker: sampling and scoring in a process of its own, overlapped with the update, each
    batch exactly `max_staleness` weight versions old (train/async_rollout.py). `args`: an
    AsyncGRPOConfig (max_staleness 1 by default), or a GRPOConfig or dict, whose max_staleness unset
    becomes 1. rollout_worker and weight_transfer (TRL's transports) are not taken: one line each.
    Reward functions and environments must be importable by the worker (module-level functions, not
    lambdas or closures). Evaluation: the config's held-out split (TRL's asynchronous trainer takes no
    eval_dataset)."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | dict[str, Any] | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | None = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
    ) -> None:
        for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if value is not None:
                raise ValueError(
                    f"grpokit's AsyncGRPOTrainer does not take {name} (TRL's); {_ASYNC_NOT_TAKEN[name]}."
                )
        if not isinstance(args, GRPOConfig):
            args = AsyncGRPOConfig(**(args or {}))
        elif args.max_staleness is None:
            args = args.model_copy(update={"max_staleness": 1})
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
        )


def _with_adapters(model: Any, cfg: GRPOConfig) -> Any:
    """The model with the config's LoRA adapters (the run trains them; a warm start, which trains the
    whole model first, adds them itself after it)."""
    from .config.plan import grpo_plan
    from .train.run import add_lora

    lora = grpo_plan(cfg, model_given=True).lora
    return model if lora is None else add_lora(model, lora)


def _refuse_not_taken(given: dict[str, Any]) -> None:
    """One error for the first of TRL's parameters grpokit has no use for that was given a value."""
    for name, value in given.items():
        parts = value if name == "optimizers" else [value]
        if any(part is not None for part in parts) and not (name == "callbacks" and value == []):
            raise ValueError(f"grpokit's GRPOTrainer does not take {name} (TRL's); {_NOT_TAKEN[name]}.")


def _environment(
    cfg: GRPOConfig, tools: Sequence[Callable[..., Any]] | None, environment_factory: Any
) -> EnvironmentSpec | None:
    """The episodes' environment TRL's tools or environment_factory make (None: single-turn)."""
    if tools and environment_factory is not None:
        raise ValueError("give tools or environment_factory, not both: an environment runs its own tools.")
    if tools:
        return tool_environment(
            list(tools), cfg.tool_call_format or "hermes", max_turns=cfg.max_turns, timeout=cfg.tool_timeout
        )
    if environment_factory is not None:
        return EnvironmentSpec(
            environment_factory,
            max_turns=cfg.max_turns,
            stop_strings=getattr(environment_factory, "stop_strings", ()),
            name=getattr(environment_factory, "__name__", "environment"),
            observation_role=getattr(environment_factory, "observation_role", "user"),
        )
    return None


def _reward_functions(
    reward_funcs: Any, max_completion_length: int, processing_classes: Any = None
) -> list[Callable[..., Any]]:
    """TRL's forms: None, one, or a list; a name is a built-in reward, a reference to a function, or a
    reward model's hub id or directory; a loaded sequence-classification model is a reward model too,
    scored with its tokenizer (`processing_classes`, TRL's reward_processing_classes: one, or a list
    aligned with reward_funcs, None where the model's own is loaded) as TRL scores it."""
    import torch

    listed = [] if reward_funcs is None else reward_funcs
    listed = list(listed) if isinstance(listed, (list, tuple)) else [listed]
    tokenizers = _aligned(processing_classes, len(listed))
    out = []
    for func, tokenizer in zip(listed, tokenizers, strict=True):
        if isinstance(func, str) and _names_a_model(func):
            func = _reward_model(func, tokenizer)
        elif isinstance(func, str):
            func = named_reward(func, max_completion_length=max_completion_length)
        elif isinstance(func, torch.nn.Module):
            func = _reward_model(func, tokenizer)
        elif not callable(func):
            raise ValueError(
                f"reward_funcs holds a {type(func).__name__}; give functions f(prompts, completions, "
                "**columns), built-in reward names or references to functions ('pkg.mod.f')."
            )
        out.append(func)
    return out


def _aligned(processing_classes: Any, count: int) -> list[Any]:
    """TRL's reward_processing_classes as one per reward function (None: the model's own)."""
    if processing_classes is None:
        return [None] * count
    if not isinstance(processing_classes, (list, tuple)):
        return [processing_classes] * count
    if len(processing_classes) != count:
        raise ValueError(
            f"reward_processing_classes holds {len(processing_classes)} tokenizers for {count} reward "
            "functions; give one per reward function (None where it is not a reward model)."
        )
    return list(processing_classes)


def _names_a_model(name: str) -> bool:
    """Whether a reward_funcs entry names a model (a directory holding one, or a hub id: owner/name),
    not a built-in reward, a server's URL or a reference to a function (FILE.py:f, pkg.mod:f, pkg.mod.f)."""
    from pathlib import Path

    text = name.strip()
    if text.startswith(("http://", "https://")) or ":" in text or text.endswith(".py"):
        return False
    return (Path(text) / "config.json").is_file() or (not Path(text).exists() and text.count("/") == 1)


def _reward_model(model: Any, tokenizer: Any) -> Callable[..., Any]:
    """A reward model (a hub id, a directory or a loaded module) as TRL's GRPOTrainer scores one: its
    tokenizer (given, or the one it was saved with) over prompt + completion, the head's first logit."""
    from .rewards import RewardModelFunction

    if isinstance(model, str):
        scorer = RewardModelFunction.from_path(model, eos=False)
        if tokenizer is not None:
            scorer = RewardModelFunction(scorer.model, tokenizer, eos=False)
    else:
        found = tokenizer if tokenizer is not None else _tokenizer_of(model, "reward_processing_classes")
        scorer = RewardModelFunction(model, found, eos=False)
    # TRL's name for it (its metrics: rewards/<name>/mean): the last part of where it was loaded from
    where = getattr(getattr(scorer.model, "config", None), "_name_or_path", "") or type(scorer.model).__name__
    scorer.__name__ = str(where).rstrip("/").split("/")[-1]
    return scorer


def _loaded_for(cfg: GRPOConfig) -> tuple[Any, Any]:
    """The model a config names and its tokenizer, loaded as training loads them."""
    from .train.run import policy_and_tokenizer

    return policy_and_tokenizer(model_spec(cfg), None, 0)


def _tokenizer_of(model: Any, argument: str = "processing_class") -> Any:
    """The tokenizer of the directory or hub id a loaded model came from (its config's name_or_path),
    as TRL loads it when no processing_class is given; one line when there is none to load."""
    from .models import load_tokenizer

    source = getattr(getattr(model, "config", None), "_name_or_path", None) or ""
    fix = f"GRPOTrainer(..., {argument}=tokenizer)."
    if not source:
        raise ValueError(
            f"a loaded model needs its tokenizer, and it does not say where it was loaded from: {fix}"
        )
    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as error:
        said = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"a loaded model needs its tokenizer, and none could be loaded from where it came from "
            f"({source}: {said}): {fix}"
        ) from None


def _lora_options(peft_config: Any, model: Any, cfg: GRPOConfig) -> dict[str, Any]:
    """A peft LoraConfig as grpokit's options (TRL's ModelConfig names): use_peft, lora_r, lora_alpha,
    lora_dropout, lora_target_modules."""
    if type(peft_config).__name__ != "LoraConfig":
        raise ValueError(
            f"peft_config is a {type(peft_config).__name__}; grpokit trains LoRA adapters only: pass a "
            "peft LoraConfig (or set use_peft and lora_* in the GRPOConfig)."
        )
    from peft import LoraConfig

    default = LoraConfig()
    changed = [
        name for name in _LORA_FIXED if getattr(peft_config, name, None) != getattr(default, name, None)
    ]
    if changed:
        raise ValueError(
            f"peft_config sets {', '.join(changed)}, which grpokit's LoRA does not have; leave "
            f"{'them' if len(changed) > 1 else 'it'} at peft's default (grpokit sets r, lora_alpha, "
            "lora_dropout and target_modules)."
        )
    targets = peft_config.target_modules
    if targets is None:  # peft's choice for the model's type (q_proj and v_proj for Llama and Qwen2)
        targets = _peft_default_targets(model, cfg)
    elif targets == "all-linear":
        targets = None  # grpokit's default: every linear projection but the LM head
    elif isinstance(targets, str):
        raise ValueError(
            f"peft_config.target_modules={targets!r} is a regular expression; name the modules as a list "
            "(e.g. ['q_proj', 'v_proj']) or 'all-linear'."
        )
    else:
        targets = sorted(targets)
    return {
        "use_peft": True,
        "lora_r": peft_config.r,
        "lora_alpha": peft_config.lora_alpha,
        "lora_dropout": peft_config.lora_dropout,
        "lora_target_modules": targets,
    }


def _peft_default_targets(model: Any, cfg: GRPOConfig) -> list[str]:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as BY_TYPE

    if not isinstance(model, str):
        kind = getattr(getattr(model, "config", None), "model_type", None)
    elif model == "tiny":
        kind = "llama"
    else:  # through the cache, a missing id said in one line (models.hf.ModelSource)
        from .models import load_model_config

        config = load_model_config(
            model, revision=cfg.model_revision, trust_remote_code=cfg.trust_remote_code
        )
        kind = config.model_type
    if kind not in BY_TYPE:
        raise ValueError(
            f"peft_config.target_modules is None and peft has no default for model type {kind!r}; name the "
            "modules (e.g. target_modules=['q_proj', 'v_proj']) or 'all-linear'."
        )
    return list(BY_TYPE[kind])
