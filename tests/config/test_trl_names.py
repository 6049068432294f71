"""What a TRL user types (aliases, answers, 'did you mean' in Python too), `--help` listing every
option, and `report_to`'s TRL forms. Where metrics go is tests/train/test_reporting.py."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from grpokit.cli import main
from grpokit.config import ConfigError, GRPOConfig, RewardConfig, SFTConfig, load_config, trl_names

CONFIGS = (GRPOConfig, RewardConfig, SFTConfig)


@pytest.fixture
def said(monkeypatch, caplog):
    """The lines the config layer says (the TRL-name mappings), from a clean 'already said' set."""
    monkeypatch.setattr(trl_names, "_said", set())
    monkeypatch.delenv("RANK", raising=False)
    caplog.set_level(logging.WARNING, logger="grpokit.config")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "grpokit.config"]


# ----------------------------------------------------------------------------- accepted TRL names


def test_bf16_and_fp16_become_dtype_from_yaml_overrides_and_python_said_once(tmp_path, said):
    file = tmp_path / "run.yaml"
    file.write_text("bf16: true\nlearning_rate: 1.0e-5\n")
    assert load_config(GRPOConfig, file).dtype == "bfloat16"
    assert load_config(GRPOConfig, None, ["bf16=true"]).dtype == "bfloat16"
    assert GRPOConfig(bf16=True).dtype == "bfloat16"
    for config in (RewardConfig, GRPOConfig):  # fp16 maps to dtype=float16, which training refuses
        with pytest.raises(ValueError, match="dtype=float16 .TRL's fp16=true. is not supported"):
            config(bf16=False, fp16=True)  # TRL's usual pair for fp16
    assert GRPOConfig(bf16=False).dtype == "float32"
    lines = said()
    assert lines.count("TRL name: bf16=true -> dtype=bfloat16") == 1, lines  # three loads, one line
    assert lines.count("TRL name: fp16=true -> dtype=float16") == 1, lines
    assert "bf16" not in GRPOConfig(bf16=True).model_dump()  # the resolved config has grpokit's names


def test_trl_options_that_change_nothing_trained_are_taken_and_said_unused(tmp_path, said):
    """TrainingArguments' loader, eval-batch, accelerate and padding options: a TRL script that sets them
    runs (they were refused), each said once, from Python, YAML and key=value alike; the config is the
    one without them."""
    given = dict(
        per_device_eval_batch_size=16,
        dataloader_num_workers=4,
        dataloader_pin_memory=False,
        dataloader_persistent_workers=True,
        dataloader_prefetch_factor=2,
        dataset_num_proc=8,
        accelerator_config={"split_batches": True},
        pad_to_multiple_of=8,
        eval_on_start=True,
        logging_strategy="steps",
        num_generations_eval=4,
        log_multimodal=False,
        use_transformers_continuous_batching=True,
    )
    assert set(given) == set(trl_names.NOT_USED)
    assert GRPOConfig(**given).model_dump() == GRPOConfig().model_dump()
    file = tmp_path / "run.yaml"
    file.write_text("per_device_eval_batch_size: 16\n")
    assert (
        load_config(GRPOConfig, file, ["pad_to_multiple_of=8"]).model_dump()
        == load_config(GRPOConfig, None).model_dump()
    )
    lines = said()
    eval_line = "per_device_eval_batch_size=16 is not used: evaluation runs in calls of micro_batch_size rows"
    loader_line = (
        "dataloader_num_workers=4 is not used: grpokit draws each step's prompts in process, with no "
    )
    assert lines.count(f"TRL option {eval_line}") == 1, lines  # three loads, one line
    assert (
        lines.count("TRL option pad_to_multiple_of=8 is not used: a batch is padded to its longest row") == 1
    )
    assert f"TRL option {loader_line}DataLoader" in lines
    with pytest.raises(ValidationError, match="per_device_eval_batch_size is a TRL option"):
        RewardConfig(per_device_eval_batch_size=16)  # (taken where it is said what is done instead)


def test_disable_tqdm_and_use_liger_kernel_are_honoured(said):
    """disable_tqdm is progress negated; use_liger_kernel=true is grpokit's own fused LM head
    (fused_logps), false keeps it (the same log-probs); contradictions and non-flags are one line."""
    assert GRPOConfig(disable_tqdm=True).progress is False
    assert GRPOConfig(disable_tqdm=False).progress is True
    assert SFTConfig(disable_tqdm=True).progress is False
    assert GRPOConfig(use_liger_kernel=True).fused_logps is True
    assert GRPOConfig(use_liger_kernel=False).fused_logps is True
    assert GRPOConfig(use_liger_kernel=False, fused_logps=False).fused_logps is False
    lines = said()
    assert "TRL name: disable_tqdm=true -> progress=false" in lines
    assert (
        "TRL name: use_liger_kernel=false -> fused_logps unchanged (the same log-probs either way)" in lines
    )
    with pytest.raises(ValidationError, match="use_liger_kernel=true contradicts fused_logps=false"):
        GRPOConfig(use_liger_kernel=True, fused_logps=False)
    with pytest.raises(ValidationError, match="disable_tqdm .TRL's name. and progress are both set"):
        GRPOConfig(disable_tqdm=True, progress=True)
    with pytest.raises(ValidationError, match="use_liger_kernel must be true or false .got 'yes'."):
        GRPOConfig(use_liger_kernel="yes")


def test_trls_flag_forms_of_scale_rewards_and_log_completions(tmp_path, said):
    """TRL takes scale_rewards as a flag (true: "group", false: "none") and log_completions as one (a
    table every logging_steps steps, or none), from Python, YAML and key=value alike."""
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert load_config(GRPOConfig, None, ["scale_rewards=false"]).scale_rewards == "none"
    assert GRPOConfig(log_completions=True, logging_steps=5).log_completions_steps == 5
    assert GRPOConfig(log_completions=True).log_completions_steps == 1  # (TRL's logging_steps default)
    file = tmp_path / "run.yaml"
    file.write_text("log_completions: false\nscale_rewards: true\n")
    loaded = load_config(GRPOConfig, file)
    assert (loaded.log_completions_steps, loaded.scale_rewards) == (0, "group")
    lines = said()
    assert lines.count("TRL value: scale_rewards=false -> scale_rewards=none") == 1, lines
    assert "TRL name: log_completions=false -> log_completions_steps=0 (no table)" in lines
    with pytest.raises(
        ValidationError, match="log_completions .TRL's name. and log_completions_steps are both"
    ):
        GRPOConfig(log_completions=True, log_completions_steps=3)
    with pytest.raises(ValidationError, match="scale_rewards"):
        GRPOConfig(scale_rewards="yes")


def test_mappings_are_said_on_rank_0_only(said, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert GRPOConfig(bf16=True).dtype == "bfloat16"
    assert said() == []


def test_a_command_line_alias_overrides_the_file_and_contradictions_are_named(tmp_path, said):
    file = tmp_path / "run.yaml"
    file.write_text("dtype: float32\n")
    assert load_config(GRPOConfig, file, ["bf16=true"]).dtype == "bfloat16"
    file.write_text("bf16: true\n")
    assert load_config(GRPOConfig, file, ["dtype=float32"]).dtype == "float32"
    with pytest.raises(
        ConfigError, match=r"\(command line\):\n  bf16=true contradicts dtype=float32; set only dtype"
    ):
        load_config(GRPOConfig, None, ["bf16=true", "dtype=float32"])
    with pytest.raises(ValidationError, match="fp16=true contradicts dtype=bfloat16"):
        GRPOConfig(bf16=True, fp16=True)
    with pytest.raises(ValidationError, match="bf16=false contradicts dtype=bfloat16"):
        GRPOConfig(dtype="bfloat16", bf16=False)
    with pytest.raises(ValidationError, match="bf16 must be true or false"):
        GRPOConfig(bf16="yes")


def test_strategies_by_steps_are_accepted_and_others_answered(said):
    cfg = GRPOConfig(eval_strategy="steps", save_strategy="steps", eval_steps=10, save_steps=20)
    assert (cfg.eval_steps, cfg.save_steps) == (10, 20)
    assert "TRL name: eval_strategy=steps -> eval_steps (grpokit always counts in steps)" in said()
    with pytest.raises(ConfigError, match=r"eval_strategy=epoch is a TRL option; .*set eval_steps"):
        load_config(GRPOConfig, None, ["eval_strategy=epoch"])
    with pytest.raises(ConfigError, match=r"save_strategy=no is a TRL option; .*set save_steps \(0 = only"):
        load_config(RewardConfig, None, ["save_strategy=no"])


# ----------------------------------------------------------------------------- answered TRL names


@pytest.mark.parametrize(
    ("schema", "name", "wanted"),
    [
        (GRPOConfig, "generation_batch_size", "set prompts_per_step and num_generations"),
        (GRPOConfig, "logging_dir", "output_dir/tensorboard; set output_dir"),
        (GRPOConfig, "warmup_ratio", "set warmup_steps"),
        (GRPOConfig, "resume_from_checkpoint", "set resume=true"),
        (GRPOConfig, "use_vllm", "set decode_loop"),
        (RewardConfig, "per_device_train_batch_size", "set batch_size and micro_batch_size"),
        (RewardConfig, "gradient_accumulation_steps", "set batch_size and micro_batch_size"),
        (RewardConfig, "num_train_epochs", "set max_steps"),
        (SFTConfig, "per_device_train_batch_size", "set batch_size"),
        (RewardConfig, "steps_per_generation", "set batch_size"),
    ],
)
def test_trl_names_without_a_faithful_mapping_name_the_grpokit_option(schema, name, wanted):
    with pytest.raises(ConfigError) as from_cli:
        load_config(schema, None, [f"{name}=4"])
    with pytest.raises(ValidationError) as from_python:
        schema(**{name: 4})
    line = str(from_cli.value).splitlines()[-1].strip()
    assert line.startswith(f"{name} is a TRL option") and wanted in line, line
    assert "did you mean" not in line
    assert line in str(from_python.value)  # the Python API says the same


def test_no_trl_option_ever_gets_a_did_you_mean():
    """Against TRL 1.16 itself: every option of its GRPOConfig, RewardConfig and SFTConfig is
    grpokit's own, translated, or answered as TRL's; the stored list is exactly TRL's."""
    trl = pytest.importorskip("trl")
    import dataclasses

    theirs = {
        f.name: cls.__name__
        for cls in (trl.GRPOConfig, trl.RewardConfig, trl.SFTConfig)
        for f in dataclasses.fields(cls)
        if not f.name.startswith("_")
    }
    assert set(theirs) == trl_names.TRL_NAMES
    for schema in CONFIGS:
        translated = set(trl_names.ALIASES) | (set(trl_names.BATCH_NAMES) if schema is GRPOConfig else set())
        translated |= {name for name, taken in trl_names.NOT_USED.items() if schema.__name__ in taken}
        for name in sorted(set(theirs) - set(schema.model_fields) - translated):
            with pytest.raises(ValidationError) as error:
                schema(**{name: 1})
            assert f"{name} is a TRL option" in str(error.value), (schema.__name__, name)
            assert "did you mean" not in str(error.value), (schema.__name__, name)


