"""The one typed, validated configuration of a GRPO run. Defaults live here and only here.

Field names and defaults follow TRL 1.16's GRPOConfig where TRL has the option; a field whose
default differs says why. Validation happens on load, before any model is touched: unknown keys
are rejected with the closest valid name, out-of-range values with the allowed range, and
cross-field rules (num_generations ≥ 2, batch divisibility) are checked together.

No torch import here: `grpokit print-config` and config errors are instant.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)

from ..net.server import server_base_url
from ..ops.loss_types import LossType
from . import trl_names
from .alerts import ALERT_THRESHOLDS
from .async_rules import AsyncFacts, async_refusal
from .load import shown
from .options import Resume, option, undeclared
from .remote_reward import REMOTE_OPTIONS, check_remote_reward, redacted_entries

# Every config class: unknown keys rejected, immutable, defaults validated, and no float option takes
# inf, -inf or nan (nor what YAML and the overrides read as them: .inf, .nan, 1e999). Pydantic merges
# a class's model_config with its bases', so the mixins and the three configs all share this one.
STRICT = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

# Why an option cannot change on resume (each field's `resume`, read by config/resume.py), where many
# share the reason. A checkpoint holds weights, optimizer and scheduler state, sampler positions and RNG
# states made under its config; an option that shaped them is fixed. One that only says how the rest of
# the run is watched, saved or bounded is applied.
FIXED_MODEL = Resume.fixed("the weights in the checkpoint have this shape and origin")
FIXED_DATA = Resume.fixed("the prompts, their order and the held-out split come from it")
FIXED_HELD_OUT = Resume.fixed("held-out metrics before and after would not be comparable")
FIXED_ALGO = Resume.fixed("the loss and the updates so far were computed with it")
FIXED_CURRICULUM = Resume.fixed(
    "the prompts drawn so far were chosen by it, and its pools are in the checkpoint"
)
FIXED_SAMPLING = Resume.fixed(
    "the completions trained on so far were drawn with it (temperature also scales log-probs)"
)
FIXED_BATCH = Resume.fixed(
    "the batch geometry: the prompt sampler's position and every update so far depend on it"
)
FIXED_OPTIM = Resume.fixed(
    "restored from the checkpoint's optimizer/scheduler state, so a new value would be ignored"
)
FIXED_SCHEDULE = Resume.fixed("the schedule so far followed it")
FIXED_WARM_START = Resume.fixed("the supervised warm start ran before step 1 and does not run again")
APPLIED = Resume.applied("only how the rest of the run is watched, saved, bounded or placed")
INVOCATION = Resume.invocation("how this command treats output_dir")
# max_steps: the scheduler's step count is restored but its decay is rebuilt from the config
# (train/optim.py make_scheduler: lr_factor(step, max_steps=max_steps·num_iterations), a lambda that is
# not part of the saved state): with a linear or cosine schedule the learning rate from the resumed step
# on follows the decay to the new max_steps, a jump where the two schedules differ. Allowed (extending a
# finished run is the common case), and the note says so (config/resume.py); a max_steps below the
# checkpoint's step is refused (it would save an older step's name over newer weights).
MAX_STEPS_RESUME = Resume.applied("where the run ends (and a decaying schedule reaches 0)")
MICRO_BATCH_RESUME = Resume.applied(
    "memory and speed: the loss's normaliser weighs each micro-batch by the whole batch (the same "
    "updates to round-off), except what is taken per micro-batch: loss_type=bnpo's token mean, "
    "top_entropy_quantile's threshold, target_entropy's measured entropy, dropout's masks"
)

# Bounds no real run exceeds; past them a value is a typo (a missing minus sign in an exponent) that
# would wreck the weights or hang a step, so it is refused before anything is built.
# AdamW moves every weight by about the learning rate per step, and initialised weights are ~0.02-1:
# a rate above 1 overwrites them in one step. Published recipes stay below 1e-2 (this project's
# presets ≤ 3e-3, its tests ≤ 0.1).
LEARNING_RATE_MAX = 1.0
# Seconds one tool call or one batch's reward may take: a day is beyond any real one (None is "no
# limit" for the reward), and keeps a thread's join() far below threading.TIMEOUT_MAX (~9e9 s).
SECONDS_MAX = 86_400.0
# Caps and bounds of an importance ratio (delta, epsilon_high, sampling_correction_min/max): a cap
# above any ratio met is the same as none, so 1e6 takes away nothing a run uses, and keeps the clamp
# bounds finite in float32 and bfloat16 arithmetic.
RATIO_BOUND_MAX = 1e6
# Seeds: what every generator takes (numpy's is 32 bits, torch's 64, random's any), and the per-step
# sampling seed derived from it (seed·1000003 + step·101 + …, train/grpo_step.py) stays below 2**64.
SEED_MAX = 2**32 - 1
# GRPO's micro_batch_size when unset: the largest divisor of the step's rows up to this (TRL's default
# generation batch, 8 prompts × 8 completions, in one pass)
MICRO_BATCH_MAX = 64

LearningRate = Annotated[float, Field(gt=0.0, le=LEARNING_RATE_MAX)]
Seconds = Annotated[float, Field(gt=0.0, le=SECONDS_MAX)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
# one weight per reward function; negative weights are penalties. ±1e6 is beyond any real weight and
# keeps a weighted sum of rewards finite in float32.
RewardWeight = Annotated[float, Field(ge=-1e6, le=1e6)]

REPORTERS = ("tensorboard", "wandb")


def _report_to(value: Any) -> Any:
    """TRL's forms: one name or a list; "none" = nothing; "all" = every one installed."""
    import importlib.util

    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        return value  # pydantic says what type it wants
    out: list[Any] = []
    for name in names:
        if name == "all":
            out += [n for n in REPORTERS if importlib.util.find_spec(n) is not None]
        elif name not in ("none", None):
            if name not in REPORTERS:
                raise ValueError(
                    f"{shown(name)} is not a destination grpokit has; use tensorboard, wandb or none"
                )
            out.append(name)
    return list(dict.fromkeys(out))


BUILTIN_TASKS = ("addition", "chain", "countdown", "reverse", "tool_addition")  # data/tasks.py TASKS (tested)


def _task_name(value: Any) -> Any:
    if value is None or not isinstance(value, str):
        return value
    if value in BUILTIN_TASKS:
        return value
    prefix, _, name = value.partition(":")
    if prefix == "reasoning_gym" and name:
        return value
    raise ValueError(
        f"{shown(value)} is not a task; built-in tasks: {', '.join(BUILTIN_TASKS)}, or reasoning_gym:NAME "
        "(e.g. reasoning_gym:countdown)"
    )


TaskName = Annotated[str, BeforeValidator(_task_name)]

ReportTo = Annotated[list[Literal["tensorboard", "wandb"]], BeforeValidator(_report_to)]

# reward_funcs' built-in names: rewards.BUILTIN_REWARDS and the task's own reward (tested)
BUILTIN_REWARDS = (
    "exact_answer",
    "math_answer",
    "format_tags",
    "gsm8k_answer",
    "gsm8k_format",
    "env",
    "task",
    "overlong_penalty",
    "length_penalty",
)
REWARD_FORMS = "FILE.py:FUNCTION, package.module:FUNCTION or package.module.FUNCTION"


def unknown_reward(name: str) -> str:
    """The one line for a reward name that is neither a built-in reward nor a function reference."""
    return (
        f"reward function {shown(name)} is not a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor a "
        f"reference to your function ({REWARD_FORMS}); a reward model is an entry {{model: DIR}}"
    )


def _reward_entries(value: Any) -> Any:
    """TRL's short forms: one entry or a list; a bare string is a built-in reward when it is one's
    name, a reward server when it is an http(s):// address ({url: ...}), else a reference to a
    function ({python: ...})."""
    entries = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(entries, (list, tuple)):
        return value  # pydantic says what type it wants
    out: list[Any] = []
    for entry in entries:
        if isinstance(entry, str):
            name = entry.strip()
            if name in BUILTIN_REWARDS:
                entry = {"builtin": name}
            elif name.startswith(("http://", "https://")):  # a reward server
                entry = {"url": name}
            elif ":" in name or "." in name:
                entry = {"python": name}
            else:
                raise ValueError(unknown_reward(entry))
        out.append(entry)
    return out


# written out (config.yaml, print-config, the metrics' reporters: every JSON dump) with the credentials in
# a reward server's url as *** (config.remote_reward.redact_url); the config itself keeps them
RewardEntries = Annotated[
    list[dict[str, Any]] | None,
    BeforeValidator(_reward_entries),
    PlainSerializer(redacted_entries, when_used="json"),
]


