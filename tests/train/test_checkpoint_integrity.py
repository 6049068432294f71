"""Checkpoint integrity: a damaged latest checkpoint falls back to the newest intact one, nothing a
checkpoint holds can run code on resume, a checkpoint of another model shape is one line, and a full
disk while saving keeps every earlier checkpoint."""

from __future__ import annotations

import errno
import json
import pickle
import shutil
import types
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.models import build_policy, load_policy
from grpokit.train import distributed
from grpokit.train.checkpoint import (
    MANIFEST,
    CheckpointError,
    SaveTo,
    checkpoint_problem,
    list_checkpoints,
    load_training_state,
    newest_intact_checkpoint,
    save_checkpoint,
    write_manifest,
)
from grpokit.train.grpo import train_grpo

from .helpers import ones_reward, tiny_config


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 3-step run with a checkpoint every step (save_total_limit=2 keeps 2 and 3)."""
    root = tmp_path_factory.mktemp("reference")
    train_grpo(tiny_config(root, max_steps=3, save_steps=1), reward_funcs=[ones_reward])
    return root / "run"


def assert_same_weights(a: Path, b: Path) -> None:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name  # bitwise: the CPU run is deterministic


def resume_with_events(tmp_path: Path, **overrides) -> list[tuple]:
    events: list[tuple] = []
    train_grpo(
        tiny_config(tmp_path, resume=True, **overrides),
        reward_funcs=[ones_reward],
        on_event=lambda *event: events.append(event),
    )
    return events


def warnings_naming(events: list[tuple], text: str) -> list[str]:
    return [data["message"] for kind, _, data in events if kind == "warning" and text in data["message"]]


# ----------------------------------------------------------------------------- fallback on resume


def test_a_truncated_latest_state_pt_resumes_from_the_checkpoint_before(tmp_path, reference):
    train_grpo(tiny_config(tmp_path, max_steps=3, save_steps=1), reward_funcs=[ones_reward])
    run = tmp_path / "run"
    state = run / "checkpoint-3" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # a crash or a full disk cut it short

    events = resume_with_events(tmp_path, max_steps=3, save_steps=1)

    assert [e[1] for e in events if e[0] == "resumed"] == [2]  # from checkpoint-2, step 3 run again
    (warning,) = warnings_naming(events, "checkpoint-3")  # one warning, naming the file and the fault
    assert "state.pt" in warning and "100 bytes" in warning and "checkpoint-2" in warning
    assert checkpoint_problem(run / "checkpoint-3") is None  # replaced by the new step 3
    assert_same_weights(run / "checkpoint-3", reference / "checkpoint-3")


def test_a_flipped_byte_in_the_latest_weights_resumes_from_the_checkpoint_before(tmp_path, reference):
    train_grpo(tiny_config(tmp_path, max_steps=3, save_steps=1), reward_funcs=[ones_reward])
    run = tmp_path / "run"
    weights = run / "checkpoint-3" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor: still a valid safetensors file
    weights.write_bytes(bytes(data))

    events = resume_with_events(tmp_path, max_steps=3, save_steps=1)

    assert [e[1] for e in events if e[0] == "resumed"] == [2]
    (warning,) = warnings_naming(events, "checkpoint-3")
    assert "model.safetensors" in warning and "SHA-256" in warning
    assert_same_weights(run / "checkpoint-3", reference / "checkpoint-3")


def test_when_every_checkpoint_is_damaged_resume_fails_with_one_line(tmp_path):
    train_grpo(tiny_config(tmp_path, max_steps=2, save_steps=1), reward_funcs=[ones_reward])
    run = tmp_path / "run"
    for checkpoint in list_checkpoints(run):
        (checkpoint / "state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as error:
        resume_with_events(tmp_path, max_steps=3, save_steps=1)
    message = str(error.value)
    assert isinstance(error.value, ValueError) and "\n" not in message  # the CLI prints it as one line
    assert "checkpoint-1: state.pt" in message and "checkpoint-2: state.pt" in message
    assert "output_dir" in message
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-1", "checkpoint-2"]  # nothing deleted


def test_resume_says_each_allowed_config_change_once_on_rank_0(reference):
    """latest_checkpoint asks its `compare` (the run's resume_changes) about the chosen checkpoint's
    config.yaml and says each of its notes once, as a warning, on rank 0 only (every rank calls it)."""
    from grpokit.config.plan import run_control
    from grpokit.train import run as run_module

    asked = []

    def changes(saved):
        asked.append(saved)
        return ["logging_steps changed from 1 to 5", "eval_steps changed from 0 to 2"]

    control = run_control(tiny_config(reference.parent, max_steps=3, resume=True))
    for rank, expected in ((0, 2), (1, 0)):
        events: list[tuple] = []
        d = distributed.Dist(rank=rank, world_size=2)
        found = run_module.latest_checkpoint(control, changes, d, lambda *e, events=events: events.append(e))
        assert found == reference / "checkpoint-3"
        messages = [data["message"] for kind, _, data in events if kind == "warning"]
        assert len(messages) == expected and all("changed from" in m for m in messages)
    assert asked == [reference / "checkpoint-3" / "config.yaml"] * 2


def fake_checkpoint(output_dir: Path, step: int, manifest: bool = True) -> Path:
    checkpoint = output_dir / f"checkpoint-{step}"
    (checkpoint / "dcp").mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"state" * 100)
    (checkpoint / "dcp" / "rank-0.safetensors").write_bytes(b"shard" * 100)
    if manifest:
        write_manifest(checkpoint)
    return checkpoint


def test_the_manifest_names_what_is_wrong_and_only_the_newest_intact_checkpoint_is_read(tmp_path):
    one, two, three = (fake_checkpoint(tmp_path, step) for step in (1, 2, 3))
    assert newest_intact_checkpoint(tmp_path) == (three, [])
    (three / "dcp" / "rank-0.safetensors").write_bytes(b"shard" * 99)  # a shard counts too
    (two / "state.pt").unlink()
    assert newest_intact_checkpoint(tmp_path) == (
        one,
        [
            "checkpoint-3: dcp/rank-0.safetensors has 495 bytes where manifest.json says 500",
            "checkpoint-2: state.pt is missing",
        ],
    )
    (one / MANIFEST).write_text("{not json")
    assert checkpoint_problem(one).startswith("manifest.json is unreadable")
    outside = {"format": 1, "files": {"../x": {"size": 1, "sha256": "0" * 64}}}
    (one / MANIFEST).write_text(json.dumps(outside))
    assert checkpoint_problem(one) == "manifest.json names a file outside the checkpoint (../x)"
    with pytest.raises(CheckpointError, match="no checkpoint in .* is intact"):
        newest_intact_checkpoint(tmp_path)


def test_a_checkpoint_without_a_manifest_is_taken_as_it_is(tmp_path):
    """Written by a grpokit before manifests: nothing to check it against, so it is used as before."""
    fake_checkpoint(tmp_path, 1)
    old = fake_checkpoint(tmp_path, 2, manifest=False)
    (old / "state.pt").write_bytes(b"anything")
    assert newest_intact_checkpoint(tmp_path) == (old, [])


# ----------------------------------------------------------------------------- nothing runs code


class _Payload:
    """Unpickling this creates `marker`: what a crafted checkpoint file would do to run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _tiny_model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_policy(
        hidden_size=16, num_layers=1, num_heads=2, vocab_size=20, dropout=0.0, max_seq_len=32, seed=seed,
        intermediate_size=32,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(seed))).logits.sum().backward()
    optimizer.step()
    return model, optimizer


