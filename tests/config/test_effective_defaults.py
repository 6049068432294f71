"""Defaults that work for the model at hand (issue 25, point 7): a tiny model built here takes the tested
addition preset's learning values where nothing set them, a real model keeps TRL's, a user's value always
wins; prompt + completion over a model's context stops with the values to set (tiny: built to fit); and
`print-config`, the run's config.yaml and `train --help` show the values that apply and where they came
from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from grpokit.cli import main
from grpokit.config import GRPOConfig, load_config
from grpokit.config.applied import CHOSEN, applied, preset_values
from grpokit.config.plan import grpo_plan
from grpokit.train.inputs import RunData, check_context, fitting_lengths, tiny_context
from tests.helpers import read_metrics, tiny_run

# the tiny run, with the steps, the learning rate and the warm start left to model=tiny and the defaults
SHORT = tiny_run("max_steps", "learning_rate", "sft_steps", micro_batch_size=16, report_to=[])


def _own_task(tmp_path) -> str:
    rows = [{"prompt": f"{n}:", "answer": "".join(sorted(n))} for n in ["312", "231", "5142", "4213", "253"]]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "train.jsonl")


# ----------------------------------------------------------------------------- what is chosen, and when


def test_a_tiny_model_takes_the_addition_presets_learning_values_where_unset():
    preset = preset_values("addition")
    resolved = applied(GRPOConfig(task="addition"))
    for name, value in {"learning_rate": 1e-4, "lr_scheduler_type": "constant"}.items():
        assert getattr(resolved.config, name) == value == preset[name], name
        assert resolved.sources[name] == CHOSEN, name
    assert resolved.defaults["learning_rate"] == 1e-6  # TRL's, which it replaced
    assert resolved.sources["temperature"] == "default" and resolved.config.temperature == 1.0  # = preset's
    assert resolved.config.sft_steps == 0  # the warm start stays yours to set (config/applied.py)
    # the plan, which the run reads, holds the chosen values
    plan = grpo_plan(GRPOConfig(task=None, dataset="train.jsonl", sft_steps=200))  # the own-task template
    assert (plan.trainee.optimizer.learning_rate, plan.trainee.optimizer.schedule) == (1e-4, "constant")
    assert plan.warm_start.schedule.steps == 200 and plan.warm_start.target_accuracy is None


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"learning_rate": 3e-5}, {"learning_rate": 3e-5, "lr_scheduler_type": "constant"}),
        ({"lr_scheduler_type": "cosine"}, {"learning_rate": 1e-4, "lr_scheduler_type": "cosine"}),
        ({"learning_rate": 1e-6}, {"learning_rate": 1e-6}),  # set to the default: still yours
    ],
)
def test_an_explicit_value_always_wins(options, expected):
    resolved = applied(GRPOConfig(task="addition", **options))
    for name, value in expected.items():
        assert getattr(resolved.config, name) == value, name
    for name in options:
        assert resolved.sources[name] == "yours"
    overrides = [f"{k}={v}" for k, v in options.items()]  # the same from the command line
    assert applied(load_config(GRPOConfig, None, ["task=addition", *overrides])).config == resolved.config


def test_a_real_model_keeps_trls_defaults():
    for cfg in [GRPOConfig(model="org/some-model"), GRPOConfig(model="./my-model-dir", sft_steps=10)]:
        resolved = applied(cfg)
        assert resolved.config == cfg and resolved.config.learning_rate == 1e-6
        assert set(resolved.sources.values()) <= {"default", "yours"}
        assert grpo_plan(cfg).trainee.optimizer.learning_rate == 1e-6
    # a model passed in from Python (cfg.model left at 'tiny') is not the tiny model built here
    plan = grpo_plan(GRPOConfig(), model_given=True)
    assert plan.trainee.optimizer.learning_rate == 1e-6 and plan.warm_start.schedule.steps == 0


# ----------------------------------------------------------------------------- the context


def _data(prompts: list[str], max_prompt_length: int | None, max_completion_length: int) -> RunData:
    rows = [{"prompt": p} for p in prompts]
    return RunData(rows, rows[:1], [], None, "ab", max_prompt_length, max_completion_length)


def test_prompt_plus_completion_over_the_context_stops_with_the_values_to_set():
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"^prompts of up to 20 tokens \(max_prompt_length\) plus") as error:
        check_context("prompt", model, None, _data(["ab"], 20, 40))
    message = str(error.value)
    assert "make 60 tokens, more than the model's context of 32" in message and "\n" not in message
    assert message.endswith("set max_completion_length=12 (or lower max_prompt_length).")
    check_context("prompt", model, None, _data(["ab"], 20, 12))  # 32: fits
    # the values that make it fit, whatever is too long
    assert fitting_lengths(32, 40, 8) == "max_prompt_length=24 (prompts cut from the left)"
    assert fitting_lengths(32, 40, 40) == "max_prompt_length=16 and max_completion_length=16"


def test_a_real_model_directory_with_a_short_context_stops_before_training(tmp_path, capsys):
    from grpokit.models import build_policy, char_tokenizer, save_policy

    tokenizer = char_tokenizer("0123456789+=")
    model = build_policy(16, 1, 2, len(tokenizer), dropout=0.0, max_seq_len=32, seed=0, intermediate_size=32)
    save_policy(model, tokenizer, tmp_path / "short")
    out = tmp_path / "run"
    args = ["train", f"model={tmp_path / 'short'}", "task=addition", f"output_dir={out}", *SHORT]
    assert main([*args, "max_completion_length=30"]) == 2
    err = capsys.readouterr().err
    assert "prompts of up to 6 tokens (max_prompt_length) plus max_completion_length=30 make 36 tokens" in err
    assert "context of 32 (max_position_embeddings); set max_completion_length=26" in err
    assert "Traceback" not in err and not out.exists()  # stopped before any work


def test_the_tiny_model_is_built_with_a_context_that_fits_its_prompts():
    long_prompts = _data(["a" * 300, "b"], None, 4)
    assert tiny_context("prompt", long_prompts) == 304  # the former 4·(64 + 4) = 272 would not hold them
    assert tiny_context("prompt", _data(["ab"], None, 4)) == 272  # short prompts: as before
    assert tiny_context("prompt", _data(["a" * 300], 100, 8)) == 432  # prompts cut to max_prompt_length
    from grpokit.models import char_tokenizer

    built = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=304))
    check_context("prompt", built, char_tokenizer("ab"), long_prompts)  # one token a character: fits


# ----------------------------------------------------------------------------- what is shown


def _entry(text: str, name: str) -> tuple[str, str]:
    """(the comment line above option `name`, or '', and its `name: value` line) in annotated YAML."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
    return (lines[at - 1] if lines[at - 1].startswith("#") else ""), lines[at]


