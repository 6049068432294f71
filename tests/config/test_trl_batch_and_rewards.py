"""TRL's batch names mapped to grpokit's step (issue 25, point 6.2), a micro_batch_size that fits a
small step by default (6.3), and reward functions named by a bare string in the config (6.5)."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from grpokit.cli import main
from grpokit.config import ConfigError, GRPOConfig, load_config, to_yaml, trl_names
from grpokit.config.schema import BUILTIN_REWARDS


@pytest.fixture
def said(monkeypatch, caplog):
    """The lines the config layer says (the TRL-name mappings), from a clean 'already said' set."""
    monkeypatch.setattr(trl_names, "_said", set())
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    caplog.set_level(logging.WARNING, logger="grpokit.config")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "grpokit.config"]


def _geometry(cfg: GRPOConfig) -> tuple[int, int, int]:
    return cfg.prompts_per_step, cfg.num_generations, cfg.micro_batch_size


# ----------------------------------------------------------------------------- TRL's batch names


def test_trl_batch_names_give_trls_generation_batch_as_one_step(said):
    """TRL 1.16 itself: generation_batch_size = per_device_train_batch_size × processes ×
    gradient_accumulation_steps completions per optimizer update; grpokit's step is that many rows in
    micro-batches of per_device_train_batch_size."""
    import trl

    for per_device, accumulation, generations in [(4, 2, 4), (8, 1, 8), (3, 4, 6), (2, 8, 2)]:
        names = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation)
        theirs = trl.GRPOConfig(
            output_dir="unused",
            use_cpu=True,
            bf16=False,
            report_to="none",
            num_generations=generations,
            **names,
        )
        ours = GRPOConfig(num_generations=generations, **names)
        assert ours.prompts_per_step * ours.num_generations == theirs.generation_batch_size
        assert theirs.steps_per_generation == accumulation  # one update per generation batch
        assert ours.micro_batch_size == theirs.per_device_train_batch_size
    assert _geometry(GRPOConfig(per_device_train_batch_size=16)) == (
        2,
        8,
        16,
    )  # TRL's default accumulation: 1
    assert _geometry(GRPOConfig(gradient_accumulation_steps=2)) == (2, 8, 8)  # TRL's default per device: 8
    assert (
        said().count(
            "TRL names: per_device_train_batch_size=4 × gradient_accumulation_steps=2 × 1 process = "
            "8 completions per optimizer step -> prompts_per_step=2 (÷ num_generations=4), micro_batch_size=4"
        )
        == 1
    )
    assert "per_device_train_batch_size" not in GRPOConfig(per_device_train_batch_size=8).model_dump()


def test_processes_multiply_the_generation_batch(said, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
    assert _geometry(cfg) == (4, 4, 4)  # 4 × 2 × 2 processes = 16 completions: 4 prompts, 2 per rank
    assert any("× 2 processes = 16 completions" in line for line in said())


def test_a_batch_that_is_not_whole_groups_names_both_values():
    with pytest.raises(ConfigError) as error:
        load_config(GRPOConfig, None, ["per_device_train_batch_size=3", "num_generations=4"])
    line = str(error.value).splitlines()[-1].strip()
    assert line.startswith("per_device_train_batch_size=3 × gradient_accumulation_steps=1 × 1 process = 3")
    assert "not divisible by num_generations=4" in line and "a multiple of 4" in line
    with pytest.raises(
        ValidationError, match="gradient_accumulation_steps must be a positive integer .got 0"
    ):
        GRPOConfig(gradient_accumulation_steps=0)


@pytest.mark.parametrize("own", ["micro_batch_size", "prompts_per_step"])
def test_a_trl_batch_name_and_the_grpokit_option_it_sets_are_not_both_taken(own):
    text = f"per_device_train_batch_size and {own} are both set"
    with pytest.raises(ValidationError, match=text):
        GRPOConfig(per_device_train_batch_size=8, **{own: 8})
    with pytest.raises(ConfigError, match=rf"\(command line\):\n  {text}"):
        load_config(GRPOConfig, None, ["per_device_train_batch_size=8", f"{own}=8"])


def test_across_sources_the_later_one_wins_as_for_other_trl_names(tmp_path, said):
    """A command line's TRL batch names replace the file's (or a preset's) prompts_per_step and
    micro_batch_size; the file's num_generations divides them; a later grpokit option wins over them."""
    file = tmp_path / "run.yaml"
    file.write_text("prompts_per_step: 32\nmicro_batch_size: 128\nnum_generations: 4\n")
    cfg = load_config(GRPOConfig, file, ["per_device_train_batch_size=4", "gradient_accumulation_steps=2"])
    assert _geometry(cfg) == (2, 4, 4)
    file.write_text("per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\nnum_generations: 4\n")
    assert _geometry(load_config(GRPOConfig, file)) == (2, 4, 4)
    assert _geometry(load_config(GRPOConfig, file, ["micro_batch_size=2"])) == (2, 4, 2)
    assert _geometry(load_config(GRPOConfig, file, ["gradient_accumulation_steps=4"])) == (4, 4, 4)


def test_written_configs_round_trip_and_print_config_shows_the_mapping(tmp_path, capsys):
    cfg = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
    file = tmp_path / "config.yaml"
    file.write_text(to_yaml(cfg))
    assert load_config(GRPOConfig, file, written=True) == cfg
    file.write_text("per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\nnum_generations: 4\n")
    assert main(["print-config", str(file)]) == 0
    out = capsys.readouterr().out
    assert "prompts_per_step: 2\n" in out and "micro_batch_size: 4\n" in out


# ----------------------------------------------------------------------------- micro_batch_size's default


def test_an_unset_micro_batch_size_fits_the_step_and_a_set_one_is_checked():
    assert _geometry(GRPOConfig(prompts_per_step=2, num_generations=4)) == (2, 4, 8)
    assert GRPOConfig(prompts_per_step=100, num_generations=8).micro_batch_size == 50  # ≤ 64, divides 800
    assert GRPOConfig(prompts_per_step=3, num_generations=7).micro_batch_size == 21
    assert GRPOConfig().micro_batch_size == 64  # 32 × 8 = 256 rows: 64 as before
    with pytest.raises(ValidationError, match="8 rows must be divisible by micro_batch_size=64"):
        GRPOConfig(prompts_per_step=2, num_generations=4, micro_batch_size=64)


def test_the_fitted_micro_batch_size_is_what_print_config_shows_and_round_trips(tmp_path, capsys):
    file = tmp_path / "small.yaml"
    file.write_text("prompts_per_step: 2\nnum_generations: 4\n")
    assert main(["print-config", str(file)]) == 0
    shown = capsys.readouterr().out
    assert "micro_batch_size: 8\n" in shown
    file.write_text(shown)
    again = load_config(GRPOConfig, file, written=True)
    assert again == load_config(GRPOConfig, tmp_path / "small.yaml") and again.micro_batch_size == 8


# ----------------------------------------------------------------------------- reward_funcs by name


def test_bare_reward_names_are_builtins_or_references():
    assert load_config(GRPOConfig, None, ["reward_funcs=exact_answer"]).reward_funcs == [
        {"builtin": "exact_answer"}
    ]
    cfg = load_config(GRPOConfig, None, ["reward_funcs=[format_tags, my_rewards.py:f, pkg.mod:g, pkg.mod.h]"])
    assert cfg.reward_funcs == [
        {"builtin": "format_tags"},
        {"python": "my_rewards.py:f"},
        {"python": "pkg.mod:g"},
        {"python": "pkg.mod.h"},
    ]
    assert GRPOConfig(reward_funcs=["exact_answer", {"model": "rm"}]).reward_funcs[1] == {"model": "rm"}


@pytest.mark.parametrize("entry", ["reward_funcs=exact_answr", "reward_funcs=[{builtin: exact_answr}]"])
def test_an_unknown_reward_name_is_one_line_listing_the_builtins(entry):
    with pytest.raises(ConfigError) as error:
        load_config(GRPOConfig, None, [entry])
    line = str(error.value).splitlines()[-1]
    assert "reward function 'exact_answr' is not a built-in reward (" + ", ".join(BUILTIN_REWARDS) in line


def test_the_builtin_names_are_the_rewards_there_are():
    from grpokit.config.plan import RewardSpec, grpo_plan
    from grpokit.rewards import BUILTIN_REWARDS as FUNCTIONS
    from grpokit.rewards.builtin import LENGTH_REWARDS
    from grpokit.train.inputs import configured_rewards

    assert set(BUILTIN_REWARDS) == {*FUNCTIONS, *LENGTH_REWARDS, "task"}
    cfg = load_config(GRPOConfig, None, ["reward_funcs=[exact_answer, math_answer]"])
    funcs = configured_rewards(RewardSpec(funcs=tuple(cfg.reward_funcs)), task=None)
    assert funcs == [FUNCTIONS["exact_answer"], FUNCTIONS["math_answer"]]
    # the length rewards by name, made for the run's max_completion_length (DAPO's over its last fifth)
    cfg = load_config(
        GRPOConfig, None, ["reward_funcs=[overlong_penalty, length_penalty]", "max_completion_length=10"]
    )
    overlong, length = configured_rewards(grpo_plan(cfg).rewards, task=None)
    ids = [[1] * n for n in (8, 9, 10, 11)]
    assert overlong([""] * 4, ["x"] * 4, completion_ids=ids) == [0.0, -0.5, -1.0, -1.0]
    assert length([""] * 4, ["x"] * 4, completion_ids=ids) == [-0.8, -0.9, -1.0, -1.1]
    assert overlong.__name__ == "overlong_penalty" and length.__name__ == "length_penalty"
    with pytest.raises(ValueError, match="'task' is the built-in task's reward, and no built-in task is set"):
        configured_rewards(RewardSpec(funcs=({"builtin": "task"},)), task=None)
