"""Running out of device memory (torch.OutOfMemoryError, a GPU user's most common fault) loses the current
step only: the step is dropped, the state after the step before is saved when none of the step's
updates had been applied, the user gets one line naming the phase, the setting to change and where the
run stands, and resume=true with that setting continues the run (micro_batch_size applies on resume).
With auto_find_batch_size the step is redone from the completions it drew, with half the micro-batch.
The error is raised here on the CPU by the functions that would raise it on a GPU. The runs learn
(a reward with spread, so the weights move every step): a wrong restore or redo changes the weights."""

from __future__ import annotations

import pytest
import torch

import grpokit.train.batch_source as batch_source_module
import grpokit.train.grpo_step as grpo_step_module
import grpokit.train.run as run_module
import grpokit.train.sft as sft_module
from grpokit.cli import main
from grpokit.train.grpo import train_grpo
from grpokit.train.grpo_step import OutOfDeviceMemory
from tests.helpers import read_steps

from .helpers import ones_reward, tiny_config, weights

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"


def _failing(monkeypatch, owner, name: str, at_call: int) -> list[int]:
    """`owner.name` raises torch.OutOfMemoryError on its `at_call`-th call (as a GPU allocator would);
    -> the call count, as it goes."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            torch.empty(1)  # (something was being allocated)
            raise torch.OutOfMemoryError(OOM + "\nmore lines of torch's advice")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def _train(tmp_path, **overrides):
    return train_grpo(tiny_config(tmp_path, **overrides), reward_funcs=[ones_reward])


def test_an_update_out_of_memory_saves_the_step_before_and_resume_redoes_it_exactly(tmp_path, monkeypatch):
    straight = _train(tmp_path / "a", max_steps=4)
    learned = read_steps(tmp_path / "a" / "run")
    assert all(r["grad_norm"] > 0 for r in learned) and len({r["reward"] for r in learned}) > 1
    with monkeypatch.context() as patch:
        _failing(patch, grpo_step_module, "optimizer_step", at_call=3)  # μ = 1: step 3's update
        with pytest.raises(OutOfDeviceMemory) as caught:
            _train(tmp_path / "b", max_steps=4)
    line = str(caught.value)
    assert line.startswith(f"out of device memory in the update of step 3 ({OOM}); set ")
    fixes = "micro_batch_size=4 or gradient_checkpointing=true or auto_find_batch_size=true"
    assert fixes + " (each applies on resume)" in line
    assert "checkpoint-2 holds the run up to step 2: resume=true continues it" in line
    assert "\n" not in line and "more lines" not in line
    out = tmp_path / "b" / "run"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert [r["step"] for r in read_steps(out)] == [1, 2]
    resumed = _train(tmp_path / "b", max_steps=4, resume=True)
    assert [r["reward"] for r in read_steps(out)] == [r["reward"] for r in learned]  # the same prompts drawn
    for name, tensor in weights(straight.output_dir).items():  # the fault cost step 3, nothing else
        assert torch.equal(tensor, weights(resumed.output_dir)[name]), name


def test_a_smaller_micro_batch_applies_on_resume(tmp_path, monkeypatch):
    """What the line advises: resume=true micro_batch_size=4 (from 8) is taken and said, not refused."""
    with monkeypatch.context() as patch:
        _failing(patch, grpo_step_module, "optimizer_step", at_call=3)
        with pytest.raises(OutOfDeviceMemory):
            _train(tmp_path, max_steps=3)
    events = []
    train_grpo(
        tiny_config(tmp_path, max_steps=3, resume=True, micro_batch_size=4),
        reward_funcs=[ones_reward],
        on_event=lambda kind, step, data: events.append((kind, data)),
    )
    notes = [d["message"] for k, d in events if k == "warning"]
    assert any(n.startswith("micro_batch_size: 8 in the checkpoint, 4 now (applied") for n in notes), notes
    assert [r["step"] for r in read_steps(tmp_path / "run")] == [1, 2, 3]


def test_sampling_out_of_memory_names_the_rollouts_settings(tmp_path, monkeypatch):
    _failing(monkeypatch, batch_source_module, "generate_and_score", at_call=2)
    with pytest.raises(OutOfDeviceMemory, match=r"in sampling of step 2 .*all 16 rows at once.*"
                       r"max_completion_length.*checkpoint-1 holds the run up to step 1"):  # fmt: skip
        _train(tmp_path, max_steps=3)
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-1"]


def test_out_of_memory_inside_the_optimizers_step_saves_nothing_half_updated(tmp_path, monkeypatch):
    """The weights may be half updated: no checkpoint of them; the latest saved one is named."""
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):  # the update is applied, then the allocator fails
        calls[0] += 1
        out = original(self, *args, **kwargs)
        if calls[0] == 3:
            raise torch.OutOfMemoryError(OOM)
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(
        OutOfDeviceMemory, match="checkpoint-2 is the latest checkpoint: resume=true continues"
    ):
        _train(tmp_path, max_steps=4, save_steps=1)
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_at_step_one_nothing_is_saved_and_the_same_command_starts_over(tmp_path, monkeypatch):
    cfg = dict(max_steps=2, micro_batch_size=1, gradient_checkpointing=True, eval_steps=1)
    with monkeypatch.context() as patch:
        _failing(patch, grpo_step_module, "optimizer_step", at_call=1)
        with pytest.raises(OutOfDeviceMemory, match="no step had finished: the same command starts over"):
            _train(tmp_path, **cfg)
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    _train(tmp_path, **cfg)  # as the line says: not refused as an earlier run
    assert [r["step"] for r in read_steps(tmp_path / "run")] == [1, 2]


def test_the_evaluation_out_of_memory_saves_the_step_it_followed(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        _failing(patch, run_module.Run, "evaluate_if_due", at_call=2)
        with pytest.raises(
            OutOfDeviceMemory, match="in the evaluation after step 2 .*checkpoint-2 holds the run"
        ):
            _train(tmp_path, max_steps=4, eval_steps=1)
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-2"]
    _train(tmp_path, max_steps=4, eval_steps=1, resume=True)
    assert [r["step"] for r in read_steps(tmp_path / "run")] == [1, 2, 3, 4]


def test_the_command_line_says_it_in_one_line(tmp_path, monkeypatch, capsys):
    _failing(monkeypatch, grpo_step_module, "optimizer_step", at_call=2)
    code = main(["train", "addition", f"output_dir={tmp_path / 'run'}", "max_steps=3", "sft_steps=0",
                 "progress=false", "prompts_per_step=4", "num_generations=4", "micro_batch_size=16",
                 "eval_steps=0", "device=cpu"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[0].startswith("grpokit train: error: out of device memory in the update of step 2")
    assert "micro_batch_size=8" in err[0] and err[1] == "(run with --debug for the traceback)"


def test_out_of_memory_outside_a_step_is_one_line_too(tmp_path, monkeypatch, capsys):
    """In the warm start (or anywhere else): the line names the settings, no traceback."""
    _failing(monkeypatch, sft_module, "sft_loss", at_call=1)
    code = main(["train", "addition", f"output_dir={tmp_path / 'run'}", "max_steps=1", "sft_steps=2",
                 "progress=false", "device=cpu"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 2
    assert err[0].startswith(f"grpokit train: error: out of device memory ({OOM}); lower micro_batch_size")


def test_auto_find_batch_size_redoes_the_step_from_its_completions_with_half_the_micro_batch(
    tmp_path, monkeypatch
):
    """TRL's auto_find_batch_size: the update of step 2 runs out of memory at micro-batch 8 and 4, then
    fits at 2; the step is redone from the batch it drew (sampled and scored once), so the run equals
    one at micro-batch 8 throughout to round-off, and every step is logged once."""
    straight = _train(tmp_path / "a", max_steps=3, micro_batch_size=8)
    sizes = []
    original = grpo_step_module.optimizer_step

    def update(engine, update, batch, frozen, params, d, look):
        sizes.append(params.spec.micro_batch_size)
        if len(sizes) in (2, 3):  # step 2's first two tries
            torch.empty(1)
            raise torch.OutOfMemoryError(OOM)
        return original(engine, update, batch, frozen, params, d, look)

    monkeypatch.setattr(grpo_step_module, "optimizer_step", update)
    draws = _failing(monkeypatch, batch_source_module, "generate_and_score", at_call=0)  # counts only
    events = []
    fitted = train_grpo(
        tiny_config(tmp_path / "b", max_steps=3, micro_batch_size=8, auto_find_batch_size=True),
        reward_funcs=[ones_reward],
        on_event=lambda kind, step, data: events.append((kind, step, data)),
    )
    assert sizes == [8, 8, 4, 2, 2] and draws == [3]  # one draw a step: the redos reuse step 2's
    said = [(step, d["message"]) for kind, step, d in events if kind == "warning"]
    redone = "out of device memory in step 2 at micro_batch_size={}: the step is redone from the completions "
    redone += "it drew, with "
    assert said == [(2, redone.format(8) + "micro_batch_size=4 (auto_find_batch_size)"),
                    (2, redone.format(4) + "micro_batch_size=2 (auto_find_batch_size)")]  # fmt: skip
    a, b = read_steps(tmp_path / "a" / "run"), read_steps(tmp_path / "b" / "run")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [r["reward"] for r in b] == [r["reward"] for r in a]  # the same completions every step
    for name, tensor in weights(straight.output_dir).items():
        # float32 sums over other micro-batches: round-off (a wrong redo moves them by the lr, 1e-2)
        torch.testing.assert_close(weights(fitted.output_dir)[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_auto_find_batch_size_does_not_redo_sampling(tmp_path, monkeypatch):
    _failing(monkeypatch, batch_source_module, "generate_and_score", at_call=2)
    with pytest.raises(OutOfDeviceMemory, match="in sampling of step 2"):
        _train(tmp_path, max_steps=3, auto_find_batch_size=True)
