"""What a TRL user types, in grpokit: the tables of TRL option names.

Each TRL name that has no grpokit field of the same name is either accepted as an alias (translated
to grpokit's option, the mapping said once on stderr through the `grpokit.config` logger) or
rejected with the grpokit option to set instead. A plain rename (TRL's dataset_name is grpokit's
dataset) is declared on the option's own field (`option(..., trl=...)`, config/options.py); the
names that need logic (bf16 -> dtype, the *_strategy options, TRL's batch geometry) are rules here.
Any other TRL name is answered as a TRL option grpokit does not have, never with a "did you mean" to
an unrelated key. The config classes call
`check_keys` before validation, so YAML files, key=value overrides and `GRPOConfig(...)` in Python
behave alike; `load_config` calls `translate` once per source so that a command-line alias wins
over the file's value. No torch import here.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic.fields import FieldInfo

from .errors import ConfigError, shorten, shown
from .options import trl_rename

# ------------------------------------------------------------------------ accepted: aliases

Updates = dict[str, Any]
Rule = Callable[[Any, Mapping[str, Any]], tuple[Updates, str]]


def _check_switch(name: str, value: Any, option: str) -> None:
    """TRL's switch `name` must be true or false: the error otherwise names grpokit's `option`."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false (got {shown(value)}); grpokit's option is {option}.")


def _precision(name: str, dtype: str) -> Rule:
    """TRL's bf16 / fp16 switches -> grpokit's dtype (the dtype the model is kept and trained in)."""

    def rule(value: Any, data: Mapping[str, Any]) -> tuple[Updates, str]:
        _check_switch(name, value, "dtype")
        current = data.get("dtype")
        if value:
            if current not in (None, dtype):
                raise ConfigError(f"{name}=true contradicts dtype={current}; set only dtype.")
            return {"dtype": dtype}, f"TRL name: {name}=true -> dtype={dtype}"
        if current == dtype:
            raise ConfigError(f"{name}=false contradicts dtype={dtype}; set only dtype.")
        return {}, f"TRL name: {name}=false -> dtype unchanged ({current or 'the default, float32'})"

    return rule


def _only_steps(name: str, grpokit_key: str, answer: str) -> Rule:
    """TRL's *_strategy: "steps" is what grpokit always does; anything else is answered."""

    def rule(value: Any, data: Mapping[str, Any]) -> tuple[Updates, str]:
        if value == "steps":
            return {}, f"TRL name: {name}=steps -> {grpokit_key} (grpokit always counts in steps)"
        given = "no" if value is False else value  # YAML 1.1 reads a bare `no` as false
        raise ConfigError(f"{name}={shorten(str(given))} is a TRL option; {answer}")

    return rule


def _rename(name: str, grpokit_key: str) -> Rule:
    """A TRL name that is a plain rename of a grpokit option, as the option's field declares it
    (`option(..., trl=NAME)`, config/options.py): TRL's dataset_name is grpokit's dataset."""

    def rule(value: Any, data: Mapping[str, Any]) -> tuple[Updates, str]:
        if data.get(grpokit_key) not in (None, value):
            raise ConfigError(f"{name} (TRL's name) and {grpokit_key} are both set; set only {grpokit_key}.")
        return {grpokit_key: value}, f"TRL name: {name}={shorten(str(value))} -> {grpokit_key}"

    return rule


def _negated(name: str, grpokit_key: str) -> Rule:
    """A TRL switch that is the opposite of a grpokit one (disable_tqdm -> progress)."""

    def rule(value: Any, data: Mapping[str, Any]) -> tuple[Updates, str]:
        _check_switch(name, value, grpokit_key)
        if data.get(grpokit_key) not in (None, not value):
            raise ConfigError(f"{name} (TRL's name) and {grpokit_key} are both set; set only {grpokit_key}.")
        return {
            grpokit_key: not value
        }, f"TRL name: {name}={str(value).lower()} -> {grpokit_key}={str(not value).lower()}"

    return rule


def _liger(value: Any, data: Mapping[str, Any]) -> tuple[Updates, str]:
    """TRL's use_liger_kernel: Liger's fused linear loss never holds [B,T,V] logits, as grpokit's own
    chunked LM head (fused_logps, on by default) does not; false keeps grpokit's choice (the same
    log-probs either way)."""
    _check_switch("use_liger_kernel", value, "fused_logps")
    if not value:
        return {}, "TRL name: use_liger_kernel=false -> fused_logps unchanged (the same log-probs either way)"
    if data.get("fused_logps") is False:
        raise ConfigError("use_liger_kernel=true contradicts fused_logps=false; set only fused_logps.")
    return {"fused_logps": True}, (
        "TRL name: use_liger_kernel=true -> fused_logps=true (grpokit's own chunked LM head: log-probs "
        "without [B,T,V] logits, as Liger's fused loss)"
    )


