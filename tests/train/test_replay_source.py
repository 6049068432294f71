"""A third batch source through the seam (issue 52's demonstration): batches recorded by one run,
replayed by another, train the same weights bit for bit."""

from __future__ import annotations

import torch

from grpokit.train.batch_source import InProcess
from grpokit.train.grpo import train_grpo
from grpokit.train.in_flight import Sampled, dumps, to_plain
from tests.helpers import read_steps
from tests.train.helpers import ones_reward, tiny_config, weights


def test_replayed_batches_train_the_same_weights(tmp_path, monkeypatch):
    recorded = tmp_path / "batches"
    recorded.mkdir()
    draw = InProcess.draw

    def recording(self, step, trainee, rewards, d, stop):
        drawn = draw(self, step, trainee, rewards, d, stop)
        item = Sampled(step, step - 1, drawn.batch, drawn.metrics, trainee.prompts.state_dict(), 0.0, 0.0)
        (recorded / f"batch-{step}.pt").write_bytes(dumps(to_plain(item)))
        return drawn

    monkeypatch.setattr(InProcess, "draw", recording)
    train_grpo(tiny_config(tmp_path / "first", max_steps=4), reward_funcs=[ones_reward])
    monkeypatch.setattr(InProcess, "draw", lambda *a: (_ for _ in ()).throw(AssertionError("sampled")))
    train_grpo(
        tiny_config(tmp_path / "again", max_steps=4, replay_batches=str(recorded)), reward_funcs=[ones_reward]
    )
    first, again = weights(tmp_path / "first" / "run"), weights(tmp_path / "again" / "run")
    assert sorted(first) == sorted(again) and all(torch.equal(first[k], again[k]) for k in first)
    losses = [[r["loss"] for r in read_steps(tmp_path / name / "run")] for name in ("first", "again")]
    assert losses[0] == losses[1] and any(loss != 0 for loss in losses[0])
