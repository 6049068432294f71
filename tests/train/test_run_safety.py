"""A run never mixes with or destroys an earlier one; a signal during the warm start stops with a
message; a run that cannot learn says so; the Python API reports like the command line."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from grpokit import GRPOTrainer
from grpokit.config.load import run_config_yaml
from grpokit.config.plan import SFTSchedule, grpo_plan
from grpokit.train.grpo import train_grpo
from grpokit.train.metrics import ZeroSpreadWatch
from grpokit.train.optim import lr_factor
from grpokit.train.rundir import claim_output_dir, clear_earlier_run
from grpokit.train.sft import SFTHooks, run_sft
from tests.helpers import read_steps, tiny_run

from .helpers import ones_reward, tiny_config, weights


def constant_reward(prompts, completions, **_):
    return [0.0] * len(completions)


# ----------------------------------------------------------------------------- output_dir


def test_a_second_run_into_the_same_output_dir_fails_before_any_work(tmp_path):
    train_grpo(tiny_config(tmp_path, save_steps=1), reward_funcs=[ones_reward])
    run = tmp_path / "run"
    before = (run / "metrics.jsonl").read_text()
    checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
    events = []
    with pytest.raises(FileExistsError) as error:
        train_grpo(tiny_config(tmp_path), reward_funcs=[ones_reward], on_event=lambda *e: events.append(e))
    message = str(error.value)
    assert str(run) in message and "resume=true" in message and "overwrite=true" in message
    assert "output_dir=" in message and "checkpoint-2" in message
    assert events == []  # nothing ran: no evaluation, no warm start
    assert (run / "metrics.jsonl").read_text() == before  # nothing appended
    assert sorted(p.name for p in run.glob("checkpoint-*")) == checkpoints  # nothing deleted


def test_overwrite_replaces_the_earlier_run_and_resume_continues_it(tmp_path):
    train_grpo(tiny_config(tmp_path, max_steps=3, save_steps=1), reward_funcs=[ones_reward])
    run = tmp_path / "run"
    (run / "notes.txt").write_text("mine")  # not a run file: never touched
    train_grpo(tiny_config(tmp_path, max_steps=1, save_steps=1, overwrite=True), reward_funcs=[ones_reward])
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]  # 2 and 3 are gone
    assert [r["step"] for r in read_steps(run)] == [1]
    assert (run / "notes.txt").read_text() == "mine"
    train_grpo(tiny_config(tmp_path, max_steps=2, save_steps=1, resume=True), reward_funcs=[ones_reward])
    assert [r["step"] for r in read_steps(run)] == [1, 2]


def test_resume_without_a_checkpoint_is_refused_and_keeps_the_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    died = json.dumps({"step": 7, "loss": 1.0}) + "\n"  # died before a checkpoint
    (run / "metrics.jsonl").write_text(died)
    with pytest.raises(
        FileExistsError, match="no checkpoint to resume from.*nothing was changed.*overwrite=true"
    ):
        train_grpo(tiny_config(tmp_path, max_steps=1, resume=True), reward_funcs=[ones_reward])
    assert (run / "metrics.jsonl").read_text() == died


def test_claim_output_dir_cases(tmp_path):
    assert not claim_output_dir(tmp_path / "new", resume=False, overwrite=False)  # nothing there: fine
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(run_config_yaml("x: 1\n"))
    (run / "sft_metrics.jsonl").write_text("")
    assert not claim_output_dir(run, resume=False, overwrite=False)  # a stopped warm start: not a run yet
    (run / "checkpoint-5").mkdir()
    with pytest.raises(FileExistsError, match="checkpoint-5"):
        claim_output_dir(run, resume=False, overwrite=False)
    with pytest.raises(FileExistsError, match="no checkpoint to resume from"):  # checkpoint-5 has no state
        claim_output_dir(run, resume=True, overwrite=False)
    (run / "checkpoint-5" / "state.pt").write_bytes(b"")
    assert not claim_output_dir(run, resume=True, overwrite=False)
    assert claim_output_dir(run, resume=False, overwrite=True)  # to be deleted, by the caller, later
    assert (run / "checkpoint-5").is_dir()
    clear_earlier_run(run)
    assert not (run / "checkpoint-5").exists() and not (run / "config.yaml").exists()


def test_overwrite_never_deletes_before_the_input_is_valid(tmp_path):
    train_grpo(tiny_config(tmp_path, save_steps=1), reward_funcs=[ones_reward])
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="missing.jsonl.*does not exist"):  # DataError
        train_grpo(
            tiny_config(tmp_path, overwrite=True, task=None, dataset=str(tmp_path / "missing.jsonl")),
            reward_funcs=[ones_reward],
        )
    assert (run / "checkpoint-2").is_dir() and (run / "metrics.jsonl").is_file()  # the earlier run is intact


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="set only one"):
        tiny_config(tmp_path, resume=True, overwrite=True)


def test_the_reward_trainer_refuses_an_earlier_run_too(tmp_path):
    from grpokit.config import RewardConfig
    from grpokit.train.reward import train_reward

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("{}\n")
    cfg = RewardConfig(output_dir=str(tmp_path / "r"), progress=False, max_steps=1)
    with pytest.raises(FileExistsError, match="resume=true"):
        train_reward(cfg)


# ----------------------------------------------------------------------------- warm start


def test_sft_schedule_warms_up_then_decays_to_zero():
    """The warm start's schedule (optim.lr_factor, cosine): hand-computed values."""
    factors = [round(lr_factor(s, kind="cosine", warmup_steps=2, max_steps=10), 3) for s in (0, 1, 2, 6, 10)]
    assert factors == [0.5, 1.0, 1.0, 0.5, 0.0]