def _log_completions(value: Any, data: Mapping[str, Any]) -> tuple[Updates, str]:
    """TRL's log_completions: a table of sample completions every logging_steps steps (TRL's default
    and grpokit's: 1), or none."""
    _check_switch("log_completions", value, "log_completions_steps")
    if "log_completions_steps" in data:
        raise ConfigError(
            "log_completions (TRL's name) and log_completions_steps are both set; set only "
            "log_completions_steps."
        )
    every = data.get("logging_steps", 1) if value else 0
    said = f"a table of sample completions every logging_steps={every} steps" if value else "no table"
    return {"log_completions_steps": every}, (
        f"TRL name: log_completions={str(value).lower()} -> log_completions_steps={every} ({said})"
    )


_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_kwargs(value: Any, data: Mapping[str, Any]) -> tuple[Updates, str]:
    """TRL's generation_kwargs (passed to transformers' generate): its sampling keys set grpokit's own
    options of those names (max_new_tokens: max_completion_length); do_sample=true is what grpokit does;
    keys grpokit's sampler does not have (num_beams, length_penalty, ...) are said unused."""
    if value is None:
        return {}, "TRL name: generation_kwargs=None -> nothing to apply"
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"generation_kwargs must be a mapping of generate()'s options (got {shown(value)})."
        )
    updates: dict[str, Any] = {}
    unused = []
    for key, item in value.items():
        own = "max_completion_length" if key == "max_new_tokens" else key
        if own in _SAMPLING_KEYS or own == "max_completion_length":
            if own in data and data[own] != item:
                raise ConfigError(
                    f"generation_kwargs sets {key}={shown(item)} and {own}={shown(data[own])} is set too; "
                    "set it once."
                )
            updates[own] = item
        elif key == "do_sample" and item is False:
            raise ConfigError("generation_kwargs do_sample=false: GRPO learns from sampled completions.")
        elif key != "do_sample":
            unused.append(f"{key}={shown(item)}")
    line = "TRL name: generation_kwargs -> " + (
        ", ".join(f"{k}={shown(v)}" for k, v in updates.items()) or "-"
    )
    if unused:
        line += f"; not used by grpokit's sampler: {', '.join(unused)}"
    return updates, line


def renames(fields: Mapping[str, Any]) -> dict[str, tuple[tuple[str, ...], Rule]]:
    """The plain renames a config's fields declare (`trl=` on the field), as ALIASES entries."""
    out: dict[str, tuple[tuple[str, ...], Rule]] = {}
    for key, field in fields.items():
        name = trl_rename(field) if isinstance(field, FieldInfo) else None
        if name is not None:
            out[name] = ((key,), _rename(name, key))
    return out


_EVAL_ANSWER = "grpokit evaluates at the start, every eval_steps steps and at the end; set eval_steps."
_SAVE_ANSWER = "grpokit saves every save_steps steps and at the end; set save_steps (0 = only at the end)."

# The TRL names that need logic. name -> rule(value, the other keys) -> (grpokit keys to set, the line
# that says so). An alias applies only to a config that has every key it sets (else the name is
# answered as a TRL option it lacks). A plain rename is declared on its field instead (`renames`).
ALIASES: dict[str, tuple[tuple[str, ...], Rule]] = {
    "bf16": (("dtype",), _precision("bf16", "bfloat16")),
    "fp16": (("dtype",), _precision("fp16", "float16")),
    "eval_strategy": (("eval_steps",), _only_steps("eval_strategy", "eval_steps", _EVAL_ANSWER)),
    "save_strategy": (("save_steps",), _only_steps("save_strategy", "save_steps", _SAVE_ANSWER)),
    "disable_tqdm": (("progress",), _negated("disable_tqdm", "progress")),
    "log_completions": (("log_completions_steps",), _log_completions),
    "use_liger_kernel": (("fused_logps",), _liger),
    "generation_kwargs": (_SAMPLING_KEYS + ("max_completion_length",), _generation_kwargs),
}
# ALIASES that carry other options' values (a mapping), not a name for any one of them
CONTAINERS = frozenset({"generation_kwargs"})

