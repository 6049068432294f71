"""The config resolved once (`config.plan`): each object holds what the config says, and nothing in
the plan needs torch."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import grpokit.config.plan as plan_module
from grpokit.config import GRPOConfig, RewardConfig
from grpokit.config.plan import grpo_plan, reward_plan


def test_the_plan_holds_what_the_config_says():
    cfg = GRPOConfig(
        seed=7,
        loss_type="grpo",
        beta=0.04,
        sync_ref_model=True,
        ref_model_sync_steps=3,
        ref_model_mixup_alpha=0.5,
        reward_weights=[1.0, 2.0],
        num_iterations=2,
        max_steps=10,
        use_peft=True,
        lora_target_modules=["q_proj"],
        sft_steps=4,
        sft_target_accuracy=0.5,
        micro_batch_size=16,
        dtype="bfloat16",
        master_weights="dtype",
    )
    plan = grpo_plan(cfg)
    step = plan.trainee.step
    assert (step.loss.loss_type, step.loss.beta, step.seed) == ("grpo", 0.04, 7)
    assert step.reference_sync == (3, 0.5) and step.reward_weights == (1.0, 2.0)
    assert plan.trainee.optimizer.total_updates == 20  # max_steps · num_iterations optimizer steps
    assert plan.lora is not None and plan.lora.target_modules == ("q_proj",)
    assert plan.warm_start.schedule.steps == 4 and plan.warm_start.probe_batch_size == 16
    assert plan.data.answers_for == "the supervised warm start (sft_steps=4)"
    assert plan.model.stored == "bfloat16" and plan.trainee.engine.group_size == cfg.num_generations
    assert plan.run.config_values["seed"] == 7 and "loss_type: grpo" in plan.run.config_yaml
    assert grpo_plan(GRPOConfig()).lora is None and grpo_plan(GRPOConfig()).data.answers_for is None
    assert grpo_plan(GRPOConfig()).trainee.step.reference_sync is None
    rewards = reward_plan(RewardConfig(max_steps=5, batch_size=8, micro_batch_size=4))
    assert rewards.optimizer.total_updates == 5 and rewards.step.micro_batch_size == 4
    assert rewards.display.label == "train" and grpo_plan(cfg).display.label == "grpo"


def test_plan_objects_are_frozen():
    plan = grpo_plan(GRPOConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.trainee.step.seed = 1  # type: ignore[misc]


def test_the_plan_module_imports_no_torch():
    tree = ast.parse(Path(plan_module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "torch" not in imported and "grpokit" not in imported  # relative imports within config only


def test_plan_objects_read_options_of_their_own_names():
    """The plan fills fields from the config's options of the same names (`plan._named`): a field that
    no option names must be one the resolver derives, or a rename would silently keep a default."""
    from dataclasses import fields

    from grpokit.config import GRPOConfig, plan

    derived = {
        plan.RunControl: {"config_yaml", "config_values"},
        plan.Placement: set(),
        plan.DataSpec: {"tiny_model", "answers_for", "answers_otherwise"},
        plan.EpisodeSpec: set(),
        plan.Evaluation: {"batch_size"},
        plan.EngineSpec: {"group_size"},
        plan.StepSpec: {
            "loss",
            "entropy",
            "reference_sync",
            "sampling_correction_bounds",
            "micro_batch_fitted",
        },
        plan.LossSpec: set(),
    }
    for cls, given in derived.items():  # (options converted on the way, report_to, are named too)
        unnamed = {f.name for f in fields(cls)} - set(GRPOConfig.model_fields)
        assert unnamed == given, cls.__name__
    cfg = GRPOConfig(beta=0.1, pass_at_k=3, max_turns=2, eval_steps=7)
    assert plan.step_spec(cfg).loss.beta == 0.1 and plan.evaluation(cfg).pass_at_k == 3
    assert plan.episode_spec(cfg).max_turns == 2 and plan.run_control(cfg).eval_steps == 7
