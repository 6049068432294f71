"""Data-parallel and FSDP2 training on CPU (gloo), 2 processes under torchrun against 1 process.

One optimizer update on a fixed global batch must give the same gradients and the same parameters
whatever the world size: the normalisers are global (dapo's token count across ranks), per-batch
means average correctly, and the reward model's Bradley–Terry mean too. The worker computes in
float64, so the tolerances below follow from float64 round-off, not from this machine. A 2-process run that is
resumed from a checkpoint must end where an uninterrupted 2-process run ends.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_MODEL, read_metrics, read_steps, tiny_run

WORKER = Path(__file__).parent / "worker.py"
ROOT = Path(__file__).resolve().parents[2]


def torchrun(
    nproc: int, *args: str, timeout: int = 300, fresh: Path | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC ARGS`; asserts it succeeded, showing what it
    printed. A rank killed by a signal in native code (SIGABRT or SIGSEGV from the transport, with no
    Python error of ours: seen once in CI, a gloo pair reset, never reproduced on this machine) is
    started again once, with a warning that carries what the first launch printed: a defect of
    grpokit's raises a Python error (never retried) or happens again. `fresh`: a directory the command
    creates, removed before that second start (a resumed run's directory is resumed again instead)."""
    # no GPU for the ranks: these runs are gloo on the CPU by design (float64 parity), and on a machine
    # with one GPU two ranks must not both start NCCL on it (the commands also get device=cpu).
    # PYTHONFAULTHANDLER: a rank that dies in native code prints its threads' Python stacks first.
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONFAULTHANDLER": "1",
    }
    # --standalone: torchrun picks a free local port itself (no race between choosing and binding)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *args,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if result.returncode != 0 and _died_in_native_code(result.stderr):
        first = _shown(result)
        warnings.warn(f"a rank died in native code; started again once. It printed:\n{first}", stacklevel=2)
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, _shown(result)
    return result


def _died_in_native_code(stderr: str) -> bool:
    """torchrun's first observed failure is a rank ended by SIGABRT or SIGSEGV, and the only Python
    errors the ranks raised are the transport's (the other ranks losing their connection to it)."""
    _, found, root = stderr.rpartition("Root Cause (first observed failure)")
    by_signal = bool(found) and re.search(r"exitcode\s*: -(6|11) ", root) is not None
    errors = re.findall(r"^\[rank\d+\]: (\w+(?:Error|Exception).*)$", stderr, flags=re.MULTILINE)
    return by_signal and all("gloo" in e or "Connection" in e for e in errors)


def _shown(result: subprocess.CompletedProcess) -> str:
    """What a failed launch printed, kept short: rank 0's first lines (the cause, when rank 0 failed
    first, is often at the top, above the other ranks' connection errors) and the last lines."""
    text = result.stderr
    return text if len(text) <= 6000 else f"{text[:3000]}\n[…]\n{text[-3000:]}"


# what torchrun printed when rank 0 died in gloo in CI (2026-11-28), cut to its telling lines
_NATIVE = """[rank1]:   File "/usr/lib/python3.11/site-packages/torch/_ops.py", line 882, in redispatch
[rank1]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6068: Connection reset
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 26249)  (SIGABRT)
"""


def test_only_a_rank_dead_in_native_code_is_started_again():
    assert _died_in_native_code(_NATIVE)
    ours = _NATIVE.replace(
        "[rank1]: RuntimeError", "[rank0]: ValueError: loss_type 'x' unknown\n[rank1]: RuntimeError"
    )
    assert not _died_in_native_code(ours)  # a Python error of ours is a failure, never retried
    assert not _died_in_native_code(_NATIVE.replace("-6 (pid", "1 (pid"))  # an exit, not a signal
    assert not _died_in_native_code(_NATIVE.replace("Root Cause", "Cause"))  # no root cause: not torchrun's


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    out = tmp_path_factory.mktemp("updates")
    torchrun(1, str(WORKER), str(out))
    torchrun(2, str(WORKER), str(out))
    return out