# the data options GRPOConfig and SFTConfig share (dataset_* are TRL's ScriptArguments names)
DATASET_CONFIG = (
    "the config (subset) of a hub dataset or directory, e.g. main for openai/gsm8k (None = its only one)"
)
DATASET_TRAIN_SPLIT = "the split of a hub dataset or directory trained on"
DATASET_TEST_SPLIT = (
    "the held-out split of a hub dataset or directory (also eval_dataset's); without eval_dataset the "
    "held-out rows are this split of `dataset` when it has one ('test' absent: none; another name must exist)"
)
ANSWER_FORMAT = (
    "how answer_column writes the answer, made bare when rows are loaded: raw (as is) or gsm8k (a worked "
    "solution ending in '#### 1,234' -> '1234')"
)


# max_staleness (GRPOConfig, and AsyncGRPOConfig with its own default)
STALENESS_RESUME = Resume.fixed("the batches trained on so far were sampled that many versions back")


class _Keys(BaseModel):
    """Every config: TRL's names are translated or answered, unknown keys get the closest valid name
    (config/trl_names.py), for YAML, key=value and Python alike. Every field is declared with `option`
    (config/options.py): a class with a field that has no resume rule or description fails here, when
    it is defined."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        missing = undeclared(cls.model_fields)
        if missing:
            raise TypeError(
                f"{cls.__name__}: declare {', '.join(missing)} with option(default, resume=..., "
                "description=...) (config/options.py): its resume rule and its description sit on the field"
            )

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        return trl_names.check_keys(getattr(cls, "TRL_TABLES", cls.__name__), cls.model_fields, data)


class _TinyModel(_Keys):
    """The size of the built-in tiny Llama (used when model is 'tiny')."""

    model_config = STRICT

    tiny_hidden_size: int = option(128, ge=8, description="model=tiny: hidden size", resume=FIXED_MODEL)
    tiny_num_layers: int = option(4, ge=1, description="model=tiny: decoder layers", resume=FIXED_MODEL)
    tiny_num_heads: int = option(4, ge=1, description="model=tiny: attention heads", resume=FIXED_MODEL)
    tiny_intermediate_size: int = option(256, ge=8, description="model=tiny: MLP width", resume=FIXED_MODEL)


DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


class _Placement(_Keys):
    """Where the models and batches live."""

    model_config = STRICT

    device: str = option(
        "auto",
        pattern=DEVICE_PATTERN,
        description="auto (CUDA when available, else CPU), cpu, cuda or cuda:N; under torchrun each rank "
        "takes cuda:LOCAL_RANK (auto/cuda) or the CPU; metrics and checkpoints are always on the host",
        resume=Resume.applied("checkpoints are on the host: any device can continue them"),
    )
    num_threads: int | None = option(
        None,
        ge=1,
        le=1024,
        description="torch's intra-op CPU threads: a number pins it (bitwise reproducible whatever else "
        "runs); None = torch's default, and on a CPU fewer while other processes hold cores, so that "
        "runs sharing a CPU do not stall each other (train/threads.py)",
        resume=Resume.applied("threads change the speed, and the last bits of parallel sums"),
    )


class _Precision(_Keys):
    """Compute precision and the precision of what trains (GRPO and reward training)."""

    model_config = STRICT

    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32",
        description="compute precision: matmuls run in it under autocast, log-softmax and loss in float32; "
        "trainable weights and AdamW state stay float32 unless master_weights=dtype "
        "(TRL's bf16=true / fp16=true map here)",
        resume=Resume.fixed("the weights and updates so far were computed in it"),
    )
    master_weights: Literal["float32", "dtype"] = option(
        "float32",
        description="precision of the trainable weights and AdamW state: float32 (mixed precision) or "
        "dtype (everything in dtype: least memory, less exact updates)",
        resume=Resume.fixed("the weights and AdamW state are stored in this precision"),
    )

    @model_validator(mode="after")
    def _trainable_dtype(self) -> _Precision:
        _check_training_dtype(self.dtype)
        return self


class _Optimisation(_Keys):
    """AdamW, schedule and clipping, as TRL's defaults (the learning rate is each trainer's own)."""

    model_config = STRICT

    lr_scheduler_type: Literal["constant", "linear", "cosine"] = option(
        "linear",
        description="after warm-up: constant, or linear / cosine decay to 0 at max_steps",
        resume=FIXED_SCHEDULE,
    )
    warmup_steps: int = option(
        0, ge=0, description="optimizer steps of linear warm-up to learning_rate", resume=FIXED_SCHEDULE
    )
    # decoupled decay multiplies each weight by 1 - learning_rate·weight_decay per step: with both ≤ 1
    # the factor stays ≥ 0 (used values: 0 to 0.1)
    weight_decay: float = option(0.0, ge=0.0, le=1.0, description="AdamW weight decay", resume=FIXED_OPTIM)
    adam_beta1: float = option(0.9, ge=0.0, lt=1.0, description="AdamW beta1", resume=FIXED_OPTIM)
    adam_beta2: float = option(0.999, ge=0.0, lt=1.0, description="AdamW beta2", resume=FIXED_OPTIM)
    # past 1 the epsilon outweighs the root of any real second moment: AdamW becomes SGD at rate lr/eps
    # ≥ 1e-30: a smaller ε rounds to 0 in float32 kernels, and 0/0 = NaN where a gradient stayed 0
    adam_epsilon: float = option(1e-8, ge=1e-30, le=1.0, description="AdamW epsilon", resume=FIXED_OPTIM)
    # no upper bound: a very large norm (1e9) is how clipping is switched off
    max_grad_norm: float = option(
        1.0, gt=0.0, description="clip the gradient norm to this before each update", resume=FIXED_ALGO
    )


class _RunControl(_Keys):
    """How a training run treats its output_dir, and what it reports (GRPO and reward training)."""

    model_config = STRICT

    resume: bool = option(
        False, description="continue from the last complete checkpoint in output_dir", resume=INVOCATION
    )
    overwrite: bool = option(
        False,
        description="delete an earlier run in output_dir first (without it or resume: an error)",
        resume=INVOCATION,
    )
    progress: bool = option(True, description="show a progress bar", resume=APPLIED)
    report_to: ReportTo = option(
        ["tensorboard"],
        description="where metrics go besides metrics.jsonl: tensorboard (output_dir/tensorboard), wandb "
        "(offline unless WANDB_MODE or WANDB_API_KEY is set); [] or none = nowhere else (TRL: none; "
        "TensorBoard here, as it is installed with grpokit)",
        resume=APPLIED,
    )

    push_to_hub: bool = option(
        False,
        description="at the end, upload the final checkpoint's model (weights, config, tokenizer, chat "
        "template) to the Hugging Face Hub; needs a login (`hf auth login` or HF_TOKEN) (TRL's name)",
        resume=Resume.applied("it decides only whether the final model is uploaded at the end"),
    )
    hub_model_id: str | None = option(
        None,
        description="push_to_hub's repository, ORG/NAME (None: output_dir's folder name, under your account)",
        resume=Resume.applied("it names only where the final model is uploaded"),
    )
    hub_private_repo: bool | None = option(
        None,
        description="push_to_hub creates the repository private (None: the hub's default)",
        resume=Resume.applied("it decides only the visibility of a repository the push creates"),
    )

    @model_validator(mode="after")
    def _one_way_on(self) -> _RunControl:
        if self.resume and self.overwrite:
            raise ValueError(
                "resume=true continues the run in output_dir and overwrite=true deletes it: set only one."
            )
        if not self.push_to_hub and (self.hub_model_id is not None or self.hub_private_repo is not None):
            raise ValueError(
                "hub_model_id and hub_private_repo only apply with push_to_hub=true: set push_to_hub=true "
                "to upload the final model, or remove them."
            )
        return self


class GRPOConfig(_RunControl, _Placement, _Precision, _TinyModel, _Optimisation):
    model_config = STRICT

    # ---------------------------------------------------------------- run
    output_dir: str = option(
        "runs/grpo",
        description="where metrics, checkpoints and the report go",
        resume=Resume.applied("a run directory may be moved or renamed between runs"),
    )
    seed: Seed = option(
        42,
        description="seeds initialisation, prompt order and sampling (TRL: 42)",
        resume=Resume.fixed("initialisation, prompt order and every sampling seed derive from it"),
    )
    max_steps: int = option(
        200, ge=1, description="GRPO steps (one generation batch each)", resume=MAX_STEPS_RESUME
    )
    shuffle_dataset: bool = option(
        True,
        description="draw the training prompts in a new random order each pass (TRL's; false: in the "
        "data's order)",
        resume=Resume.fixed("the prompt order so far followed it"),
    )
    num_train_epochs: float | None = option(
        None,
        gt=0,
        description="TRL's: passes over the training prompts, read by GRPOTrainer when max_steps is not "
        "set (max_steps = ⌈num_train_epochs · prompts / prompts_per_step⌉; GRPOTrainer's default 3, as "
        "TRL's); the command line counts max_steps",
        resume=MAX_STEPS_RESUME,
    )
    logging_steps: int = option(1, ge=1, description="write metrics every N steps", resume=APPLIED)
    save_steps: int = option(
        50, ge=0, description="checkpoint every N steps (0 = only at the end)", resume=APPLIED
    )
    save_total_limit: int = option(2, ge=1, description="keep the last K checkpoints", resume=APPLIED)
    eval_steps: int = option(
        50,
        ge=0,
        description="evaluate on held-out prompts every N steps (0 = start and end only)",
        resume=APPLIED,
    )
    log_completions_steps: int = option(
        50, ge=0, description="print a table of sample completions every N steps", resume=APPLIED
    )
    num_completions_to_print: int | None = option(
        6,
        ge=1,
        description="rows of that table: the first completion of this many prompts (None: every prompt; "
        "TRL's default, None, prints every completion of the batch)",
        resume=APPLIED,
    )
    auto_find_batch_size: bool = option(
        False,
        description="when the device runs out of memory in a step's reference pass or update, redo the "
        "step with micro_batch_size halved (TRL's name: a batch that fits, by exponential decay); one "
        "process only",
        resume=Resume.applied("it decides only how a step that runs out of memory is redone"),
    )
    strict_invariants: bool = option(
        False,
        description="stop (with a checkpoint of the step) when a runtime invariant breaks, instead of "
        "warning once (docs/health.md)",
        resume=Resume.applied("it decides only whether a broken invariant stops the run"),
    )
    alert_thresholds: dict[str, float] = option(
        {},
        description="training-health alert thresholds to change, by name: entropy_collapse, length_growth, "
        "truncation_share, clip_ratio, kl, zero_spread, reward_hacking, logp_mismatch (defaults in "
        "docs/health.md)",
        resume=Resume.applied("they decide only when a warning is given"),
    )

    # ---------------------------------------------------------------- model
    model: str = option(
        "tiny",
        description="a hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct: through the Hugging Face cache, downloaded "
        "unless HF_HUB_OFFLINE=1), a local model directory, or 'tiny' to build a small Llama",
        resume=FIXED_MODEL,
    )
    model_revision: str | None = option(
        None,
        description="a hub id's branch, tag or commit (None = its default branch; TRL's name)",
        resume=FIXED_MODEL,
    )
    strategy: Literal["ddp", "fsdp"] = option(
        "ddp",
        description="under torchrun: ddp (whole model per rank) or fsdp (FSDP2 sharding)",
        resume=Resume.fixed("an FSDP checkpoint is sharded (dcp/), a DDP one is not"),
    )
    fsdp_cpu_offload: bool = option(
        False,
        description="fsdp: keep parameters and optimizer state on the CPU",
        resume=Resume.applied("memory only: where FSDP keeps the same shards"),
    )
    trust_remote_code: bool = option(
        False,
        description="run a model directory's own Python code (off: safe)",
        resume=Resume.applied("it decides only whether the model directory's own code may run"),
    )
    gradient_checkpointing: bool = option(
        False,
        description="keep each layer's input only and recompute the layer in the backward: the same "
        "gradients, a fraction of the activation memory, about an eighth more update time (TRL: True; "
        "off here: small models gain nothing)",
        resume=Resume.applied("memory only: the same gradients"),
    )
    torch_compile: bool | Literal["auto"] = option(
        "auto",
        description="compile the training passes with torch.compile: the policy's scoring pass forward "
        "and backward, the frozen passes (old policy, reference) and the loss, on shapes bucketed so "
        "that a run compiles a bounded number of graphs (logged as compile/graphs); auto = by device, "
        "off on a CPU (measured: benchmarks/RESULTS.md) and on a GPU until measured there (TRL: false). "
        "Policies of the Llama family, one process, no LoRA, one turn",
        resume=Resume.applied("a speed choice: the same numbers to float round-off"),
    )
    torch_compile_mode: (
        Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None
    ) = option(
        None,
        description="torch.compile's mode (None = its default)",
        resume=Resume.applied("a speed choice"),
    )
    torch_compile_backend: str | None = option(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$",
        description="torch.compile's backend (None = inductor)",
        resume=Resume.applied("a speed choice"),
    )
    fused_logps: bool = option(
        True,
        description="log-probs from hidden states and the LM head in chunks, never [B,T,V] logits "
        "(single process, plain linear head; otherwise the logits path)",
        resume=Resume.applied("the same log-probs, computed in chunks or not"),
    )

    # ---------------------------------------------------------------- data
    task: TaskName | None = option(
        "addition",
        description="a built-in task (prompts, reward, accuracy): addition, countdown, reverse, "
        "tool_addition (multi-turn, a calc tool), or reasoning_gym:NAME (a reasoning-gym generator and "
        "its scorer; pip install reasoning-gym); None to use `dataset`",
        resume=FIXED_DATA,
    )
    dataset: str | None = option(
        None,
        trl="dataset_name",  # TRL's ScriptArguments (its dataset_config too)
        description="prompts when task is None: a file (.jsonl/.json/.csv/.parquet), a Hugging Face Hub "
        "dataset (e.g. openai/gsm8k, through the HF cache; offline with HF_HUB_OFFLINE=1) or a directory "
        "laid out like one",
        resume=FIXED_DATA,
    )
    eval_dataset: str | None = option(
        None,
        description="held-out prompts (a file, hub dataset or directory), when task is None",
        resume=FIXED_HELD_OUT,
    )
    dataset_config: str | None = option(None, description=DATASET_CONFIG, resume=FIXED_DATA)
    dataset_train_split: str = option("train", description=DATASET_TRAIN_SPLIT, resume=FIXED_DATA)
    dataset_test_split: str = option("test", description=DATASET_TEST_SPLIT, resume=FIXED_HELD_OUT)
    prompt_column: str = option("prompt", description="the column holding the prompt", resume=FIXED_DATA)
    system_prompt: str | None = option(
        None,
        description="a system message opening every prompt: text prompts become [system, user] conversations "
        "rendered with the model's chat template (None = prompts as the data has them)",
        resume=FIXED_DATA,
    )
    chat_template_kwargs: dict[str, Any] | None = option(
        None,
        description="extra variables for the chat template, e.g. {enable_thinking: false} (TRL's name)",
        resume=FIXED_DATA,
    )
    num_eval_prompts: int = option(
        200,
        ge=1,
        description="held-out prompts used by evaluation",
        resume=Resume.fixed("a task's held-out split (and so its training prompts) depends on it"),
    )

    # ---------------------------------------------------------------- supervised warm start
    sft_steps: int = option(
        0,
        ge=0,
        description="supervised steps on the task's answers before GRPO (0 = none)",
        resume=FIXED_WARM_START,
    )
    sft_examples: int | None = option(
        None,
        ge=1,
        description="the warm start learns from the first N training rows (demonstrations; None = all); "
        "GRPO then trains on every prompt",
        resume=FIXED_WARM_START,
    )
    sft_warmup_steps: int = option(
        0,
        ge=0,
        description="warm start: linear warm-up steps before its cosine decay to 0",
        resume=FIXED_WARM_START,
    )
    sft_target_accuracy: float | None = option(
        None,
        gt=0.0,
        le=1.0,
        description="end the warm start early once greedy accuracy on a probe of training prompts "
        "reaches this (checked every 10 steps; needs an exact accuracy: a task or an answer column); "
        "None = run sft_steps",
        resume=FIXED_WARM_START,
    )
    sft_batch_size: int = option(
        256, ge=1, description="warm start: examples per step", resume=FIXED_WARM_START
    )
    sft_learning_rate: LearningRate = option(
        3e-3, description="warm start: peak learning rate", resume=FIXED_WARM_START
    )

    # ---------------------------------------------------------------- generation
    decode_loop: Literal["auto", "eager", "static", "compiled", "cuda_graph"] = option(
        "auto",
        description="how grpokit's one KV-cached decode loop runs: eager (a loop with growing shapes), "
        "static (a static-shape step over preallocated buffers, finished rows compacted away), "
        "compiled (static + torch.compile), "
        "cuda_graph (compiled, replayed as CUDA graphs); auto = cuda_graph on a GPU, eager on a CPU "
        "(measured fastest there: benchmarks/RESULTS.md)",
        resume=Resume.applied("a speed choice; the same distribution"),
    )
    num_generations: int = option(
        8, ge=2, description="G, completions per prompt (TRL: 8)", resume=FIXED_BATCH
    )
    prompts_per_step: int = option(
        32, ge=1, description="P, prompts per generation batch (B = P·G rows)", resume=FIXED_BATCH
    )
    micro_batch_size: int = option(
        MICRO_BATCH_MAX,
        ge=1,
        description="rows per forward/backward; gradients accumulate. Unset: the largest divisor of "
        f"prompts_per_step·num_generations up to {MICRO_BATCH_MAX}, and on a GPU the largest whose "
        "forecast peak memory fits 80% of the GPU (said when the run starts); set: it must divide that",
        resume=MICRO_BATCH_RESUME,
    )
    max_prompt_length: int | None = option(
        None, ge=1, description="prompt tokens (None = the task's, or no limit)", resume=FIXED_BATCH
    )
    max_completion_length: int | None = option(
        None, ge=1, description="tokens per completion (None = the task's; TRL: 256)", resume=FIXED_BATCH
    )
    prompt_truncation: Literal["left", "error"] = option(
        "left",
        description="prompts over max_prompt_length: cut from the left (counted) or an error",
        resume=FIXED_BATCH,
    )
    # > 0: greedy sampling gives every group G equal completions, no spread, nothing to learn. ≤ 10:
    # softmax(logits / 10) is close to uniform, noise rather than the policy's samples
    temperature: float = option(
        1.0,
        gt=0.0,
        le=10.0,
        description="sampling temperature of training completions and pass@k (> 0; evaluation's accuracy "
        "is greedy regardless)",
        resume=FIXED_SAMPLING,
    )
    top_p: float = option(
        1.0,
        gt=0.0,
        le=1.0,
        description="nucleus sampling: keep the top-p probability mass",
        resume=FIXED_SAMPLING,
    )
    top_k: int = option(
        0, ge=0, description="sample from the k likeliest tokens (0 = off; TRL: 0)", resume=FIXED_SAMPLING
    )
    min_p: float | None = option(
        None,
        ge=0.0,
        le=1.0,
        description="drop tokens below min_p × the top token's probability (None = off)",
        resume=FIXED_SAMPLING,
    )
    repetition_penalty: float = option(  # 10 already all but bans a repeat (logits divided by it)
        1.0,
        gt=0.0,
        le=10.0,
        description="penalise tokens already generated, as transformers does (1 = off)",
        resume=FIXED_SAMPLING,
    )

    # ---------------------------------------------------------------- multi-turn: tools and environments
    tools: list[str] | None = option(
        None,
        description="tools the policy may call in multi-turn episodes: built-in names (calc) or your "
        "functions as FILE.py:NAME | package.module:NAME (their signatures and docstrings describe them); "
        "None = the task's tools (tool_addition: [calc]), [] = none (single-turn)",
        resume=Resume.fixed("the episodes trained on so far had these tools"),
    )
    environment: str | None = option(
        None,
        description="your environment as FILE.py:NAME | package.module:NAME: a class or function "
        "returning a fresh object with reset(row) -> text and step(text) -> (text, reward | None, done)",
        resume=Resume.fixed("the episodes trained on so far came from it"),
    )
    max_turns: int = option(
        4,
        ge=1,
        description="multi-turn: policy turns per episode at most",
        resume=Resume.fixed("the episodes trained on so far were this long"),
    )
    tool_call_format: Literal["hermes", "brackets"] | None = option(
        None,
        description="how a tool call is written: hermes = <tool_call>…</tool_call> with "
        "<tool_response>…</tool_response>, brackets = […] with {…}; None = the task's, else hermes",
        resume=Resume.fixed("the policy learned to call tools in this format"),
    )
    tool_timeout: Seconds = option(
        5.0,
        description="seconds a tool may run before the policy is told it timed out",
        resume=Resume.applied("a bound on a slow tool, as reward_timeout"),
    )

    # ---------------------------------------------------------------- algorithm
    loss_type: LossType = option(
        "dapo", description="the GRPO variant's surrogate and normaliser (TRL: dapo)", resume=FIXED_ALGO
    )
    # in use: 0 to 0.1 (DeepSeekMath 0.04); 10 already pins the policy to the reference
    beta: float = option(0.0, ge=0.0, le=10.0, description="KL coefficient (TRL: 0.0)", resume=FIXED_ALGO)
    epsilon: float = option(  # ≤ 1: the lower clip 1 - epsilon of a ratio (> 0) is otherwise no bound
        0.2,
        ge=0.0,
        le=1.0,
        description="clip range: the ratio is kept within [1-epsilon, 1+epsilon_high]",
        resume=FIXED_ALGO,
    )
    epsilon_high: float | None = option(
        None,
        ge=0.0,
        le=RATIO_BOUND_MAX,
        description="upper clip range (None = epsilon); for cispo the absolute weight cap",
        resume=FIXED_ALGO,
    )
    delta: float | None = option(
        None,
        gt=1.0,
        le=RATIO_BOUND_MAX,
        description="two-sided clipping cap on the ratio (> 1)",
        resume=FIXED_ALGO,
    )
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = option(
        "token",
        description="the ratio per token, per sequence (GSPO) or sequence_token (GSPO-token)",
        resume=FIXED_ALGO,
    )
    top_entropy_quantile: float = option(
        1.0,
        gt=0.0,
        le=1.0,
        description="policy loss only on tokens in the top quantile of entropy (1 = all)",
        resume=FIXED_ALGO,
    )
    off_policy_mask_threshold: float | None = option(
        None,
        gt=0.0,
        description="DeepSeek-V3.2's off-policy sequence mask (TRL's): a completion with a negative "
        "advantage whose mean per-token log q − log π_θ (q: the policy that sampled it) exceeds this many "
        "nats keeps no policy loss (None = off; the paper's example 0.5)",
        resume=FIXED_ALGO,
    )
    target_entropy: float | None = option(
        None,
        gt=0.0,
        le=20.0,
        description="adaptive entropy control: an entropy bonus −c·H whose coefficient c ≥ 0 moves after "
        "each step by entropy_coef_lr × (target − mean token entropy), so the entropy tracks this many "
        "nats (None = no bonus)",
        resume=FIXED_ALGO,
    )
    entropy_coef_lr: float = option(
        0.3,
        gt=0.0,
        le=10.0,
        description="target_entropy: how fast the bonus's coefficient follows the gap",
        resume=FIXED_ALGO,
    )
    entropy_coef: float = option(
        0.0,
        ge=0.0,
        le=100.0,
        description="TRL's entropy bonus −c·H with H the mean per-token entropy for every loss type "
        "(0 = none); with use_adaptive_entropy, the first coefficient",
        resume=FIXED_ALGO,
    )
    use_adaptive_entropy: bool = option(
        False,
        description="TRL's adaptive entropy control (Skywork-OR1): after each step the coefficient rises by "
        "entropy_coef_delta while the entropy is at or below entropy_target and falls otherwise, within "
        "[entropy_coef_min, entropy_coef_max]; the bonus acts only while the entropy is at or below "
        "the target",
        resume=FIXED_ALGO,
    )
    entropy_coef_min: float = option(
        0.0, ge=0.0, description="use_adaptive_entropy: the coefficient's floor", resume=FIXED_ALGO
    )
    entropy_coef_max: float = option(
        1.0, ge=0.0, description="use_adaptive_entropy: the coefficient's ceiling", resume=FIXED_ALGO
    )
    entropy_coef_delta: float = option(
        0.005, gt=0.0, description="use_adaptive_entropy: the coefficient's step", resume=FIXED_ALGO
    )
    entropy_target: float = option(
        0.2,
        gt=0.0,
        description="use_adaptive_entropy: the mean per-token entropy, nats, at or below which the bonus "
        "acts and grows (TRL's default 0.2 nats acts only near collapse)",
        resume=FIXED_ALGO,
    )
    teacher_model: str | None = option(
        None,
        description="loss_type=opd or gkd: the teacher, a hub id or a model directory (a checkpoint of "
        "another run), with the policy's tokenizer; opd: its log-probs of the student's completions join the "
        "advantages; gkd: the loss is the divergence to its next-token distributions",
        resume=FIXED_ALGO,
    )
    teacher_model_revision: str | None = option(
        None,
        description="teacher_model's branch, tag or commit, when it is a hub id (model_revision's twin)",
        resume=FIXED_ALGO,
    )
    distill_coef: float = option(
        1.0,
        ge=0.0,
        le=100.0,
        description="loss_type=opd: λ, the weight of the teacher reverse KL term",
        resume=FIXED_ALGO,
    )
    gkd_beta: float = option(
        0.5,
        ge=0.0,
        le=1.0,
        description="loss_type=gkd: β of the generalised Jensen–Shannon divergence to the teacher (0: "
        "forward KL, 1: reverse KL; TRL's GKDConfig.beta, renamed: beta is the reference KL's coefficient)",
        resume=FIXED_ALGO,
    )
    lmbda: float = option(
        0.5,
        ge=0.0,
        le=1.0,
        description="loss_type=gkd: the share of steps that learn from the student's own samples "
        "(on-policy); the others from the dataset's answers (answer_column) as completions (TRL's lmbda)",
        resume=Resume.fixed(
            "the loss and the updates so far were computed with it; which steps learn from the dataset's "
            "answers derives from it"
        ),
    )
    seq_kd: bool = option(
        False,
        description="loss_type=gkd: the steps that are not on-policy learn from the teacher's own samples "
        "of each prompt (sequence-level KD) instead of the dataset's answers (TRL's GKDConfig.seq_kd)",
        resume=FIXED_ALGO,
    )
    teacher_device: str | None = option(
        None,
        pattern=DEVICE_PATTERN,
        description="loss_type=opd or gkd: where the teacher runs: cpu, cuda or cuda:N (None: the policy's "
        "device)",
        resume=Resume.applied("where the teacher runs changes its log-probs only by round-off"),
    )
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group",
        description="divide advantages by the group's reward std, the batch's, or none (Dr. GRPO)",
        resume=FIXED_ALGO,
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = option(
        "sum_then_normalize",
        description="several reward functions: sum the weighted rewards, then normalise as scale_rewards "
        "says; or normalise each function within each group, sum, then normalise the sum over the batch "
        "(GDPO; scale_rewards unused) (TRL's)",
        resume=FIXED_ALGO,
    )
    num_iterations: int = option(
        1,
        ge=1,
        description="μ: optimizer steps per generation batch",
        resume=Resume.fixed(
            "the loss and the updates so far were computed with it; the schedule counts "
            "max_steps·num_iterations updates"
        ),
    )
    sampling_correction: Literal[
        "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = option(
        "none",
        description="weight each token's policy term by pi_old/q when completions are drawn from q other "
        "than the training policy (top-k/top-p/min-p/repetition penalty, reduced-precision decoding); "
        "per token or per sequence, out-of-range ratios truncated or masked (TRL's vLLM importance "
        "sampling modes); none = off",
        resume=FIXED_ALGO,
    )
    sampling_correction_max: float | None = option(
        3.0,
        gt=0.0,
        le=RATIO_BOUND_MAX,
        description="sampling_correction: upper bound C_max of the ratio (None = none)",
        resume=FIXED_ALGO,
    )
    sampling_correction_min: float | None = option(
        None,
        ge=0.0,
        le=RATIO_BOUND_MAX,
        description="sampling_correction: lower bound C_min of the ratio (None = none)",
        resume=FIXED_ALGO,
    )
    mask_truncated_completions: bool = option(
        False, description="completions cut at max_completion_length get no loss (DAPO)", resume=FIXED_ALGO
    )
    reward_funcs: RewardEntries = option(
        None,
        description="None = the task's reward; else entries {model: DIR} (a trained reward model, "
        "optional batch_size, device), {builtin: exact_answer | math_answer | format_tags | env | task}, "
        "{python: FILE.py:FUNCTION | package.module:FUNCTION} (your own f(prompts, completions, **columns)) "
        "or {url: http://HOST:PORT/PATH} (a reward server, one POST a batch; optional timeout, retries, "
        "name, api_key_env, ca_bundle); a bare name is a builtin's when it is one, a url's when it is one, "
        "else a python reference (reward_funcs=exact_answer)",
        resume=Resume.fixed("the rewards trained on so far came from them"),
    )
    reward_weights: list[RewardWeight] | None = option(
        None,
        description="one weight per reward function, summed into the reward (None = all 1)",
        resume=Resume.fixed("the rewards trained on so far were summed with them"),
    )
    use_bias_correction_kl: bool = option(
        True, description="multiply the KL term by the ratio (TRL 1.16)", resume=FIXED_ALGO
    )
    sync_ref_model: bool = option(
        False,
        description="move the reference toward the policy every ref_model_sync_steps (TR-DPO)",
        resume=Resume.fixed("the reference model so far was (or was not) moved toward the policy"),
    )
    ref_model_mixup_alpha: float = option(
        0.6,
        ge=0.0,
        le=1.0,
        description="sync: reference = alpha·policy + (1-alpha)·reference",
        resume=Resume.fixed("the reference model so far was moved by it"),
    )
    ref_model_sync_steps: int = option(
        512,
        ge=1,
        description="sync the reference every N steps",
        resume=Resume.fixed("the reference model so far was moved on this period"),
    )
    dynamic_sampling: bool = option(
        False, description="DAPO: drop groups whose rewards all agree, draw more", resume=FIXED_ALGO
    )
    max_resample_batches: int = option(
        4, ge=1, description="bound on extra generation batches per step", resume=FIXED_ALGO
    )
    curriculum: bool = option(
        False,
        description="set aside prompts whose groups had zero reward spread (every completion solved, or "
        "every one failed) on curriculum_patience visits in a row; draw them again only now and then "
        "(data/curriculum.py)",
        resume=FIXED_CURRICULUM,
    )
    # 1: a prompt comes round once an epoch, so k visits take k epochs; at 2 a run of under two epochs
    # (the main job: 1.35) sets nothing aside in time (benchmarks/RESULTS.md, curriculum)
    curriculum_patience: int = option(
        1,
        ge=1,
        description="curriculum: visits in a row, all solved or all failed, that set a prompt aside",
        resume=FIXED_CURRICULUM,
    )
    curriculum_revisit: float = option(
        0.1,
        ge=0.0,
        le=1.0,
        description="curriculum: the probability that a set-aside prompt is drawn when its turn in an epoch "
        "comes",
        resume=FIXED_CURRICULUM,
    )
    on_reward_error: Literal["raise", "unscorable"] = option(
        "raise",
        description="a failing reward function: stop naming it, or score the row None (counted)",
        resume=Resume.applied("what happens to the next failing reward call"),
    )
    reward_timeout: float | None = option(
        300.0,
        gt=0.0,
        le=SECONDS_MAX,
        description="seconds the reward functions may take for one batch; past it the batch is an error "
        "naming the function (or its rows unscorable with on_reward_error=unscorable); None = no limit",
        resume=APPLIED,
    )

    # ---------------------------------------------------------------- asynchronous GRPO
    max_staleness: int | None = option(
        None,
        ge=0,
        le=64,
        description="sample and score in a rollout worker process, overlapped with the update: step s's "
        "batch is sampled with the weights after step max(0, s-1-k), exactly (train/async_rollout.py); "
        "None: the synchronous loop; 0: the synchronous run's numbers, sampled in another process",
        resume=STALENESS_RESUME,
    )
    weight_sync_steps: int = option(
        1,
        ge=1,
        le=1000,
        description="with max_staleness: publish the weights to the worker every this many steps (a batch "
        "is then sampled with the newest version published at or before max(0, s-1-k))",
        resume=Resume.fixed("the weights each batch so far was sampled with followed it"),
    )
    weight_sync_timeout: float = option(
        600.0,
        gt=0.0,
        le=SECONDS_MAX,
        description="with max_staleness: seconds the trainer waits for the worker's next batch before it "
        "stops the run with one line (a worker that died, hangs or is too slow)",
        resume=APPLIED,
    )
    rollout_workers: int = option(
        1,
        ge=1,
        le=64,
        description="with max_staleness: rollout worker processes, taking the steps in turn (step s is "
        "worker s mod n's), each sampling exactly as one worker would: the same numbers, up to "
        "max_staleness+1 batches sampled at once; not with dynamic_sampling or curriculum",
        resume=Resume.applied("how many batches are sampled at once: the numbers do not depend on it"),
    )
    rollout_device: str | None = option(
        None,
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="with max_staleness: where the rollout worker's copy of the policy lives: cpu, cuda or "
        "cuda:N; None: the trainer's device on a CPU, on GPUs the first one no rank of this machine "
        "trains on when there is one, else the trainer's own",
        resume=APPLIED,
    )

    rollout_server_urls: list[str] | None = option(
        None,
        description="with max_staleness: sample on these `grpokit serve-policy` servers (http://HOST:PORT), "
        "each batch's prompts split over them, weights sent by path before each version's first batch "
        "(engine/remote.py); one server: the in-process run's numbers; None: in the rollout worker",
        resume=Resume.applied("where the next batches are sampled (one server: as in process)"),
    )
    request_timeout: float = option(
        600.0,
        gt=0.0,
        le=SECONDS_MAX,
        description="with rollout_server_urls: seconds a rollout server may take to answer one request "
        "(a batch's share, a weight update) before the run stops naming it (TRL's AsyncGRPOConfig name)",
        resume=APPLIED,
    )

    # ---------------------------------------------------------------- optimisation
    learning_rate: LearningRate = option(
        1e-6, description="peak AdamW learning rate (TRL: 1e-6)", resume=FIXED_OPTIM
    )
    max_consecutive_skips: int = option(
        3,
        ge=1,
        description="stop (with a checkpoint) after this many updates in a row with a non-finite loss",
        resume=APPLIED,
    )

    # ---------------------------------------------------------------- evaluation
    pass_at_k: int = option(
        0,
        ge=0,
        description="also sample k completions per held-out prompt and report pass@k",
        resume=Resume.applied("an extra evaluation metric; training is unchanged"),
    )

    # ---------------------------------------------------------------- own data; LoRA (TRL ModelConfig names)
    answer_column: str = option(
        "answer",
        description="the column of a dataset's rows holding the reference answer: what sft_steps learns, "
        "and the exact-match accuracy evaluation reports when every held-out row has one",
        resume=FIXED_DATA,
    )
    answer_format: Literal["raw", "gsm8k"] = option("raw", description=ANSWER_FORMAT, resume=FIXED_DATA)
    use_peft: bool = option(
        False,
        description="train LoRA adapters (after any warm start) instead of every weight (needs peft)",
        resume=Resume.fixed("the checkpoint holds LoRA adapters or whole weights"),
    )
    lora_r: int = option(16, ge=1, description="LoRA rank (TRL: 16)", resume=FIXED_MODEL)
    lora_alpha: int = option(
        32,
        ge=1,
        description="LoRA scale numerator: adapters scale by alpha/r (TRL: 32)",
        resume=Resume.fixed("the adapters were trained at this scale"),
    )
    lora_dropout: float = option(
        0.05, ge=0.0, lt=1.0, description="dropout on the adapters' input (TRL: 0.05)", resume=FIXED_ALGO
    )
    lora_target_modules: list[str] | None = option(
        None,
        min_length=1,
        description="module names to adapt (e.g. [q_proj, v_proj]); None = every linear projection "
        "except the LM head",
        resume=FIXED_MODEL,
    )

    @field_validator("alert_thresholds")
    @classmethod
    def _known_alerts(cls, value: dict[str, float]) -> dict[str, float]:
        """Each name is an alert's, each threshold a finite number ≥ 0."""
        for name, threshold in value.items():
            if not math.isfinite(threshold) or threshold < 0:
                raise ValueError(f"alert_thresholds.{name}={threshold} must be a finite number ≥ 0")
            if name not in ALERT_THRESHOLDS:
                raise ValueError(
                    f"alert_thresholds has no alert {name!r}; the alerts are {', '.join(ALERT_THRESHOLDS)}"
                )
        return value

    @model_validator(mode="before")
    @classmethod
    def _trl_max_steps(cls, data: Any) -> Any:
        """TRL's max_steps=-1 ("count num_train_epochs instead") leaves max_steps unset."""
        if isinstance(data, dict) and data.get("max_steps") == -1 and not isinstance(data["max_steps"], bool):
            data = {k: v for k, v in data.items() if k != "max_steps"}
            trl_names.say(
                "TRL value: max_steps=-1 -> max_steps unset (GRPOTrainer counts num_train_epochs passes over "
                "its train_dataset; otherwise max_steps keeps its default)"
            )
        return data

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_scale_rewards(cls, value: Any) -> Any:
        """TRL 1.16 still takes scale_rewards as a flag: true is "group", false is "none" (said once)."""
        if isinstance(value, bool):
            mapped = "group" if value else "none"
            trl_names.say(f"TRL value: scale_rewards={str(value).lower()} -> scale_rewards={mapped}")
            return mapped
        return value

    @field_validator("temperature", mode="before")
    @classmethod
    def _sampling_temperature(cls, value: Any) -> Any:
        """0 is refused with the reason (pydantic's "greater than 0" would not say it)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            raise ValueError(
                "temperature=0 samples greedily: the G completions of a prompt are then all the same, "
                "every group has zero reward spread and GRPO learns nothing; use a temperature > 0 "
                "(e.g. 1.0; held-out accuracy is measured greedily anyway)"
            )
        return value

    def _check_teacher(self) -> None:
        """loss_type=opd or gkd and teacher_model come together, the teacher is a trained model, and each
        distillation option is set only where it is read."""
        distilling = self.loss_type in ("opd", "gkd")
        if distilling != (self.teacher_model is not None):
            raise ValueError(
                f"loss_type={self.loss_type} distills from teacher_model, and teacher_model is read only by "
                "loss_type=opd or gkd: set both (e.g. loss_type=opd teacher_model=runs/addition/final)"
                if distilling
                else "teacher_model is read only by loss_type=opd or gkd: set loss_type=opd (or gkd) with "
                "it, or drop teacher_model"
            )
        if self.teacher_model_revision is not None and self.teacher_model is None:
            raise ValueError("teacher_model_revision is read only with teacher_model (a hub id): set both")
        if self.teacher_model == "tiny":
            raise ValueError(
                "teacher_model=tiny would be an untrained model: name a trained one, a hub id or a model "
                "directory such as another run's final/ or checkpoint-N/"
            )
        unread = {
            "distill_coef": (self.distill_coef != 1.0 and self.loss_type != "opd", "loss_type=opd"),
            "gkd_beta": (self.gkd_beta != 0.5 and self.loss_type != "gkd", "loss_type=gkd"),
            "lmbda": (self.lmbda != 0.5 and self.loss_type != "gkd", "loss_type=gkd"),
            "seq_kd": (self.seq_kd and self.loss_type != "gkd", "loss_type=gkd"),
        }
        for name, (set_unread, reader) in unread.items():
            if set_unread:
                value = getattr(self, name)
                shown = str(value).lower() if isinstance(value, bool) else f"{value:g}"
                raise ValueError(f"{name}={shown} is read only by {reader}: set it there, or drop it")
        if self.loss_type == "gkd":
            self._check_gkd()
        self._check_entropy()

    def _check_entropy(self) -> None:
        """grpokit's target_entropy and TRL's entropy_coef / use_adaptive_entropy are two controls of one
        bonus: one at a time."""
        if self.target_entropy is not None and (self.entropy_coef != 0.0 or self.use_adaptive_entropy):
            raise ValueError(
                "target_entropy (grpokit's control) and entropy_coef / use_adaptive_entropy (TRL's) both set "
                "the entropy bonus: keep one of them"
            )
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min={self.entropy_coef_min:g} is above "
                f"entropy_coef_max={self.entropy_coef_max:g}"
            )

    def _check_gkd(self) -> None:
        """What loss_type=gkd's loss (the divergence to the teacher, no rewards in it) cannot take."""
        pointless = {
            "beta": (self.beta != 0.0, "its loss has no reference term; set beta=0"),
            "sampling_correction": (
                self.sampling_correction != "none",
                "its loss weighs no sampled token by a ratio; set sampling_correction=none",
            ),
            "dynamic_sampling": (
                self.dynamic_sampling,
                "its loss does not read rewards, so groups of equal reward teach as much as any",
            ),
            "curriculum": (self.curriculum, "its loss does not read rewards, which the curriculum sorts by"),
            "target_entropy": (
                self.target_entropy is not None,
                "the divergence to the teacher already sets the student's entropy",
            ),
            "entropy_coef": (
                self.entropy_coef != 0.0 or self.use_adaptive_entropy,
                "the divergence to the teacher already sets the student's entropy",
            ),
        }
        surrogate = "its loss is no policy-gradient surrogate, which this shapes"
        pointless |= {
            "top_entropy_quantile": (self.top_entropy_quantile != 1.0, surrogate),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold is not None, surrogate),
            "importance_sampling_level": (self.importance_sampling_level != "token", surrogate),
            "epsilon_high": (self.epsilon_high is not None, surrogate),
            "delta": (self.delta is not None, surrogate),
            "torch_compile": (
                self.torch_compile is True,
                "its passes over whole distributions are not compiled yet; set torch_compile=false",
            ),
            "seq_kd": (
                self.seq_kd and self.lmbda >= 1.0,
                "with lmbda=1 every step is on the student's own samples and the teacher's are never drawn",
            ),
        }
        for name, (bad, why) in pointless.items():
            if bad:
                raise ValueError(f"{name} with loss_type=gkd is refused: {why}")
        if self.lmbda < 1.0 and (self.tools or self.environment is not None):
            raise ValueError(
                f"lmbda={self.lmbda:g} with multi-turn episodes (tools or environment) is refused: a dataset "
                "answer is no transcript; set lmbda=1 (every step on the student's own episodes)"
            )

    def _check_compile(self) -> None:
        """torch_compile_mode and torch_compile_backend are read only when the passes are compiled."""
        if self.torch_compile is False:
            for name in ("torch_compile_mode", "torch_compile_backend"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(
                        f"{name} is read only with torch_compile=true or auto; drop it or set both"
                    )

    def _check_servers(self) -> None:
        """rollout_server_urls: URLs, and nothing a server does not sample."""
        urls = self.rollout_server_urls or []
        if not urls:
            raise ValueError(
                "rollout_server_urls is empty: give at least one http://HOST:PORT, or leave it unset"
            )
        for url in urls:
            if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
                raise ValueError(
                    f"rollout_server_urls: {url!r} is not an http(s) URL (http://HOST:PORT, where "
                    "`grpokit serve-policy MODEL --port PORT` listens, or the http://HOST:PORT/v1 it prints)"
                )
        if len({server_base_url(url) for url in urls}) != len(urls):  # (http://H:P/v1 is http://H:P)
            raise ValueError("rollout_server_urls names a server twice: each server once")

    def _check_async(self) -> None:
        """weight_sync_* are read only with max_staleness, and what the rollout worker does not take
        yet is refused in one line (config/async_rules.py)."""
        if self.max_staleness is None:
            names = "weight_sync_steps weight_sync_timeout rollout_workers rollout_device rollout_server_urls"
            for name in [*names.split(), "request_timeout"]:
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name} is read only with max_staleness (asynchronous GRPO): set both")
            return
        if self.rollout_server_urls is not None:
            self._check_servers()
        refusal = async_refusal(
            AsyncFacts(
                loss_type=self.loss_type,
                lora=self.use_peft,
                servers=self.rollout_server_urls is not None,
                episodes=bool(self.tools) or self.environment is not None,
                workers=self.rollout_workers,
                dynamic_sampling=self.dynamic_sampling,
                curriculum=self.curriculum,
            )
        )
        if refusal is not None:
            raise ValueError(refusal)

    @model_validator(mode="after")
    def _cross_field(self) -> GRPOConfig:
        low, high = self.sampling_correction_min, self.sampling_correction_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"sampling_correction_min={low:g} must be below sampling_correction_max={high:g}: the "
                "ratio would be kept within an empty range; lower the minimum or raise the maximum"
            )
        self._check_teacher()
        self._check_async()
        self._check_compile()
        if self.sampling_correction != "none" and self.loss_type == "vespo":
            raise ValueError(
                "sampling_correction with loss_type=vespo is not supported (VESPO folds importance weights "
                "into its own); use sampling_correction=none or another loss_type"
            )
        if self.use_peft and self.strategy == "fsdp":
            raise ValueError(
                "use_peft=true with strategy=fsdp is not supported (a LoRA checkpoint is saved from the "
                "whole model, which FSDP shards); use strategy=ddp, whose ranks each hold the small adapters"
            )
        rows = self.prompts_per_step * self.num_generations
        _fit_micro_batch(self, rows)
        if rows % self.micro_batch_size != 0:
            raise ValueError(
                f"prompts_per_step·num_generations = {rows} rows must be divisible by micro_batch_size="
                f"{self.micro_batch_size}; choose a micro_batch_size that divides {rows}"
            )
        if self.reward_weights is not None and not self.reward_weights:
            raise ValueError("reward_weights, when given, needs one weight per reward function")
        for spec in self.reward_funcs or []:
            _check_reward_entry(spec)
        if self.environment is not None and self.tools:
            raise ValueError(
                "tools and environment are both set; an environment runs its own tools: give tools as a "
                "list (tool-calling episodes) or environment (your own episodes), not both"
            )
        if self.environment is not None and self.task is not None:
            raise ValueError(
                f"environment is set with task={self.task}: your environment runs on your own rows and "
                "pays its own reward; set task: null and dataset (a built-in task brings its own)"
            )
        for reference in [*(self.tools or []), *([self.environment] if self.environment else [])]:
            _check_reference(reference)
        return self