def test_sharded_state_round_trips_bitwise(tmp_path):
    """The sharded format (one process here; the 2-process FSDP resume is tests/distributed)."""
    saved_model, saved_optimizer = _tiny_model_and_optimizer(seed=0)
    distributed.save_sharded(distributed.Dist(), tmp_path / "dcp", saved_model, saved_optimizer)
    model, optimizer = _tiny_model_and_optimizer(seed=1)
    distributed.load_sharded(distributed.Dist(), tmp_path / "dcp", model, optimizer)
    for (name, a), b in zip(saved_model.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    want, got = saved_optimizer.state_dict(), optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


@pytest.mark.parametrize("replaced", [".metadata", "rank-0.json", "rank-0.safetensors"])
def test_a_crafted_shard_file_runs_nothing_and_is_refused_in_one_line(tmp_path, replaced):
    """torch.distributed.checkpoint's `.metadata` (what an older grpokit wrote) and each file of the
    current format, replaced by a pickle that would create a marker file when unpickled."""
    shards = tmp_path / "checkpoint-2" / "dcp"
    model, optimizer = _tiny_model_and_optimizer(seed=0)
    if replaced == ".metadata":  # the old layout: DCP's files only
        shards.mkdir(parents=True)
    else:
        distributed.save_sharded(distributed.Dist(), shards, model, optimizer)
    marker = tmp_path / "code-ran"
    (shards / replaced).write_bytes(pickle.dumps(_Payload(marker)))

    with pytest.raises(ValueError) as error, warnings.catch_warnings():
        # (torch.distributed.checkpoint, which loaded shards before, warns when used in one process)
        warnings.simplefilter("ignore", UserWarning)
        distributed.load_sharded(distributed.Dist(), shards, model, optimizer)

    assert not marker.exists()
    message = str(error.value)
    assert "\n" not in message and str(shards) in message


def test_a_crafted_state_pt_runs_nothing_and_is_refused_in_one_line(tmp_path, reference):
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(reference / "checkpoint-3", checkpoint)
    marker = tmp_path / "code-ran"
    (checkpoint / "state.pt").write_bytes(pickle.dumps(_Payload(marker), protocol=2))  # torch.save's protocol
    model = load_policy(checkpoint).model

    with pytest.raises(CheckpointError) as error:
        load_training_state(checkpoint, model)

    assert not marker.exists()
    message = str(error.value)
    assert "\n" not in message and "state.pt" in message and "could run code" in message


# ----------------------------------------------------------------------------- another model shape


def test_resuming_into_another_model_shape_is_one_line(tmp_path, reference):
    checkpoint = reference / "checkpoint-3"
    vocab = load_file(checkpoint / "model.safetensors")["model.embed_tokens.weight"].shape[0]
    wider = build_policy(
        hidden_size=32, num_layers=1, num_heads=2, vocab_size=vocab, dropout=0.0, max_seq_len=32, seed=0,
        intermediate_size=32,
    )  # fmt: skip
    before = {k: v.clone() for k, v in wider.state_dict().items()}

    with pytest.raises(CheckpointError) as error:
        load_training_state(checkpoint, wider)

    message = str(error.value)
    assert "\n" not in message and len(message) < 400
    assert f"model.embed_tokens.weight is ({vocab}, 16) there and ({vocab}, 32) in this model" in message
    assert str(checkpoint) in message and "another output_dir" in message
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())  # nothing loaded


