"""The command line end to end on a tiny model: train, report and eval; sft."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import TINY_MODEL, tiny_run


@pytest.mark.slow
def test_cli_train_and_report_on_a_tiny_run(tmp_path):
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "grpokit",
        "train",
        f"output_dir={run}",
        # the tiny run at the preset's completion length and learning rate
        *tiny_run(
            "max_completion_length",
            "learning_rate",
            sft_steps=20,
            micro_batch_size=16,
            num_eval_prompts=8,
            log_completions_steps=1,
        ),
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "held-out greedy accuracy" in result.stdout and "sample completions at step 1" in result.stdout
    # no CONFIG: which preset it starts from is said first, not left silent
    assert result.stdout.startswith(f"the built-in addition preset with your overrides (output_dir {run});")
    report = subprocess.run(
        [sys.executable, "-m", "grpokit", "report", str(run)], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0 and (run / "report" / "index.html").is_file()
    evaluation = subprocess.run(
        [sys.executable, "-m", "grpokit", "eval", f"model={run / 'checkpoint-2'}", "num_eval_prompts=8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert evaluation.returncode == 0, evaluation.stderr
    assert '"accuracy"' in evaluation.stdout


@pytest.mark.slow
def test_cli_sft(tmp_path):
    out = tmp_path / "sft"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "sft",
            f"output_dir={out}",
            "max_steps=3",
            "batch_size=8",
            *TINY_MODEL,
            "num_eval_prompts=8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (out / "final" / "model.safetensors").is_file() and "held-out greedy accuracy" in result.stdout