@pytest.mark.parametrize("schema", CONFIGS)
def test_python_constructors_say_did_you_mean_like_the_command_line(schema):
    text = "unknown key 'learning_rat'; did you mean 'learning_rate'?"
    with pytest.raises(ValidationError, match=text):
        schema(learning_rat=1e-3)
    with pytest.raises(ConfigError, match=text):
        load_config(schema, None, ["learning_rat=1e-3"])
    assert isinstance(ConfigError("x"), ValueError)


# ----------------------------------------------------------------------------- --help


@pytest.mark.parametrize(
    ("command", "schema"),
    [
        ("train", GRPOConfig),
        ("eval", GRPOConfig),
        ("print-config", GRPOConfig),
        ("sft", SFTConfig),
        ("reward", RewardConfig),
        ("eval-reward", RewardConfig),
    ],
)
def test_help_lists_every_option_with_its_default_and_description(command, schema, capsys):
    import yaml

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    entries = {}  # option -> (its line, the description lines under it)
    for line in text.split(f"options ({schema.__name__};", 1)[1].splitlines():
        if line.startswith("  ") and not line.startswith("      ") and " = " in line:
            name = line.split(" = ", 1)[0].strip()
            entries[name] = (line, [])
        elif line.startswith("      ") and entries:
            entries[list(entries)[-1]][1].append(line.strip())
    from grpokit.config.reference import EVAL_OPTIONS

    listed = set(EVAL_OPTIONS) if command == "eval" else set(schema.model_fields)  # eval: what it reads
    assert list(entries) and set(entries) == listed
    for name, field in schema.model_fields.items():
        if name not in listed:
            continue
        line, description = entries[name]
        assert field.description and " ".join(description) == " ".join(field.description.split()), name
        default = yaml.safe_load(line.split(" = ", 1)[1].split("   (", 1)[0])
        assert default == field.default, name


