"""The one typed, validated configuration of a GRPO run. Defaults live here and only here.

Field names and defaults follow TRL 1.16's GRPOConfig where TRL has the option; a field whose
default differs says why. Validation happens on load, before any model is touched: unknown keys
are rejected with the closest valid name, out-of-range values with the allowed range, and
cross-field rules (num_generations ≥ 2, batch divisibility) are checked together.

No torch import here: `grpokit print-config` and config errors are instant.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


class _TinyModel(BaseModel):
    """The size of the built-in tiny Llama (used when model is 'tiny')."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    tiny_hidden_size: int = Field(128, ge=8)
    tiny_num_layers: int = Field(4, ge=1)
    tiny_num_heads: int = Field(4, ge=1)
    tiny_intermediate_size: int = Field(256, ge=8)


class _Optimisation(BaseModel):
    """AdamW, schedule and clipping, as TRL's defaults (the learning rate is each trainer's own)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)


class GRPOConfig(_TinyModel, _Optimisation):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # ---------------------------------------------------------------- run
    output_dir: str = Field("runs/grpo", description="where metrics, checkpoints and the report go")
    seed: int = Field(42, description="seeds initialisation, prompt order and sampling (TRL: 42)")
    max_steps: int = Field(200, ge=1, description="GRPO steps (one generation batch each)")
    logging_steps: int = Field(1, ge=1, description="write metrics every N steps")
    save_steps: int = Field(50, ge=0, description="checkpoint every N steps (0 = only at the end)")
    save_total_limit: int = Field(2, ge=1, description="keep the last K checkpoints")
    eval_steps: int = Field(
        50, ge=0, description="evaluate on held-out prompts every N steps (0 = start and end only)"
    )
    log_completions_steps: int = Field(
        50, ge=0, description="print a table of sample completions every N steps"
    )
    resume: bool = Field(False, description="continue from the last complete checkpoint in output_dir")
    progress: bool = Field(True, description="show a progress bar")

    # ---------------------------------------------------------------- model
    model: str = Field("tiny", description="a local model directory, or 'tiny' to build a small Llama")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="under torchrun: ddp (whole model per rank) or fsdp (FSDP2 sharding)"
    )
    fsdp_cpu_offload: bool = Field(False, description="fsdp: keep parameters and optimizer state on the CPU")
    trust_remote_code: bool = Field(False, description="run a model directory's own Python code (off: safe)")
    gradient_checkpointing: bool = Field(
        False,
        description="recompute activations in backward (TRL: True; off here: small models gain nothing)",
    )
    fused_logps: bool = Field(
        True,
        description="log-probs from hidden states and the LM head in chunks, never [B,T,V] logits "
        "(single process, plain linear head; otherwise the logits path)",
    )

    # ---------------------------------------------------------------- data
    task: Literal["addition", "countdown", "reverse"] | None = Field(
        "addition", description="a built-in task (prompts, reward, accuracy); None to use `dataset`"
    )
    dataset: str | None = Field(
        None, description="prompt file (.jsonl/.json/.csv/.parquet) when task is None"
    )
    eval_dataset: str | None = None
    prompt_column: str = "prompt"
    num_eval_prompts: int = Field(200, ge=1, description="held-out prompts used by evaluation")

    # ---------------------------------------------------------------- supervised warm start
    sft_steps: int = Field(
        0, ge=0, description="supervised steps on the task's answers before GRPO (0 = none)"
    )
    sft_batch_size: int = Field(256, ge=1)
    sft_learning_rate: float = Field(3e-3, gt=0)

    # ---------------------------------------------------------------- generation
    sampler: Literal["kv", "hf"] = Field(
        "kv", description="kv: grpokit's KV-cached decode loop (faster); hf: transformers' generate"
    )
    num_generations: int = Field(8, ge=2, description="G, completions per prompt (TRL: 8)")
    prompts_per_step: int = Field(32, ge=1, description="P, prompts per generation batch (B = P·G rows)")
    micro_batch_size: int = Field(64, ge=1, description="rows per forward/backward; gradients accumulate")
    max_prompt_length: int | None = Field(None, ge=1, description="None = the task's, or no limit")
    max_completion_length: int | None = Field(None, ge=1, description="None = the task's (TRL: 256)")
    prompt_truncation: Literal["left", "error"] = "left"
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off (TRL: 0)")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)

    # ---------------------------------------------------------------- algorithm
    loss_type: LossType = "dapo"
    beta: float = Field(0.0, ge=0.0, description="KL coefficient (TRL: 0.0)")
    epsilon: float = Field(0.2, ge=0.0)
    epsilon_high: float | None = Field(
        None, ge=0.0, description="None = epsilon; for cispo the absolute weight cap"
    )
    delta: float | None = Field(None, gt=1.0, description="two-sided clipping cap on the ratio (> 1)")
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    top_entropy_quantile: float = Field(1.0, gt=0.0, le=1.0)
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(1, ge=1, description="μ: optimizer steps per generation batch")
    mask_truncated_completions: bool = False
    reward_funcs: list[dict[str, Any]] | None = Field(
        None,
        description="None = the task's reward; else entries {model: DIR} (a trained reward model, "
        "optional batch_size, device) or {builtin: exact_answer | math_answer | format_tags | task}",
    )
    reward_weights: list[float] | None = None
    use_bias_correction_kl: bool = True
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = Field(0.6, ge=0.0, le=1.0)
    ref_model_sync_steps: int = Field(512, ge=1)
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards all agree, draw more")
    max_resample_batches: int = Field(4, ge=1, description="bound on extra generation batches per step")
    on_reward_error: Literal["raise", "unscorable"] = "raise"

    # ---------------------------------------------------------------- optimisation
    learning_rate: float = Field(1e-6, gt=0.0, description="TRL: 1e-6")
    max_consecutive_skips: int = Field(
        3,
        ge=1,
        description="stop (with a checkpoint) after this many updates in a row with a non-finite loss",
    )

    # ---------------------------------------------------------------- evaluation
    pass_at_k: int = Field(
        0, ge=0, description="also sample k completions per held-out prompt and report pass@k"
    )

    @model_validator(mode="after")
    def _cross_field(self) -> GRPOConfig:
        rows = self.prompts_per_step * self.num_generations
        if rows % self.micro_batch_size != 0:
            raise ValueError(
                f"prompts_per_step·num_generations = {rows} rows must be divisible by micro_batch_size="
                f"{self.micro_batch_size}; choose a micro_batch_size that divides {rows}"
            )
        if self.reward_weights is not None and not self.reward_weights:
            raise ValueError("reward_weights, when given, needs one weight per reward function")
        for spec in self.reward_funcs or []:
            kinds = {"model", "builtin"} & set(spec)
            if len(kinds) != 1 or set(spec) - {"model", "builtin", "batch_size", "device"}:
                raise ValueError(
                    f"reward_funcs entry {spec} must have exactly one of 'model' (a directory) or 'builtin' "
                    "(exact_answer, math_answer, format_tags, task), and optionally batch_size, device"
                )
        return self


class SFTConfig(_TinyModel):
    """A minimal supervised warm start: cross-entropy on the task's answers."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    output_dir: str = "runs/sft"
    seed: int = 42
    model: str = "tiny"
    task: Literal["addition", "countdown", "reverse"] = "addition"
    num_eval_prompts: int = Field(200, ge=1)
    max_steps: int = Field(600, ge=1)
    batch_size: int = Field(256, ge=1)
    learning_rate: float = Field(3e-3, gt=0.0)
    progress: bool = True