def test_print_config_shows_the_applied_values_and_where_they_came_from(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("task: addition\nmax_steps: 5\n")
    assert main(["print-config", str(tmp_path / "mine.yaml"), "seed=3"]) == 0
    text = capsys.readouterr().out
    assert _entry(text, "learning_rate") == (
        "# chosen for model=tiny, as unset (default: 1.0e-06)",
        "learning_rate: 0.0001",
    )
    assert _entry(text, "max_steps") == ("# yours", "max_steps: 5") and _entry(text, "seed") == (
        "# yours",
        "seed: 3",
    )
    assert _entry(text, "temperature") == ("", "temperature: 1.0")  # the default: no comment
    # what it prints loads back to the values a run applies
    (tmp_path / "shown.yaml").write_text(text)
    mine = load_config(GRPOConfig, tmp_path / "mine.yaml", ["seed=3"])
    assert load_config(GRPOConfig, tmp_path / "shown.yaml", written=True) == applied(mine).config

    # the preset: its values are the preset's (chosen values need no choosing there), overrides yours
    assert main(["print-config", "max_steps=7"]) == 0
    text = capsys.readouterr().out
    assert _entry(text, "learning_rate") == ("# preset addition", "learning_rate: 0.0001")
    assert _entry(text, "max_steps") == ("# yours", "max_steps: 7")
    # a real model: TRL's learning rate, shown as the default
    (tmp_path / "real.yaml").write_text("model: org/some-model\ntask: addition\n")
    assert main(["print-config", str(tmp_path / "real.yaml")]) == 0
    assert _entry(capsys.readouterr().out, "learning_rate") == ("", "learning_rate: 1.0e-06")


def test_train_help_shows_the_presets_values_and_those_chosen_for_tiny(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    lines = {
        line.split(" = ")[0].strip(): line
        for line in text.splitlines()
        if line.startswith("  ") and " = " in line
    }
    assert lines["learning_rate"].endswith(
        "learning_rate = 1.0e-06   (addition preset: 0.0001; model=tiny when unset: 0.0001)"
    )
    assert lines["sft_steps"].endswith("sft_steps = 0   (addition preset: 1000)")  # not chosen for tiny
    assert lines["max_steps"].endswith("max_steps = 200   (addition preset: 400)")
    assert lines["temperature"].endswith("temperature = 1.0")  # nothing sets another value
    with pytest.raises(SystemExit):
        main(["reward", "--help"])
    assert "learning_rate = 0.0001   (reward_addition preset: 0.001)" in capsys.readouterr().out


def test_a_tiny_run_records_the_chosen_values_and_resumes_with_them(tmp_path, capsys):
    train = _own_task(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "def ones(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n"
    )
    out = tmp_path / "run"
    config = f"task: null\ndataset: {train}\nmodel: tiny\nreward_funcs: [{{python: my_rewards.py:ones}}]\n"
    (tmp_path / "own.yaml").write_text(config + f"output_dir: {out}\n")
    assert main(["train", "own.yaml", *SHORT, "max_steps=1"]) == 0, capsys.readouterr().err
    saved = (out / "config.yaml").read_text()
    assert _entry(saved, "learning_rate") == (
        "# chosen for model=tiny, as unset (default: 1.0e-06)",
        "learning_rate: 0.0001",
    )
    assert _entry(saved, "dataset") == ("# yours", f"dataset: {train}")
    metrics = read_metrics(out)
    assert [m["learning_rate"] for m in metrics if "learning_rate" in m] == [1e-4]  # the rate applied
    # the same command resumes: the checkpoint's chosen values are what the run applies again
    assert main(["train", "own.yaml", *SHORT, "max_steps=2", "resume=true"]) == 0, capsys.readouterr().err
    assert yaml.safe_load((out / "checkpoint-2" / "config.yaml").read_text())["learning_rate"] == 1e-4


def test_help_after_a_preset_name_shows_that_presets_values(capsys):
    """`grpokit train gsm8k --help` (and doctor, print-config) shows what that command would apply:
    the gsm8k preset's values, not the addition preset's; `train --help` keeps the addition preset."""
    for command in (["train", "gsm8k", "--help"], ["doctor", "gsm8k", "-h"], ["print-config", "gsm8k", "-h"]):
        with pytest.raises(SystemExit):
            main(command)
        text = capsys.readouterr().out
        assert "the gsm8k preset's value (what the command runs so)" in " ".join(text.split()), command
        assert "  num_generations = 8   (gsm8k preset: 5)" in text
        assert "  beta = 0.0   (gsm8k preset: 0.001)" in text
        assert "(addition preset:" not in text
    with pytest.raises(SystemExit):
        main(["doctor", "--groups", "4", "gsm8k", "--help"])  # an option's value is no preset name
    assert "  beta = 0.0   (gsm8k preset: 0.001)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "model=x", "gsm8k", "--help"])  # CONFIG comes first: gsm8k is not one here
    text = capsys.readouterr().out
    assert "  max_steps = 200   (addition preset: 400)" in text and "gsm8k preset" not in text
