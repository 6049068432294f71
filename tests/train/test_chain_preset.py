"""The chain preset (issue 54) briefly: its warm start learns worked solutions, its completions are long,
and the report splits their lengths by correctness. Its learning is measured in benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest

from grpokit.config import GRPOConfig
from grpokit.config.applied import preset_of, preset_values
from grpokit.data import get_task, sft_rows
from grpokit.models import char_tokenizer
from grpokit.report import write_report
from grpokit.train.grpo import train_grpo
from tests.helpers import read_metrics


def test_the_warm_start_learns_the_worked_solutions():
    task = get_task("chain")
    rows = sft_rows(task.train[:3], char_tokenizer(task.alphabet))
    assert [r["answer"] for r in rows] == [r["answer"] for r in task.train[:3]]
    assert all(
        r["answer"].endswith(";" + t["result"]) and "," in r["answer"]
        for r, t in zip(rows, task.train[:3], strict=True)
    )


@pytest.mark.slow  # about 9 s alone
def test_a_short_chain_run_samples_long_completions_and_reports_their_lengths_by_correctness(tmp_path):
    overrides = {
        "output_dir": str(tmp_path / "run"),
        "progress": False,
        "sft_steps": 30,  # the format only: no probe, a short warm start
        "sft_target_accuracy": None,
        "sft_batch_size": 16,
        "max_steps": 2,
        "prompts_per_step": 2,
        "num_generations": 4,
        "micro_batch_size": 8,
        "num_eval_prompts": 4,
        "eval_steps": 0,
        "save_steps": 0,
        "log_completions_steps": 0,
    }
    cfg = GRPOConfig(**(preset_values("chain") | overrides))
    result = train_grpo(cfg, preset=preset_of("chain", overrides))
    steps = [r for r in read_metrics(result.output_dir) if "loss" in r]
    assert len(steps) == 2
    for row in steps:
        assert row["completions/max_length"] > 32  # the warm start's worked solutions are long
        assert row["completions/max_length"] <= 128
        assert row["completions/correct_ratio"] == row["reward"]  # the task pays exactly what is right
        assert row["completions/incorrect_mean_length"] is not None or row["reward"] == 1.0
    write_report(result.output_dir)
    assert (result.output_dir / "report" / "length_by_correctness.png").is_file()
