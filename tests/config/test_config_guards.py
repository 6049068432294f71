"""The config refuses what would destroy a run or hang the loader, each with one clear ConfigError:
non-finite and absurd numbers, seeds no generator takes, greedy training, duplicate YAML keys,
alias bombs and values nested past any real config. BAD_CONFIG_INPUTS lists every such input."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from grpokit.config import ConfigError, GRPOConfig, RewardConfig, SFTConfig, load_config
from grpokit.config.load import MAX_DEPTH, MAX_NODES, shown

SCHEMAS = (GRPOConfig, RewardConfig, SFTConfig)
PRESETS = Path(__file__).parents[2] / "src" / "grpokit" / "presets"


def _yaml(tmp_path: Path, text: str, schema=GRPOConfig):
    """load_config on a YAML file holding `text`."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(schema, path)


def _bomb(levels: int = 9) -> str:
    """The classic "billion laughs": `levels` lists of 9 aliases of the list before, 9**levels strings
    once expanded, in a few hundred bytes. Under a real key (a list option), so that nothing refuses
    the document before its value is validated and echoed."""
    lines = ["lora_target_modules:", '  a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


NESTED = "reward_funcs=" + "[" * 100_000 + "]" * 100_000


def _latin1_yaml(tmp: Path) -> Path:
    (tmp / "latin1.yaml").write_bytes("max_steps: 2\n# café\n".encode("latin-1"))
    return tmp / "latin1.yaml"


def _directory_yaml(tmp: Path) -> Path:
    (tmp / "adir.yaml").mkdir()
    return tmp / "adir.yaml"


BAD_CONFIG_INPUTS = [
    # ------------------------------------------------------------------ files that are no YAML
    (
        "config file not UTF-8",
        lambda t: load_config(GRPOConfig, _latin1_yaml(t)),
        ConfigError,
        "latin1.yaml: line 2 is not valid UTF-8 (byte 0xe9 at column 6); save the file as UTF-8.",
    ),
    (
        "config file is a directory",
        lambda t: load_config(GRPOConfig, _directory_yaml(t)),
        ConfigError,
        "adir.yaml' is a directory; give the path of a YAML file.",
    ),
    # ------------------------------------------------------------------ non-finite and absurd numbers
    (
        "learning_rate inf (GRPO)",
        lambda t: load_config(GRPOConfig, None, ["learning_rate=inf"]),
        ConfigError,
        "learning_rate: Input should be a finite number",
    ),
    (
        "learning_rate .inf in a YAML file (reward)",
        lambda t: _yaml(t, "learning_rate: .inf\n", RewardConfig),
        ConfigError,
        "learning_rate: Input should be a finite number",
    ),
    (
        "learning_rate 1e999 in a YAML file (a string to YAML 1.1, inf to float())",
        lambda t: _yaml(t, "learning_rate: 1e999\n"),
        ConfigError,
        "learning_rate: Input should be a finite number",
    ),
    (
        "learning_rate 1e30 (GRPO)",
        lambda t: load_config(GRPOConfig, None, ["learning_rate=1e30"]),
        ConfigError,
        "learning_rate: Input should be less than or equal to 1 (got 1e+30); allowed: 0 < learning_rate ≤ 1",
    ),
    (
        "learning_rate 1e30 (reward)",
        lambda t: load_config(RewardConfig, None, ["learning_rate=1e30"]),
        ConfigError,
        "allowed: 0 < learning_rate ≤ 1",
    ),
    (
        "learning_rate nan (GRPO)",
        lambda t: load_config(GRPOConfig, None, ["learning_rate=.nan"]),
        ConfigError,
        "learning_rate: Input should be a finite number (got nan); allowed: 0 < learning_rate ≤ 1",
    ),
    (
        "learning_rate nan (reward)",
        lambda t: load_config(RewardConfig, None, ["learning_rate=.nan"]),
        ConfigError,
        "learning_rate: Input should be a finite number",
    ),
    (
        "sft learning_rate inf",
        lambda t: load_config(SFTConfig, None, ["learning_rate=-.inf"]),
        ConfigError,
        "learning_rate: Input should be a finite number",
    ),
    (
        "max_grad_norm inf (no upper bound, but finite)",
        lambda t: load_config(GRPOConfig, None, ["max_grad_norm=.inf"]),
        ConfigError,
        "max_grad_norm: Input should be a finite number (got inf); allowed: 0 < max_grad_norm, finite",
    ),
    (
        "weight_decay past 1",
        lambda t: load_config(GRPOConfig, None, ["weight_decay=2"]),
        ConfigError,
        "allowed: 0 ≤ weight_decay ≤ 1",
    ),
    (
        "adam_epsilon past 1",
        lambda t: load_config(RewardConfig, None, ["adam_epsilon=10"]),
        ConfigError,
        "allowed: 1e-30 ≤ adam_epsilon ≤ 1",
    ),
    (
        "adam_epsilon that is 0 in float32",
        lambda t: load_config(GRPOConfig, None, ["adam_epsilon=1e-46"]),
        ConfigError,
        "(got 1e-46); allowed: 1e-30 ≤ adam_epsilon ≤ 1",
    ),
    (
        "tool_timeout past a day",
        lambda t: load_config(GRPOConfig, None, ["tool_timeout=1e10"]),
        ConfigError,
        "allowed: 0 < tool_timeout ≤ 86400",
    ),
    (
        "reward_timeout inf (null is no limit)",
        lambda t: load_config(GRPOConfig, None, ["reward_timeout=.inf"]),
        ConfigError,
        "reward_timeout: Input should be a finite number",
    ),
    (
        "a reward weight nan",
        lambda t: load_config(GRPOConfig, None, ["reward_weights=[1.0, .nan]"]),
        ConfigError,
        "reward_weights.1: Input should be a finite number",
    ),
    (
        "epsilon past 1 (the lower clip 1-epsilon would be no bound)",
        lambda t: load_config(GRPOConfig, None, ["epsilon=1.5"]),
        ConfigError,
        "allowed: 0 ≤ epsilon ≤ 1",
    ),
    (
        "sampling_correction_min above its max",
        lambda t: load_config(GRPOConfig, None, ["sampling_correction_min=4", "sampling_correction_max=2"]),
        ConfigError,
        "sampling_correction_min=4 must be below sampling_correction_max=2",
    ),
    # ------------------------------------------------------------------ seeds
    (
        "seed 1e23",
        lambda t: load_config(GRPOConfig, None, ["seed=1e23"]),
        ConfigError,
        "seed: Input should be a smaller integer (got 1e+23); allowed: 0 ≤ seed ≤ 4294967295",
    ),
    (
        "seed 2**64 in a YAML file (reward)",
        lambda t: _yaml(t, f"seed: {2**64}\n", RewardConfig),
        ConfigError,
        "allowed: 0 ≤ seed ≤ 4294967295",
    ),
    (
        "seed not integral",
        lambda t: load_config(SFTConfig, None, ["seed=1.5"]),
        ConfigError,
        "seed: Input should be a valid integer, got a number with a fractional part",
    ),
    (
        "seed negative",
        lambda t: load_config(GRPOConfig, None, ["seed=-1"]),
        ConfigError,
        "seed: Input should be greater than or equal to 0",
    ),
    # ------------------------------------------------------------------ greedy training
    (
        "temperature 0 in training",
        lambda t: load_config(GRPOConfig, None, ["temperature=0"]),
        ConfigError,
        "every group has zero reward spread and GRPO learns nothing; use a temperature > 0 (e.g. 1.0",
    ),
    (
        "temperature 0.0 in a YAML file",
        lambda t: _yaml(t, "temperature: 0.0\n"),
        ConfigError,
        "temperature=0 samples greedily",
    ),
    # ------------------------------------------------------------------ removed options
    (
        "sampler, removed (one decode loop)",
        lambda t: _yaml(t, "sampler: hf\n"),
        ConfigError,
        "sampler was removed: grpokit samples with its one KV-cached decode loop (transformers' generate "
        "is kept only as a test reference); delete sampler from the config",
    ),
    # ------------------------------------------------------------------ YAML that hangs or lies
    (
        "billion laughs",
        lambda t: _yaml(t, _bomb()),
        ConfigError,
        f"aliases expand the value at line 6 to more than {MAX_NODES} values",  # a4: 9**5 strings
    ),
    (
        "an alias inside itself",
        lambda t: _yaml(t, "lora_target_modules: &loop [a, *loop]\n"),
        ConfigError,
        "refers to a value that contains it",
    ),
    (
        "duplicate key",
        lambda t: _yaml(t, "max_steps: 10\nseed: 1\nmax_steps: 20\n"),
        ConfigError,
        "key 'max_steps' is given twice (line 1 and line 3); YAML would silently keep the last one",
    ),
    (
        "duplicate key in a nested mapping",
        lambda t: _yaml(t, "reward_funcs:\n  - builtin: task\n    builtin: format_tags\n"),
        ConfigError,
        "key 'builtin' is given twice (line 2 and line 3)",
    ),
    (
        "duplicate key in an override",
        lambda t: load_config(GRPOConfig, None, ["reward_funcs=[{builtin: task, builtin: task}]"]),
        ConfigError,
        "override reward_funcs: key 'builtin' is given twice",
    ),
    (
        "deeply nested override",
        lambda t: load_config(GRPOConfig, None, [NESTED]),
        ConfigError,
        f"override reward_funcs: values nested more than {MAX_DEPTH} levels deep",
    ),
    (
        "deeply nested YAML file",
        lambda t: _yaml(t, "tools: " + "[" * 5000 + "]" * 5000 + "\n"),
        ConfigError,
        f"values nested more than {MAX_DEPTH} levels deep (line 1)",
    ),
    (
        "a huge value is echoed short",
        lambda t: load_config(GRPOConfig, None, ["task=" + "x" * 100_000]),
        ConfigError,
        "xxx' is not a task",  # and the whole message < 600 characters
    ),
    # ------------------------------------------------------------------ reward servers ({url: ...})
    (
        "a reward server's url that is not http(s)",
        lambda t: _yaml(t, "reward_funcs:\n  - url: ftp://127.0.0.1/score\n"),
        ConfigError,
        "reward_funcs entry {'url': 'ftp://127.0.0.1/score'}: url 'ftp://127.0.0.1/score' is not an http:// "
        "or https:// address with a host; write http://HOST:PORT/PATH",
    ),
    (
        "a reward server's timeout of 0",
        lambda t: _yaml(t, "reward_funcs:\n  - url: http://127.0.0.1:8000/score\n    timeout: 0\n"),
        ConfigError,
        "reward_funcs entry {'timeout': 0, 'url': 'http://127.0.0.1:8000/score'}: timeout 0 must be a number "
        "of seconds above 0",
    ),
    (
        "a reward server's negative retries",
        lambda t: load_config(GRPOConfig, None, ["reward_funcs=[{url: http://127.0.0.1:80/, retries: -1}]"]),
        ConfigError,
        "reward_funcs entry {'retries': -1, 'url': 'http://127.0.0.1:80/'}: retries -1 must be an integer "
        "from 0 to 100",
    ),
]


@pytest.mark.parametrize(
    ("case", "call", "error", "text"), BAD_CONFIG_INPUTS, ids=[c[0] for c in BAD_CONFIG_INPUTS]
)
def test_bad_config_input_gets_one_clear_error(tmp_path, case, call, error, text):
    with pytest.raises(error) as caught:
        call(tmp_path)
    message = str(caught.value)
    assert text in message, message
    assert len(message) < 600, message  # no echo of a whole value


def _has_float(annotation) -> bool:
    return annotation is float or any(_has_float(a) for a in typing.get_args(annotation))


FLOAT_FIELDS = [
    (schema, name, field.annotation)
    for schema in SCHEMAS
    for name, field in schema.model_fields.items()
    if _has_float(field.annotation)
]


def test_float_fields_are_found():
    """The parametrization below covers the float options (a broken `_has_float` would pass it)."""
    names = {(s.__name__, n) for s, n, _ in FLOAT_FIELDS}
    some = {("GRPOConfig", "learning_rate"), ("GRPOConfig", "reward_weights"), ("SFTConfig", "learning_rate")}
    assert some <= names and ("RewardConfig", "center_rewards_coefficient") in names and len(names) >= 30


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e999"])
@pytest.mark.parametrize(
    ("schema", "name", "annotation"), FLOAT_FIELDS, ids=[f"{s.__name__}.{n}" for s, n, _ in FLOAT_FIELDS]
)
def test_every_float_option_refuses_a_non_finite_value(schema, name, annotation, value):
    """A float option added later is covered too: the list comes from the schemas."""
    listed = typing.get_origin(annotation) is list or any(
        typing.get_origin(a) is list for a in typing.get_args(annotation)
    )
    mapped = typing.get_origin(annotation) is dict  # a mapping of names to floats: a value of it
    override = f"{name}=[{value}]" if listed else f"{name}={{some: {value}}}" if mapped else f"{name}={value}"
    with pytest.raises(ConfigError) as caught:
        load_config(schema, None, [override])
    assert f"{name}" in str(caught.value) and "finite number" in str(caught.value), str(caught.value)


def test_the_presets_and_defaults_are_within_the_bounds():
    """The bounds refuse no value in use: every preset loads, and each config's defaults."""
    for schema in SCHEMAS:
        schema()
    for preset in sorted(PRESETS.glob("*.yaml")):
        load_config(RewardConfig if preset.name.startswith("reward") else GRPOConfig, preset)


def test_positive_temperatures_and_large_grad_norm_still_load():
    """Not over-refused: a sampling temperature below 1, clipping switched off with a huge norm, the
    largest learning rate the tests use, an anchor reused a few times, an explicit key beside a merge."""
    cfg = load_config(GRPOConfig, None, ["temperature=0.3", "max_grad_norm=1e9", "learning_rate=0.3"])
    assert (cfg.temperature, cfg.max_grad_norm, cfg.learning_rate) == (0.3, 1e9, 0.3)
    path = Path("anchors.yaml")
    path.write_text(
        "reward_funcs:\n  - &r {builtin: task}\n  - *r\nreward_weights: [1.0, 0.5]\n"
        "lora_target_modules: [q_proj, v_proj]\n"
    )
    cfg = load_config(GRPOConfig, path)
    assert cfg.reward_funcs == [{"builtin": "task"}, {"builtin": "task"}]


def test_a_value_in_a_message_is_short_and_quick():
    """`shown` neither walks nor prints a huge structure (a plain repr would take minutes here)."""
    huge: list = ["lol"] * 9
    for _ in range(8):
        huge = [huge] * 9  # 9**9 strings once expanded, as the alias bomb
    began = time.process_time()  # CPU time: other processes' load does not count
    text = shown(huge)
    assert len(text) <= 80 and text.startswith("[[[")
    assert time.process_time() - began < 1.0  # no timing tolerance: a full repr would not return at all


@pytest.mark.slow  # (waits out timeouts or builds a large payload, 1-2 s: the full suite runs it)
def test_billion_laughs_returns_at_once(tmp_path):
    """The bomb in a fresh interpreter with 2 GiB of address space: before the guard it never returned
    (the error message expanded it), and would have eaten the machine's memory."""
    (tmp_path / "bomb.yaml").write_text(_bomb())
    code = (
        "from grpokit.config import ConfigError, GRPOConfig, load_config\n"
        "try:\n"
        f"    load_config(GRPOConfig, {str(tmp_path / 'bomb.yaml')!r})\n"
        "except ConfigError as error:\n"
        "    print('ConfigError:', error)\n"
    )

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=limit_memory
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ConfigError:") and "to more than 10000 values" in result.stdout


def test_aliases_nesting_too_deep_are_refused(tmp_path):
    """Few values, but each alias nests the one before a level deeper: refused by depth, not size."""
    lines = ["lora_target_modules:", "  a0: &a0 [x]"] + [f"  a{i}: &a{i} [*a{i - 1}]" for i in range(1, 40)]
    with pytest.raises(ConfigError, match=f"more than {MAX_DEPTH} levels deep"):
        _yaml(tmp_path, "\n".join(lines) + "\n")
