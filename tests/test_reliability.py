"""Reliability: bad input gets one clear error; numerical faults skip an update; SIGTERM and
kill -9 lose nothing but the current step, and a resumed run ends bitwise equal to an
uninterrupted one."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpokit.config import ConfigError, GRPOConfig, RewardConfig, load_config
from grpokit.config.plan import model_spec
from grpokit.data import DataError, load_preferences, load_prompts
from grpokit.models import char_tokenizer, load_policy, save_policy
from grpokit.rewards import RewardFunctionError, score_completions
from grpokit.train.grpo import train_grpo
from grpokit.train.run import TooManySkips
from tests.helpers import read_steps, tiny_run
from tests.train.helpers import ones_reward, tiny_config


def _write(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp / name


def _saved_policy(tmp: Path, name: str = "policy") -> Path:
    from grpokit.models import build_policy

    tok = char_tokenizer("0123456789+=")
    save_policy(
        build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tok), max_seq_len=16, seed=0),
        tok,
        tmp / name,
    )
    return tmp / name


def _reward(values):
    def fn(prompts, completions, **_):
        return values

    fn.__name__ = "my_reward"
    return fn


def _raising(prompts, completions, **_):
    raise KeyError("score")


# (case id, callable taking tmp_path, error class, text the message must contain)
BAD_INPUTS = [
    (
        "unknown key",
        lambda t: load_config(GRPOConfig, None, ["learnig_rate=1"]),
        ConfigError,
        "did you mean 'learning_rate'",
    ),
    (
        "out of range",
        lambda t: load_config(GRPOConfig, None, ["epsilon=-1"]),
        ConfigError,
        "epsilon: Input should be greater than or equal to 0",
    ),
    (
        "wrong type",
        lambda t: load_config(GRPOConfig, None, ["max_steps=many"]),
        ConfigError,
        "max_steps: Input should be a valid integer",
    ),
    (
        "wrong literal",
        lambda t: load_config(GRPOConfig, None, ["scale_rewards=max"]),
        ConfigError,
        "scale_rewards: Input should be 'group', 'batch' or 'none'",
    ),
    (
        "batch does not divide",
        lambda t: load_config(GRPOConfig, None, ["micro_batch_size=5"]),
        ConfigError,
        "must be divisible by micro_batch_size=5",
    ),
    (
        "one generation",
        lambda t: load_config(GRPOConfig, None, ["num_generations=1"]),
        ConfigError,
        "num_generations: Input should be greater than or equal to 2",
    ),
    (
        "reward batch does not divide",
        lambda t: load_config(RewardConfig, None, ["batch_size=10", "micro_batch_size=4"]),
        ConfigError,
        "batch_size=10 must be divisible by micro_batch_size=4",
    ),
    (
        "bad reward_funcs entry",
        lambda t: load_config(GRPOConfig, None, ["reward_funcs=[{path: x}]"]),
        ConfigError,
        "must have exactly one of 'model'",
    ),
    (
        "config file missing",
        lambda t: load_config(GRPOConfig, t / "nope.yaml"),
        ConfigError,
        "nope.yaml' does not exist",
    ),
    (
        "config not YAML",
        lambda t: load_config(GRPOConfig, _write(t, "c.yaml", "a: [\n")),
        ConfigError,
        "c.yaml: not valid YAML",
    ),
    ("empty dataset", lambda t: load_prompts(_write(t, "e.jsonl", "")), DataError, "e.jsonl has no rows"),
    (
        "missing prompt column",
        lambda t: load_prompts(_write(t, "m.jsonl", '{"text": "1+1="}\n')),
        DataError,
        "has no column 'prompt' (columns: text)",
    ),
    (
        "malformed JSON line",
        lambda t: load_prompts(_write(t, "b.jsonl", '{"prompt": "a"}\n{"prompt": \n')),
        DataError,
        "b.jsonl: line 2 is not valid JSON",
    ),
    (
        "unreadable Parquet",
        lambda t: load_prompts(_write(t, "x.parquet", "not parquet")),
        DataError,
        "x.parquet: not a readable Parquet file",
    ),
    ("prompt file missing", lambda t: load_prompts(t / "gone.csv"), DataError, "gone.csv' does not exist"),
    (
        "preference without rejected",
        lambda t: load_preferences([{"chosen": "a"}]),
        DataError,
        "row 0 has no 'rejected'",
    ),
    (
        "margin not a number",
        lambda t: load_preferences([{"chosen": "a", "rejected": "b", "margin": "x"}]),
        DataError,
        "margin 'x' is not a number",
    ),
    (
        "reward raises",
        lambda t: score_completions([_raising], ["p"], ["c"]),
        RewardFunctionError,
        "'_raising' raised on row 0 (completion 'c'): KeyError",
    ),
    (
        "reward wrong count",
        lambda t: score_completions([_reward([1.0])], ["p"] * 2, ["a", "b"]),
        RewardFunctionError,
        "'my_reward' returned 1 values for 2 completions",
    ),
    (
        "reward string",
        lambda t: score_completions([_reward(["good"])], ["p"], ["a"]),
        RewardFunctionError,
        "'my_reward' returned 'good' (str) for row 0",
    ),
    (
        "reward NaN",
        lambda t: score_completions([_reward([float("nan")])], ["p"], ["a"]),
        RewardFunctionError,
        "returned nan for row 0",
    ),
    (
        "reward infinity",
        lambda t: score_completions([_reward([float("inf")])], ["p"], ["a"]),
        RewardFunctionError,
        "returned inf for row 0",
    ),
    (
        "model directory missing",
        lambda t: load_policy(t / "no-model"),
        FileNotFoundError,
        "no-model' does not exist",
    ),
    ("not a model directory", lambda t: load_policy(t), FileNotFoundError, "has no config.json"),
    ("corrupt model", lambda t: load_policy(_corrupt(t)), ValueError, "could not load the model in"),
    (
        "tokenizer without pad or eos",
        lambda t: _no_special_tokens(t),
        ValueError,
        "neither a pad nor an eos token",
    ),
    (
        "prompts over the context",
        lambda t: train_grpo(
            tiny_config(t, model=str(_saved_policy(t)), max_completion_length=14), reward_funcs=[ones_reward]
        ),
        ValueError,
        "more than the model's context of 16 (max_position_embeddings); set max_completion_length=",
    ),
    (
        "nothing to train on",
        lambda t: train_grpo(tiny_config(t, task=None)),
        ValueError,
        "nothing to train on",
    ),
    (
        "reward weights count",
        lambda t: train_grpo(tiny_config(t, reward_weights=[1.0, 2.0])),
        ValueError,
        "reward_weights has 2 weights for 1 reward functions",
    ),
]


def _corrupt(tmp: Path) -> Path:
    directory = _saved_policy(tmp, "corrupt")
    (directory / "model.safetensors").write_bytes(b"this is not a safetensors file")
    return directory


def _no_special_tokens(tmp: Path) -> None:
    directory = _saved_policy(tmp, "nospecial")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for key in ("pad_token", "eos_token"):
        config[key] = None
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    special = directory / "special_tokens_map.json"
    if special.exists():
        special.write_text("{}")
    load_policy(directory)


@pytest.mark.parametrize(("case", "call", "error", "text"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_one_clear_error(tmp_path, case, call, error, text):
    with pytest.raises(error) as caught:
        call(tmp_path)
    assert type(caught.value) is error or issubclass(type(caught.value), error)
    assert text in str(caught.value), str(caught.value)


@pytest.mark.slow
def test_cli_shows_one_line_not_a_traceback(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "train",
            f"model={tmp_path / 'missing'}",
            f"output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "missing' does not exist" in result.stderr
    debug = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "--debug",
            "train",
            f"model={tmp_path / 'missing'}",
            f"output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" in debug.stderr


def test_trust_remote_code_is_off_unless_set(tmp_path, monkeypatch):
    import grpokit.train.run as train_run

    seen = []
    monkeypatch.setattr(
        train_run,
        "load_policy",
        lambda path, **kw: (
            seen.append(kw["trust_remote_code"]) or (_ for _ in ()).throw(RuntimeError("stop"))
        ),
    )
    for flag in (False, True):
        with pytest.raises(RuntimeError, match="stop"):
            spec = model_spec(tiny_config(tmp_path, model="somewhere", trust_remote_code=flag))
            train_run.policy_and_tokenizer(spec, None, 16)
    assert seen == [False, True]


# ----------------------------------------------------------------------------- numerical faults


def _nan_at(calls: set[int], monkeypatch):
    """Make grpo_loss return a NaN loss on the given call numbers (1-based)."""
    import grpokit.train.update as update_module
    from grpokit.ops import LossOutput

    real = update_module.grpo_loss
    count = [0]

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        count[0] += 1
        return LossOutput(out.loss * float("nan"), out.metrics) if count[0] in calls else out

    monkeypatch.setattr(update_module, "grpo_loss", poisoned)


def test_a_nan_loss_skips_that_update_and_the_run_finishes(tmp_path, monkeypatch):
    _nan_at({2}, monkeypatch)  # micro_batch_size 16 = the whole batch: call 2 is step 2's update
    cfg = tiny_config(tmp_path, max_steps=4, micro_batch_size=16)
    result = train_grpo(cfg, reward_funcs=[ones_reward])
    rows = read_steps(result.output_dir)
    assert [r["skipped_update"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert result.steps == 4 and (result.output_dir / "checkpoint-4").is_dir()


def test_a_skipped_update_changes_nothing(tmp_path, monkeypatch):
    """The weights and optimizer state after a skipped update are those before it."""
    from grpokit.train.optim import apply_update

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    out = apply_update(model, opt, sched, torch.tensor(float("nan")), 1.0)
    assert out["skipped_update"] == 1.0 and not opt.state and sched.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_consecutive_non_finite_updates_stop(tmp_path, monkeypatch):
    _nan_at({2, 3, 4, 5, 6}, monkeypatch)
    cfg = tiny_config(tmp_path, max_steps=8, micro_batch_size=16, max_consecutive_skips=3)
    with pytest.raises(TooManySkips, match="3 consecutive updates had a non-finite loss.*checkpoint-4"):
        train_grpo(cfg, reward_funcs=[ones_reward])
    assert (Path(cfg.output_dir) / "checkpoint-4").is_dir()  # the last good state, saved before stopping


# ----------------------------------------------------------------------------- killed runs

# the tiny run at the preset's completion length, a checkpoint each step (the last 2 kept); each caller
# names the steps (a config file of the user's may, too)
TINY = tiny_run(
    "max_steps",
    "max_completion_length",
    micro_batch_size=16,
    lr_scheduler_type="constant",
    save_steps=1,
    save_total_limit=2,
)


def _start(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "grpokit", "train", f"output_dir={out}", f"max_steps={steps}", *TINY, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def _final_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / f"checkpoint-{step}" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    process = _start(out, 12)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    return _final_weights(out, 12)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_kill_9_at_a_random_point_then_resume_is_bitwise_equal(tmp_path, uninterrupted, seed):
    out = tmp_path / "run"
    process = _start(out, 12)
    target = random.Random(seed).randint(2, 9)  # kill once this many steps are logged (mid-run)
    deadline = time.time() + 240
    while _steps_logged(out) < target and time.time() < deadline and process.poll() is None:
        time.sleep(0.01)
    time.sleep(
        random.Random(seed + 10).random() * 0.2
    )  # anywhere in the next step, checkpoint writes included
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    resumed = _start(out, 12, "resume=true")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    final = _final_weights(out, 12)
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)
    assert [r["step"] for r in read_steps(out)] == list(range(1, 13))  # no step lost or doubled


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_then_resume_is_bitwise_equal(tmp_path, uninterrupted):
    out = tmp_path / "run"
    process = _start(out, 12, "save_steps=0")  # no periodic checkpoints: the one on SIGTERM must be written
    while _steps_logged(out) < 3 and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM after step" in stdout and "resume=true" in stdout
    stopped_at = int(stdout.split("after step ")[1].split(":")[0])
    assert (out / f"checkpoint-{stopped_at}").is_dir()
    resumed = _start(out, 12, "resume=true", "save_steps=0")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    final = _final_weights(out, 12)
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)


def test_half_written_checkpoints_are_never_loaded(tmp_path):
    """A staging directory (crash before the rename) and a checkpoint without its state file are
    ignored; resume continues from the last complete checkpoint."""
    cfg = tiny_config(tmp_path, max_steps=2, save_steps=1)
    train_grpo(cfg, reward_funcs=[ones_reward])
    run = Path(cfg.output_dir)
    (run / ".tmp-checkpoint-3").mkdir()
    (run / ".tmp-checkpoint-3" / "model.safetensors").write_bytes(b"partial")
    (run / "checkpoint-9").mkdir()  # no state.pt: incomplete
    events = []
    train_grpo(
        cfg.model_copy(update={"resume": True, "max_steps": 3}),
        reward_funcs=[ones_reward],
        on_event=lambda kind, step, data: events.append((kind, step)),
    )
    assert ("resumed", 2) in events and (run / "checkpoint-3" / "state.pt").is_file()
    from grpokit.train.checkpoint import list_checkpoints

    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]  # the last K=2 kept