LOSSES = ("dapo", "grpo", "dr_grpo", "gkd")  # gkd: the divergence to fixed teacher logits, its own normaliser
CASES = [f"grpo-{loss}-{strategy}" for strategy in ("ddp", "fsdp") for loss in LOSSES]
CASES += ["reward-ddp", "reward-fsdp", "grpo-dapo-fsdp_offload"]


# Tolerances, derived. Two world sizes sum the same terms in a different order: float64 round-off,
# n·2.2e-16 of the summed magnitudes for n terms (n is in the hundreds here), so gradients must agree
# to GRAD_RTOL of each tensor's largest entry on any CPU (measured: 4e-16). Gradients are compared
# before AdamW touches them: its first step, lr·g/(|g| + eps), is blind to a scale error in g (a
# wrong normaliser) and magnifies an error δ in a near-zero gradient up to lr·δ/eps; that bound, from
# GRAD_RTOL, is the tolerance on the weights (measured: 6e-14).
GRAD_RTOL = 1e-12
LEARNING_RATE, ADAM_EPS = 1e-2, 1e-8  # as in worker.py


@pytest.mark.slow
@pytest.mark.xdist_group("updates")  # the module's two torchrun launches, made once
@pytest.mark.parametrize("case", CASES)
def test_one_update_is_the_same_on_one_and_two_processes(updates, case):
    one, two = torch.load(updates / f"{case}-ws1.pt"), torch.load(updates / f"{case}-ws2.pt")
    assert one["grads"].keys() == two["grads"].keys() and one["weights"].keys() == two["weights"].keys()
    assert next(iter(one["grads"].values())).dtype == torch.float64
    largest = max(g.abs().max().item() for g in one["grads"].values())
    assert largest > 1e-3  # the update is not trivial
    for name, g in one["grads"].items():
        scale = g.abs().max().item()
        torch.testing.assert_close(two["grads"][name], g, rtol=0, atol=GRAD_RTOL * scale, msg=name)
    weight_atol = LEARNING_RATE * GRAD_RTOL * largest / ADAM_EPS
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=0, atol=weight_atol, msg=name)
    if case.startswith("grpo"):  # the weights moved far more than the tolerance
        initial = torch.load(updates / "initial.pt")
        moved = max((one["weights"][k] - initial[k]).abs().max().item() for k in one["weights"])
        assert moved > 1e-3


@pytest.mark.slow
@pytest.mark.xdist_group("updates")
def test_fsdp_cpu_offload_trains(updates):
    """With fsdp_cpu_offload the 2-process update still equals the 1-process one (see above)."""
    test_one_update_is_the_same_on_one_and_two_processes(updates, "grpo-dapo-fsdp_offload")


def _stopped_after_step_2(straight: Path, stopped: Path) -> Path:
    """`straight` (a finished 4-step run with a checkpoint every 2 steps) as a process killed after
    its step-2 checkpoint would leave it: the same directory without checkpoint-4. A resume continues
    from checkpoint-2 and drops the metric rows written after it, so the resumed steps 3-4 must end
    where the uninterrupted run did. (One run fewer than stopping a 2-step run and resuming it: each
    torchrun start costs two interpreters importing torch and transformers.)"""
    shutil.copytree(straight, stopped)
    shutil.rmtree(stopped / "checkpoint-4")
    assert (stopped / "checkpoint-2").is_dir()
    return stopped