# TRL options (most of them transformers' TrainingArguments) that change nothing of what grpokit trains
# nor how: taken, and said unused in one line (once per process) with what grpokit does instead.
# name -> {config class name: why}
_NO_LOADER = "grpokit draws each step's prompts in process, with no DataLoader"
NOT_USED: dict[str, dict[str, str]] = {
    "per_device_eval_batch_size": {"GRPOConfig": "evaluation runs in calls of micro_batch_size rows"},
    "dataloader_num_workers": {"GRPOConfig": _NO_LOADER},
    "dataloader_pin_memory": {"GRPOConfig": _NO_LOADER},
    "dataloader_persistent_workers": {"GRPOConfig": _NO_LOADER},
    "dataloader_prefetch_factor": {"GRPOConfig": _NO_LOADER},
    "dataset_num_proc": {"GRPOConfig": "datasets are read in process"},
    "accelerator_config": {
        "GRPOConfig": "grpokit does not run through accelerate: its processes are torchrun's",
    },
    "pad_to_multiple_of": {"GRPOConfig": "a batch is padded to its longest row"},
    "eval_on_start": {"GRPOConfig": "grpokit evaluates the held-out split at the start of every run"},
    "logging_strategy": {"GRPOConfig": "grpokit logs every logging_steps steps"},
    "num_generations_eval": {
        "GRPOConfig": "grpokit's evaluation is one greedy completion a prompt (and pass_at_k samples)"
    },
    "log_multimodal": {"GRPOConfig": "grpokit trains on text"},
    "use_transformers_continuous_batching": {
        "GRPOConfig": "grpokit samples with its own batched, KV-cached decode loop"
    },
}

# ------------------------------------------------------------------------ rejected: the grpokit option to use

_GRPO_STEP = "a grpokit step takes prompts_per_step·num_generations completions (TRL's generation batch)"
# name -> {config class name or "*": what to set instead}
REJECTED: dict[str, dict[str, str]] = {
    "per_device_train_batch_size": {  # GRPOConfig: translated (BATCH_NAMES)
        "RewardConfig": "grpokit counts pairs: batch_size per optimizer step (over all processes), "
        "micro_batch_size per forward/backward; set batch_size and micro_batch_size.",
        "SFTConfig": "set batch_size (examples per optimizer step).",
    },
    "gradient_accumulation_steps": {  # GRPOConfig: translated (BATCH_NAMES)
        "RewardConfig": "accumulation is implied: batch_size pairs run in micro-batches of micro_batch_size "
        "whose gradients add up to one update; set batch_size and micro_batch_size.",
        "SFTConfig": "the warm start takes one batch of batch_size examples per step; set batch_size.",
    },
    "steps_per_generation": {  # GRPOConfig: read with the batch names (BATCH_NAMES)
        "RewardConfig": "grpokit counts pairs: batch_size per optimizer step; set batch_size.",
    },
    "generation_batch_size": {
        "GRPOConfig": f"{_GRPO_STEP}; set prompts_per_step and num_generations.",
    },
    "num_train_epochs": {  # GRPOConfig: a field (GRPOTrainer counts max_steps from it)
        "RewardConfig": "grpokit counts steps of batch_size pairs; set max_steps "
        "(one pass over N pairs is N / batch_size steps).",
        "SFTConfig": "grpokit counts steps of batch_size examples; set max_steps.",
    },
    "logging_dir": {
        "GRPOConfig": "TensorBoard logs go to output_dir/tensorboard; set output_dir.",
        "RewardConfig": "TensorBoard logs go to output_dir/tensorboard; set output_dir.",
    },
    "warmup_ratio": {
        "GRPOConfig": "set warmup_steps (warmup_ratio·max_steps, rounded up).",
        "RewardConfig": "set warmup_steps (warmup_ratio·max_steps, rounded up).",
    },
    "resume_from_checkpoint": {
        "*": "set resume=true (continues from the last complete checkpoint in output_dir).",
    },
    "run_name": {"*": "a run is named by its output_dir (also the wandb run name); set output_dir."},
    "use_vllm": {
        "GRPOConfig": "grpokit samples with its own KV-cached decode loop, from the training policy itself; "
        "set decode_loop to choose how that loop runs.",
    },
    "vllm_importance_sampling_correction": {
        "GRPOConfig": "grpokit has no vLLM: its sampler is the training policy. To weigh tokens drawn from a "
        "reshaped distribution (top-k/top-p, bf16 decoding) set sampling_correction.",
    },
    "vllm_importance_sampling_mode": {
        "GRPOConfig": "set sampling_correction (token_truncate, token_mask, sequence_truncate or "
        "sequence_mask).",
    },
    "vllm_importance_sampling_clip_max": {"GRPOConfig": "set sampling_correction_max."},
    "vllm_importance_sampling_clip_min": {"GRPOConfig": "set sampling_correction_min."},
    "model_init_kwargs": {
        "GRPOConfig": "a model directory is loaded with dtype and trust_remote_code; set those.",
        "RewardConfig": "a model directory is loaded with dtype and trust_remote_code; set those.",
    },
}

