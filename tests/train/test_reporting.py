"""Where metrics go (`report_to`): TensorBoard, Weights & Biases offline-safe. The TRL forms of
`report_to` are tests/config/test_trl_names.py."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

from grpokit.cli import main
from grpokit.config import ConfigError
from grpokit.train.metrics import MetricsWriter, check_reporters, wandb_settings
from tests.helpers import read_metrics


@pytest.mark.custom_metrics  # a text "note": what TensorBoard leaves out
def test_tensorboard_gets_every_scalar_and_the_json_lines_stay(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, report_to=["tensorboard"])
    writer.write(0, {"accuracy": 0.25}, prefix="eval/")
    writer.write(1, {"loss": 0.5, "reward": float("nan"), "note": "text"})
    writer.write(2, {"loss": 0.25})
    writer.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["reward"] is None and rows[1]["note"] == "text"
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/accuracy", "loss"]  # NaN and text are not scalars
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.25)]
    quiet = MetricsWriter(tmp_path / "quiet", report_to=[])
    quiet.write(1, {"loss": 1.0})
    quiet.close()
    assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == ["metrics.jsonl"]


def test_a_missing_tensorboard_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ConfigError) as error:
        MetricsWriter(tmp_path, report_to=["tensorboard"])
    message = str(error.value)
    assert "pip install tensorboard" in message and "report_to=[]" in message and "\n" not in message
    with pytest.raises(
        ConfigError, match=r"pip install tensorboard`, or leave it out with report_to=\[wandb\]"
    ):
        check_reporters(["tensorboard", "wandb"])


@pytest.mark.parametrize("command", ["train", "reward"])
def test_a_missing_wandb_stops_the_run_before_any_model_is_loaded(command, tmp_path, monkeypatch, capsys):
    import grpokit.train.grpo as grpo
    import grpokit.train.reward as reward

    boom = lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was loaded"))  # noqa: E731
    monkeypatch.setattr(grpo, "policy_and_tokenizer", boom)
    monkeypatch.setattr(reward, "reward_model_and_tokenizer", boom)
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main([command, f"output_dir={tmp_path / 'run'}", "report_to=[tensorboard, wandb]"]) == 2
    err = capsys.readouterr().err
    assert "pip install wandb" in err and "report_to=[tensorboard]" in err and "a model was loaded" not in err


class FakeWandb(types.ModuleType):
    """A `wandb` module that records what grpokit asks of it."""

    def __init__(self) -> None:
        super().__init__("wandb")
        # a spec as an installed module has: importing transformers under the fake (this file's first
        # test may be the first to) asks importlib.util.find_spec("wandb"), which refuses a None spec
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((dict(data), step))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_is_offline_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "my_run"
    assert wandb_settings(out) == {"project": "grpokit", "name": "my_run", "dir": str(out), "mode": "offline"}
    monkeypatch.setenv("WANDB_PROJECT", "team")
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_settings(out)["mode"] is None and wandb_settings(out)["project"] == "team"  # wandb decides
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_settings(out)["mode"] is None  # wandb reads WANDB_MODE itself


def test_a_grpo_run_reports_to_wandb_and_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpokit.config.applied import applied
    from grpokit.train.grpo import train_grpo
    from tests.train.helpers import tiny_config

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    cfg = tiny_config(tmp_path, report_to=["tensorboard", "wandb"])
    train_grpo(cfg)
    out = Path(cfg.output_dir)
    assert fake.inits == [
        {
            "config": applied(cfg).config.model_dump(mode="json"),  # the values the run applied
            "project": "proj",
            "name": "run",
            "dir": str(out),
            "mode": "offline",
        }
    ]
    rows = read_metrics(out)
    assert [step for _, step in fake.logged] == [r["step"] for r in rows]  # every row, with its step
    for (data, _), row in zip(fake.logged, rows, strict=True):
        assert data == {
            k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))
        }
    assert "loss" in fake.logged[1][0] and "eval/accuracy" in fake.logged[0][0]
    assert fake.finished == 1
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]


def test_a_reward_model_run_reports_to_wandb(tmp_path, monkeypatch):
    from grpokit.train.reward import train_reward
    from tests.train.test_reward_model import reward_cfg

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = reward_cfg(tmp_path, max_steps=2, report_to="wandb")
    train_reward(cfg)
    assert fake.inits[0]["config"]["report_to"] == ["wandb"] and fake.finished == 1
    assert [step for _, step in fake.logged] == [0, 1, 2, 2] and "loss" in fake.logged[1][0]
    assert not (Path(cfg.output_dir) / "tensorboard").exists()