def test_run_sft_stops_on_its_goal_or_on_a_signal(tmp_path):
    from grpokit.data import get_task
    from grpokit.models import build_policy, char_tokenizer

    task = get_task("addition")
    tok = char_tokenizer(task.alphabet)

    def model():
        return build_policy(
            hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tok), dropout=0.0, seed=0
        )

    schedule = SFTSchedule(steps=10, batch_size=8, learning_rate=1e-3, seed=0)
    done = run_sft(model(), tok, task.train, schedule, SFTHooks(done=lambda s: s == 4))
    assert len(done.losses) == 4 and done.reached and not done.stopped
    asked = []
    stopped = run_sft(
        model(), tok, task.train, schedule, SFTHooks(should_stop=lambda: asked.append(1) or len(asked) == 3)
    )
    assert len(stopped.losses) == 3 and stopped.stopped and not stopped.reached
    full = run_sft(model(), tok, task.train, schedule)
    assert full.losses[:3] == stopped.losses and len(full.losses) == 10  # the same steps, whatever ends them


def test_a_signal_during_the_warm_start_stops_cleanly_and_the_same_run_starts_again(tmp_path):
    events = []

    def on_event(kind, step, data):
        events.append((kind, step, data))
        if kind == "sft_step" and step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C mid warm start

    cfg = tiny_config(tmp_path, sft_steps=50, sft_batch_size=8)
    result = train_grpo(cfg, reward_funcs=[ones_reward], on_event=on_event)
    assert result.stopped_by == "SIGINT" and result.phase == "warm start" and result.steps == 0
    run = tmp_path / "run"
    assert len((run / "sft_metrics.jsonl").read_text().splitlines()) == 3
    assert not (run / "metrics.jsonl").exists() and not list(run.glob("checkpoint-*"))
    run_dir = str(tmp_path / "run")
    assert events[-1] == ("stopped", 0, {"signal": "SIGINT", "phase": "warm start", "output_dir": run_dir})
    again = train_grpo(
        tiny_config(tmp_path, sft_steps=5, sft_batch_size=8, save_steps=1), reward_funcs=[ones_reward]
    )
    assert again.steps == 2 and again.stopped_by is None
    assert len((run / "sft_metrics.jsonl").read_text().splitlines()) == 5


