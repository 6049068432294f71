"""Training-health alerts (issue 26, point 3): each fires once, with its value, threshold, cause and
fix, on the terminal, in output_dir/alerts.jsonl and as a marker on the report's plots. Each is
triggered by a run constructed to go bad that way (an absurd learning rate on an unlearnable reward
for entropy collapse, a length reward for blow-up, a constant reward for zero spread, ...); the main
job fires none (tests/test_main_job.py)."""

from __future__ import annotations

import random

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.ops import LossOutput
from grpokit.report import write_report
from grpokit.train import update as update_module
from grpokit.train.alerts import AlertWatch
from grpokit.train.grpo import train_grpo
from grpokit.train.run_files import check_run_files
from tests.helpers import read_alerts
from tests.train.helpers import ones_reward, tiny_config


def _run(tmp_path, reward_funcs=None, name="run", **overrides):
    events = []
    cfg = tiny_config(tmp_path, output_dir=str(tmp_path / name), **overrides)
    result = train_grpo(
        cfg, reward_funcs=reward_funcs, on_event=lambda kind, step, data: events.append((kind, step, data))
    )
    alerts = read_alerts(result.output_dir)
    said = [(step, data["message"]) for kind, step, data in events if kind == "warning"]
    return result, alerts, [(s, m) for s, m in said if m.startswith("alert ")]


def _noise_reward():
    rng = random.Random(0)  # a reward no policy can learn: independent of the text

    def noise_reward(prompts, completions, **_):
        return [rng.random() for _ in completions]

    return noise_reward


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def constant_reward(prompts, completions, **_):
    return [1.0 for _ in completions]


def _only(alerts, said, name, step=None):
    """Exactly one alert, `name` (at `step`), in the file and on the terminal, with all its fields."""
    assert [a["name"] for a in alerts] == [name], alerts
    alert = alerts[0]
    assert set(alert) == {"step", "name", "value", "threshold", "advice"}
    assert step is None or alert["step"] == step
    assert said == [(alert["step"], said[0][1])] and f"alert {name} at step {alert['step']}" in said[0][1]
    assert f"threshold {alert['threshold']:g}" in said[0][1] and alert["advice"] in said[0][1]
    return alert


def test_an_absurd_learning_rate_on_an_unlearnable_reward_collapses_entropy(tmp_path):
    result, alerts, said = _run(tmp_path, [_noise_reward()], max_steps=12, learning_rate=1.0)
    alert = _only(alerts, said, "entropy_collapse", step=10)  # the first step with two windows
    assert alert["value"] < 0.1 and alert["threshold"] == 0.1
    assert "learning_rate" in alert["advice"] and "temperature" in alert["advice"]


def test_a_sane_learning_rate_on_the_same_reward_does_not(tmp_path):
    _, alerts, said = _run(tmp_path, [_noise_reward()], max_steps=12, learning_rate=1e-2)
    assert alerts == [] and said == []


def test_a_length_reward_blows_up_the_completions(tmp_path):
    result, alerts, said = _run(
        tmp_path, [length_reward], max_steps=20, max_completion_length=32, learning_rate=3e-2
    )
    alert = _only(alerts, said, "length_blowup")
    assert alert["value"] >= 1.5 and "max_completion_length" in alert["advice"]


def test_a_constant_reward_has_zero_spread(tmp_path):
    _, alerts, said = _run(tmp_path, [constant_reward], max_steps=12)
    alert = _only(alerts, said, "zero_spread", step=10)  # after 10 steps in a row
    assert alert["value"] == 1.0 and "zero reward spread" in alert["advice"]


def test_large_updates_over_several_iterations_leave_the_clipping_range(tmp_path):
    # eight updates on one batch at a high learning rate: past the trust region within 3 steps (over
    # seeds 1, 2, 3, 7, 11, 13 the largest share was 0.53-0.95, the threshold 0.2)
    _, alerts, said = _run(tmp_path, [ones_reward], max_steps=3, num_iterations=8, learning_rate=3e-2)
    clip = [a for a in alerts if a["name"] == "clip_ratio"]
    assert len(clip) == 1 and clip[0]["step"] <= 3 and clip[0]["value"] > 0.2
    assert "num_iterations" in clip[0]["advice"]
    assert [s for s, m in said if "alert clip_ratio" in m] == [clip[0]["step"]]


def test_a_policy_driven_far_from_its_reference_blows_up_the_kl(tmp_path):
    # over seeds 1, 2, 3, 7, 11 the KL passed 1 nat by step 3 to 5
    _, alerts, said = _run(tmp_path, [ones_reward], max_steps=8, beta=0.01, learning_rate=0.3)
    kl = [a for a in alerts if a["name"] == "kl"]
    assert len(kl) == 1 and kl[0]["value"] > 1.0 and "beta" in kl[0]["advice"]
    assert [s for s, m in said if "alert kl" in m] == [kl[0]["step"]]


def test_a_non_finite_loss_is_said(tmp_path, monkeypatch):
    real, count = update_module.grpo_loss, [0]

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        count[0] += 1
        return LossOutput(out.loss * float("nan"), out.metrics) if count[0] == 2 else out

    monkeypatch.setattr(update_module, "grpo_loss", poisoned)
    _, alerts, said = _run(tmp_path, [ones_reward], max_steps=3, micro_batch_size=16)  # a call a step
    alert = _only(alerts, said, "non_finite", step=2)
    assert "learning_rate" in alert["advice"]


