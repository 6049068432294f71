"""Each config option changes behaviour: one short run per option against the same base run, with
the observable that option must change. A last test checks the table covers every field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.rewards import RewardFunctionError
from grpokit.train.grpo import train_grpo
from tests.helpers import named_tests, read_metrics
from tests.train.helpers import ones_reward, tiny_config, weights

# Off-policy (μ = 2) with a KL term, so that clipping and KL options all act within two steps.
BASE = dict(num_iterations=2, beta=0.04, log_completions_steps=1)


def starts_with_one(prompts, completions, **_):
    """Often equal within a group: makes zero-variance groups for dynamic sampling."""
    return [float(c.startswith("1")) for c in completions]


def fails_on_nine(prompts, completions, **_):
    if any("9" in c for c in completions):
        raise ValueError("cannot score a 9")
    return [0.0] * len(completions)


def run(tmp_path, name: str, reward=ones_reward, **options: Any) -> dict[str, Any]:
    if "output_dir" in options:
        options = options | {"output_dir": str(tmp_path / options["output_dir"])}
    cfg = tiny_config(tmp_path / name, **(BASE | options))
    events: list[tuple[str, int, dict]] = []
    train_grpo(
        cfg, reward_funcs=[reward], on_event=lambda kind, step, data: events.append((kind, step, data))
    )
    out = tmp_path / name / "run" if "output_dir" not in options else tmp_path / options["output_dir"]
    out = Path(cfg.output_dir)
    rows = read_metrics(out)
    return {
        "weights": weights(out),
        "rows": rows,
        "steps": [r for r in rows if "loss" in r],
        "events": events,
        "dir": out,
    }


def completions(result) -> list[str]:
    return next(data["completions"] for kind, _, data in result["events"] if kind == "completions")


def differ(a, b) -> bool:
    return a["weights"].keys() != b["weights"].keys() or any(
        a["weights"][k].shape != b["weights"][k].shape or not torch.equal(a["weights"][k], b["weights"][k])
        for k in a["weights"]
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return run(tmp_path_factory.mktemp("base"), "base")


# option -> (overrides, check(base_result, variant_result) -> bool). Checks read what the option is for.
CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "output_dir": (
        {"output_dir": "elsewhere/run"},
        lambda b, v: v["dir"].name == "run" and v["dir"].parent.name == "elsewhere",
    ),
    "seed": ({"seed": 4}, differ),
    "max_steps": ({"max_steps": 3}, lambda b, v: len(v["steps"]) == 3 and len(b["steps"]) == 2),
    "logging_steps": ({"logging_steps": 2}, lambda b, v: [r["step"] for r in v["steps"]] == [2]),
    "save_steps": (
        {"save_steps": 1},
        lambda b, v: (v["dir"] / "checkpoint-1").is_dir() and not (b["dir"] / "checkpoint-1").exists(),
    ),
    "save_total_limit": (
        {"save_steps": 1, "save_total_limit": 1},
        lambda b, v: not (v["dir"] / "checkpoint-1").exists(),
    ),
    "eval_steps": (
        {"eval_steps": 1},
        lambda b, v: any(r["step"] == 1 and "eval/reward" in r for r in v["rows"]),
    ),
    "log_completions_steps": (
        {"log_completions_steps": 2},
        lambda b, v: [s for k, s, _ in v["events"] if k == "completions"] == [2],
    ),
    "tiny_hidden_size": ({"tiny_hidden_size": 24, "tiny_num_heads": 2}, differ),
    "tiny_num_layers": ({"tiny_num_layers": 2}, lambda b, v: len(v["weights"]) > len(b["weights"])),
    "tiny_num_heads": ({"tiny_num_heads": 4}, differ),
    "tiny_intermediate_size": ({"tiny_intermediate_size": 48}, differ),
    # bf16 compute: a different trajectory, but the weights (the float32 master copy) stay float32
    "dtype": (
        {"dtype": "bfloat16"},
        lambda b, v: differ(b, v) and all(w.dtype == torch.float32 for w in v["weights"].values()),
    ),
    "task": (
        {"task": "reverse"},
        lambda b, v: all(
            p.endswith(">") for p in next(d["prompts"] for k, _, d in v["events"] if k == "completions")
        ),
    ),
    "num_eval_prompts": (
        {"num_eval_prompts": 2},
        lambda b, v: v["rows"][0]["eval/num_prompts"] == 2 and b["rows"][0]["eval/num_prompts"] == 4,
    ),
    "sft_steps": ({"sft_steps": 2, "sft_batch_size": 8}, differ),
    "num_generations": (
        {"num_generations": 2},
        lambda b, v: len(completions(v)) == 8 and len(completions(b)) == 16,
    ),
    "prompts_per_step": ({"prompts_per_step": 2}, lambda b, v: len(completions(v)) == 8),
    "max_prompt_length": (
        {"max_prompt_length": 3},
        lambda b, v: v["steps"][0]["num_truncated_prompts"] > 0 == b["steps"][0]["num_truncated_prompts"],
    ),
    "max_completion_length": (
        {"max_completion_length": 2},
        lambda b, v: v["steps"][0]["completions/max_length"] <= 2 < b["steps"][0]["completions/max_length"],
    ),
    "temperature": ({"temperature": 0.5}, lambda b, v: completions(v) != completions(b)),
    "top_p": ({"top_p": 0.3}, lambda b, v: completions(v) != completions(b)),
    "top_k": ({"top_k": 2}, lambda b, v: completions(v) != completions(b)),
    "min_p": ({"min_p": 0.95}, lambda b, v: completions(v) != completions(b)),
    "repetition_penalty": ({"repetition_penalty": 3.0}, lambda b, v: completions(v) != completions(b)),
    "beta": ({"beta": 0.5}, differ),
    "epsilon": ({"epsilon": 0.001}, differ),
    "epsilon_high": ({"epsilon_high": 0.001}, differ),
    "delta": ({"delta": 1.0001}, differ),
    "importance_sampling_level": ({"importance_sampling_level": "sequence"}, differ),
    "top_entropy_quantile": ({"top_entropy_quantile": 0.3}, differ),
    # μ = 2: the second update's π_θ has moved from the sampler's q, so a tiny δ drops negative-advantage rows
    "off_policy_mask_threshold": ({"off_policy_mask_threshold": 1e-9}, differ),
    # GDPO: groups normalised, then the batch: other advantages than the group's own scaling
    "multi_objective_aggregation": ({"multi_objective_aggregation": "normalize_then_sum"}, differ),
    # the data's order instead of a shuffled one: other prompts in the first steps
    "shuffle_dataset": ({"shuffle_dataset": False}, differ),
    "scale_rewards": ({"scale_rewards": "none"}, differ),
    "num_iterations": ({"num_iterations": 1}, differ),
    "mask_truncated_completions": ({"mask_truncated_completions": True}, differ),
    "reward_weights": (
        {"reward_weights": [2.0]},
        lambda b, v: v["steps"][0]["reward"] == pytest.approx(2 * b["steps"][0]["reward"]),
    ),
    "use_bias_correction_kl": ({"use_bias_correction_kl": False}, differ),
    "sync_ref_model": ({"sync_ref_model": True, "ref_model_sync_steps": 1}, differ),
    "learning_rate": ({"learning_rate": 1e-3}, differ),
    "lr_scheduler_type": (
        {"lr_scheduler_type": "linear"},  # the base: constant, chosen for model=tiny (config/applied.py)
        lambda b, v: v["steps"][1]["learning_rate"] < b["steps"][1]["learning_rate"],
    ),
    "warmup_steps": (
        {"warmup_steps": 4},
        lambda b, v: v["steps"][0]["learning_rate"] < b["steps"][0]["learning_rate"],
    ),
    "weight_decay": ({"weight_decay": 0.5}, differ),
    "adam_beta1": ({"adam_beta1": 0.5}, differ),
    "adam_beta2": ({"adam_beta2": 0.5}, differ),
    "adam_epsilon": ({"adam_epsilon": 1.0}, differ),
    "max_grad_norm": ({"max_grad_norm": 1e-4}, differ),
    "pass_at_k": (
        {"pass_at_k": 2},
        lambda b, v: "eval/pass@2" in v["rows"][0] and "eval/pass@2" not in b["rows"][0],
    ),
}

# options whose effect needs another base run:
# option -> (overrides of the base, overrides of the variant, reward, check)
RELATIVE: dict[str, tuple[dict, dict, Any, Any]] = {
    # grpo (mean per sequence, then over sequences) and dapo (mean over all tokens) differ only when
    # completions have different lengths: room for them to end at different places
    "loss_type": (
        {"max_completion_length": 8},
        {"loss_type": "grpo"},
        ones_reward,
        lambda b, v: (
            b["steps"][0]["completions/min_length"] < b["steps"][0]["completions/max_length"] and differ(b, v)
        ),
    ),
    # top-k draws from q = π/Z on the k likeliest tokens: the sampled tokens' π_old/q is Z < 1
    # the repetition penalty reshapes the sampler's distribution from each row's history and is not
    # replayed on the training forward (top-k, top-p and min-p are: their ratio is 1, test_invariants.py)
    "sampling_correction": (
        {"repetition_penalty": 1.5},
        {"sampling_correction": "token_truncate"},
        ones_reward,
        lambda b, v: (
            differ(b, v)
            and abs(v["steps"][0]["sampling/importance_sampling_ratio/mean"] - 1.0) > 1e-3
            and "sampling/importance_sampling_ratio/mean" not in b["steps"][0]
        ),
    ),
    "sampling_correction_max": (
        {"repetition_penalty": 1.5, "sampling_correction": "token_truncate"},
        {"sampling_correction_max": 0.2},
        ones_reward,
        differ,
    ),
    "sampling_correction_min": (
        {"repetition_penalty": 1.5, "sampling_correction": "token_mask"},
        {"sampling_correction_min": 0.999},
        ones_reward,
        differ,
    ),
    # with bf16 compute, master_weights=dtype keeps the weights (and AdamW state) in bf16 too
    "master_weights": (
        {"dtype": "bfloat16"},
        {"master_weights": "dtype"},
        ones_reward,
        lambda b, v: all(w.dtype == torch.bfloat16 for w in v["weights"].values()) and differ(b, v),
    ),
    "sft_batch_size": ({"sft_steps": 2, "sft_batch_size": 8}, {"sft_batch_size": 4}, ones_reward, differ),
    "sft_learning_rate": (
        {"sft_steps": 2, "sft_batch_size": 8},
        {"sft_learning_rate": 1e-5},
        ones_reward,
        differ,
    ),
    # the warm start learns from 4 rows instead of all of them; warms up instead of starting at full rate
    "sft_examples": ({"sft_steps": 2, "sft_batch_size": 8}, {"sft_examples": 4}, ones_reward, differ),
    "sft_warmup_steps": ({"sft_steps": 3, "sft_batch_size": 8}, {"sft_warmup_steps": 3}, ones_reward, differ),
    "ref_model_mixup_alpha": (
        {"sync_ref_model": True, "ref_model_sync_steps": 1},
        {"ref_model_mixup_alpha": 0.1},
        ones_reward,
        differ,
    ),
    "ref_model_sync_steps": (
        {"sync_ref_model": True, "ref_model_sync_steps": 1},
        {"ref_model_sync_steps": 5},
        ones_reward,
        differ,
    ),
    "dynamic_sampling": (
        {},
        {"dynamic_sampling": True},
        starts_with_one,
        lambda b, v: v["steps"][0]["num_generation_batches"] > 1 == b["steps"][0]["num_generation_batches"],
    ),
    "max_resample_batches": (
        {"dynamic_sampling": True},
        {"max_resample_batches": 1},
        starts_with_one,
        lambda b, v: v["steps"][0]["num_generation_batches"] == 1 < b["steps"][0]["num_generation_batches"],
    ),
    "micro_batch_size": (
        {},
        {"micro_batch_size": 4},
        ones_reward,
        # micro-batching must not change the math: equal up to float32 summation order
        lambda b, v: all(torch.allclose(b["weights"][k], v["weights"][k], atol=1e-5) for k in b["weights"]),
    ),
}

# options tested elsewhere, with where
ELSEWHERE = {
    "torch_compile": "tests/models/test_compiled.py (the compiled passes equal the eager ones; graphs per "
    "bucket) and test_compiled_runs.py (a run trains as the eager one and resumes bitwise)",
    "torch_compile_mode": "tests/models/test_compiled.py::test_the_config_refuses_what_compile_does_not_read",
    "torch_compile_backend": "tests/models/test_compiled.py (aot_eager, inductor; an unknown name: one line)",
    "teacher_model": "test_distillation.py::test_a_student_distils_the_teachers_habit_with_no_reward",
    "teacher_model_revision": "tests/models/test_hub_models.py (a teacher at a revision loads; a missing one "
    "is one line)",
    "distill_coef": "test_distillation.py (the per-token advantage by hand; resume refuses another value)",
    "gkd_beta": "test_gkd.py::test_the_loss_equals_a_direct_computation_in_value_and_every_gradient (β = 0, "
    "0.5, 1); test_a_student_takes_the_teachers_habit_from_its_own_samples_and_from_answers",
    "seq_kd": "test_gkd.py::test_seq_kd_learns_from_the_teachers_samples_and_needs_no_answers",
    "lmbda": "test_gkd.py::test_the_share_of_on_policy_steps_is_lmbda_and_a_resume_is_bitwise (and lmbda = 0 "
    "and 1: test_a_student_takes_the_teachers_habit_from_its_own_samples_and_from_answers)",
    "teacher_device": "test_distillation.py::test_bad_distillation_options_are_refused (a run on the "
    "policy's device otherwise: the distillation tests)",
    "target_entropy": "test_entropy_control.py::test_a_run_that_would_collapse_is_held_near_its_target",
    "num_train_epochs": "tests/test_trl_script.py::test_run_length_is_trls_when_max_steps_is_unset",
    "entropy_coef": "tests/test_trl_script.py::test_trls_entropy_options_train_as_trls",
    "use_adaptive_entropy": "tests/test_trl_script.py::test_trls_entropy_options_train_as_trls",
    "entropy_target": "tests/test_trl_script.py::test_trls_entropy_options_train_as_trls",
    "entropy_coef_delta": "tests/test_trl_script.py::test_trls_entropy_options_train_as_trls",
    "entropy_coef_min": "test_entropy_control.py::"
    "test_trls_adaptive_rule_steps_within_its_bounds_and_acts_only_at_or_below_the_target",
    "entropy_coef_max": "test_entropy_control.py::"
    "test_trls_adaptive_rule_steps_within_its_bounds_and_acts_only_at_or_below_the_target",
    "entropy_coef_lr": "test_entropy_control.py (the controller's rule, the band, resume)",
    "strict_invariants": "test_invariants.py::test_strict_invariants_stops_the_run_with_a_checkpoint",
    "num_completions_to_print": "test_every_option.py::test_num_completions_to_print_sets_the_rows_of_the_"
    "completions_table",
    "auto_find_batch_size": "test_out_of_memory.py::test_auto_find_batch_size_redoes_the_step_from_its_"
    "completions_with_half_the_micro_batch",
    "curriculum": "test_curriculum.py::test_the_curriculum_composes_with_dynamic_sampling (prompts set "
    "aside: fewer zero-spread groups and generation batches); test_a_run_with_the_curriculum_resumes_bitwise",
    "curriculum_patience": "test_curriculum.py::test_hand_built_rewards_move_prompts_between_pools_"
    "exactly_as_specified (k = 2); test_patience_one_sets_aside_on_the_first_zero_spread_visit",
    "curriculum_revisit": "test_curriculum.py::test_set_aside_prompts_are_revisited_with_probability_p",
    "alert_thresholds": "test_alerts.py::test_a_threshold_changed_by_name_changes_when_it_fires",
    "resume": "test_grpo_loop.py::test_stopped_and_resumed_run_ends_with_bitwise_equal_weights",
    "progress": "test_progress_can_be_switched_off (below)",
    "model": "test_grpo_loop.py::test_facade_takes_a_path_or_a_loaded_model; "
    "test_dataset_files_and_prompt_column (below)",
    "gradient_checkpointing": "test_gradient_checkpointing_is_switched_on (below)",
    "device": "tests/models/test_device.py (resolution, placement, backend choice); tests/gpu/test_gpu.py "
    "(pytest -m gpu: train, resume across devices, reward, sampler on CUDA)",
    "decode_loop": "tests/rollout/test_static_decode.py (every loop gives the eager loop's tokens and "
    "log-probs; auto and cuda_graph resolved per device)",
    "tools": "test_multi_turn_training.py (tool_addition with and without its tool; your tool by "
    "reference: test_the_episode_options_reach_the_environment)",
    "environment": "test_multi_turn_training.py::test_your_own_environment_by_reference_with_its_reward",
    "max_turns": "test_multi_turn_training.py::test_the_episode_options_reach_the_environment; "
    "tests/rollout/test_multi_turn.py (turns bounded)",
    "tool_call_format": "test_multi_turn_training.py::test_the_episode_options_reach_the_environment",
    "tool_timeout": "test_multi_turn_training.py::test_the_episode_options_reach_the_environment; "
    "tests/envs/test_tools.py (a hang answered after the timeout)",
    "fused_logps": "test_fused_logps.py (both paths equal in values and every gradient)",
    "dataset": "test_dataset_files_and_prompt_column (below)",
    "eval_dataset": "test_dataset_files_and_prompt_column (below)",
    "prompt_column": "test_dataset_files_and_prompt_column (below)",
    "prompt_truncation": "test_prompt_truncation_error (below)",
    "on_reward_error": "test_reward_errors_raise_or_count (below)",
    "reward_timeout": "test_reward_and_update_guards.py: reward hangs past reward_timeout, in evaluation",
    "num_threads": "test_threads.py::test_num_threads_pins_torch_threads_for_the_run_and_is_restored",
    "reward_funcs": "test_reward_model.py::test_grpo_reward_funcs_from_the_config; {url: ...} entries: "
    "tests/rewards/test_remote_rewards.py::test_a_training_run_scored_by_serve_reward_equals_one_scored_directly",
    "strategy": "tests/distributed/test_world_size.py (ddp and fsdp, 2 processes)",
    "fsdp_cpu_offload": "tests/distributed/test_world_size.py::test_fsdp_cpu_offload_trains",
    "trust_remote_code": "tests/test_reliability.py::test_trust_remote_code_is_off_unless_set",
    "max_consecutive_skips": "tests/test_reliability.py::test_consecutive_non_finite_updates_stop",
    "overwrite": "test_run_safety.py::test_overwrite_replaces_the_earlier_run_and_resume_continues_it",
    "sft_target_accuracy": "test_run_safety.py::test_warm_start_stops_once_the_probe_reaches_the_target",
    "report_to": "test_reporting.py::test_a_grpo_run_reports_to_wandb_and_tensorboard",
    "answer_column": "test_own_task.py::test_answer_column_names_the_column_answers_come_from",
    "model_revision": "tests/models/test_hub_models.py (a revision loads; a missing one is one line)",
    "push_to_hub": "tests/train/test_hub_push.py (the final model uploaded, and it loads)",
    "hub_model_id": "tests/train/test_hub_push.py (named, or after output_dir)",
    "hub_private_repo": "tests/train/test_hub_push.py (passed to create_repo)",
    "system_prompt": "tests/train/test_hub_training.py (rows opened by it; the gsm8k preset end to end)",
    "chat_template_kwargs": "tests/train/test_hub_training.py::test_a_system_prompt_opens_every_prompt_and_"
    "template_variables_reach_the_template",
    "answer_format": "tests/data/test_hub_datasets.py (gsm8k answers made bare, in training and eval)",
    "dataset_config": "tests/data/test_hub_datasets.py (a directory's and a hub dataset's configs)",
    "dataset_train_split": "tests/data/test_hub_datasets.py (the split trained on; a missing one)",
    "dataset_test_split": "tests/data/test_hub_datasets.py (held-out rows from it; a missing one)",
    "max_staleness": "test_async.py::test_staleness_0_is_the_synchronous_run_bitwise; "
    "test_every_batch_is_exactly_k_versions_old",
    "weight_sync_steps": "test_async.py::test_a_run_whose_worker_was_killed_resumes_bitwise",
    "weight_sync_timeout": "test_async.py::test_a_worker_that_fails_hangs_or_dies_ends_the_run_in_one_line",
    "rollout_device": "test_async.py::test_the_rollout_device_by_hand; "
    "test_every_batch_is_exactly_k_versions_old",
    "rollout_workers": "test_async.py::test_several_workers_take_the_steps_in_turn_with_the_same_numbers",
    "rollout_server_urls": "tests/serve/test_rollout_servers.py::"
    "test_one_server_samples_what_the_worker_samples_bitwise; "
    "test_two_servers_share_each_batch_and_both_get_every_version",
    "request_timeout": "tests/serve/test_rollout_servers.py::"
    "test_a_server_that_stops_answering_or_is_stopped_ends_the_run_in_one_line",
    "use_peft": "test_own_task.py::test_lora_trains_only_adapters_and_exports_merged",
    "lora_r": "test_own_task.py::test_lora_trains_only_adapters_and_exports_merged (adapter shapes)",
    "lora_alpha": "test_own_task.py::test_lora_trains_only_adapters_and_exports_merged (adapter config)",
    "lora_dropout": "test_own_task.py::test_lora_trains_only_adapters_and_exports_merged (adapter config)",
    "lora_target_modules": "test_own_task.py::test_lora_resume_continues_bitwise; "
    "test_lora_target_that_matches_nothing_and_missing_peft",
}


@pytest.mark.parametrize("option", sorted(CASES))
def test_option_changes_behaviour(tmp_path, base, option):
    overrides, check = CASES[option]
    assert check(base, run(tmp_path, option, **overrides)), option


@pytest.mark.parametrize("option", sorted(RELATIVE))
def test_option_changes_behaviour_relative(tmp_path, option):
    base_overrides, variant_overrides, reward, check = RELATIVE[option]
    reference = run(tmp_path, "base", reward=reward, **base_overrides)
    variant = run(tmp_path, "variant", reward=reward, **(base_overrides | variant_overrides))
    assert check(reference, variant), option


def test_every_option_has_a_test():
    covered = set(CASES) | set(RELATIVE) | set(ELSEWHERE)
    assert set(GRPOConfig.model_fields) == covered, set(GRPOConfig.model_fields) ^ covered


def test_every_test_named_elsewhere_exists():
    """ELSEWHERE's strings name test files and functions (`file.py::test_name`, a bare test_name of the
    file named before it, or of this one: `(below)`) that exist: a renamed test leaves no stale entry."""
    here = Path(__file__)
    for option, where in ELSEWHERE.items():
        named = named_tests(where, here.parent, here)
        assert named and all(named.values()), (option, [test for test, found in named.items() if not found])


def test_progress_can_be_switched_off():
    from rich.console import Console

    from grpokit.config.plan import display
    from grpokit.train.progress import RichReporter

    for enabled in (True, False):
        with RichReporter(Console(), display(GRPOConfig(progress=enabled)), enabled=enabled) as reporter:
            assert reporter.progress.disable is (not enabled)


def test_num_completions_to_print_sets_the_rows_of_the_completions_table():
    """One row per prompt (its first completion), as many prompts as num_completions_to_print; None:
    every prompt."""
    from rich.console import Console

    from grpokit.config.plan import display
    from grpokit.train.events import EventKind
    from grpokit.train.progress import RichReporter

    G, P = 4, 5
    data = {  # P prompts × G completions; completion "p.g", reward p + g/10
        "prompts": [f"prompt{p}" for p in range(P) for _ in range(G)],
        "completions": [f"{p}.{g}" for p in range(P) for g in range(G)],
        "rewards": [p + g / 10 for p in range(P) for g in range(G)],
    }
    for count, rows in ((2, ["0.0", "1.0"]), (None, ["0.0", "1.0", "2.0", "3.0", "4.0"])):
        console = Console(record=True, width=200)
        shown = display(GRPOConfig(num_generations=G, num_completions_to_print=count))
        with RichReporter(console, shown, enabled=False) as reporter:
            reporter.on_event(EventKind.COMPLETIONS, 7, data)
        text = console.export_text()
        assert [f"'{c}'" in text for c in data["completions"]] == [c in rows for c in data["completions"]]


def test_gradient_checkpointing_is_switched_on(tmp_path):
    from grpokit.config.plan import model_spec
    from grpokit.train.run import policy_and_tokenizer

    for flag in (False, True):
        spec = model_spec(tiny_config(tmp_path, gradient_checkpointing=flag))
        model, _ = policy_and_tokenizer(spec, "0123", 16)
        assert model.is_gradient_checkpointing is flag


def test_dataset_files_and_prompt_column(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:3]))
    cfg = tiny_config(
        tmp_path,
        task=None,
        dataset=str(tmp_path / "train.jsonl"),
        eval_dataset=str(tmp_path / "eval.jsonl"),
        prompt_column="question",
        model=str(tmp_path / "policy"),
        max_steps=1,
    )
    from grpokit.models import build_policy, char_tokenizer, save_policy

    tok = char_tokenizer("0123456789+=")
    save_policy(
        build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tok), max_seq_len=32, seed=0),
        tok,
        tmp_path / "policy",
    )
    result = train_grpo(cfg, reward_funcs=[ones_reward])
    assert result.eval_before["num_prompts"] == 3
    with pytest.raises(Exception, match="no column 'prompt'"):
        train_grpo(
            cfg.model_copy(update={"prompt_column": "prompt", "overwrite": True}), reward_funcs=[ones_reward]
        )


def test_prompt_truncation_error(tmp_path):
    with pytest.raises(ValueError, match="more than max_prompt_length=3"):
        run(tmp_path, "error", max_prompt_length=3, prompt_truncation="error")


def test_reward_errors_raise_or_count(tmp_path):
    with pytest.raises(RewardFunctionError, match="fails_on_nine"):
        run(tmp_path, "raise", reward=fails_on_nine, num_eval_prompts=1)
    result = run(tmp_path, "count", reward=fails_on_nine, on_reward_error="unscorable", num_eval_prompts=1)
    assert sum(r["reward_errors"] for r in result["steps"]) > 0
