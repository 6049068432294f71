"""Runtime invariants (issue 26, point 1): every step logs `invariants/*` at no extra forward (intact
groups, advantages summing to 0, the ratio at the first update, the KL to the reference at step 1, the
loss normaliser's total weight) and the sampler/training mismatch. A normal run holds them; a run that
breaks one on purpose (rows out of group order, shifted advantages, a wrong normaliser, a stale
reference, a top-k sampler taken for the policy, an off sampler) is told once, naming the invariant,
the step and the likely cause, and strict_invariants stops it with a checkpoint. Under top-k, top-p
and min-p the importance ratio is exact where a full-vocabulary one is off by the kept mass
(trl#6789)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models import build_policy, char_tokenizer
from grpokit.ops.loss_types import LossVariant
from grpokit.rollout import SamplingParams, process_logits
from grpokit.train import before_update as before_update_module
from grpokit.train import draw as draw_module
from grpokit.train import grpo as grpo_module
from grpokit.train.grpo import train_grpo
from grpokit.train.metrics import InvariantWatch
from tests.helpers import read_steps
from tests.train.helpers import ones_reward, tiny_config

TOKENIZER = char_tokenizer("0123456789+=")


def _run(tmp_path, **overrides):
    events = []
    cfg = tiny_config(tmp_path, max_steps=3, **overrides)
    result = train_grpo(
        cfg, reward_funcs=[ones_reward], on_event=lambda kind, step, data: events.append((kind, step, data))
    )
    warnings = [(step, data["message"]) for kind, step, data in events if kind == "warning"]
    return read_steps(result.output_dir), warnings


def test_a_normal_run_holds_its_group_invariants(tmp_path):
    rows, warnings = _run(tmp_path)
    assert len(rows) == 3
    for row in rows:
        assert row["invariants/groups_intact"] == 1.0
        assert row["invariants/group_advantage_sum_max"] <= 1e-5
    assert not [m for _, m in warnings if "invariant" in m]


def test_advantages_changed_after_normalisation_are_caught_once(tmp_path, monkeypatch):
    original = draw_module.group_advantages

    def shifted(*args, **kwargs):
        out = original(*args, **kwargs)
        return type(out)(**{**out.__dict__, "advantages": out.advantages + 0.5})

    monkeypatch.setattr(draw_module, "group_advantages", shifted)
    rows, warnings = _run(tmp_path)
    assert all(r["invariants/group_advantage_sum_max"] > 0.1 for r in rows)
    said = [(s, m) for s, m in warnings if "invariant group_advantage_sum_max" in m]
    assert len(said) == 1 and said[0][0] == 1 and "do not sum to 0" in said[0][1]


def test_rows_moved_out_of_group_order_are_caught_once(tmp_path, monkeypatch):
    original = draw_module.merge_groups

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

    monkeypatch.setattr(draw_module, "merge_groups", rolled)
    rows, warnings = _run(tmp_path)
    assert all(r["invariants/groups_intact"] == 0.0 for r in rows)
    said = [(s, m) for s, m in warnings if "invariant groups_intact" in m]
    assert len(said) == 1 and said[0][0] == 1 and "more than one prompt" in said[0][1]


# ------------------------------------------------------------------- the first update, the reference,
# the normaliser and the sampler (issue 26, point 1, the rest)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # μ = 1: nothing to compare the ratio with; the sampler against the training forward
        {"num_iterations": 2, "beta": 0.1},  # old log-probs from the rollout (the lean float32 sampler)
        {"num_iterations": 2, "top_k": 3, "beta": 0.1},  # old log-probs from a forward: top-k cuts q
        {"num_iterations": 2, "top_p": 0.8, "sampling_correction": "token_truncate"},
        {"loss_type": "dapo", "micro_batch_size": 4, "num_iterations": 2},  # a global token count
        {"loss_type": "dr_grpo", "micro_batch_size": 2},
        {"loss_type": "luspo", "micro_batch_size": 4},
    ],
)
def test_a_normal_run_holds_every_invariant(tmp_path, overrides):
    rows, warnings = _run(tmp_path, **overrides)
    for row in rows:
        assert abs(row["invariants/loss_weight_error"]) <= 1e-6
        if overrides.get("num_iterations", 1) > 1:
            assert row["invariants/first_ratio_max"] <= 1e-5
        assert row["sampling/sampling_logp_difference/max"] <= 1e-5  # the float32 lean sampler
    if overrides.get("beta"):
        assert rows[0]["invariants/kl_at_start_max"] <= 1e-6
        assert all("invariants/kl_at_start_max" not in r for r in rows[1:])  # step 1 only
    if "sampling_correction" in overrides:  # the sampler's cut replayed on the training forward: exact
        assert abs(rows[0]["sampling/importance_sampling_ratio/mean"] - 1.0) <= 1e-5
    assert not [m for _, m in warnings if "invariant" in m or "alert" in m]


def test_a_wrong_normaliser_is_caught(tmp_path, monkeypatch):
    # dapo's loss already divides by the whole batch's token count; dividing each micro-batch's loss by
    # the number of micro-batches as well (the per-batch means' rule) weighs the batch 1/4 in all
    monkeypatch.setattr(LossVariant, "global_normaliser", property(lambda self: False))
    rows, warnings = _run(tmp_path, loss_type="dapo", micro_batch_size=4)
    assert all(abs(r["invariants/loss_weight_error"] + 0.75) <= 1e-6 for r in rows)
    said = [(s, m) for s, m in warnings if "invariant loss_weight_error" in m]
    assert len(said) == 1 and said[0][0] == 1 and "micro-batch split or the world size" in said[0][1]


def test_a_stale_reference_is_caught_at_step_1(tmp_path, monkeypatch):
    original = grpo_module.build_trainee

    def stale(*args, **kwargs):  # a reference that is not the starting policy
        trainee = original(*args, **kwargs)
        with torch.no_grad():
            for p in trainee.engine.reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return trainee

    monkeypatch.setattr(grpo_module, "build_trainee", stale)
    rows, warnings = _run(tmp_path, beta=0.1)
    assert rows[0]["invariants/kl_at_start_max"] > 1e-2
    said = [(s, m) for s, m in warnings if "invariant kl_at_start_max" in m]
    assert len(said) == 1 and said[0][0] == 1 and "stale or different reference" in said[0][1]


def test_a_top_k_sampler_taken_for_the_policy_is_caught(tmp_path, monkeypatch):
    # old log-probs from the rollout although top-k cut the distribution it drew from: the ratio at the
    # first update is then 1/kept mass, not 1
    monkeypatch.setattr(before_update_module, "old_logps_source", lambda engine, params: "rollout")
    rows, warnings = _run(tmp_path, num_iterations=2, top_k=3)
    assert rows[0]["invariants/first_ratio_max"] > 0.05
    said = [(s, m) for s, m in warnings if "invariant first_ratio_max" in m]
    assert len(said) == 1 and said[0][0] == 1 and "top-k" in said[0][1]


def test_a_sampler_that_differs_from_the_training_forward_is_measured_and_alerted(tmp_path, monkeypatch):
    original = PolicyEngine.generate

    def off(self, *args, **kwargs):  # a sampler whose log-probs are 0.3 nats off the forward's
        rollout = original(self, *args, **kwargs)
        return dataclasses.replace(rollout, sampling_logps=rollout.sampling_logps + 0.3)

    monkeypatch.setattr(PolicyEngine, "generate", off)
    rows, warnings = _run(tmp_path)
    for row in rows:
        assert abs(row["sampling/sampling_logp_difference/mean"] - 0.3) <= 1e-4
        assert row["sampling/logp_mismatch_share"] == 1.0
    said = [(s, m) for s, m in warnings if "alert logp_mismatch" in m]
    assert len(said) == 1 and said[0][0] == 1 and "sampling_correction" in said[0][1]


def test_strict_invariants_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(before_update_module, "old_logps_source", lambda engine, params: "rollout")
    events = []
    cfg = tiny_config(tmp_path, max_steps=3, num_iterations=2, top_k=3, strict_invariants=True)
    result = train_grpo(cfg, reward_funcs=[ones_reward], on_event=lambda *e: events.append(e))
    assert result.steps == 1 and result.stopped_by == "invariant first_ratio_max"
    assert (result.output_dir / "checkpoint-1").is_dir()
    assert any(
        "strict_invariants=true: the run stops here" in e[2]["message"] for e in events if e[0] == "warning"
    )


def test_the_bounds_are_tight_in_float32_and_wider_under_autocast():
    row = {"invariants/first_ratio_max": 0.01, "invariants/kl_at_start_max": 0.0}
    assert len(InvariantWatch(exact=True).update(1, row)) == 1
    assert InvariantWatch(exact=False).update(1, row) == []  # bf16 round-off reaches 0.01
    assert (
        len(InvariantWatch(exact=False).update(1, {"invariants/first_ratio_max": 0.94})) == 1
    )  # NeMo's 0.06


@pytest.mark.parametrize("cut", [{"top_k": 4}, {"top_p": 0.7}, {"min_p": 0.9}, {"top_k": 6, "top_p": 0.9}])
def test_the_importance_ratio_under_a_cut_sampler_is_exact_where_a_full_vocabulary_one_is_not(cut):
    """trl#6789: the sampler's log-probs are those of the cut, renormalised distribution it drew from.
    grpokit's ratio replays the cut on the training forward and is 1; TRL's takes a full-vocabulary
    log-softmax against them and is off by the kept mass S of every position."""
    torch.manual_seed(0)
    model = build_policy(hidden_size=32, num_layers=2, num_heads=4, vocab_size=TOKENIZER.vocab_size, seed=2)
    model.eval()
    engine = PolicyEngine.create(model, TOKENIZER, EngineSpec(temperature=0.9))
    params = SamplingParams(num_generations=4, max_completion_length=6, temperature=0.9, seed=1, **cut)
    rollout = engine.generate(["1+2=", "30+4="], params)
    replayed = engine.replayed_logps(rollout, 8, params)
    mask = rollout.completion_mask
    ours = (replayed.sampled - rollout.sampling_logps)[mask].exp()
    assert (ours - 1.0).abs().max() <= 1e-5
    full_vocabulary = (replayed.policy - rollout.sampling_logps)[mask].exp()  # TRL's ratio
    # the kept mass of each position, from the full distribution directly
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).long()
    T = rollout.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -T - 1 : -1].float()  # [B, T, V]
    kept = process_logits(logits.reshape(-1, logits.shape[-1]), None, params).isfinite()  # [B·T, V]
    probs = torch.softmax(logits / 0.9, -1).reshape(-1, logits.shape[-1])
    mass = (probs * kept).sum(-1).view(mask.shape)[mask]  # [N]
    assert (full_vocabulary - mass).abs().max() <= 1e-5
    assert mass.min() < 0.95  # the cut removed real mass: TRL's ratio is wrong by it
