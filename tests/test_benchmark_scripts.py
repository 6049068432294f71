"""The GPU benchmarks (benchmarks/gpu_throughput.py, benchmarks/gpu_vs_trl.py) cannot run here at their
size, but their code paths can: the tiny size on the CPU, so that the scripts a GPU user runs do not rot."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import read_steps

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_throughput.py"


def test_gpu_throughput_script_runs_on_a_tiny_model(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "result.json"
    args = ["--size", "tiny", "--device", "cpu", "--prompts", "2", "--generations", "4", "--tokens", "8"]
    assert (
        module.main(
            [*args, "--prompt-tokens", "6", "--micro-batch", "4", "--repeats", "1", "--out", str(out)]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["work"] == "2 prompts x 4 completions x 8 tokens, prompts of 6 tokens"
    for piece in ("sampling", "reference_pass", "policy_update"):
        assert result[piece]["tokens_per_second"] > 0 and result[piece]["model_tflops"] > 0
        assert result[piece]["mfu"] is None  # no peak on a CPU


def test_model_flops_count_by_hand():
    """2·N_mm + 4·layers·hidden·context per token forward, ×3 to train; N_mm: every weight but the
    embedding table (hidden 64, 2 layers, intermediate 128, V = 100, untied head)."""
    from grpokit.models import build_policy

    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = build_policy(hidden_size=64, num_layers=2, num_heads=4, vocab_size=100, intermediate_size=128)
    per_layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # attention and MLP projections, two norms
    n_mm = 2 * per_layer + 64 + 100 * 64  # layers, final norm, LM head
    forward = 2 * n_mm + 4 * 2 * 64 * 10.0
    assert module.model_flops_per_token(model, 10.0, train=False) == forward
    assert module.model_flops_per_token(model, 10.0, train=True) == 3 * forward


def test_main_job_spread_summarises_runs(tmp_path, monkeypatch, capsys):
    """The robustness report of the README's promise: the gain of each run from its metrics, and the
    worst one (what the README may promise), from runs already on disk (`--collect`)."""
    spec = importlib.util.spec_from_file_location("main_job_spread", SCRIPT.parent / "main_job_spread.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, (before, after) in {"best_s0": (0.30, 0.55), "default_s0": (0.40, 0.80)}.items():
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        rows = [
            {"step": 0, "eval/accuracy": before},
            {"step": 5, "loss": 1.0},
            {"step": 10, "eval/accuracy": after},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "sft_metrics.jsonl").write_text('{"sft_step": 1}\n{"sft_step": 2}\n')
    out = tmp_path / "spread.json"
    argv = ["x", "--collect", "--runs", str(tmp_path / "runs"), "--out", str(out), "--seeds", "0"]
    monkeypatch.setattr("sys.argv", [*argv, "--isa", "best", "default"])
    assert module.main() == 0
    result = json.loads(out.read_text())
    assert result["summary"]["worst_gain_points"] == 25.0 and result["summary"]["runs"] == 2
    assert result["runs"]["default_s0"]["gain_points"] == 40.0
    assert result["runs"]["best_s0"]["sft_steps_taken"] == 2


def _gpu_vs_trl():
    spec = importlib.util.spec_from_file_location("gpu_vs_trl", SCRIPT.parent / "gpu_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_gpu_vs_trl_smoke(result: dict, checkpointing: bool) -> None:
    """benchmarks/gpu_vs_trl.py --smoke's result: both trainers, each in its own process, on a tiny
    Llama with tied embeddings and 2 KV heads (V = 512) on the CPU; every completion has the full 16
    tokens (EOS cannot be drawn), and the result has both sides' times and memory. With
    --gradient-checkpointing, both trainers checkpoint."""
    module = _gpu_vs_trl()
    assert result["settings"]["gradient_checkpointing"] is checkpointing
    assert result["work"] == "2 prompts x 4 completions x 16 tokens, prompts of 8 tokens"
    assert result["model"]["vocab"] == 512 and result["model"]["shape"]["kv_heads"] == 2
    assert result["model"]["eos_logit_margin"] > module.FLOAT32_UNDERFLOW_MARGIN
    assert result["all_completions_full_length"]
    for side in ("grpokit", "trl"):
        assert result[side]["step_time"]["n"] == 2 and result[side]["step_time"]["median"] > 0
        assert result[side]["completion_mean_length"] == [16.0, 16.0, 16.0]
        assert result[side]["peak_rss_bytes"] > 0
    assert result["step_time_ratio"] > 0 and result["peak_memory_measure"] == "peak_rss_bytes"
    phases = result["grpokit"]["phases"]  # the step split as TRL-like timing/* names
    assert set(phases) == {"timing/sampling", "timing/scoring", "timing/reference", "timing/update"}
    assert sum(p["median"] for p in phases.values()) <= result["grpokit"]["own_step_time"]["max"]
    assert result["machine"]["device"] == "cpu" and result["machine"]["trl"] == "1.16.0"
    assert result["markdown_row"].startswith("| 2 prompts x 4 completions x 16 tokens")


@pytest.mark.slow
def test_gpu_vs_trl_script_runs_its_smoke_mode_on_the_cpu_with_gradient_checkpointing(tmp_path):
    """gpu_vs_trl.py --smoke --gradient-checkpointing (without it, the same smoke run is gpu_check's
    vs_trl part: test_gpu_check_smoke_runs_every_part_on_the_cpu checks its result the same way)."""
    out = tmp_path / "result.json"
    assert _gpu_vs_trl().main(["--smoke", "--out", str(out), "--gradient-checkpointing"]) == 0
    _check_gpu_vs_trl_smoke(json.loads(out.read_text()), checkpointing=True)


def test_gpu_vs_trl_script_needs_cuda_or_smoke(monkeypatch, capsys):
    import torch

    module = _gpu_vs_trl()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert module.main([]) == 2
    assert "--smoke" in capsys.readouterr().err
    # steps end at 0, 1, 3 and 6 s: step 2 took 1 s (warm-up), steps 3 and 4 took 2 and 3 s
    assert module.step_times([0.0, 1.0, 3.0, 6.0], warmup=2) == [2.0, 3.0]


def test_decode_loops_script_runs_on_a_tiny_model(tmp_path):
    """benchmarks/decode_loops.py on the tiny setup: every loop and generate timed on the same work, the
    ratios taken against the eager loop and generate (compiled left out here: it compiles for seconds,
    and tests/rollout/test_static_decode.py covers it)."""
    spec = importlib.util.spec_from_file_location("decode_loops", SCRIPT.parent / "decode_loops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "loops.json"
    assert (
        module.main(["--setup", "tiny", "--loops", "eager,static", "--repeats", "1", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["rows"] == 32 and set(run["loops"]) == {"eager", "static", "generate"}
    assert run["loops"]["eager"]["vs_eager"] == 1.0 and run["loops"]["generate"]["vs_generate"] == 1.0
    assert all(v["tokens_per_s"] > 0 and "weight_read_floor_fraction" not in v for v in run["loops"].values())


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT.parent / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_reads_pytest_counts_and_judges_goals():
    """The pytest summary line and FAILED lines become counts and names; a goal is met, missed, or
    None when its part did not report the figure (never met by default)."""
    module = _gpu_check()
    text = "FAILED tests/gpu/test_gpu.py::test_a - boom\n=== 1 failed, 9 passed, 2 skipped in 55.6s ==="
    assert module.summarise_pytest(text) == {
        "passed": 9, "failed": 1, "skipped": 2, "failures": ["tests/gpu/test_gpu.py::test_a"],
    }  # fmt: skip
    stopped = (  # `-v` lines of a run stopped at its budget: no closing line
        "tests/gpu/test_gpu.py::test_a PASSED [  7%]\n"
        "tests/gpu/test_gpu.py::test_b[cuda-cpu] FAILED [ 14%]\n"
        "tests/gpu/test_gpu.py::test_c SKIPPED (needs two GPUs) [ 21%]\n"
        "tests/gpu/test_gpu.py::test_d PASSED [ 28%]"
    )
    assert module.summarise_pytest(stopped) == {
        "passed": 2, "failed": 1, "skipped": 1, "failures": ["tests/gpu/test_gpu.py::test_b[cuda-cpu]"],
    }  # fmt: skip
    goals = module._goals({"vs_trl": {"step_time_ratio": 0.1, "peak_memory_ratio": 0.95}})
    assert goals["step_time_vs_trl_at_most_0.1"]["met"] is True  # the bound itself meets it
    assert goals["peak_memory_vs_trl_at_most_0.6"]["met"] is False
    assert goals["compiled_update_mfu_at_least_0.30"] == {"value": None, "bound": ">= 0.3", "met": None}
    assert goals["bf16_reward_rises"]["met"] is None  # the part did not run: never met by default


def test_gpu_check_runs_parts_in_priority_order_and_skips_what_the_deadline_cannot_hold():
    """Issue 55's order (the correctness checks, then the figures it asks for first); under a
    deadline a part starts only when its whole budget fits what is left, and a later, shorter part
    still may."""
    module = _gpu_check()
    commands, _ = module._parts(False, Path("/nonexistent"), None)
    assert list(commands) == [
        "pytest_gpu",
        "train_bf16",
        "compiled",
        "vs_trl",
        "decode",
        "gsm8k",
        "throughput",
    ]
    assert list(module.BUDGETS) == list(commands)
    assert module.plan_budget("decode", False, None) == module.BUDGETS["decode"]  # no deadline
    assert module.plan_budget("decode", False, module.BUDGETS["decode"]) == module.BUDGETS["decode"]
    assert module.plan_budget("decode", False, module.BUDGETS["decode"] - 1) is None
    assert (
        module.plan_budget("throughput", False, module.BUDGETS["decode"] - 1) == module.BUDGETS["throughput"]
    )
    assert module.plan_budget("decode", True, 5.0) is None  # the smoke guard is a budget too


def test_gpu_check_reports_a_part_the_deadline_left_out(tmp_path, monkeypatch):
    """A check whose deadline holds no part runs none, writes every part as not reached, judges no
    goal, and fails; the file is written though nothing ran."""
    module = _gpu_check()
    monkeypatch.setattr(module, "run_part", lambda *a: pytest.fail("no part fits a 1 s deadline"))
    out = tmp_path / "check.json"
    assert module.main(["--deadline", "1", "--only", "decode,throughput", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert list(result["parts"]) == ["decode", "throughput"] and result["deadline_s"] == 1
    assert all(part["not_reached"] and not part["ok"] for part in result["parts"].values())
    assert "its 160 s budget did not fit" in result["parts"]["decode"]["error"]
    assert all(goal["met"] is None for goal in result["goals"].values())


def test_device_wheels_cover_what_grpokit_and_trl_need():
    """Every distribution grpokit's runtime requirements and trl's pull in, at any depth (markers read
    for the lent machine's Python 3.12 on Linux), is either carried as a wheel or in the machine's
    image: a new dependency fails here, not in the middle of a GPU lease."""
    from importlib import metadata

    from packaging.requirements import Requirement

    spec = importlib.util.spec_from_file_location("device_wheels", SCRIPT.parent / "device_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    machine = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython",
               "extra": ""}  # fmt: skip

    def name(text: str) -> str:
        return text.lower().replace("_", "-").replace(".", "-")

    runtime = [r for r in metadata.requires("grpokit") if "extra ==" not in r]
    todo, needed = [Requirement(r) for r in [*runtime, "trl"]], set()
    while todo:
        requirement = todo.pop()
        if name(requirement.name) in needed or (
            requirement.marker and not requirement.marker.evaluate(machine)
        ):
            continue
        needed.add(name(requirement.name))
        todo += [Requirement(r) for r in metadata.requires(requirement.name) or []]
    carried, present = set(module.CARRIED), set(module.ON_THE_MACHINE)
    assert not carried & present
    assert needed - carried - present == set()
    assert carried <= needed  # nothing carried for nothing


@pytest.mark.slow  # seconds in a subprocess: the full suite runs it, the fast tier stays under 90 s
def test_gpu_check_stops_a_part_at_its_budget_with_its_output(tmp_path):
    """A part over its budget is killed with the processes it started, and its last lines are kept."""
    import sys

    module = _gpu_check()
    script = "import subprocess, sys, time; print('started', flush=True); time.sleep(30)"
    part = module.run_part("train_bf16", [sys.executable, "-c", script], 2, tmp_path / "none.json")
    assert part["ok"] is False and part["error"] == "over its budget of 2 s"
    assert part["output_tail"] == "started" and part["seconds"] < 10
    # a part read from its output keeps the verdicts it printed before its budget
    line = "print('tests/gpu/test_gpu.py::test_a PASSED [ 7%]', flush=True)"
    argv = [sys.executable, "-c", f"import time; {line}; time.sleep(30)"]
    part = module.run_part("pytest_gpu", argv, 2, None)
    assert part["ok"] is False and (part["passed"], part["failed"]) == (1, 0)


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_part_on_the_cpu(tmp_path):
    """`--smoke`: every part runs at toy size on the CPU and reports its figures; the bf16 run's
    reward rises (a CPU fact here, checked on a GPU by the real run). The vs_trl part is
    `gpu_vs_trl.py --smoke` itself: its own JSON (kept with --work) is checked in full here, so that
    the suite runs that smoke comparison once."""
    out, work = tmp_path / "check.json", tmp_path / "parts"
    assert _gpu_check().main(["--smoke", "--out", str(out), "--work", str(work)]) == 0
    _check_gpu_vs_trl_smoke(json.loads((work / "vs_trl.json").read_text()), checkpointing=False)
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["machine"]["device"] == "cpu"
    assert list(result["parts"]) == list(_gpu_check().BUDGETS)  # every part, in priority order
    assert all(part["ok"] for part in result["parts"].values()), result["parts"]
    compiled = result["parts"]["compiled"]  # the compiled passes timed; no MFU on a CPU
    assert compiled["update_s"] > 0 and compiled["reference_s"] > 0 and compiled["update_mfu"] is None
    assert json.loads((work / "compiled.json").read_text())["torch_compile"] is True
    assert result["parts"]["pytest_gpu"]["passed"] == 0  # no CUDA here: the GPU tests skip
    assert result["parts"]["decode"]["best_tokens_per_s_8"] > 0
    assert result["goals"]["bf16_reward_rises"]["met"] is True
    # the gsm8k part is `gsm8k_gpu.py --smoke`: the tiny Qwen under the hub id
    # Qwen/Qwen2.5-0.5B-Instruct in a cache made by the script, a GSM8K-like dataset in hub layout,
    # `grpokit train gsm8k` offline for 2 steps; the figures come from the run's metrics
    gsm8k = json.loads((work / "gsm8k.json").read_text())
    assert gsm8k["exit_code"] == 0 and gsm8k["steps"] == 2
    assert gsm8k["step_time_s"] > 0 and gsm8k["completion_tokens_per_s"] > 0
    assert set(gsm8k["timing_s"]) == {"sampling", "scoring", "reference", "update"}
    assert gsm8k["peak_gpu_memory_gib"] is None and gsm8k["device"] == "cpu"  # no GPU memory on a CPU
    assert result["parts"]["gsm8k"]["steps"] == 2 and result["parts"]["gsm8k"]["peak_memory_gib"] is None


@pytest.mark.slow  # seconds in a subprocess: the full suite runs it, the fast tier stays under 90 s
def test_packed_pass_benchmark_runs_and_records_the_auto_choice(tmp_path):
    """benchmarks/packed_pass.py on its first case (no padding): every route timed, the token counts
    by hand, and the auto rule declines to pack a batch without padding."""
    spec = importlib.util.spec_from_file_location("packed_pass", SCRIPT.parent / "packed_pass.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "packed.json"
    assert module.main(["--cases", "1", "--repeats", "1", "--out", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert set(case["median_s"]) == {"shared", "padded", "padding_free"}
    assert all(t > 0 for t in case["median_s"].values())
    shared = 2 * 32 + 16 * 128  # each prompt once, completions padded to T (none are shorter here)
    assert case["tokens"] == {"shared": shared, "padded": 16 * 160, "padding_free": shared}
    assert case["real_completion_share"] == 1.0 and case["auto_takes_padding_free"] is False


def test_memory_metrics_describe_only_a_gpu():
    import torch

    from grpokit.models import memory_metrics

    assert memory_metrics(torch.device("cpu")) == {}


@pytest.mark.slow
def test_doctor_memory_script_runs_its_smoke_size(tmp_path):
    """benchmarks/doctor_memory.py --smoke: a tiny Llama (V = 512) through two GRPO steps in a fresh
    process; the row has the forecast's parts, the baseline it was given and the measured peak, and
    the script's verdict is the 25% bound on their ratio."""
    spec = importlib.util.spec_from_file_location("doctor_memory", SCRIPT.parent / "doctor_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "doctor_memory.json"
    code = module.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["size"] == "smoke" and row["vocab"] == 512
    assert row["forecast_parts"]["baseline"] == row["baseline_bytes"] > 0
    assert row["forecast_bytes"] == row["forecast_parts"]["total"]
    assert row["measured_peak_rss_bytes"] >= row["measured_peak_rss_step1_bytes"] > row["baseline_bytes"]
    assert row["ratio"] == row["forecast_bytes"] / row["measured_peak_rss_bytes"]
    within = abs(row["ratio"] - 1) <= module.BOUND
    assert result["all_within_bound"] is within and code == (0 if within else 1)


@pytest.mark.slow
def test_distillation_demo_runs_its_smoke_size(tmp_path):
    """benchmarks/opd_demo.py --smoke --loss-type gkd: a 3-step teacher, then one seed of GRPO alone and
    of GKD from that teacher through the command line, 2 steps each; the JSON names the loss and its
    settings, and the GKD run logged the divergence to the teacher (finite) and which steps were on-policy."""
    script = SCRIPT.parent / "opd_demo.py"
    out, work = tmp_path / "demo.json", tmp_path / "work"
    args = ["--smoke", "--loss-type", "gkd", "--lmbda", "0.5", "--work", str(work), "--out", str(out)]
    subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["loss_type"] == "gkd" and result["lmbda"] == 0.5 and result["distill_coef"] is None
    (row,) = result["seeds"]
    assert row["seed"] == 1 and row["gkd"]["steps"] == row["grpo"]["steps"] == 2
    assert result["teacher"] == str(work / "teacher" / "checkpoint-3")
    steps = read_steps(work / "gkd-1")
    assert len(steps) == 2 and all(math.isfinite(r["distill/divergence"]) for r in steps)
    assert {r["distill/on_policy"] for r in steps} <= {0.0, 1.0}


def test_checkpointing_benchmark_measures_what_the_forward_keeps(tmp_path):
    """benchmarks/checkpointing.py --smoke: the bytes the training forward keeps, with and without
    activation checkpointing, equal the forecast's to 1 KiB (token ids), and checkpointing keeps less."""
    spec = importlib.util.spec_from_file_location("checkpointing_bench", SCRIPT.parent / "checkpointing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "result.json"
    assert module.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for side in ("off", "on"):
        assert abs(result[side]["kept_bytes"] - result[side]["forecast_kept_bytes"]) <= 1024, result[side]
        assert result[side]["forward_backward_s"]["median"] > 0
    assert result["on"]["gradient_checkpointing"] and result["kept_ratio"] < 0.5


@pytest.mark.slow  # three profiled model builds, one compiled (about 30 s)
def test_launches_counts_each_pieces_operator_calls(tmp_path):
    """benchmarks/launches.py (issue 53): the update micro-batch (forward, loss, backward) makes more
    operator calls than the reference pass (a forward), both grow with the layers, and the compiled
    passes make fewer calls than the eager ones, in all and from the top level."""
    spec = importlib.util.spec_from_file_location("launches", SCRIPT.parent / "launches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    counts = {}
    for layers, mode in ((1, "both"), (2, "eager")):
        out = tmp_path / f"launches-{layers}.json"
        argv = ["--layers", str(layers), "--rows", "8", "--tokens", "4", "--mode", mode, "--out", str(out)]
        assert module.main(argv) == 0
        counts[layers] = json.loads(out.read_text())
    eager = {layers: result["eager"] for layers, result in counts.items()}
    for layers, result in eager.items():
        assert result["update_micro_batch"]["calls"] > result["reference_pass"]["calls"] > 0, layers
    for piece in ("update_micro_batch", "reference_pass"):
        assert eager[2][piece]["calls"] > eager[1][piece]["calls"]
        compiled = counts[1]["compiled"][piece]
        for key in ("calls", "top_level", "kernels"):
            assert 0 < compiled[key] < eager[1][piece][key], (piece, key)
            assert counts[1]["compiled_over_eager"][piece][key] == round(
                compiled[key] / eager[1][piece][key], 3
            )


def test_length_bias_warm_start_never_learns_a_held_out_prompt(tmp_path):
    """The task's held-out prompts are its first num_eval_prompts rows: a warm start built with fewer
    (it once was, with 2) learns worked solutions of prompts the later runs hold out, and their held-out
    accuracy starts inflated. The warm start's training rows and the runs' held-out rows are disjoint."""
    from grpokit.data import get_task

    spec = importlib.util.spec_from_file_location("length_bias", SCRIPT.parent / "length_bias.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    warm = module.warm_config(3, tmp_path)
    run = module.preset_config(3, tmp_path / "run", loss_type="grpo", sft_steps=0, max_steps=100)
    assert warm.sft_steps > 0 and warm.task == run.task == "chain"
    trained = {r["prompt"] for r in get_task("chain", seed=warm.seed, num_eval=warm.num_eval_prompts).train}
    held_out = {r["prompt"] for r in get_task("chain", seed=run.seed, num_eval=run.num_eval_prompts).eval}
    assert len(held_out) == run.num_eval_prompts and not trained & held_out


def test_length_bias_summarises_each_loss_over_its_first_and_last_steps(tmp_path):
    """benchmarks/length_bias.py's table from runs on record (`--plot-only`): the first and last windows'
    mean lengths (NaN steps, with no right or no wrong completion, skipped), the drift of the wrong
    completions' length per seed, and the held-out accuracy before and after, averaged over seeds."""
    spec = importlib.util.spec_from_file_location("length_bias", SCRIPT.parent / "length_bias.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(wrong: list, right: list, share: list, evals: list) -> dict:
        return {
            "completions/incorrect_mean_length": wrong,
            "completions/correct_mean_length": right,
            "completions/correct_ratio": share,
            "eval": evals,
            "eval_lengths": [],
            "seconds": 1.0,
        }

    results = {
        "steps": 4,
        "runs": {
            "grpo": {
                "1": run([50, 60, 80, 90], [40, None, 40, 40], [0.1, 0.0, 0.3, 0.5], [(0, 0.2), (4, 0.4)]),
                "2": run([50, 50, 70, 70], [30, 30, 30, 30], [0.2, 0.2, 0.4, 0.4], [(0, 0.3), (4, 0.5)]),
            },
            "dr_grpo": {
                "1": run([50, 50, 50, 50], [40, 40, 40, 40], [0.1, 0.1, 0.1, 0.1], [(0, 0.2), (4, 0.2)]),
                "2": run([60, 60, 60, 60], [40, 40, 40, 40], [0.1, 0.1, 0.1, 0.1], [(0, 0.3), (4, 0.3)]),
            },
        },
    }
    out = tmp_path / "length_bias.json"
    out.write_text(json.dumps(results))
    table = module.summary(results, width=2)
    assert table["grpo"]["wrong_length_drift_per_seed"] == [30.0, 20.0]  # (80+90)/2-(50+60)/2; 70-50
    assert table["grpo"]["completions/incorrect_mean_length"] == [52.5, 77.5]
    assert table["grpo"]["completions/correct_mean_length"] == [35.0, 35.0]  # seed 1's None skipped: 40
    assert table["grpo"]["eval_accuracy"] == pytest.approx([0.25, 0.45])
    assert table["dr_grpo"]["wrong_length_drift_per_seed"] == [0.0, 0.0]
    text = module.markdown(table, 2)
    assert "| grpo | 35.0 → 35.0 | 52.5 → 77.5 | +30.0, +20.0 | nan → nan |" in text  # (no completions kept)
    assert "| 0.12 → 0.40 | 25.0% → 45.0% |" in text
    figure = tmp_path / "length_bias.png"
    argv = ["x", "--plot-only", "--out", str(out), "--figure", str(figure), "--window", "2"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", argv)
        assert module.main() == 0
    assert figure.stat().st_size > 10_000 and "summary" in json.loads(out.read_text())
    # a step's completions: the wrong ones' length beyond the solution in the style each chose
    prompts = ["1+2+3=", "1+2+3=", "4+5+6=", "4+5+6="]
    completions = ["1+2=3,3+3=6;6", "+2=3,+3=6,+9=15;15", "+5=9,+6=15;15", "4+5=9;9"]
    figures = module.completion_figures(prompts, completions, [1.0, 0.0, 1.0, 0.0])
    # wrong: a short one 7 characters past "+2=3,+3=6;6" (18 against 11) and a full one that stopped 8
    # short of "4+5=9,9+6=15;15" (7 against 15): (7 - 8) / 2
    assert figures == {"wrong_excess": -0.5, "wrong_terms": 3.0, "short_style": 0.5}