def _fit_micro_batch(cfg: GRPOConfig, rows: int) -> None:
    """micro_batch_size left unset: the largest divisor of the step's `rows` up to MICRO_BATCH_MAX, so
    that a small batch (2 prompts × 4 completions) needs no micro_batch_size of its own."""
    if "micro_batch_size" not in cfg.model_fields_set:
        fitted = max(d for d in range(1, min(rows, MICRO_BATCH_MAX) + 1) if rows % d == 0)
        cfg.__dict__["micro_batch_size"] = fitted  # (the config is frozen: set while it is validated)


def _check_training_dtype(dtype: str) -> None:
    """float16 training needs loss scaling (its gradients underflow otherwise), which the GRPO and
    reward trainers do not do: refused, with the way out."""
    if dtype == "float16":
        raise ValueError(
            "dtype=float16 (TRL's fp16=true) is not supported for training: float16 gradients underflow "
            "without loss scaling, which this trainer does not do; use dtype=bfloat16 (GPUs from Ampere "
            "on) or dtype=float32"
        )


def _check_reference(reference: str) -> None:
    """A tool or environment reference: a built-in tool name, FILE.py:NAME or package.module:NAME."""
    if ":" not in reference and not reference.isidentifier():
        raise ValueError(
            f"{shown(reference)} is not a built-in tool name nor a reference FILE.py:NAME or "
            "package.module:NAME"
        )