def _train(nproc: int, out: Path, *overrides: str) -> None:
    # the tiny run at the preset's completion length, with a reference (beta) and a checkpoint every 2 steps
    tiny = tiny_run(
        "max_completion_length", device="cpu", lr_scheduler_type="constant", beta=0.04, save_steps=2
    )
    fresh = None if "resume=true" in overrides else out  # (a resumed run is resumed again)
    torchrun(nproc, "-m", "grpokit", "train", f"output_dir={out}", *tiny, *overrides, fresh=fresh)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_run_stopped_and_resumed_matches_an_uninterrupted_one(tmp_path, strategy):
    from safetensors.torch import load_file

    _train(2, tmp_path / "straight", "max_steps=4", f"strategy={strategy}")
    _stopped_after_step_2(tmp_path / "straight", tmp_path / "stopped")
    _train(2, tmp_path / "stopped", "max_steps=4", f"strategy={strategy}", "resume=true")
    a = load_file(tmp_path / "straight" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "stopped" / "checkpoint-4" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    assert [r["step"] for r in read_steps(tmp_path / "stopped")] == [1, 2, 3, 4]  # none lost or doubled
    if strategy == "fsdp":
        assert (tmp_path / "straight" / "checkpoint-4" / "dcp" / "rank-1.safetensors").is_file()
    # the runtime invariants hold at world size 2: the loss normaliser's total weight over both ranks
    # and all micro-batches is what one process gives the whole batch (issue 26)
    rows = read_steps(tmp_path / "straight")
    assert len(rows) == 4
    for row in rows:
        assert abs(row["invariants/loss_weight_error"]) <= 1e-6
        assert row["invariants/groups_intact"] == 1.0
    assert rows[0]["invariants/kl_at_start_max"] <= 1e-5  # beta=0.04: the reference is the start
    assert not (tmp_path / "straight" / "alerts.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_reward_training_runs_under_torchrun_and_resumes(tmp_path, strategy):
    from safetensors.torch import load_file

    tiny = [
        "device=cpu",
        *TINY_MODEL,
        "batch_size=8",
        "micro_batch_size=4",
        "num_eval_pairs=8",
        "eval_steps=0",
        "progress=false",
        "lr_scheduler_type=constant",
        "save_steps=2",
        f"strategy={strategy}",
        "max_length=32",
    ]
    torchrun(
        2,
        "-m",
        "grpokit",
        "reward",
        f"output_dir={tmp_path / 'a'}",
        "max_steps=4",
        *tiny,
        fresh=tmp_path / "a",
    )
    _stopped_after_step_2(tmp_path / "a", tmp_path / "b")
    torchrun(
        2, "-m", "grpokit", "reward", f"output_dir={tmp_path / 'b'}", "max_steps=4", "resume=true", *tiny
    )
    a = load_file(tmp_path / "a" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "b" / "checkpoint-4" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    for run in ("a", "b"):  # one writer (rank 0); the resumed run dropped and rewrote steps 3-4
        assert [r["step"] for r in read_steps(tmp_path / run)] == [1, 2, 3, 4], run


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_multi_turn_episodes_under_torchrun_resume_exactly(tmp_path, strategy):
    """tool_addition's episodes on 2 ranks (under FSDP every forward of the turn loop in lockstep):
    stopped after 2 steps and resumed, the run ends where an uninterrupted one does."""
    from safetensors.torch import load_file

    episodes = ["task=tool_addition", "max_completion_length=null", "max_turns=3", f"strategy={strategy}"]
    _train(2, tmp_path / "straight", "max_steps=4", *episodes)
    _stopped_after_step_2(tmp_path / "straight", tmp_path / "stopped")
    _train(2, tmp_path / "stopped", "max_steps=4", "resume=true", *episodes)
    a = load_file(tmp_path / "straight" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "stopped" / "checkpoint-4" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    assert any("env/turns" in row for row in read_metrics(tmp_path / "straight"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_grpo_under_torchrun_resumes_exactly(tmp_path, strategy):
    """max_staleness=1 on 2 ranks: a rollout worker per rank samples and scores the rank's share of
    each batch, rank 0 publishes each version (gathered from the shards under FSDP). Stopped after step
    2 (checkpoint-2 holds both ranks' batch of step 3, in flight) and resumed, the run ends where the
    uninterrupted one ends, bit for bit; every batch after the first is exactly one version old."""
    from safetensors.torch import load_file

    options = ["max_steps=4", f"strategy={strategy}", "max_staleness=1"]
    _train(2, tmp_path / "straight", *options)
    _stopped_after_step_2(tmp_path / "straight", tmp_path / "stopped")
    _train(2, tmp_path / "stopped", *options, "resume=true")
    a = load_file(tmp_path / "straight" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "stopped" / "checkpoint-4" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    for run in ("straight", "stopped"):
        rows = read_steps(tmp_path / run)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert [r["async/weight_version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
        assert all(r["invariants/groups_intact"] == 1.0 for r in rows)
    assert not (tmp_path / "straight" / ".rollout").exists()  # the weight files removed at the end
