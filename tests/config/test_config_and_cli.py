"""The config (validation, YAML + overrides, print-config, presets) as the command line reads it. The
command line end to end on a tiny run is tests/train/test_cli_runs.py."""

from __future__ import annotations

import pytest

from grpokit.cli import main
from grpokit.config import ConfigError, GRPOConfig, load_config, parse_overrides, to_yaml


def test_defaults_follow_trl_where_names_match():
    trl = pytest.importorskip("trl")
    ours = GRPOConfig()
    theirs = trl.GRPOConfig(output_dir="/tmp/unused-grpokit-cfg", report_to=[], use_cpu=True, bf16=False)
    # fields whose default deliberately differs, each documented in schema.py
    differs = {
        "output_dir",
        "max_steps",
        "logging_steps",
        "save_steps",
        "eval_steps",
        "save_total_limit",
        "max_completion_length",
        "max_prompt_length",
        "num_generations_eval",
        "lr_scheduler_type",
        "warmup_steps",
        "gradient_checkpointing",
        "report_to",
        "num_completions_to_print",  # one row per prompt, 6 of them; TRL prints every completion
        "num_train_epochs",  # None: max_steps counts; GRPOTrainer takes TRL's 3 when max_steps is unset
        "torch_compile",  # auto: by device, as measured (engine/compiled.py); TRL: false
    }
    shared = (set(GRPOConfig.model_fields) & set(vars(theirs))) - differs
    assert {
        "learning_rate",
        "beta",
        "loss_type",
        "epsilon",
        "num_generations",
        "temperature",
        "top_p",
        "scale_rewards",
        "num_iterations",
        "mask_truncated_completions",
        "use_bias_correction_kl",
        "ref_model_mixup_alpha",
        "ref_model_sync_steps",
        "adam_beta1",
        "adam_beta2",
        "max_grad_norm",
        "seed",
        "weight_decay",
    } <= shared
    for name in shared:
        assert getattr(ours, name) == getattr(theirs, name), name


def test_yaml_plus_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 3.0e-4\nloss_type: grpo\nreward_weights: [1.0, 0.5]\n")
    cfg = load_config(GRPOConfig, path, ["loss_type=bnpo", "beta=0.04", "top_k=5", "epsilon_high=null"])
    assert (cfg.learning_rate, cfg.loss_type, cfg.beta, cfg.reward_weights, cfg.top_k) == (
        3e-4,
        "bnpo",
        0.04,
        [1.0, 0.5],
        5,
    )
    assert cfg.epsilon_high is None
    assert load_config(GRPOConfig, None, []) == GRPOConfig()
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(GRPOConfig, again) == cfg  # print-config output is a loadable config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["learning_rte=1e-4"], "unknown key 'learning_rte'; did you mean 'learning_rate'?"),
        (["num_generations=1"], "num_generations: Input should be greater than or equal to 2 (got 1)"),
        (["top_p=1.5"], "top_p: Input should be less than or equal to 1 (got 1.5)"),
        (["loss_type=ppo"], "loss_type: Input should be 'grpo', 'bnpo'"),
        (["micro_batch_size=7"], "must be divisible by micro_batch_size=7"),
        (["beta=-1"], "beta: Input should be greater than or equal to 0"),
        (["delta=0.9"], "delta: Input should be greater than 1"),
        (["max_steps=ten"], "max_steps: Input should be a valid integer"),
        (["novalue"], "override 'novalue' is not key=value"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_range(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(GRPOConfig, None, overrides)
    assert message in str(error.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(GRPOConfig, tmp_path / "none.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(GRPOConfig, tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(GRPOConfig, tmp_path / "bad.yaml")
    # one line, and the snippet of the file it quotes shows no password of a reward server's url
    (tmp_path / "secret.yaml").write_text(
        'reward_funcs: [{url: "http://alice:s3cretPW@127.0.0.1:1/ok"\nmax_steps: 1\n'
    )
    with pytest.raises(ConfigError, match="not valid YAML") as refused:
        load_config(GRPOConfig, tmp_path / "secret.yaml")
    assert "\n" not in str(refused.value) and "s3cretPW" not in str(refused.value)
    assert str(refused.value).endswith(
        "not valid YAML (while parsing a flow mapping at line 1, column 16: expected ',' or '}', but got "
        "'<scalar>' at line 2, column 1)."
    )


def test_override_values_are_yaml_scalars():
    assert parse_overrides(["a=3e-4", "b=true", "c=null", "d=[1, 2]", "e=text", "f="]) == {
        "a": 3e-4,
        "b": True,
        "c": None,
        "d": [1, 2],
        "e": "text",
        "f": None,
    }


def test_print_config_shows_the_preset_with_overrides(capsys):
    assert main(["print-config", "max_steps=7"]) == 0
    text = capsys.readouterr().out
    assert "max_steps: 7" in text and "sft_steps: 1000" in text and "learning_rate: 0.0001" in text


def test_bad_config_fails_before_any_model_is_loaded(tmp_path, capsys, monkeypatch):
    """The error is one line naming the key; no model is built (building would fail here)."""
    import grpokit.train.grpo as grpo

    monkeypatch.setattr(
        grpo, "policy_and_tokenizer", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded"))
    )
    out = f"output_dir={tmp_path / 'run'}"
    assert main(["train", out, "num_generations=1"]) == 2
    err = capsys.readouterr().err
    assert "num_generations" in err and "--debug" in err and "Traceback" not in err
    assert main(["train", out, "task=null"]) == 2
    assert "nothing to train on" in capsys.readouterr().err


def test_every_built_in_preset_is_valid_and_named_presets_resolve(tmp_path, monkeypatch):
    from grpokit.cli import PRESET, _config, presets
    from grpokit.config import RewardConfig

    names = presets()
    assert {"addition", "rlhf_addition", "reward_addition", "reward_addition_rlhf"} <= set(names)
    for name in names:
        schema = RewardConfig if name.startswith("reward_") else GRPOConfig
        cfg = _config(schema, PRESET, [name, "max_steps=3"])  # a bare name selects the preset
        assert cfg.max_steps == 3 and isinstance(cfg, schema), name
    # a file of that name in the working directory wins over the preset
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rlhf_addition").write_text("max_steps: 7\n")
    assert _config(GRPOConfig, PRESET, ["rlhf_addition"]).max_steps == 7
    with pytest.raises(ConfigError, match="no_such_preset"):
        _config(GRPOConfig, PRESET, ["no_such_preset"])


def test_the_rlhf_preset_reads_the_reward_preset_s_final_checkpoint():
    """`grpokit reward reward_addition_rlhf` then `grpokit train rlhf_addition` is one chain."""
    from grpokit.cli import PRESET, _config
    from grpokit.config import RewardConfig

    rm = _config(RewardConfig, PRESET, ["reward_addition_rlhf"])
    grpo = _config(GRPOConfig, PRESET, ["rlhf_addition"])
    assert grpo.reward_funcs == [{"model": f"{rm.output_dir}/checkpoint-{rm.max_steps}"}]
    assert rm.task == grpo.task and rm.seed == grpo.seed  # the same train / held-out split