@pytest.mark.slow
def test_a_reward_that_pays_for_the_wrong_thing_is_caught_hacking(tmp_path):
    """A warm start teaches some addition (held-out accuracy 0.2-0.4); then the reward pays for '1'
    characters instead of the sum: the training reward rises to 1 while held-out accuracy falls to 0
    (seeds 1, 2, 3, 7: caught at the first evaluation after, step 4). About 20 s."""
    cfg = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        task="addition",
        model="tiny",
        seed=3,
        max_steps=8,
        prompts_per_step=8,
        num_generations=4,
        micro_batch_size=32,
        num_eval_prompts=64,
        eval_steps=4,
        save_steps=0,
        log_completions_steps=0,
        progress=False,
        sft_steps=400,
        sft_target_accuracy=0.2,
        sft_batch_size=256,
        sft_learning_rate=3e-3,
        sft_warmup_steps=50,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
    )
    result = train_grpo(cfg, reward_funcs=[ones_reward])
    alerts = read_alerts(result.output_dir)
    hacking = [a for a in alerts if a["name"] == "reward_hacking"]
    assert len(hacking) == 1 and hacking[0]["step"] % 4 == 0  # found at an evaluation
    assert hacking[0]["value"] >= 0.1 and "held-out accuracy fell" in hacking[0]["advice"]


def test_a_threshold_changed_by_name_changes_when_it_fires(tmp_path):
    _, alerts, _ = _run(
        tmp_path,
        [ones_reward],
        max_steps=3,
        num_iterations=8,
        learning_rate=3e-2,
        alert_thresholds={"clip_ratio": 1.0},  # a share: never above 1, so the alert is off
    )
    assert "clip_ratio" not in [a["name"] for a in alerts]
    with pytest.raises(ValueError, match="no alert 'entropy'; the alerts are entropy_collapse"):
        GRPOConfig(alert_thresholds={"entropy": 0.1})


def test_a_resumed_run_says_nothing_twice_and_counts_from_its_real_start(tmp_path):
    _run(tmp_path, [constant_reward], max_steps=6, save_steps=2)
    # resumed at step 6: the 4 steps after it complete the 10 in a row, as in an uninterrupted run
    _, alerts, said = _run(tmp_path, [constant_reward], max_steps=12, save_steps=2, resume=True)
    _only(alerts, said, "zero_spread", step=10)
    _, again, said_again = _run(tmp_path, [constant_reward], max_steps=14, save_steps=2, resume=True)
    assert again == alerts and said_again == []  # kept in the file, not said again


def test_the_report_marks_each_alert_on_its_plots(tmp_path):
    result, alerts, _ = _run(tmp_path, [constant_reward], max_steps=12)
    assert [a["name"] for a in alerts] == ["zero_spread"]
    check_run_files(result.output_dir)  # what the run wrote is read back as a resume reads it
    page = write_report(result.output_dir).read_text()
    assert "<h2>Alerts</h2>" in page and "zero_spread" in page
    marked = (result.output_dir / "report" / "zero_spread.png").read_bytes()
    (result.output_dir / "alerts.jsonl").unlink()
    write_report(result.output_dir)
    plain = (result.output_dir / "report" / "zero_spread.png").read_bytes()
    assert marked != plain  # the marker is drawn (and only when there is an alert)
    assert "None fired" in (result.output_dir / "report" / "index.html").read_text()


def test_the_watch_on_a_constructed_metric_stream():
    watch = AlertWatch()
    rows = [{"entropy": 2.0, "reward": 0.5, "reward_std": 0.1, "loss": 0.0} for _ in range(9)]
    assert all(watch.update(i + 1, r) == [] for i, r in enumerate(rows))
    # the held-out accuracy: best 0.6 at a reward of 0.5; later 0.45 at a higher reward
    assert watch.evaluated(9, {"eval/accuracy": 0.6}) == []
    for step in range(10, 16):
        watch.update(step, {"entropy": 2.0, "reward": 0.9, "reward_std": 0.1, "loss": 0.0})
    fired = watch.evaluated(15, {"eval/accuracy": 0.45})
    assert [a.name for a in fired] == ["reward_hacking"] and abs(fired[0].value - 0.15) < 1e-9
    assert watch.evaluated(20, {"eval/accuracy": 0.3}) == []  # once per run
    nan_step = {"entropy": 2.0, "reward": 0.9, "loss": torch.tensor(float("nan")), "skipped_update": 1.0}
    assert [a.name for a in watch.update(16, nan_step)] == ["non_finite"]


@pytest.mark.parametrize(
    ("rewards", "hacking"), [((0.2, 0.15, 0.1, 0.08, 0.05, 0.05), False), ((0.2, 0.5, 0.9), True)]
)
def test_a_fall_from_the_evaluation_before_training_is_hacking_only_if_the_reward_rose(rewards, hacking):
    """The best held-out accuracy is often step 0's, before any training reward: the reward then is
    the first step's. A collapse (held-out 0.34 -> 0.08 with the training reward falling, the chain
    preset at seed 42 and a learning rate of 2e-4) is not hacking; the same fall with the reward rising
    is."""
    watch = AlertWatch()
    assert watch.evaluated(0, {"eval/accuracy": 0.34}) == []
    for step, reward in enumerate(rewards, start=1):
        watch.update(step, {"entropy": 2.0, "reward": reward, "reward_std": 0.1, "loss": 0.0})
    fired = watch.evaluated(len(rewards), {"eval/accuracy": 0.08})
    assert [a.name for a in fired] == (["reward_hacking"] if hacking else [])