# ----------------------------------------------------------------------------- report_to


def test_report_to_takes_trl_forms(monkeypatch):
    import importlib.util

    assert GRPOConfig().report_to == ["tensorboard"]
    assert GRPOConfig(report_to="none").report_to == []
    assert GRPOConfig(report_to=["none"]).report_to == []
    assert GRPOConfig(report_to="wandb").report_to == ["wandb"]
    assert load_config(RewardConfig, None, ["report_to=[tensorboard, wandb]"]).report_to == [
        "tensorboard",
        "wandb",
    ]
    with pytest.raises(
        ConfigError, match="'mlflow' is not a destination grpokit has; use tensorboard, wandb"
    ):
        load_config(GRPOConfig, None, ["report_to=mlflow"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    assert GRPOConfig(report_to="all").report_to == ["tensorboard"]  # TRL: every one installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
    assert RewardConfig(report_to="all").report_to == ["tensorboard", "wandb"]


def test_the_config_package_never_imports_torch():
    root = Path(trl_names.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] in ("torch", "transformers")], path.name


# ----------------------------------------------------------------------------- TRL options of issue 51


def test_generation_kwargs_set_grpokits_sampling_options_and_say_the_rest_unused(caplog):
    with caplog.at_level("WARNING", logger="grpokit.config"):
        cfg = GRPOConfig(
            generation_kwargs={"do_sample": True, "top_k": 7, "max_new_tokens": 12, "num_beams": 3}
        )
    assert (cfg.top_k, cfg.max_completion_length) == (7, 12)
    assert "not used by grpokit's sampler: num_beams=3" in caplog.text
    for bad, line in (
        ({"generation_kwargs": {"do_sample": False}}, "GRPO learns from sampled completions"),
        ({"generation_kwargs": {"top_p": 0.5}, "top_p": 0.9}, "set it once"),
        ({"generation_kwargs": [1]}, "must be a mapping"),
    ):
        with pytest.raises(ValidationError, match=line):
            GRPOConfig(**bad)


def test_steps_per_generation_is_taken_when_it_is_trls_default_and_refused_otherwise():
    cfg = GRPOConfig(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_generations=4,
    )
    assert (cfg.prompts_per_step, cfg.micro_batch_size) == (2, 4)  # 4 × 2 completions, groups of 4
    with pytest.raises(
        ValidationError, match="steps_per_generation=4 differs from gradient_accumulation_steps=2"
    ):
        GRPOConfig(
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
            num_generations=4,
        )


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("eval_on_start", True, "evaluates the held-out split at the start of every run"),
        ("logging_strategy", "steps", "logs every logging_steps steps"),
        ("num_generations_eval", 2, "one greedy completion a prompt"),
        ("use_transformers_continuous_batching", True, "its own batched, KV-cached decode loop"),
    ],
)
def test_trl_options_that_change_nothing_trained_are_said_unused(caplog, name, value, why):
    with caplog.at_level("WARNING", logger="grpokit.config"):
        GRPOConfig(**{name: value})
    assert f"TRL option {name}=" in caplog.text and why in caplog.text


def test_trls_loss_warnings_are_said_when_the_trainer_is_made(caplog):
    """TRL warns that a sequence-level ratio with a token-summed loss weights sequences by their length;
    grpokit says the same line as the trainer is made (grpo, which averages per sequence, is quiet)."""
    from grpokit import GRPOTrainer
    from grpokit.config import trl_names
    from grpokit.rewards import exact_answer

    rows = [{"prompt": "1+1=", "answer": "2"}]
    for loss_type, warned in (("dapo", True), ("grpo", False)):
        trl_names._said.clear()
        caplog.clear()
        with caplog.at_level("WARNING"):
            GRPOTrainer(
                "tiny",
                exact_answer,
                GRPOConfig(importance_sampling_level="sequence", loss_type=loss_type),
                rows,
            )
        assert ("weights each sequence by its completion length" in caplog.text) == warned, loss_type