# ----------------------------------------------------------------------------- a full disk


def test_a_full_disk_while_saving_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
    real_save = torch.save
    saves = []

    def save_until_the_disk_is_full(obj, f, *args, **kwargs):
        if str(getattr(f, "name", f)).endswith("state.pt"):
            saves.append(f)
            if len(saves) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    with pytest.raises(OSError) as error:
        train_grpo(tiny_config(tmp_path, max_steps=4, save_steps=1), reward_funcs=[ones_reward])

    run = tmp_path / "run"
    assert error.value.errno == errno.ENOSPC
    assert Path(error.value.filename).name == "state.pt" and Path(error.value.filename).parent.parent == run
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-1", "checkpoint-2"]
    assert all(checkpoint_problem(p) is None for p in list_checkpoints(run))
    assert [p.name for p in run.iterdir() if p.name.startswith(".tmp")] == []  # no staging left


def test_a_full_disk_reported_by_safetensors_is_an_os_error(tmp_path):
    """safetensors reports a failed write as SafetensorError("... (os error 28)"): an OSError for the
    command line, with the path, and the staging directory is gone."""
    from safetensors import SafetensorError

    out = tmp_path / "out"
    earlier = fake_checkpoint(out, 1)
    before = {p: p.read_bytes() for p in earlier.rglob("*") if p.is_file()}

    def full(directory, **_):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    model = types.SimpleNamespace(save_pretrained=full)
    with pytest.raises(OSError) as error:
        save_checkpoint(SaveTo(out, "", keep=2), 2, model, None, {})
    assert error.value.errno == errno.ENOSPC and error.value.filename.endswith("model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1"]
    assert {p: p.read_bytes() for p in earlier.rglob("*") if p.is_file()} == before


