"""Resuming with a changed config: what may change, what may not.

A checkpoint holds weights, optimizer and scheduler state, sampler positions and RNG states that were
made under its config.yaml. An option that shaped them (the model, the data, the algorithm, the batch
geometry, the optimizer and its schedule) cannot change on resume: the new value would be ignored
(AdamW's betas, epsilon, weight decay and the scheduler's base learning rate are restored from the
checkpoint) or would silently mix two runs in one output_dir, whose next checkpoints would record a
config that describes neither. Those are refused, every difference in one ConfigError. An option
that only says how the rest of the run is watched, saved or bounded may change: it is applied and
said once.

RESUME_RULES classifies every option of GRPOConfig and RewardConfig (tests/config/test_config_resume.py
fails for a field that is not in it); an option missing from it is treated as fixed.
No torch import here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from .load import ConfigError, load_config, shorten, shown
from .remote_reward import redacted_entries

Rule = Literal["fixed", "applied", "invocation"]

_FIXED_MODEL = "the weights in the checkpoint have this shape and origin"
_FIXED_DATA = "the prompts, their order and the held-out split come from it"
_FIXED_ALGO = "the loss and the updates so far were computed with it"
_FIXED_CURRICULUM = "the prompts drawn so far were chosen by it, and its pools are in the checkpoint"
_FIXED_SAMPLING = "the completions trained on so far were drawn with it (temperature also scales log-probs)"
_FIXED_BATCH = "the batch geometry: the prompt sampler's position and every update so far depend on it"
_FIXED_OPTIM = "restored from the checkpoint's optimizer/scheduler state, so a new value would be ignored"
_FIXED_WARM_START = "the supervised warm start ran before step 1 and does not run again"
_APPLIED = "only how the rest of the run is watched, saved, bounded or placed"

# option -> (rule, why). "fixed": refused when it differs; "applied": a difference is used and said;
# "invocation": how this command treats output_dir, not part of the run (never compared).
RESUME_RULES: dict[str, tuple[Rule, str]] = {
    # ------------------------------------------------------------ the model
    "model": ("fixed", _FIXED_MODEL),
    "tiny_hidden_size": ("fixed", _FIXED_MODEL),
    "tiny_num_layers": ("fixed", _FIXED_MODEL),
    "tiny_num_heads": ("fixed", _FIXED_MODEL),
    "tiny_intermediate_size": ("fixed", _FIXED_MODEL),
    "use_peft": ("fixed", "the checkpoint holds LoRA adapters or whole weights"),
    "lora_r": ("fixed", _FIXED_MODEL),
    "lora_alpha": ("fixed", "the adapters were trained at this scale"),
    "lora_dropout": ("fixed", _FIXED_ALGO),
    "lora_target_modules": ("fixed", _FIXED_MODEL),
    "dtype": ("fixed", "the weights and updates so far were computed in it"),
    "master_weights": ("fixed", "the weights and AdamW state are stored in this precision"),
    "strategy": ("fixed", "an FSDP checkpoint is sharded (dcp/), a DDP one is not"),
    "model_revision": ("fixed", _FIXED_MODEL),
    "system_prompt": ("fixed", _FIXED_DATA),
    "chat_template_kwargs": ("fixed", _FIXED_DATA),
    "trust_remote_code": ("applied", "it decides only whether the model directory's own code may run"),
    # ------------------------------------------------------------ data
    "task": ("fixed", _FIXED_DATA),
    "dataset": ("fixed", _FIXED_DATA),
    "eval_dataset": ("fixed", "held-out metrics before and after would not be comparable"),
    "prompt_column": ("fixed", _FIXED_DATA),
    "answer_column": ("fixed", _FIXED_DATA),
    "answer_format": ("fixed", _FIXED_DATA),
    "dataset_config": ("fixed", _FIXED_DATA),
    "dataset_train_split": ("fixed", _FIXED_DATA),
    "dataset_test_split": ("fixed", "held-out metrics before and after would not be comparable"),
    "num_eval_prompts": ("fixed", "a task's held-out split (and so its training prompts) depends on it"),
    "num_eval_pairs": ("fixed", "a task's held-out split (and so its training pairs) depends on it"),
    "near_miss": ("fixed", _FIXED_DATA),
    "max_length": ("fixed", _FIXED_DATA),
    "long_pairs": ("fixed", _FIXED_DATA),
    "seed": ("fixed", "initialisation, prompt order and every sampling seed derive from it"),
    # ------------------------------------------------------------ supervised warm start (before step 1)
    "sft_steps": ("fixed", _FIXED_WARM_START),
    "sft_examples": ("fixed", _FIXED_WARM_START),
    "sft_warmup_steps": ("fixed", _FIXED_WARM_START),
    "sft_target_accuracy": ("fixed", _FIXED_WARM_START),
    "sft_batch_size": ("fixed", _FIXED_WARM_START),
    "sft_learning_rate": ("fixed", _FIXED_WARM_START),
    # ------------------------------------------------------------ batch geometry
    "prompts_per_step": ("fixed", _FIXED_BATCH),
    "num_generations": ("fixed", _FIXED_BATCH),
    "micro_batch_size": (
        "applied",
        "memory and speed: the loss's normaliser weighs each micro-batch by the whole batch (the same "
        "updates to round-off), except what is taken per micro-batch: loss_type=bnpo's token mean, "
        "top_entropy_quantile's threshold, target_entropy's measured entropy, dropout's masks",
    ),
    "batch_size": ("fixed", _FIXED_BATCH),
    "max_prompt_length": ("fixed", _FIXED_BATCH),
    "max_completion_length": ("fixed", _FIXED_BATCH),
    "prompt_truncation": ("fixed", _FIXED_BATCH),
    # ------------------------------------------------------------ optimizer and schedule
    "learning_rate": ("fixed", _FIXED_OPTIM),
    "lr_scheduler_type": ("fixed", "the schedule so far followed it"),
    "warmup_steps": ("fixed", "the schedule so far followed it"),
    "weight_decay": ("fixed", _FIXED_OPTIM),
    "adam_beta1": ("fixed", _FIXED_OPTIM),
    "adam_beta2": ("fixed", _FIXED_OPTIM),
    "adam_epsilon": ("fixed", _FIXED_OPTIM),
    "max_grad_norm": ("fixed", _FIXED_ALGO),
    # ------------------------------------------------------------ sampling
    "temperature": ("fixed", _FIXED_SAMPLING),
    "top_p": ("fixed", _FIXED_SAMPLING),
    "top_k": ("fixed", _FIXED_SAMPLING),
    "min_p": ("fixed", _FIXED_SAMPLING),
    "repetition_penalty": ("fixed", _FIXED_SAMPLING),
    # how, not what, is computed: the same distributions and the same math, another implementation
    "decode_loop": ("applied", "a speed choice; the same distribution"),
    "fused_logps": ("applied", "the same log-probs, computed in chunks or not"),
    "gradient_checkpointing": ("applied", "memory only: the same gradients"),
    "fsdp_cpu_offload": ("applied", "memory only: where FSDP keeps the same shards"),
    "num_threads": ("applied", "threads change the speed, and the last bits of parallel sums"),
    "device": ("applied", "checkpoints are on the host: any device can continue them"),
    # ------------------------------------------------------------ multi-turn
    "tools": ("fixed", "the episodes trained on so far had these tools"),
    "environment": ("fixed", "the episodes trained on so far came from it"),
    "max_turns": ("fixed", "the episodes trained on so far were this long"),
    "tool_call_format": ("fixed", "the policy learned to call tools in this format"),
    "tool_timeout": ("applied", "a bound on a slow tool, as reward_timeout"),
    # ------------------------------------------------------------ algorithm and rewards
    "loss_type": ("fixed", _FIXED_ALGO),
    "beta": ("fixed", _FIXED_ALGO),
    "epsilon": ("fixed", _FIXED_ALGO),
    "epsilon_high": ("fixed", _FIXED_ALGO),
    "delta": ("fixed", _FIXED_ALGO),
    "importance_sampling_level": ("fixed", _FIXED_ALGO),
    "top_entropy_quantile": ("fixed", _FIXED_ALGO),
    "target_entropy": ("fixed", _FIXED_ALGO),
    "teacher_model": ("fixed", _FIXED_ALGO),
    "teacher_model_revision": ("fixed", _FIXED_ALGO),
    "distill_coef": ("fixed", _FIXED_ALGO),
    "gkd_beta": ("fixed", _FIXED_ALGO),
    "seq_kd": ("fixed", _FIXED_ALGO),
    "lmbda": ("fixed", _FIXED_ALGO + "; which steps learn from the dataset's answers derives from it"),
    "teacher_device": ("applied", "where the teacher runs changes its log-probs only by round-off"),
    "entropy_coef_lr": ("fixed", _FIXED_ALGO),
    "scale_rewards": ("fixed", _FIXED_ALGO),
    "num_iterations": ("fixed", _FIXED_ALGO + "; the schedule counts max_steps·num_iterations updates"),
    "sampling_correction": ("fixed", _FIXED_ALGO),
    "sampling_correction_max": ("fixed", _FIXED_ALGO),
    "sampling_correction_min": ("fixed", _FIXED_ALGO),
    "mask_truncated_completions": ("fixed", _FIXED_ALGO),
    "use_bias_correction_kl": ("fixed", _FIXED_ALGO),
    "sync_ref_model": ("fixed", "the reference model so far was (or was not) moved toward the policy"),
    "ref_model_mixup_alpha": ("fixed", "the reference model so far was moved by it"),
    "ref_model_sync_steps": ("fixed", "the reference model so far was moved on this period"),
    "dynamic_sampling": ("fixed", _FIXED_ALGO),
    "max_resample_batches": ("fixed", _FIXED_ALGO),
    "curriculum": ("fixed", _FIXED_CURRICULUM),
    "curriculum_patience": ("fixed", _FIXED_CURRICULUM),
    "curriculum_revisit": ("fixed", _FIXED_CURRICULUM),
    "reward_funcs": ("fixed", "the rewards trained on so far came from them"),
    "reward_weights": ("fixed", "the rewards trained on so far were summed with them"),
    "center_rewards_coefficient": ("fixed", _FIXED_ALGO),
    # ------------------------------------------------------------ how the rest of the run is watched
    # max_steps: the scheduler's step count is restored but its decay is rebuilt from the config
    # (train/optim.py make_scheduler: lr_factor(step, max_steps=max_steps·num_iterations), a lambda
    # that is not part of the saved state): with a linear or cosine schedule the learning rate from
    # the resumed step on follows the decay to the new max_steps, a jump where the two schedules
    # differ. Allowed (extending a finished run is the common case), and the note says so; a
    # max_steps below the checkpoint's step is refused (it would save an older step's name over
    # newer weights).
    "max_steps": ("applied", "where the run ends (and a decaying schedule reaches 0)"),
    "logging_steps": ("applied", _APPLIED),
    "save_steps": ("applied", _APPLIED),
    "save_total_limit": ("applied", _APPLIED),
    "eval_steps": ("applied", _APPLIED),
    "log_completions_steps": ("applied", _APPLIED),
    "pass_at_k": ("applied", "an extra evaluation metric; training is unchanged"),
    "progress": ("applied", _APPLIED),
    "report_to": ("applied", _APPLIED),
    "push_to_hub": ("applied", "it decides only whether the final model is uploaded at the end"),
    "hub_model_id": ("applied", "it names only where the final model is uploaded"),
    "hub_private_repo": ("applied", "it decides only the visibility of a repository the push creates"),
    "max_consecutive_skips": ("applied", _APPLIED),
    "auto_find_batch_size": ("applied", "it decides only how a step that runs out of memory is redone"),
    "strict_invariants": ("applied", "it decides only whether a broken invariant stops the run"),
    "alert_thresholds": ("applied", "they decide only when a warning is given"),
    "reward_timeout": ("applied", _APPLIED),
    "on_reward_error": ("applied", "what happens to the next failing reward call"),
    "output_dir": ("applied", "a run directory may be moved or renamed between runs"),
    "resume": ("invocation", "how this command treats output_dir"),
    "overwrite": ("invocation", "how this command treats output_dir"),
}

_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)$")


def _value(value: Any) -> str:
    """A value as the user writes it in YAML: true/null, not True/None; shortened."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return shorten(value) if isinstance(value, str) else shown(value)