@pytest.mark.slow
def test_sigterm_during_the_warm_start_exits_with_a_message(tmp_path):
    out = tmp_path / "run"
    args = tiny_run(micro_batch_size=16, sft_steps=100000, sft_batch_size=8)  # stopped in the warm start
    process = subprocess.Popen(
        [sys.executable, "-m", "grpokit", "train", f"output_dir={out}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    import time

    deadline = time.time() + 120
    while not (out / "config.yaml").exists() and time.time() < deadline:  # written just before the warm start
        time.sleep(0.05)
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "during the supervised warm start" in stdout and "run the same command again" in stdout
    assert "Traceback" not in stderr


def test_warm_start_target_needs_an_exact_accuracy(tmp_path):
    from grpokit.train.grpo_setup import warm_start_goal
    from grpokit.train.inputs import RunData

    cfg = tiny_config(tmp_path, sft_steps=5, sft_target_accuracy=0.5)
    data = RunData([], [], [ones_reward], None, None, None, 4)  # no is_correct
    with pytest.raises(ValueError, match="sft_target_accuracy needs an exact accuracy"):
        warm_start_goal(grpo_plan(cfg).warm_start, None, data, [])
    assert warm_start_goal(grpo_plan(tiny_config(tmp_path, sft_steps=5)).warm_start, None, data, []) is None


def test_warm_start_stops_once_the_probe_reaches_the_target(tmp_path):
    """A target any policy meets (a correctness that always holds) ends the warm start at the first
    probe; the probe accuracy is reported."""
    events = []
    cfg = tiny_config(tmp_path, sft_steps=100, sft_batch_size=8, sft_target_accuracy=1.0)
    train_grpo(
        cfg, reward_funcs=[ones_reward], is_correct=lambda c, r: True, on_event=lambda *e: events.append(e)
    )
    done = [e for e in events if e[0] == "sft_done"]
    assert done == [("sft_done", 10, {"probe_accuracy": 1.0, "reached": True})]
    assert len((tmp_path / "run" / "sft_metrics.jsonl").read_text().splitlines()) == 10


# ----------------------------------------------------------------------------- cannot learn


def test_zero_spread_watch_warns_once_after_patience_and_rearms():
    watch = ZeroSpreadWatch(patience=3)
    said = [watch.update(f, 0.0) for f in (0.9, 0.9, 0.4, 0.9, 0.9, 0.9, 0.9)]
    assert [s is not None for s in said] == [False, False, False, False, False, True, False]
    assert "sft_steps" in said[5] and "temperature" in said[5] and "num_generations" in said[5]
    assert "scores 0" in said[5]
    assert watch.update(0.1, 0.5) is None  # recovered: re-armed
    later = [watch.update(1.0, 1.0) for _ in range(3)]
    assert later[-1] is not None and "already solves" in later[-1]


def test_a_run_that_cannot_learn_says_so(tmp_path, caplog):
    events = []
    cfg = tiny_config(tmp_path, max_steps=12)
    train_grpo(cfg, reward_funcs=[constant_reward], on_event=lambda *e: events.append(e))
    warnings = [e for e in events if e[0] == "warning"]
    assert [e[1] for e in warnings] == [10]  # once, after 10 steps with every group at zero spread
    assert "zero reward spread" in warnings[0][2]["message"]
    with caplog.at_level(logging.WARNING, logger="grpokit"):  # no progress display: the logger
        train_grpo(tiny_config(tmp_path, max_steps=10, overwrite=True), reward_funcs=[constant_reward])
    assert any("zero reward spread" in r.getMessage() for r in caplog.records)


def test_the_report_plots_zero_spread_and_the_warm_start_loss(tmp_path):
    from grpokit.report import write_report

    train_grpo(tiny_config(tmp_path, sft_steps=3, sft_batch_size=8), reward_funcs=[ones_reward])
    page = write_report(tmp_path / "run")
    assert (page.parent / "zero_spread.png").is_file() and (page.parent / "sft_loss.png").is_file()
    assert "sft_loss.png" in page.read_text()


def test_the_python_api_shows_progress_like_the_cli(tmp_path, capsys):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    cfg = tiny_config(tmp_path, progress=True, eval_steps=1).model_dump()
    trainer = GRPOTrainer("tiny", ones_reward, cfg | {"task": None}, rows, eval_dataset=rows[:4])
    trainer.train()
    out = capsys.readouterr().out
    assert "step 2 eval" in out
    capsys.readouterr()
    GRPOTrainer("tiny", ones_reward, cfg | {"progress": False, "overwrite": True}, rows).train()
    assert capsys.readouterr().out == ""
    assert weights(tmp_path / "run")


@pytest.mark.slow
def test_the_python_api_says_why_it_stopped(tmp_path, capsys):
    """progress=True: the same line as the command line, for a stop in the warm start and in GRPO."""
    from grpokit.train.progress import stop_message

    assert "during the supervised warm start" in stop_message("SIGINT", "warm start", 0, "runs/x")
    assert "after step 7: checkpoint-7 saved in runs/x" in stop_message("SIGTERM", "grpo", 7, "runs/x")
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    cfg = tiny_config(
        tmp_path, progress=True, sft_steps=100_000, sft_batch_size=8
    ).model_dump()  # until the signal
    trainer = GRPOTrainer("tiny", ones_reward, cfg | {"task": None}, rows)
    import threading

    timer = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    result = trainer.train()
    timer.join()
    assert result.stopped_by == "SIGINT"
    assert stop_message("SIGINT", result.phase, result.steps, str(tmp_path / "run")) in " ".join(
        capsys.readouterr().out.split()
    )


def test_no_zero_spread_warning_under_dynamic_sampling(tmp_path):
    """Dynamic sampling trains on groups with a spread: the first batch's share is not the trained one."""
    events = []
    cfg = tiny_config(tmp_path, max_steps=11, dynamic_sampling=True, max_resample_batches=1)
    train_grpo(cfg, reward_funcs=[constant_reward], on_event=lambda *e: events.append(e))
    assert not [e for e in events if e[0] == "warning"]
