"""Resuming with a changed config: options that shaped the checkpoint are refused (every difference
in one ConfigError), the others are applied and said once; every option of every config is classified
on its own field (a field without a rule fails when its class is defined)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from grpokit.config import ConfigError, GRPOConfig, RewardConfig, SFTConfig, to_yaml
from grpokit.config.options import RULES, Resume, option
from grpokit.config.resume import resume_changes, resume_rules
from tests.train.helpers import tiny_config


def saved(tmp_path: Path, cfg, step: int = 2) -> Path:
    """`cfg` written as a checkpoint's config.yaml (as checkpoints write it)."""
    path = tmp_path / "run" / f"checkpoint-{step}" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path


def test_the_same_config_resumes_without_a_note(tmp_path):
    cfg = tiny_config(tmp_path)
    assert resume_changes(cfg.model_copy(update={"resume": True}), saved(tmp_path, cfg)) == []


def test_a_changed_model_shape_is_refused_naming_it(tmp_path):
    path = saved(tmp_path, tiny_config(tmp_path))
    with pytest.raises(ConfigError) as caught:
        resume_changes(tiny_config(tmp_path, tiny_hidden_size=32, resume=True), path)
    message = str(caught.value)
    assert "tiny_hidden_size: checkpoint 16, now 32" in message
    assert "resume with the checkpoint's values, or start a new run in another output_dir" in message


def test_several_refused_changes_are_all_named_in_one_error(tmp_path):
    path = saved(tmp_path, tiny_config(tmp_path))
    changed = dict(learning_rate=3e-2, seed=4, num_generations=8, loss_type="grpo", dtype="bfloat16")
    now = tiny_config(tmp_path, **changed, resume=True)
    with pytest.raises(ConfigError) as caught:
        resume_changes(now, path)
    lines = str(caught.value).splitlines()
    for line in (
        "learning_rate: checkpoint 0.01, now 0.03",
        "seed: checkpoint 3, now 4",
        "num_generations: checkpoint 4, now 8",
        "loss_type: checkpoint dapo, now grpo",
        "dtype: checkpoint float32, now bfloat16",
    ):
        assert f"  {line}" in lines, lines
    assert len(lines) == 7  # the header, the five differences, the fix


def test_allowed_changes_are_applied_with_one_note_each(tmp_path):
    path = saved(tmp_path, tiny_config(tmp_path, lr_scheduler_type="constant"))
    now = tiny_config(
        tmp_path, lr_scheduler_type="constant", max_steps=4, eval_steps=2, report_to=[], resume=True
    )
    assert sorted(resume_changes(now, path)) == [
        "eval_steps: 0 in the checkpoint, 2 now (applied)",
        "max_steps: 2 in the checkpoint, 4 now (applied)",
        "report_to: ['tensorboard'] in the checkpoint, [] now (applied)",
    ]


def test_more_steps_with_a_decaying_schedule_says_what_happens_to_the_learning_rate(tmp_path):
    path = saved(tmp_path, tiny_config(tmp_path, lr_scheduler_type="linear"))
    (note,) = resume_changes(tiny_config(tmp_path, lr_scheduler_type="linear", max_steps=4), path)
    assert note.startswith("max_steps: 2 in the checkpoint, 4 now (applied; the linear schedule now decays")
    assert "higher" in note


def test_max_steps_before_the_checkpoint_is_refused(tmp_path):
    path = saved(tmp_path, tiny_config(tmp_path, max_steps=8), step=6)
    with pytest.raises(ConfigError, match="max_steps: 4 is before the checkpoint's step 6"):
        resume_changes(tiny_config(tmp_path, max_steps=4), path)


def test_reward_config_refuses_a_changed_batch(tmp_path):
    before = RewardConfig(output_dir=str(tmp_path / "run"), batch_size=8, micro_batch_size=4)
    path = saved(tmp_path, before)
    with pytest.raises(ConfigError, match="batch_size: checkpoint 8, now 16"):
        resume_changes(before.model_copy(update={"batch_size": 16}), path)
    assert resume_changes(before.model_copy(update={"save_total_limit": 5}), path) == [
        "save_total_limit: 2 in the checkpoint, 5 now (applied)"
    ]


def test_an_invalid_checkpoint_config_is_one_error_naming_the_file(tmp_path):
    path = saved(tmp_path, tiny_config(tmp_path))
    path.write_text(path.read_text().replace("learning_rate: 0.01", "learning_rate: .inf"))
    with pytest.raises(ConfigError, match=r"(?s)checkpoint-2/config\.yaml\):\n  learning_rate: .*finite"):
        resume_changes(tiny_config(tmp_path), path)


@pytest.mark.parametrize("schema", [GRPOConfig, RewardConfig, SFTConfig])
def test_every_option_is_classified(schema):
    """Every field declares its rule (fixed, applied or invocation) and why, on the field itself."""
    rules = resume_rules(schema)
    assert set(rules) == set(schema.model_fields)
    assert all(rule.rule in RULES and rule.why.strip() for rule in rules.values())


def test_a_field_without_a_rule_fails_when_its_class_is_defined():
    with pytest.raises(TypeError, match=r"Extended: declare new_option with option\(default, resume="):

        class Extended(GRPOConfig):
            new_option: int = Field(1, description="a new option")

    with pytest.raises(TypeError, match="resume"):

        class Undeclared(GRPOConfig):
            new_option: int = option(1, description="a new option")  # type: ignore[call-arg]

    with pytest.raises(ValueError, match="a resume rule is one of fixed, applied, invocation"):
        Resume.fixed("")


def test_a_new_option_needs_only_its_field(tmp_path):
    """A field declared with its rule and its TRL name is compared on resume and translated from
    TRL's name with no table elsewhere."""

    class Extended(GRPOConfig):
        new_option: int = option(
            1, ge=1, trl="trl_new_option", description="a new option", resume=Resume.fixed("it shapes it")
        )

    before = Extended(output_dir=str(tmp_path / "run"))
    path = saved(tmp_path, before)
    with pytest.raises(ConfigError, match="new_option: checkpoint 1, now 2"):
        resume_changes(Extended(output_dir=str(tmp_path / "run"), trl_new_option=2), path)
    assert resume_rules(Extended)["new_option"] == Resume.fixed("it shapes it")


def test_a_checkpoint_from_before_an_option_was_removed_still_resumes(tmp_path):
    """A run saved when `sampler` existed (its config.yaml says `sampler: kv`) resumes: the option is
    dropped from the checkpoint's config, not refused; a user's config that sets it is refused."""
    cfg = tiny_config(tmp_path)
    saved = tmp_path / "checkpoint-1" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(to_yaml(cfg) + "sampler: kv\n")
    assert resume_changes(cfg, saved) == []
    user = tmp_path / "user.yaml"
    user.write_text("sampler: kv\n")
    from grpokit.config import load_config

    with pytest.raises(ConfigError, match="sampler was removed"):
        load_config(GRPOConfig, user)