class RewardConfig(_TinyModel, _Optimisation):
    """Bradley–Terry reward-model training. Names and defaults follow TRL 1.16's RewardConfig where
    TRL has the option (learning_rate 1e-4, max_length 1024, center_rewards_coefficient None)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # ---------------------------------------------------------------- run
    output_dir: str = "runs/reward"
    seed: int = 42
    max_steps: int = Field(300, ge=1)
    logging_steps: int = Field(1, ge=1)
    save_steps: int = Field(100, ge=0, description="checkpoint every N steps (0 = only at the end)")
    save_total_limit: int = Field(2, ge=1)
    eval_steps: int = Field(50, ge=0, description="evaluate every N steps (0 = start and end only)")
    resume: bool = False
    progress: bool = True

    # ---------------------------------------------------------------- model
    model: str = Field(
        "tiny", description="a local sequence-classification or causal-LM directory, or 'tiny'"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="under torchrun: ddp or fsdp (FSDP2 sharding)"
    )
    trust_remote_code: bool = Field(False, description="run a model directory's own Python code (off: safe)")

    # ---------------------------------------------------------------- data
    task: Literal["addition", "countdown", "reverse"] | None = Field(
        "addition", description="built-in preference pairs from a task (chosen right, rejected wrong)"
    )
    near_miss: float = Field(
        0.0, ge=0.0, le=1.0, description="share of rejected answers that are near misses"
    )
    dataset: str | None = Field(
        None, description="preference file with chosen/rejected (prompt, margin optional)"
    )
    eval_dataset: str | None = None
    num_eval_pairs: int = Field(200, ge=1)
    max_length: int = Field(1024, ge=2, description="tokens per sequence (TRL: 1024)")
    long_pairs: Literal["drop", "truncate"] = Field(
        "drop", description="pairs over max_length: dropped (TRL) or cut"
    )

    # ---------------------------------------------------------------- optimisation
    batch_size: int = Field(64, ge=1, description="pairs per optimizer step")
    micro_batch_size: int = Field(64, ge=1, description="pairs per forward/backward; gradients accumulate")
    center_rewards_coefficient: float | None = Field(None, ge=0.0, description="TRL: None; EasyDeL: 0.1")
    learning_rate: float = Field(1e-4, gt=0.0, description="TRL RewardConfig: 1e-4")
    max_consecutive_skips: int = Field(
        3, ge=1, description="stop after this many non-finite updates in a row"
    )

    @model_validator(mode="after")
    def _cross_field(self) -> RewardConfig:
        if self.batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by micro_batch_size={self.micro_batch_size}"
            )
        return self