def _check_reward_entry(spec: dict[str, Any]) -> None:
    """One reward_funcs entry: exactly one of model / builtin / python / url, and only the options it
    takes."""
    kinds = {"model", "builtin", "python", "url"} & set(spec)
    said = shown(redacted_entries([spec])[0])  # a password in the url is not repeated
    extras = set(spec) - {"model", "builtin", "python", "batch_size", "device", "revision"}
    if "model" not in spec:  # a reward model's own options
        extras |= {"batch_size", "device", "revision"} & set(spec)
    if "url" in spec:  # a reward server: its own options only
        extras = set(spec) - {"url", *REMOTE_OPTIONS}
    if len(kinds) != 1 or extras or ("python" in spec and set(spec) != {"python"}):
        raise ValueError(
            f"reward_funcs entry {said} must have exactly one of 'model' (a directory), 'builtin' "
            f"({', '.join(BUILTIN_REWARDS)}), 'python' (FILE.py:FUNCTION or "
            "package.module:FUNCTION) or 'url' (http://HOST:PORT/PATH, a reward server); a model entry "
            "optionally batch_size, device, revision (of a hub id); a url entry optionally timeout, "
            "retries, name, api_key_env, ca_bundle"
        )
    if "url" in spec:
        check_remote_reward(f"reward_funcs entry {said}", **spec)
    if "builtin" in spec and spec["builtin"] not in BUILTIN_REWARDS:
        raise ValueError(unknown_reward(spec["builtin"]))
    if "python" in spec:
        ref = spec["python"]
        where, sep, name = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
        if isinstance(ref, str) and not sep and not ref.endswith(".py"):
            where, sep, name = ref.rpartition(".")
        if not sep or not where.strip() or not name.isidentifier():
            raise ValueError(
                f"reward_funcs entry {said}: 'python' must name a function as 'FILE.py:FUNCTION', "
                "'package.module:FUNCTION' or 'package.module.FUNCTION'"
            )