# Every option name of TRL 1.16's GRPOConfig, RewardConfig and SFTConfig (tests/train compares this
# with TRL itself). A name here that a config lacks is answered as a TRL option, never "did you mean".
TRL_NAMES = frozenset(
    """
accelerator_config activation_checkpointing activation_checkpointing_kwargs activation_offloading
adam_beta1 adam_beta2 adam_epsilon assistant_only_loss auto_find_batch_size
average_tokens_across_devices batch_eval_metrics beta bf16 bf16_full_eval cache_implementation
cast_lm_head_to_fp32 center_rewards_coefficient chat_template_kwargs chat_template_path
completion_only_loss data_seed dataloader_drop_last dataloader_in_order
dataloader_multiprocessing_context dataloader_num_workers dataloader_persistent_workers
dataloader_pin_memory dataloader_prefetch_factor dataset_kwargs dataset_num_proc dataset_text_field
ddp_backend ddp_broadcast_buffers ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph
ddp_timeout debug deepspeed delta disable_dropout disable_tqdm do_eval do_predict do_train
ds3_gather_for_generation enable_jit_checkpoint entropy_coef entropy_coef_delta entropy_coef_max
entropy_coef_min entropy_target eos_token epsilon epsilon_high eval_accumulation_steps eval_delay
eval_do_concat_batches eval_on_start eval_packing eval_steps eval_strategy eval_use_gather_object
fp16 fp16_full_eval fsdp fsdp_config full_determinism generation_batch_size generation_kwargs
gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs greater_is_better
hub_always_push hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip
importance_sampling_level include_for_metrics include_num_input_tokens_seen label_names
label_smoothing_factor learning_rate length_column_name liger_kernel_config load_best_model_at_end
local_rank log_completions log_completions_hub_repo log_level log_level_replica log_multimodal
log_on_each_node log_unique_prompts logging_first_step logging_nan_inf_filter logging_steps
logging_strategy loss_type lr_scheduler_kwargs lr_scheduler_type mask_truncated_completions
max_completion_length max_grad_norm max_length max_steps max_tool_calling_iterations
metric_for_best_model min_p model_init_kwargs multi_objective_aggregation neftune_noise_alpha
num_completions_to_print num_generations num_generations_eval num_iterations num_train_epochs
off_policy_mask_threshold optim optim_args optim_target_modules output_dir packing packing_strategy
pad_to_multiple_of pad_token padding_free parallelism_config per_device_eval_batch_size
per_device_train_batch_size prediction_loss_only project push_to_hub ref_model_mixup_alpha
ref_model_sync_steps remove_unused_columns repetition_penalty report_to
restore_callback_states_from_checkpoint resume_from_checkpoint reward_weights router_aux_loss_coef
run_name sapo_temperature_neg sapo_temperature_pos save_on_each_node save_only_model save_steps
save_strategy save_total_limit scale_rewards seed shuffle_dataset skip_memory_metrics
steps_per_generation sync_ref_model temperature tf32 top_entropy_quantile top_k top_p torch_compile
torch_compile_backend torch_compile_mode torch_empty_cache_steps trackio_bucket_id trackio_space_id
trackio_static_space_id train_sampling_strategy transformers_continuous_batching_config
truncation_mode trust_remote_code use_adaptive_entropy use_bias_correction_kl use_cache use_cpu
use_liger_kernel use_transformers_continuous_batching use_transformers_paged use_vllm vespo_k_neg
vespo_k_pos vespo_lambda_neg vespo_lambda_pos vllm_enable_sleep_mode vllm_gpu_memory_utilization
vllm_group_port vllm_importance_sampling_cap vllm_importance_sampling_clip_max
vllm_importance_sampling_clip_min vllm_importance_sampling_correction vllm_importance_sampling_mode
vllm_max_model_length vllm_mode vllm_model_impl vllm_server_base_url vllm_server_host
vllm_server_port vllm_server_timeout vllm_structured_outputs_regex vllm_tensor_parallel_size
warmup_steps weight_decay
""".split()  # noqa: SIM905 - a list of 207 quoted names would hide them
)

