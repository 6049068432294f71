"""A config, resolved once into the small typed objects the code runs on.

The user-facing configs (schema.py) stay flat, with TRL's names: one place to read and set every
option. The code below them does not take that whole config: `grpo_plan(cfg)` (and `reward_plan`,
`sft_plan`) turn it, once, at the entry point, into frozen dataclasses that each say one thing (which
model, which data, how to sample, one step, the optimizer, the run's cadence, evaluation), and every
function takes only the objects it reads. A function's signature then says what it depends on, and a
test builds just those.

No torch import here (the config package stays instant). How completions are drawn and how the engine
runs are the runtime's own types (`SamplingParams`, `EngineSpec`: config/specs.py, which rollout/ and
engine/ re-export), built here once; train/ fills in what the data decides (the lengths) with
`dataclasses.replace`, and builds the engine on its device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..ops.loss_types import LOSS_TYPES, LossVariant
from .applied import Preset, annotated_yaml, applied
from .load import run_config_yaml, to_yaml
from .schema import GRPOConfig, RewardConfig, SFTConfig
from .specs import EngineSpec, SamplingParams

# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class TinySize:
    """The built-in tiny Llama's size (model: tiny)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256


@dataclass(frozen=True)
class ModelSpec:
    """Which model, and how it is loaded and stored."""

    name: str  # a hub id, a local directory, or "tiny"
    seed: int  # the tiny model's initialisation
    revision: str | None = None  # a hub id's branch, tag or commit
    dtype: str = "float32"  # compute precision
    master_weights: str = "float32"  # "float32", or "dtype": the weights stored in `dtype`
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    tiny: TinySize = field(default_factory=TinySize)

    @property
    def stored(self) -> str:
        """The dtype the trainable weights are stored in."""
        return self.dtype if self.master_weights == "dtype" else "float32"


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters (use_peft); target_modules None: every linear projection except the LM head."""

    r: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...] | None


@dataclass(frozen=True)
class Placement:
    """Where the run executes, and how it is spread over processes."""

    device: str = "auto"
    strategy: str = "ddp"
    fsdp_cpu_offload: bool = False
    num_threads: int | None = None


# ----------------------------------------------------------------------------- data and rewards


@dataclass(frozen=True)
class DataSpec:
    """Where the prompts come from and how they are read (`train.inputs.resolve_data`)."""

    task: str | None
    seed: int  # a task's generator
    dataset: str | None = None  # a file, a hub dataset name or a dataset directory
    eval_dataset: str | None = None
    dataset_config: str | None = None  # of a hub dataset or directory
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"  # also the held-out rows of `dataset` without eval_dataset
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    answer_format: str = "raw"  # data/answers.py ANSWER_FORMATS
    num_eval_prompts: int = 200
    max_prompt_length: int | None = None  # None: the task's (or no limit)
    max_completion_length: int | None = None  # None: the task's (or 256)
    system_prompt: str | None = None  # opens every prompt (text prompts become conversations)
    chat_template_kwargs: dict[str, Any] | None = None
    tiny_model: bool = True  # the tiny model's character tokenizer is built over the data's alphabet
    # what learns the answers of the first `sft_examples` training rows (None: nothing), which they
    # must then have, and the way out an error names
    answers_for: str | None = None
    answers_otherwise: str = "set sft_steps=0"
    sft_examples: int | None = None


@dataclass(frozen=True)
class EpisodeSpec:
    """Multi-turn episodes: tools (None: the task's) or your environment."""

    tools: tuple[str, ...] | None = None
    environment: str | None = None
    max_turns: int = 4
    tool_call_format: str | None = None
    tool_timeout: float = 5.0


@dataclass(frozen=True)
class RewardSpec:
    """The reward functions the config names (None: the task's), their weights, and the device a
    reward model goes to when its entry names none."""

    funcs: tuple[Mapping[str, Any], ...] | None = None
    weights: tuple[float, ...] | None = None
    device: str = "auto"
    max_completion_length: int = 256  # what overlong_penalty and length_penalty are made for


# ----------------------------------------------------------------------------- generation and the step


@dataclass(frozen=True)
class LossSpec:
    """`ops.grpo_loss`'s semantic choices (fields named as its arguments: the step passes them as they
    are). `max_completion_length` is the data's (dr_grpo's constant normaliser): set when the data is
    resolved (`train.trainee.StepParams.of`)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    max_completion_length: int | None = None  # None until the data is resolved

    @property
    def variant(self) -> LossVariant:
        """What this loss type is and needs (`ops.loss_types.LOSS_TYPES`)."""
        return LOSS_TYPES[self.loss_type]


@dataclass(frozen=True)
class EntropySpec:
    """The entropy bonus −c·H: how its coefficient c moves (`train.trainee.ENTROPY_RULES`) and how H is
    averaged (`ops.grpo_loss`'s entropy_bonus)."""

    rule: str  # "target" (target_entropy), "fixed" (TRL's entropy_coef), "stepped" (use_adaptive_entropy)
    coef: float  # the first step's coefficient
    target: float | None  # nats: target_entropy or entropy_target (None: fixed)
    rate: float  # target: entropy_coef_lr; stepped: entropy_coef_delta
    bounds: tuple[float, float]  # stepped: (entropy_coef_min, entropy_coef_max)
    bonus: str  # "as_loss" (grpokit's target_entropy) or "token_mean" (TRL's)


# TRL's loss types that sum per-token terms: under a sequence-level ratio each sequence weighs its length
_TOKEN_SUMMED = ("bnpo", "dr_grpo", "dapo", "cispo")


def loss_advice(cfg: GRPOConfig) -> list[str]:
    """What TRL warns of in a loss's set-up that runs but is likely not what was meant (the same lines)."""
    lines = []
    level, loss = cfg.importance_sampling_level, cfg.loss_type
    if level == "sequence" and loss in _TOKEN_SUMMED:
        lines.append(
            f"importance_sampling_level='sequence' with loss_type='{loss}': the loss sums per-token "
            "contributions, which effectively weights each sequence by its completion length instead of "
            "optimizing the per-sequence objective; loss_type='grpo' reproduces the GSPO paper's setup"
        )
    if loss == "luspo" and level != "sequence":
        lines.append("loss_type='luspo' mirrors its paper with importance_sampling_level='sequence'")
    if loss == "vespo" and level != "token":
        lines.append(
            "loss_type='vespo' computes sequence-level weights itself: importance_sampling_level should be "
            "'token' (the default)"
        )
    return lines


def entropy_spec(cfg: GRPOConfig) -> EntropySpec | None:
    if cfg.target_entropy is not None:
        return EntropySpec("target", 0.0, cfg.target_entropy, cfg.entropy_coef_lr, (0.0, math.inf), "as_loss")
    if cfg.use_adaptive_entropy:
        bounds = (cfg.entropy_coef_min, cfg.entropy_coef_max)
        return EntropySpec(
            "stepped", cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_delta, bounds, "token_mean"
        )
    if cfg.entropy_coef != 0.0:
        return EntropySpec("fixed", cfg.entropy_coef, None, 0.0, (cfg.entropy_coef,) * 2, "token_mean")
    return None


@dataclass(frozen=True)
class StepSpec:
    """One GRPO step as the config sets it (`train.grpo_step.StepParams.of` adds the sampling and the
    world size)."""

    prompts_per_step: int
    micro_batch_size: int
    num_iterations: int
    loss: LossSpec
    prompt_column: str
    chat_template_kwargs: dict[str, Any] | None
    scale_rewards: str
    multi_objective_aggregation: str
    reward_weights: tuple[float, ...] | None
    on_reward_error: str
    reward_timeout: float | None
    mask_truncated_completions: bool
    dynamic_sampling: bool
    max_resample_batches: int
    curriculum: bool  # data/curriculum.py: set zero-spread prompts aside
    curriculum_patience: int
    curriculum_revisit: float
    seed: int
    shuffle_dataset: bool
    max_grad_norm: float
    reference_sync: tuple[int, float] | None  # (every N steps, mixup alpha), or None
    sampling_correction: str
    sampling_correction_bounds: tuple[float | None, float | None]  # (C_min, C_max)
    entropy: EntropySpec | None = None  # the entropy bonus and its control (train.trainee.EntropyControl)
    distill_coef: float = 1.0  # loss_type=opd: λ of the teacher's reverse KL in the advantages
    gkd_beta: float = 0.5  # loss_type=gkd: β of the generalised JSD to the teacher
    lmbda: float = 0.5  # loss_type=gkd: the share of steps on the student's own samples
    # micro_batch_size left unset: on a GPU the memory forecast fits it (train/memory_check.py)
    micro_batch_fitted: bool = False
    answer_column: str = "answer"  # loss_type=gkd with lmbda < 1: the dataset's answers as completions
    answer_format: str = "raw"  # a worked format's solutions are those completions (data.demonstration)
    seq_kd: bool = False  # loss_type=gkd: the other steps on the teacher's samples, not the answers


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW and its schedule over `total_updates` optimizer steps."""

    learning_rate: float
    total_updates: int
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "linear"  # constant, linear or cosine after the warm-up
    warmup_steps: int = 0


@dataclass(frozen=True)
class SFTSchedule:
    """A supervised run (`train.sft.run_sft`): AdamW, warm-up then cosine decay to 0."""

    steps: int
    batch_size: int
    learning_rate: float
    seed: int
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0


@dataclass(frozen=True)
class WarmStart:
    """The supervised warm start before GRPO (schedule.steps = 0: none)."""

    schedule: SFTSchedule
    examples: int | None  # learn from the first N training rows (None: all)
    target_accuracy: float | None  # stop once a probe of training prompts is this accurate
    probe_batch_size: int  # rows per forward pass of the probe (as in training)
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    answer_format: str = "raw"  # a worked format's solutions are what it learns (data.demonstration)


# ----------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class RunControl:
    """The run's directory, length and cadence, and the config as it is recorded."""

    output_dir: str
    max_steps: int
    logging_steps: int = 1
    eval_steps: int = 0
    save_steps: int = 0
    save_total_limit: int = 2
    max_consecutive_skips: int = 3
    log_completions_steps: int = 0
    strict_invariants: bool = False  # a broken invariant stops the run with a checkpoint
    auto_find_batch_size: bool = False  # out of memory in a step's passes: redo it with half the micro-batch
    alert_thresholds: Mapping[str, float] = field(default_factory=dict)  # overrides of the defaults
    resume: bool = False
    overwrite: bool = False
    report_to: tuple[str, ...] = ()
    push_to_hub: bool = False  # the final checkpoint's model to the hub (train/hub_push.py)
    hub_model_id: str | None = None
    hub_private_repo: bool | None = None
    config_yaml: str = ""  # config.yaml of the run and of each checkpoint
    config_values: Mapping[str, Any] = field(default_factory=dict)  # for the metrics' reporters


@dataclass(frozen=True)
class Evaluation:
    """How held-out evaluation samples and scores (`train.evaluation.evaluate`)."""

    prompt_column: str = "prompt"
    chat_template_kwargs: dict[str, Any] | None = None
    pass_at_k: int = 0
    temperature: float = 1.0  # of pass@k's samples; accuracy is greedy
    seed: int = 0
    on_reward_error: str = "raise"
    reward_timeout: float | None = None
    batch_size: int | None = None  # completions per call (None: all at once)


@dataclass(frozen=True)
class Display:
    """What the progress display shows (`train.progress`)."""

    progress: bool = True
    label: str = "grpo"
    max_steps: int = 0
    sft_steps: int = 0
    num_generations: int = 1  # the completions table shows one row per group
    num_completions_to_print: int | None = 6  # ... of this many groups (None: all)


@dataclass(frozen=True)
class TraineeSpec:
    """What the policy trains with (`train.grpo_setup.build_trainee`): where, the engine, how it
    samples, one step, and the optimizer."""

    placement: Placement
    engine: EngineSpec
    # the lengths are the data's (train/grpo_setup.py `sampling_params`), the seed the step's
    sampling: SamplingParams
    step: StepSpec
    optimizer: OptimizerSpec


@dataclass(frozen=True)
class TeacherSpec:
    """loss_type=opd or gkd: the teacher; which model, where, in the policy's precision (grpo_setup)."""

    model: ModelSpec
    device: str | None  # None: the policy's device


@dataclass(frozen=True)
class RolloutSpec:
    """Where a step's batch comes from (`train.batch_source.open_batch_source`): drawn in process
    (max_staleness None), or asynchronous GRPO: a rollout worker samples and scores step s's batch with
    the weights after step `train.in_flight.sampling_version(s, ...)`."""

    max_staleness: int | None = None  # None: the synchronous loop
    weight_sync_steps: int = 1
    timeout: float = 600.0  # weight_sync_timeout
    device: str | None = None  # rollout_device (None: `train.async_rollout.rollout_device` chooses)
    workers: int = 1  # rollout_workers: step s is sampled by worker s mod workers
    servers: tuple[str, ...] = ()  # rollout_server_urls (engine/remote.py); empty: in the worker
    request_timeout: float = 600.0  # seconds a rollout server may take to answer


@dataclass(frozen=True)
class GRPOPlan:
    """A GRPO run, resolved from its config (`grpo_plan`)."""

    seed: int
    model: ModelSpec
    lora: LoraSpec | None  # None: every weight trains
    data: DataSpec
    episodes: EpisodeSpec
    rewards: RewardSpec
    warm_start: WarmStart
    trainee: TraineeSpec
    run: RunControl
    evaluation: Evaluation
    display: Display
    teacher: TeacherSpec | None = None  # loss_type=opd or gkd
    rollout: RolloutSpec = RolloutSpec()  # (max_staleness None: the synchronous loop)


def _tuple(values: Any) -> tuple[Any, ...] | None:
    return None if values is None else tuple(values)


def model_spec(cfg: GRPOConfig | SFTConfig | RewardConfig) -> ModelSpec:
    """The model a config names (an SFTConfig has no precision options: float32)."""
    return ModelSpec(
        name=cfg.model,
        seed=cfg.seed,
        revision=cfg.model_revision,
        dtype=getattr(cfg, "dtype", "float32"),
        master_weights=getattr(cfg, "master_weights", "float32"),
        trust_remote_code=getattr(cfg, "trust_remote_code", False),
        gradient_checkpointing=getattr(cfg, "gradient_checkpointing", False),
        tiny=TinySize(
            cfg.tiny_hidden_size, cfg.tiny_num_layers, cfg.tiny_num_heads, cfg.tiny_intermediate_size
        ),
    )


def _named(cls: Any, cfg: Any, **given: Any) -> Any:
    """`cls` from the config's options of the same names, and `given` for the rest (renamed or
    derived); a field the config does not have (an SFTConfig has no `strategy`) keeps its default."""
    same = {f.name: getattr(cfg, f.name) for f in fields(cls) if f.name not in given and hasattr(cfg, f.name)}
    return cls(**same, **given)


def run_control(cfg: GRPOConfig | RewardConfig, config_yaml: str | None = None) -> RunControl:
    """config_yaml: the run's config.yaml (None: `to_yaml(cfg)`)."""
    values = cfg.model_dump(mode="json")
    text = run_config_yaml(to_yaml(cfg) if config_yaml is None else config_yaml)
    return _named(RunControl, cfg, report_to=tuple(cfg.report_to), config_yaml=text, config_values=values)


def optimizer_spec(cfg: GRPOConfig | RewardConfig, total_updates: int) -> OptimizerSpec:
    return OptimizerSpec(
        learning_rate=cfg.learning_rate,
        total_updates=total_updates,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        schedule=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
    )


def placement(cfg: GRPOConfig | SFTConfig | RewardConfig) -> Placement:
    return _named(Placement, cfg)


def data_spec(cfg: GRPOConfig) -> DataSpec:
    warm = f"the supervised warm start (sft_steps={cfg.sft_steps})" if cfg.sft_steps else None
    return _named(DataSpec, cfg, tiny_model=cfg.model == "tiny", answers_for=warm)


def episode_spec(cfg: GRPOConfig) -> EpisodeSpec:
    return _named(EpisodeSpec, cfg, tools=_tuple(cfg.tools))


def reward_spec(cfg: GRPOConfig) -> RewardSpec:
    return RewardSpec(
        funcs=_tuple(cfg.reward_funcs),
        weights=_tuple(cfg.reward_weights),
        device=cfg.device,
        max_completion_length=cfg.max_completion_length,
    )


def evaluation(cfg: GRPOConfig) -> Evaluation:
    return _named(Evaluation, cfg, batch_size=cfg.micro_batch_size)  # rows per pass, as in training


def engine_spec(cfg: GRPOConfig) -> EngineSpec:
    # temperature > 0: the config refuses greedy training
    return _named(EngineSpec, cfg, group_size=cfg.num_generations)


def step_spec(cfg: GRPOConfig) -> StepSpec:
    sync = (cfg.ref_model_sync_steps, cfg.ref_model_mixup_alpha) if cfg.sync_ref_model else None
    return _named(
        StepSpec,
        cfg,
        loss=_named(LossSpec, cfg),
        entropy=entropy_spec(cfg),
        reward_weights=_tuple(cfg.reward_weights),
        reference_sync=sync,
        sampling_correction_bounds=(cfg.sampling_correction_min, cfg.sampling_correction_max),
        micro_batch_fitted="micro_batch_size" not in cfg.model_fields_set,
    )


def grpo_plan(cfg: GRPOConfig, preset: Preset | None = None, *, model_given: bool = False) -> GRPOPlan:
    """Everything a GRPO run reads from its config, resolved once: first the values chosen for its
    model where the config leaves them unset (`config.applied`; model_given: the caller passes its own
    model, which keeps the config's values), then the plan objects. `preset`: the built-in preset the
    config came from, named in config.yaml."""
    resolved = applied(cfg, preset, model_given=model_given)
    cfg = resolved.config
    lora = None
    if cfg.use_peft:
        lora = LoraSpec(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, _tuple(cfg.lora_target_modules))
    teacher = None
    if cfg.teacher_model is not None:
        named = {"model": cfg.teacher_model, "model_revision": cfg.teacher_model_revision}
        teacher_cfg = cfg.model_copy(update=named)
        teacher = TeacherSpec(
            model=replace(model_spec(teacher_cfg), gradient_checkpointing=False), device=cfg.teacher_device
        )
    rollout = RolloutSpec(
        cfg.max_staleness,
        cfg.weight_sync_steps,
        cfg.weight_sync_timeout,
        cfg.rollout_device,
        cfg.rollout_workers,
        tuple(cfg.rollout_server_urls or ()),
        cfg.request_timeout,
    )
    return GRPOPlan(
        rollout=rollout,
        teacher=teacher,
        seed=cfg.seed,
        model=model_spec(cfg),
        lora=lora,
        data=data_spec(cfg),
        episodes=episode_spec(cfg),
        rewards=reward_spec(cfg),
        warm_start=WarmStart(
            schedule=SFTSchedule(
                steps=cfg.sft_steps,
                batch_size=cfg.sft_batch_size,
                learning_rate=cfg.sft_learning_rate,
                seed=cfg.seed,
                warmup_steps=cfg.sft_warmup_steps,
            ),
            examples=cfg.sft_examples,
            target_accuracy=cfg.sft_target_accuracy,
            probe_batch_size=cfg.micro_batch_size,
            prompt_column=cfg.prompt_column,
            answer_column=cfg.answer_column,
            answer_format=cfg.answer_format,
        ),
        trainee=TraineeSpec(
            placement=placement(cfg),
            engine=engine_spec(cfg),
            sampling=SamplingParams(
                num_generations=cfg.num_generations,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                min_p=cfg.min_p,
                repetition_penalty=cfg.repetition_penalty,
                prompt_truncation=cfg.prompt_truncation,
            ),
            step=step_spec(cfg),
            optimizer=optimizer_spec(cfg, cfg.max_steps * cfg.num_iterations),
        ),
        run=run_control(cfg, annotated_yaml(resolved)),
        evaluation=evaluation(cfg),
        display=display(cfg),
    )


def display(cfg: GRPOConfig | RewardConfig) -> Display:
    grpo = isinstance(cfg, GRPOConfig)
    return Display(
        progress=cfg.progress,
        label="grpo" if grpo else "train",
        max_steps=cfg.max_steps,
        sft_steps=cfg.sft_steps if grpo else 0,
        num_generations=cfg.num_generations if grpo else 1,
        num_completions_to_print=cfg.num_completions_to_print if grpo else None,
    )


# ----------------------------------------------------------------------------- reward models


@dataclass(frozen=True)
class PairSpec:
    """Where the preference pairs come from (`train.reward.preference_data`)."""

    task: str | None
    seed: int
    near_miss: float = 0.0
    dataset: str | None = None
    eval_dataset: str | None = None
    num_eval_pairs: int = 200


@dataclass(frozen=True)
class PairStep:
    """One reward-model update (`train.reward.reward_step`)."""

    micro_batch_size: int
    max_length: int
    long_pairs: str
    center_rewards_coefficient: float | None
    max_grad_norm: float
    dtype: str = "float32"
    master_weights: str = "float32"


@dataclass(frozen=True)
class RewardPlan:
    """A reward-model run, resolved from its config (`reward_plan`)."""

    seed: int
    model: ModelSpec
    placement: Placement
    pairs: PairSpec
    batch_size: int  # pairs per optimizer step
    step: PairStep
    optimizer: OptimizerSpec
    run: RunControl
    display: Display


def reward_plan(cfg: RewardConfig) -> RewardPlan:
    return RewardPlan(
        seed=cfg.seed,
        model=model_spec(cfg),
        placement=placement(cfg),
        pairs=PairSpec(
            task=cfg.task,
            seed=cfg.seed,
            near_miss=cfg.near_miss,
            dataset=cfg.dataset,
            eval_dataset=cfg.eval_dataset,
            num_eval_pairs=cfg.num_eval_pairs,
        ),
        batch_size=cfg.batch_size,
        step=PairStep(
            micro_batch_size=cfg.micro_batch_size,
            max_length=cfg.max_length,
            long_pairs=cfg.long_pairs,
            center_rewards_coefficient=cfg.center_rewards_coefficient,
            max_grad_norm=cfg.max_grad_norm,
            dtype=cfg.dtype,
            master_weights=cfg.master_weights,
        ),
        optimizer=optimizer_spec(cfg, cfg.max_steps),
        run=run_control(cfg),
        display=display(cfg),
    )


# ----------------------------------------------------------------------------- grpokit sft


def sft_data(cfg: SFTConfig) -> DataSpec:
    """`grpokit sft`'s data, resolved as training resolves it (its rows must all have answers)."""
    return _named(
        DataSpec, cfg, tiny_model=cfg.model == "tiny", answers_for="grpokit sft", answers_otherwise="use task"
    )


def sft_schedule(cfg: SFTConfig) -> SFTSchedule:
    return SFTSchedule(
        steps=cfg.max_steps, batch_size=cfg.batch_size, learning_rate=cfg.learning_rate, seed=cfg.seed
    )


@dataclass(frozen=True)
class SFTPlan:
    """A `grpokit sft` run, resolved from its config (`sft_plan`; `train.sft_run.train_sft` runs it)."""

    model: ModelSpec  # (an SFTConfig has no precision options: float32)
    placement: Placement
    data: DataSpec
    schedule: SFTSchedule
    output_dir: str
    overwrite: bool = False  # replace an earlier run in output_dir
    config_yaml: str = ""  # output_dir/config.yaml


def sft_plan(cfg: SFTConfig) -> SFTPlan:
    return SFTPlan(
        model=model_spec(cfg),
        placement=placement(cfg),
        data=sft_data(cfg),
        schedule=sft_schedule(cfg),
        output_dir=cfg.output_dir,
        overwrite=cfg.overwrite,
        config_yaml=run_config_yaml(to_yaml(cfg)),
    )


def eval_plan(cfg: GRPOConfig) -> GRPOPlan:
    """`grpokit eval`'s plan: the config's, without a warm start (evaluation trains nothing, so its rows
    need no answers)."""
    return grpo_plan(cfg.model_copy(update={"sft_steps": 0}))