class SFTConfig(_Placement, _TinyModel):
    """A minimal supervised warm start: cross-entropy on the task's answers."""

    model_config = STRICT

    output_dir: str = option(
        "runs/sft",
        description="where the final model and config go",
        resume=Resume.applied("a run directory may be moved or renamed between runs"),
    )
    overwrite: bool = option(
        False,
        description="delete an earlier run in output_dir first (without it: an error)",
        resume=INVOCATION,
    )
    seed: Seed = option(
        42,
        description="seeds initialisation and example order",
        resume=Resume.fixed("initialisation, prompt order and every sampling seed derive from it"),
    )
    model: str = option(
        "tiny",
        description="a hub id (through the Hugging Face cache), a local model directory, or 'tiny'",
        resume=FIXED_MODEL,
    )
    model_revision: str | None = option(
        None, description="a hub id's branch, tag or commit (TRL's name)", resume=FIXED_MODEL
    )
    task: Literal["addition", "chain", "countdown", "reverse"] | None = option(
        "addition", description="a built-in task; None to train on `dataset`", resume=FIXED_DATA
    )
    num_eval_prompts: int = option(
        200,
        ge=1,
        description="held-out prompts for the accuracy after training",
        resume=Resume.fixed("a task's held-out split (and so its training prompts) depends on it"),
    )
    max_steps: int = option(600, ge=1, description="supervised steps", resume=MAX_STEPS_RESUME)
    batch_size: int = option(256, ge=1, description="examples per step", resume=FIXED_BATCH)
    learning_rate: LearningRate = option(3e-3, description="peak learning rate", resume=FIXED_OPTIM)
    progress: bool = option(True, description="show progress", resume=APPLIED)

    # ---------------------------------------------------------------- own data (as GRPOConfig)
    dataset: str | None = option(
        None,
        trl="dataset_name",  # TRL's ScriptArguments (its dataset_config too)
        description="prompt/answer rows when task is None: a file (.jsonl/.json/.csv/.parquet), a Hugging "
        "Face Hub dataset (through the HF cache) or a directory laid out like one",
        resume=FIXED_DATA,
    )
    eval_dataset: str | None = option(
        None,
        description="held-out prompt/answer rows: greedy exact-answer accuracy after training",
        resume=FIXED_HELD_OUT,
    )
    dataset_config: str | None = option(None, description=DATASET_CONFIG, resume=FIXED_DATA)
    dataset_train_split: str = option("train", description=DATASET_TRAIN_SPLIT, resume=FIXED_DATA)
    dataset_test_split: str = option("test", description=DATASET_TEST_SPLIT, resume=FIXED_HELD_OUT)
    prompt_column: str = option("prompt", description="the column holding the prompt", resume=FIXED_DATA)
    answer_column: str = option(
        "answer", description="the column holding the answer the model learns", resume=FIXED_DATA
    )
    answer_format: Literal["raw", "gsm8k"] = option("raw", description=ANSWER_FORMAT, resume=FIXED_DATA)