# grpokit options that were removed: the one line a config that still sets one gets (schema -> line).
REMOVED: dict[str, dict[str, str]] = {
    "sampler": {
        "GRPOConfig": "sampler was removed: grpokit samples with its one KV-cached decode loop "
        "(transformers' generate is kept only as a test reference); delete sampler from the config "
        "(decode_loop chooses how the loop runs).",
    },
}

# TRL's AsyncGRPOConfig options (trl.experimental.async_grpo, TRL 1.16) that grpokit's rollout worker
# has no use for: an AsyncGRPOConfig given one says so in one line and goes on without it
ASYNC_NOT_USED = {
    "vllm_server_timeout": "request_timeout bounds every request to a rollout server",
    "heartbeat_stale_after_s": "weight_sync_timeout bounds every wait for the worker",
    "queue_maxsize": "the queue holds max_staleness + 1 batches: each batch is sampled exactly "
    "max_staleness versions back, so no more can be waiting",
    "max_inflight_tasks": "the worker samples whole batches of prompts_per_step x num_generations",
    "fork_threshold_tokens": "the worker samples whole batches with one KV cache",
    "token_budget": "a step is prompts_per_step x num_generations completions",
}


def drop_async_names(data: Any) -> Any:
    """AsyncGRPOConfig's before-validator: TRL's async options grpokit does not use, each said in one
    line (once per process) and dropped."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    if "vllm_server_base_url" in out and "rollout_server_urls" not in out:
        url = out.pop("vllm_server_base_url")
        say(
            f"TRL's AsyncGRPOConfig option vllm_server_base_url={shown(url)} is taken as rollout_server_urls="
            f"[{shown(url)}]: a `grpokit serve-policy` server there samples (vLLM's own weight transfer is "
            "not spoken)"
        )
        out["rollout_server_urls"] = [url]
    for name, why in ASYNC_NOT_USED.items():
        if name in out:
            say(f"TRL's AsyncGRPOConfig option {name}={shown(out.pop(name))} is not used: {why}")
    return out


COMMANDS = {"GRPOConfig": "train", "RewardConfig": "reward", "SFTConfig": "sft"}

# ------------------------------------------------------------------------ accepted: TRL's batch geometry

# TRL's names for the batch (GRPOConfig) and their TRL defaults. TRL 1.16 (GRPOConfig.__post_init__,
# GRPOTrainer._prepare_inputs) with steps_per_generation unset: steps_per_generation =
# gradient_accumulation_steps, generation batch = per_device_train_batch_size · processes ·
# steps_per_generation completions, drawn as generation batch / num_generations prompts; each process
# runs per_device_train_batch_size rows per forward/backward, and gradient_accumulation_steps of them
# make one optimizer update: one update per generation batch (num_iterations of them with μ > 1),
# which is a grpokit step.
BATCH_NAMES = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": None,
}
BATCH_FIELDS = ("prompts_per_step", "micro_batch_size")  # what they set


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer (got {shown(value)}).")
    return value


def takes_batch_names(fields: Iterable[str]) -> bool:
    """Whether a config translates TRL's batch names (GRPOConfig)."""
    fields = set(fields)
    return {*BATCH_FIELDS, "num_generations"} <= fields and not set(BATCH_NAMES) & fields


def split_batch_names(data: dict[str, Any]) -> dict[str, Any]:
    """TRL's batch names taken out of one source's `data`; a source that also sets what they set
    (prompts_per_step, micro_batch_size) is one line naming both."""
    given = {name: data.pop(name) for name in BATCH_NAMES if name in data}
    for name in given:
        for own in BATCH_FIELDS:
            if own in data:
                raise ConfigError(
                    f"{name} and {own} are both set; {name} (TRL's name) sets {' and '.join(BATCH_FIELDS)}: "
                    "set only one of them."
                )
    return given