def resume_changes(cfg: Any, saved_config: Path) -> list[str]:
    """Compare the resolved `cfg` of a resumed run with the checkpoint's `saved_config` (its
    config.yaml). Options that cannot change raise ConfigError naming every difference; the options
    that may change and did are returned as one-line notes, to be said once."""
    saved_config = Path(saved_config)
    saved = load_config(type(cfg), saved_config, written=True)  # its ConfigError names the file
    refused: list[str] = []
    notes: list[str] = []
    for name in type(cfg).model_fields:
        before, now = getattr(saved, name), getattr(cfg, name)
        if name == "reward_funcs":  # config.yaml holds the urls redacted: compared (and shown) alike
            before, now = redacted_entries(before), redacted_entries(now)
        rule = RESUME_RULES.get(name, ("fixed", ""))[0]
        if before == now or rule == "invocation":
            continue
        if rule == "fixed":
            refused.append(f"{name}: checkpoint {_value(before)}, now {_value(now)}")
        else:
            what = _why(cfg, name, before, now)
            notes.append(f"{name}: {_value(before)} in the checkpoint, {_value(now)} now (applied{what})")
    step = _CHECKPOINT_DIR.search(saved_config.parent.name)
    if step and cfg.max_steps < int(step.group(1)):
        refused.append(
            f"max_steps: {cfg.max_steps} is before the checkpoint's step {step.group(1)} "
            f"(set max_steps ≥ {step.group(1)})"
        )
    if refused:
        raise ConfigError(
            f"resume: options that cannot change on resume differ from {saved_config}:\n  "
            + "\n  ".join(refused)
            + "\n  resume with the checkpoint's values, or start a new run in another output_dir"
        )
    return notes


def _why(cfg: Any, name: str, before: Any, now: Any) -> str:
    """What an applied change of `name` does beyond the obvious ("" when nothing)."""
    if name == "max_steps" and getattr(cfg, "lr_scheduler_type", "constant") != "constant":
        direction = "higher" if now > before else "lower"
        return (
            f"; the {cfg.lr_scheduler_type} schedule now decays to 0 at step {now} instead of {before}: "
            f"after warm-up the learning rate is {direction} from here on than the checkpoint's "
            "schedule had it"
        )
    return ""