class RewardConfig(_RunControl, _Placement, _Precision, _TinyModel, _Optimisation):
    """Bradley–Terry reward-model training. Names and defaults follow TRL 1.16's RewardConfig where
    TRL has the option (learning_rate 1e-4, max_length 1024, center_rewards_coefficient None)."""

    model_config = STRICT

    # ---------------------------------------------------------------- run
    output_dir: str = option(
        "runs/reward",
        description="where metrics, checkpoints and calibration go",
        resume=Resume.applied("a run directory may be moved or renamed between runs"),
    )
    seed: Seed = option(
        42,
        description="seeds initialisation, pair order and the built-in pairs",
        resume=Resume.fixed("initialisation, prompt order and every sampling seed derive from it"),
    )
    max_steps: int = option(300, ge=1, description="optimizer steps", resume=MAX_STEPS_RESUME)
    logging_steps: int = option(1, ge=1, description="write metrics every N steps", resume=APPLIED)
    save_steps: int = option(
        100, ge=0, description="checkpoint every N steps (0 = only at the end)", resume=APPLIED
    )
    save_total_limit: int = option(2, ge=1, description="keep the last K checkpoints", resume=APPLIED)
    eval_steps: int = option(
        50, ge=0, description="evaluate every N steps (0 = start and end only)", resume=APPLIED
    )

    # ---------------------------------------------------------------- model
    model: str = option(
        "tiny",
        description="a sequence-classification or causal LM: a hub id (through the Hugging Face cache), a "
        "local directory, or 'tiny'",
        resume=FIXED_MODEL,
    )
    model_revision: str | None = option(
        None, description="a hub id's branch, tag or commit (TRL's name)", resume=FIXED_MODEL
    )
    strategy: Literal["ddp", "fsdp"] = option(
        "ddp",
        description="under torchrun: ddp or fsdp (FSDP2 sharding)",
        resume=Resume.fixed("an FSDP checkpoint is sharded (dcp/), a DDP one is not"),
    )
    trust_remote_code: bool = option(
        False,
        description="run a model directory's own Python code (off: safe)",
        resume=Resume.applied("it decides only whether the model directory's own code may run"),
    )

    # ---------------------------------------------------------------- data
    task: Literal["addition", "countdown", "reverse"] | None = option(
        "addition",
        description="built-in preference pairs from a task (chosen right, rejected wrong)",
        resume=FIXED_DATA,
    )
    near_miss: float = option(
        0.0, ge=0.0, le=1.0, description="share of rejected answers that are near misses", resume=FIXED_DATA
    )
    dataset: str | None = option(
        None,
        trl="dataset_name",
        description="preference file with chosen/rejected (prompt, margin optional)",
        resume=FIXED_DATA,
    )
    eval_dataset: str | None = option(
        None, description="held-out preference file when task is None", resume=FIXED_HELD_OUT
    )
    num_eval_pairs: int = option(
        200,
        ge=1,
        description="held-out pairs used by evaluation",
        resume=Resume.fixed("a task's held-out split (and so its training pairs) depends on it"),
    )
    max_length: int = option(1024, ge=2, description="tokens per sequence (TRL: 1024)", resume=FIXED_DATA)
    long_pairs: Literal["drop", "truncate"] = option(
        "drop", description="pairs over max_length: dropped (TRL) or cut", resume=FIXED_DATA
    )

    # ---------------------------------------------------------------- optimisation
    batch_size: int = option(64, ge=1, description="pairs per optimizer step", resume=FIXED_BATCH)
    micro_batch_size: int = option(
        64,
        ge=1,
        description="pairs per forward/backward; gradients accumulate",
        resume=MICRO_BATCH_RESUME,
    )
    center_rewards_coefficient: float | None = option(  # in use 0.01 to 0.1; 10 outweighs the loss itself
        None,
        ge=0.0,
        le=10.0,
        description="adds this × mean((r_chosen + r_rejected)²), centring rewards (TRL: None; EasyDeL: 0.1)",
        resume=FIXED_ALGO,
    )
    learning_rate: LearningRate = option(
        1e-4, description="peak AdamW learning rate (TRL: 1e-4)", resume=FIXED_OPTIM
    )
    max_consecutive_skips: int = option(
        3, ge=1, description="stop after this many non-finite updates in a row", resume=APPLIED
    )

    @model_validator(mode="after")
    def _cross_field(self) -> RewardConfig:
        if self.batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by micro_batch_size={self.micro_batch_size}"
            )
        return self


class AsyncGRPOConfig(GRPOConfig):
    """TRL's AsyncGRPOConfig (trl.experimental.async_grpo): GRPOConfig with the rollout worker on.
    max_staleness defaults to 1, not TRL's 4: grpokit's staleness is exact (every batch is exactly that
    many weight versions old, never fewer), and 1 already overlaps sampling and scoring with the whole
    update. TRL's options for its vLLM server, queue and task scheduling are answered in one line each
    (`trl_names.ASYNC_NOT_USED`) and otherwise not used."""

    TRL_TABLES: ClassVar[str] = "GRPOConfig"  # TRL's names are answered as GRPOConfig's

    max_staleness: int | None = option(
        1,
        ge=0,
        le=64,
        description=GRPOConfig.model_fields["max_staleness"].description or "",
        resume=STALENESS_RESUME,
    )

    @model_validator(mode="before")
    @classmethod
    def _trl_async_names(cls, data: Any) -> Any:
        return trl_names.drop_async_names(data)