# ----------------------------------------------------------------------------- pruning and deleting


def _save(run: Path, step: int, keep: int) -> Path:
    from grpokit.models import char_tokenizer

    tok = char_tokenizer("0123456789+=")
    model = build_policy(
        hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tok), max_seq_len=16, seed=0
    )
    return save_checkpoint(SaveTo(run, "seed: 0\n", keep), step, model, tok, {"step": step})


def test_a_damaged_newer_checkpoint_never_pushes_the_intact_ones_out(tmp_path):
    """Resume skipped a damaged checkpoint-4 and continues from checkpoint-2: saving step 3 with
    save_total_limit=1 must keep checkpoint-3 (the damaged 4 counts for nothing until step 4 is saved
    again), or every intact checkpoint would be gone."""
    run = tmp_path / "run"
    _save(run, 2, keep=2)
    _save(run, 4, keep=2)
    (run / "checkpoint-4" / "state.pt").write_bytes(b"torn")
    _save(run, 3, keep=1)
    assert newest_intact_checkpoint(run)[0] == run / "checkpoint-3"
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-3", "checkpoint-4"]


def test_a_checkpoint_is_never_half_deleted_under_its_own_name(tmp_path, monkeypatch):
    """A kill in the middle of deleting an old checkpoint (here: after its manifest went) must not
    leave a directory that passes for a checkpoint without a manifest."""
    import grpokit.train.checkpoint as checkpoint_module

    run = tmp_path / "run"
    _save(run, 1, keep=2)
    _save(run, 2, keep=2)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        if "checkpoint-1" in Path(path).name and (Path(path) / MANIFEST).exists():
            (Path(path) / MANIFEST).unlink()
            raise KeyboardInterrupt  # the kill
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        _save(run, 3, keep=2)
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", real_rmtree)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]
    assert all((p / MANIFEST).is_file() for p in list_checkpoints(run))


def test_a_file_that_cannot_be_read_is_damage_and_resume_falls_back(tmp_path, monkeypatch):
    import errno as errnos

    import grpokit.train.checkpoint as checkpoint_module

    run = tmp_path / "run"
    _save(run, 1, keep=2)
    _save(run, 2, keep=2)
    real_sha = checkpoint_module._sha256

    def bad_sector(path):
        if "checkpoint-2" in str(path):
            raise OSError(errnos.EIO, "Input/output error", str(path))
        return real_sha(path)

    monkeypatch.setattr(checkpoint_module, "_sha256", bad_sector)
    chosen, corrupt = newest_intact_checkpoint(run)
    assert chosen == run / "checkpoint-1"
    assert len(corrupt) == 1 and corrupt[0].startswith("checkpoint-2: ") and "unreadable" in corrupt[0]