def _batch_geometry(fields: Mapping[str, Any], data: dict[str, Any]) -> str | None:
    """TRL's per_device_train_batch_size / gradient_accumulation_steps in `data` replaced by the
    prompts_per_step and micro_batch_size that make a grpokit step the same work (the line that says
    so; None when neither is given)."""
    given = split_batch_names(data)
    if not given:
        return None
    per_device = _positive_int("per_device_train_batch_size", given.get("per_device_train_batch_size", 8))
    accumulation = _positive_int("gradient_accumulation_steps", given.get("gradient_accumulation_steps", 1))
    per_generation = given.get("steps_per_generation")
    if per_generation is not None and _positive_int("steps_per_generation", per_generation) != accumulation:
        raise ConfigError(
            f"steps_per_generation={per_generation} differs from gradient_accumulation_steps={accumulation}: "
            "TRL then splits one generation batch over several optimizer steps; a grpokit step is one "
            "generation batch and num_iterations optimizer steps on all of it: leave steps_per_generation "
            "unset (or equal), and set num_iterations for more updates per batch."
        )
    field = fields.get("num_generations")
    generations = data.get("num_generations", getattr(field, "default", 8))
    if isinstance(generations, bool) or not isinstance(generations, int) or generations < 1:
        return None  # the config's own check of num_generations says what is wrong
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    batch = per_device * accumulation * processes  # completions per generation batch (per update)
    product = (
        f"per_device_train_batch_size={per_device} × gradient_accumulation_steps={accumulation} × "
        f"{processes} process{'es' * (processes != 1)} = {batch} completions"
    )
    if batch % generations:
        raise ConfigError(
            f"{product} per step is not divisible by num_generations={generations}: a step takes whole "
            f"groups; make per_device_train_batch_size × gradient_accumulation_steps a multiple of "
            f"{generations} (or set prompts_per_step and micro_batch_size instead)."
        )
    data.update(prompts_per_step=batch // generations, micro_batch_size=per_device)
    return (
        f"TRL names: {product} per optimizer step -> prompts_per_step={batch // generations} "
        f"(÷ num_generations={generations}), micro_batch_size={per_device}"
    )


_said: set[str] = set()


def say(line: str) -> None:
    """The mapping of an accepted TRL name, once per process and only on rank 0."""
    if line not in _said and os.environ.get("RANK", "0") == "0":
        _said.add(line)
        logging.getLogger("grpokit.config").warning(line)


def translate(
    schema_name: str, fields: Iterable[str], data: Mapping[str, Any], *, batch: bool = True
) -> dict[str, Any]:
    """`data` with every accepted TRL alias replaced by the grpokit option it stands for (said once).
    Keys the config has, and names it rejects, are left for `check_keys`. batch: also TRL's batch
    names (BATCH_NAMES), read together: `load_config` translates them once, over all its sources.
    `fields`: the config's field names, or its model_fields (whose num_generations default is read)."""
    defaults = fields if isinstance(fields, Mapping) else {}
    fields = set(fields)
    out = dict(data)
    for name, (sets, rule) in (ALIASES | renames(defaults)).items():
        if name in out and name not in fields and set(sets) <= fields:
            value = out.pop(name)
            updates, line = rule(value, out)
            out.update(updates)
            say(line)
    for name, answers in NOT_USED.items():
        if name in out and name not in fields and schema_name in answers:
            say(f"TRL option {name}={shown(out.pop(name))} is not used: {answers[schema_name]}")
    if batch and takes_batch_names(fields):
        line = _batch_geometry(defaults, out)
        if line:
            say(line)
    return out


def unknown_key(schema_name: str, fields: Iterable[str], key: str) -> str:
    """One line for a key the config does not have: the grpokit option a TRL name stands for, or the
    closest valid name."""
    fields = list(fields)
    removed = REMOVED.get(key, {}).get(schema_name)
    if removed:
        return removed
    answers = REJECTED.get(key, {})
    answer = answers.get(schema_name) or answers.get("*")
    if answer:
        return f"{key} is a TRL option; {answer}"
    if key in TRL_NAMES or key in ALIASES:
        command = COMMANDS.get(schema_name, "train")
        return (
            f"{key} is a TRL option that grpokit's {schema_name} does not have; "
            f"`grpokit {command} --help` lists every option."
        )
    match = difflib.get_close_matches(key, fields, n=1, cutoff=0.5)
    hint = f"did you mean {match[0]!r}?" if match else f"valid keys: {', '.join(sorted(fields))}"
    return f"unknown key {shown(key)}; {hint}"


def check_keys(schema_name: str, fields: Iterable[str], data: Any) -> Any:
    """The before-validator of every config class: translate TRL aliases, then reject unknown keys
    with one line each (ConfigError, a ValueError: pydantic's error then carries the same text)."""
    if not isinstance(data, Mapping):
        return data
    data = translate(schema_name, fields, data)
    fields = list(fields)
    unknown = [key for key in data if key not in fields]
    if unknown:
        raise ConfigError("\n  ".join(unknown_key(schema_name, fields, str(key)) for key in unknown))
    return data
