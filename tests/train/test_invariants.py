"""Runtime invariants of GRPO's groups (issue 26, point 1, in part): every step logs
`invariants/groups_intact` and `invariants/group_advantage_sum_max` at no extra forward; a normal run
holds them, and a run that breaks one on purpose (rows moved out of group order, advantages shifted
after normalisation) is told once, naming the invariant, the step and the likely cause."""

from __future__ import annotations

import json

import torch

from grpokit.train import grpo_step as step_module
from grpokit.train.grpo import train_grpo
from tests.train.helpers import ones_reward, tiny_config


def _run(tmp_path, **overrides):
    events = []
    cfg = tiny_config(tmp_path, max_steps=3, **overrides)
    result = train_grpo(
        cfg, reward_funcs=[ones_reward], on_event=lambda kind, step, data: events.append((kind, step, data))
    )
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    warnings = [(step, data["message"]) for kind, step, data in events if kind == "warning"]
    return [r for r in rows if "loss" in r], warnings


def test_a_normal_run_holds_its_group_invariants(tmp_path):
    rows, warnings = _run(tmp_path)
    assert len(rows) == 3
    for row in rows:
        assert row["invariants/groups_intact"] == 1.0
        assert row["invariants/group_advantage_sum_max"] <= 1e-5
    assert not [m for _, m in warnings if "invariant" in m]


def test_advantages_changed_after_normalisation_are_caught_once(tmp_path, monkeypatch):
    original = step_module.group_advantages

    def shifted(*args, **kwargs):
        out = original(*args, **kwargs)
        return type(out)(**{**out.__dict__, "advantages": out.advantages + 0.5})

    monkeypatch.setattr(step_module, "group_advantages", shifted)
    rows, warnings = _run(tmp_path)
    assert all(r["invariants/group_advantage_sum_max"] > 0.1 for r in rows)
    said = [(s, m) for s, m in warnings if "invariant group_advantage_sum_max" in m]
    assert len(said) == 1 and said[0][0] == 1 and "do not sum to 0" in said[0][1]


def test_rows_moved_out_of_group_order_are_caught_once(tmp_path, monkeypatch):
    original = step_module.merge_groups

    def rolled(parts, G, pad_id):
        batch = original(parts, G, pad_id)
        order = torch.roll(torch.arange(len(batch.prompts)), 1)  # every group loses its first row
        return type(batch)(
            **{
                name: value[order]
                if isinstance(value, torch.Tensor)
                else [value[i] for i in order.tolist()]
                if isinstance(value, list)
                else value
                for name, value in batch.__dict__.items()
            }
        )

    monkeypatch.setattr(step_module, "merge_groups", rolled)
    rows, warnings = _run(tmp_path)
    assert all(r["invariants/groups_intact"] == 0.0 for r in rows)
    said = [(s, m) for s, m in warnings if "invariant groups_intact" in m]
    assert len(said) == 1 and said[0][0] == 1 and "more than one prompt" in said[0][1]
