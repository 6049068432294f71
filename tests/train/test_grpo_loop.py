"""The GRPO loop end to end on a tiny policy: metrics, checkpoints, resume, the façade, the report."""

from __future__ import annotations

import pytest
import torch

from grpokit.train.grpo import train_grpo
from tests.helpers import read_metrics, read_steps
from tests.train.helpers import ones_reward, tiny_config, weights

PHASES = ("timing/sampling", "timing/scoring", "timing/reference", "timing/update")  # of one step


def test_one_run_writes_trl_named_metrics_checkpoint_and_config(tmp_path):
    cfg = tiny_config(tmp_path, beta=0.04, max_steps=2)
    result = train_grpo(cfg, reward_funcs=[ones_reward])
    rows = read_metrics(result.output_dir)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    expected = {
        "reward",
        "reward_std",
        "rewards/ones_reward/mean",
        "rewards/ones_reward/std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "kl",
        "entropy",
        "clip_ratio/region_mean",
        "loss",
        "grad_norm",
        "learning_rate",
        "step_time",
        "tokens_per_second",
        "num_generation_batches",
    } | set(PHASES)
    assert expected <= set(steps[0]), expected - set(steps[0])
    for row in steps:  # the phases are parts of the step, each timed once
        assert all(row[k] >= 0 for k in PHASES) and sum(row[k] for k in PHASES) <= row["step_time"]
    assert {"eval/accuracy", "eval/reward"} <= set(rows[0]) and rows[0]["step"] == 0
    checkpoint = result.output_dir / "checkpoint-2"
    assert {"model.safetensors", "state.pt", "config.yaml", "tokenizer.json"} <= {
        p.name for p in checkpoint.iterdir()
    }
    assert (result.output_dir / "config.yaml").read_text() == (checkpoint / "config.yaml").read_text()
    assert "accuracy" in result.eval_before and "accuracy" in result.eval_after


def test_training_changes_what_the_reward_favours(tmp_path):
    """30 steps on the '1'-share reward raise the sampled reward (the loop's sign is right)."""
    cfg = tiny_config(tmp_path, max_steps=30, prompts_per_step=8, micro_batch_size=32, learning_rate=3e-2)
    result = train_grpo(cfg, reward_funcs=[ones_reward])
    rewards = [r["reward"] for r in read_steps(result.output_dir)]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


@pytest.mark.parametrize(
    "extra", [{}, {"num_iterations": 2, "beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 1}]
)
def test_stopped_and_resumed_run_ends_with_bitwise_equal_weights(tmp_path, extra):
    """N = 4 steps straight, versus stopped after step 3 (last checkpoint: step 2) and resumed."""
    straight = tiny_config(tmp_path / "a", max_steps=4, save_steps=2, **extra)
    train_grpo(straight, reward_funcs=[ones_reward])

    interrupted = tiny_config(tmp_path / "b", max_steps=4, save_steps=2, **extra)

    def stop_at_3(kind, step, data):
        if kind == "step" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_grpo(interrupted, reward_funcs=[ones_reward], on_event=stop_at_3)
    events = []
    train_grpo(
        interrupted.model_copy(update={"resume": True}),
        reward_funcs=[ones_reward],
        on_event=lambda kind, step, data: events.append((kind, step)),
    )
    assert ("resumed", 2) in events
    a, b = weights(straight.output_dir and tmp_path / "a" / "run"), weights(tmp_path / "b" / "run")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_steps(tmp_path / "b" / "run")]
    assert steps == [1, 2, 3, 4]  # the rows of step 3 written before the stop were replaced, not doubled


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    cfg = tiny_config(tmp_path, resume=True, max_steps=1)
    events = []
    train_grpo(cfg, reward_funcs=[ones_reward], on_event=lambda kind, step, data: events.append(kind))
    assert "resumed" not in events and "start" in events


def test_facade_takes_a_path_or_a_loaded_model(tmp_path, tiny_policy):
    from grpokit import GRPOTrainer
    from grpokit.models import save_policy

    model, tok = tiny_policy
    save_policy(model, tok, tmp_path / "policy")
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
    cfg = tiny_config(tmp_path, task=None, max_steps=1)
    result = GRPOTrainer(str(tmp_path / "policy"), ones_reward, cfg, rows, eval_dataset=rows[:4]).train()
    assert result.steps == 1 and "reward" in result.eval_after
    cfg2 = tiny_config(tmp_path / "two", task=None, max_steps=1)
    result2 = GRPOTrainer(model, [ones_reward], cfg2, rows, processing_class=tok).train()
    assert result2.eval_after == {}  # no eval dataset given
    with pytest.raises(ValueError, match="needs its tokenizer"):
        GRPOTrainer(model, ones_reward, cfg2, rows)


def test_report_writes_plots_and_html(tmp_path):
    from grpokit.report import write_report

    result = train_grpo(tiny_config(tmp_path, max_steps=3, beta=0.04), reward_funcs=[ones_reward])
    page = write_report(result.output_dir)
    pngs = {p.stem for p in page.parent.glob("*.png")}
    assert {"reward", "kl", "entropy", "length", "loss"} <= pngs
    text = page.read_text()
    # (3 steps of a tiny model may solve nothing: a series at 0 throughout is a note, not a flat line)
    assert "accuracy" in pngs or "accuracy: eval/accuracy 0 at every step (not drawn)" in text
    assert "reward.png" in text and "learning_rate: 0.01" in text
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clip_grad_norm_equals_torch_bit_for_bit(max_norm):
    """grpokit's clipping skips torch's per-call grouping of tensors; its norm and its clipped
    gradients must be torch's exactly, clipped (small max_norm) or not; parameters without a
    gradient are left alone, and mixed dtypes fall back to torch's function."""
    from grpokit.train.optim import clip_grad_norm

    def model_with_grads(seed, mixed=False):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
        if mixed:
            model[1].double()
        model[2].weight.requires_grad_(False)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p) * 3
        return model

    for mixed in (False, True):
        ours, theirs = model_with_grads(0, mixed), model_with_grads(0, mixed)
        norm = clip_grad_norm(ours, max_norm)
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
        assert torch.equal(norm, expected)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
