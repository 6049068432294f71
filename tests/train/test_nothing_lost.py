"""No plausible mix-up loses data: each refusal here touches nothing, byte for byte.

* `resume=true` where a run left no checkpoint to resume from is refused, instead of starting again
  over its metrics and checkpoint directories.
* An output_dir that is, or lies inside, a checkpoint or a saved model is refused before anything is
  written there (not even the lock file).
* A config.yaml grpokit did not write (the user's own) is never replaced.
* `overwrite=true` deletes only what grpokit wrote.
* A second Ctrl-C while a checkpoint is written: one line naming the last complete checkpoint, and a
  resume continues from it.
* Every field of a checkpoint's state.pt is checked before a resume uses it: a value of the wrong
  type, shape or range is one line, exit code 2, and the run directory is unchanged.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from grpokit.cli import main
from grpokit.train.checkpoint import CheckpointError, write_manifest
from grpokit.train.rundir import LOCK_NAME, list_checkpoints
from tests.helpers import TINY_MODEL, read_steps

from ..test_reliability import TINY


def _train(capsys, out: Path, *extra: str, steps: int = 2) -> tuple[int, str]:
    """`grpokit train` in this process: (exit code, stderr)."""
    code = main(["train", f"output_dir={out}", f"max_steps={steps}", *TINY, *extra])
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    """The one error line (the line after it only points at --debug); never a traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("grpokit train: error:")]
    assert len(lines) == 1, err
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every directory (None) under `root`, by relative path; the lock file
    aside (it holds the PID of the last process that locked the directory, a refused one included)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
        if p.name != LOCK_NAME
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-step run with checkpoint-1 and checkpoint-2, made once; tests copy it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", f"output_dir={out}", "max_steps=2", *TINY]) == 0
    return out


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


# ----------------------------------------------------------------------------- resume with nothing to resume


def test_resume_where_no_checkpoint_can_be_resumed_is_refused_and_touches_nothing(
    finished_run, tmp_path, capsys
):
    out = _copy(finished_run, tmp_path / "run")
    for checkpoint in list_checkpoints(out):  # weights kept, state and manifest lost (copied without them)
        (checkpoint / "state.pt").unlink()
        (checkpoint / "manifest.json").unlink()
    (out / "checkpoint-2" / "my-notes.txt").write_text("mine")
    before = snapshot(out)
    code, err = _train(capsys, out, "resume=true", steps=3)
    assert code == 2
    line = _one_line(err)
    assert f"output_dir {str(out)!r} holds a run (checkpoint-1, checkpoint-2, metrics.jsonl" in line
    assert (
        "no checkpoint to resume from" in line and "overwrite=true" in line and "nothing was changed" in line
    )
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- a checkpoint or a model


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_checkpoint_given_as_output_dir_is_refused_and_the_run_resumes_from_it(
    finished_run, tmp_path, capsys, resume
):
    out = _copy(finished_run, tmp_path / "run")
    before = snapshot(out)
    for target in (out / "checkpoint-2", out / "checkpoint-2" / "sub"):
        code, err = _train(capsys, target, *(["resume=true"] if resume else []))
        assert code == 2
        line = _one_line(err)
        assert f"a checkpoint of the run in {str(out)!r}" in line
        assert (
            f"output_dir={str(out)!r} resume=true" in line and f"model={str(out / 'checkpoint-2')!r}" in line
        )
        assert snapshot(out) == before  # not even a lock file
    # the real run still resumes from its newest checkpoint, not from checkpoint-1
    code, err = _train(capsys, out, "resume=true", steps=3)
    assert code == 0, err
    assert [r["step"] for r in read_steps(out)] == [1, 2, 3]
    assert "damaged" not in err


def test_a_saved_model_given_as_output_dir_is_refused(finished_run, tmp_path, capsys):
    model = _copy(finished_run / "checkpoint-2", tmp_path / "model")
    for name in ("state.pt", "manifest.json", "config.yaml"):  # what save_pretrained leaves
        (model / name).unlink()
    before = snapshot(model)
    code, err = _train(capsys, model)
    assert code == 2
    line = _one_line(err)
    assert "a saved model (config.json and weights)" in line and f"model={str(model)!r}" in line
    assert snapshot(model) == before


def test_a_symbolic_link_to_a_checkpoint_names_the_run_it_points_into(finished_run, tmp_path, capsys):
    out = _copy(finished_run, tmp_path / "runs" / "x")
    link = tmp_path / "link"
    link.symlink_to(out / "checkpoint-2")
    code, err = _train(capsys, link)
    assert code == 2
    line = _one_line(err)
    assert f"a checkpoint of the run in {str(out.resolve())!r}" in line
    assert f"output_dir={str(out.resolve())!r} resume=true" in line


def test_a_directory_holding_only_tensorboard_events_is_an_earlier_run(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"an older run's curves")
    for extra in ([], ["resume=true"]):
        code, err = _train(capsys, out, *extra)
        assert code == 2 and "holds a run (tensorboard)" in _one_line(err)
        assert (out / "tensorboard" / "events.out.tfevents.1").read_bytes() == b"an older run's curves"


# ----------------------------------------------------------------------------- the user's config.yaml


def test_a_users_config_yaml_in_output_dir_is_never_replaced(tmp_path, capsys, monkeypatch):
    project = tmp_path / "proj"
    project.mkdir()
    mine = "# my experiment: sums up to 99\nmax_steps: 2\nseed: 7\n"
    (project / "config.yaml").write_text(mine)
    monkeypatch.chdir(project)
    code = main(["train", "config.yaml", "output_dir=.", *TINY])
    err = capsys.readouterr().err
    assert code == 2
    line = _one_line(err)
    assert "holds a config.yaml that grpokit did not write" in line and "output_dir=" in line
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml"]
    assert (project / "config.yaml").read_text() == mine
    # the same config into a directory of its own runs, and its config.yaml is grpokit's to rewrite
    code = main(["train", "config.yaml", "output_dir=runs/x", *TINY])
    assert code == 0, capsys.readouterr().err
    code = main(["train", "config.yaml", "output_dir=runs/x", "overwrite=true", *TINY])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "reward", "sft"])
def test_overwrite_never_deletes_a_users_config_yaml_beside_a_checkpoint_best(tmp_path, capsys, command):
    """A checkpoint-best/ of the user's is no run of grpokit's, so output_dir=. is refused for the
    config.yaml there, with overwrite=true too (which would have deleted it)."""
    project = tmp_path / "proj"
    (project / "checkpoint-best").mkdir(parents=True)
    mine = "# mine\nmax_steps: 1\n"
    (project / "config.yaml").write_text(mine)
    before = snapshot(project)
    overrides = TINY if command == "train" else ["max_steps=1"]
    code = main([command, f"output_dir={project}", "overwrite=true", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "holds a config.yaml that grpokit did not write" in err and "Traceback" not in err
    assert snapshot(project) == before


# ----------------------------------------------------------------------------- the run's own files


@pytest.mark.parametrize(
    "name, damage, said",
    [
        (
            "alerts.jsonl",
            b'{"step": 1, "name": "zero_sp\xffread"}\n',
            "alerts.jsonl: line 1 is not valid UTF-8",
        ),
        (
            "metrics.jsonl",
            b'{"step": 1, "loss": 0.5, "note": "\xfe"}\n',
            "metrics.jsonl: line 1 is not valid UTF-8",
        ),
        (
            "alerts.jsonl",
            b'{"step": "two", "name": "zero_spread", "value": 1, "threshold": 0.5, "advice": "x"}\n',
            "alerts.jsonl: line 1: 'step' must be a whole number",
        ),
    ],
    ids=["alerts-not-utf8", "metrics-not-utf8", "alerts-string-step"],
)
def test_a_damaged_metrics_or_alerts_line_stops_a_resume_in_one_line_before_anything_changes(
    finished_run, tmp_path, capsys, name, damage, said
):
    out = _copy(finished_run, tmp_path / "run")
    (out / name).write_bytes(damage + (out / name).read_bytes() if (out / name).exists() else damage)
    before = snapshot(out)
    code, err = _train(capsys, out, "resume=true", steps=3)
    assert code == 2
    line = _one_line(err)
    assert f"{out / name}" in line and said.split(": ", 1)[1] in line and "repair or delete that line" in line
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- overwrite


def test_overwrite_deletes_only_what_grpokit_wrote(finished_run, tmp_path, capsys):
    out = _copy(finished_run, tmp_path / "run")
    assert main(["report", str(out)]) == 0
    (out / "checkpoint-best").mkdir()
    (out / "checkpoint-best" / "model.safetensors").write_bytes(b"the user's best")
    (out / "report" / "notes.md").write_text("what I saw")
    code, err = _train(capsys, out, "overwrite=true", steps=1)
    assert code == 0, err
    assert (out / "checkpoint-best" / "model.safetensors").read_bytes() == b"the user's best"
    assert (out / "report" / "notes.md").read_text() == "what I saw"
    assert sorted(p.name for p in (out / "report").iterdir()) == ["notes.md"]  # the old plots went
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]


# ----------------------------------------------------------------------------- a second Ctrl-C


def test_a_second_ctrl_c_while_a_checkpoint_is_written_is_one_line_and_resume_continues(
    tmp_path, capsys, monkeypatch
):
    from grpokit.train import checkpoint

    out = tmp_path / "run"
    real = checkpoint.write_manifest

    def interrupted_twice(staging: Path) -> None:
        if staging.name.startswith(".tmp-checkpoint-2-"):
            os.kill(os.getpid(), signal.SIGINT)  # the first asks the run to stop after this step
            os.kill(os.getpid(), signal.SIGINT)  # the second stops it at once, mid-write
        real(staging)

    monkeypatch.setattr(checkpoint, "write_manifest", interrupted_twice)
    code = main(["train", f"output_dir={out}", "max_steps=3", *TINY])
    err = capsys.readouterr().err
    assert code == 130
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{str(out / 'checkpoint-1')!r} is the last complete checkpoint" in err and "resume=true" in err
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]  # nothing half-written is left
    monkeypatch.setattr(checkpoint, "write_manifest", real)
    code, err = _train(capsys, out, "resume=true", steps=3)
    assert code == 0, err
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]


def test_ctrl_c_that_breaks_torch_save_mid_write_is_still_one_line(tmp_path, capsys, monkeypatch):
    """A second Ctrl-C inside torch.save: its zip writer fails as the interrupt unwinds it (a
    RuntimeError whose context is the KeyboardInterrupt), which is still the interrupt's one line."""
    from grpokit.train import checkpoint

    real = checkpoint.torch.save

    def broken_by_ctrl_c(obj, f, *args, **kwargs):
        if ".tmp-checkpoint-2-" in str(getattr(f, "name", "")):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64") from None
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", broken_by_ctrl_c)
    out = tmp_path / "run"
    code = main(["train", f"output_dir={out}", "max_steps=3", *TINY])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{str(out / 'checkpoint-1')!r} is the last complete checkpoint" in err
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def test_sft_holds_its_output_dir_and_never_replaces_an_earlier_run(tmp_path, capsys, finished_run):
    sft = ["max_steps=2", *TINY_MODEL]
    out = tmp_path / "sft"
    assert main(["sft", f"output_dir={out}", *sft]) == 0
    capsys.readouterr()
    before = snapshot(out)
    assert main(["sft", f"output_dir={out}", *sft]) == 2
    said = capsys.readouterr().err
    assert "already holds a run (final); start a new one" in said and "resume=true" not in said  # no resume
    assert snapshot(out) == before
    assert main(["sft", f"output_dir={out}", "overwrite=true", *sft]) == 0
    grpo = _copy(finished_run, tmp_path / "grpo")  # a GRPO run's config.yaml is not replaced either
    before = snapshot(grpo)
    assert main(["sft", f"output_dir={grpo}", *sft]) == 2
    assert "already holds a run (checkpoint-1, checkpoint-2" in capsys.readouterr().err
    assert snapshot(grpo) == before


# ----------------------------------------------------------------------------- every field of state.pt


def _leaves(value, path=()):
    """(path, value) of every leaf of a state (tensors are leaves). A long list (the Python generator's
    625 words, the curriculum's pool and streak of every prompt) is a leaf itself, and its first item
    stands for the rest (the same check reads each)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, (list, tuple)) and len(value) > 8:
        yield path, value
        yield from _leaves(value[0], (*path, 0))
    elif isinstance(value, (list, tuple)) and not (path and path[-1] in ("base_lrs", "_last_lr")):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _bad_values(path: tuple, value):
    """Values of the wrong kind, shape or range for the leaf at `path`, each one a run never writes. An
    epoch or a visit count of any size is a valid one (it only seeds the order): out of range for
    those is past 2**62; the bounds the run sets (a position, a step) have cases of their own."""
    bad: list = ["x"]  # a string is wrong everywhere in a state
    if isinstance(value, torch.Tensor):
        bad += [torch.zeros(3, 2, 1), [0.0]]
    elif value is None:
        bad += [[1.0]]
    elif isinstance(value, bool):
        bad += [7]
    elif isinstance(value, int):
        bad += ([] if "streak" in path else [-1]) + [1.5, 10**30]
    elif isinstance(value, float):  # (the curriculum's reward bounds may be below 0)
        bad += (
            [[1.0]]
            if path[0] == "eval_before"
            else [float("inf")]
            if "curriculum" in path
            else [-1.0, float("inf")]
        )
    elif isinstance(value, list):
        bad += [value[:-1], {}]
    return bad


def _set(state, path: tuple, value):
    """`state` with the leaf at `path` replaced by `value` (a copy: dicts, lists and tuples on the way
    are rebuilt, the rest shared)."""
    head, rest = path[0], path[1:]
    new = _set(state[head], rest, value) if rest else value
    if isinstance(state, dict):
        return {**state, head: new}
    return type(state)(new if i == head else item for i, item in enumerate(state))


def _picked_leaves(state: dict):
    """Every leaf of `state`, the optimizer's per-parameter state for its first parameter only (the
    others are checked by the same code)."""
    return [
        (path, value) for path, value in _leaves(state) if path[:2] != ("optimizer", "state") or path[2] == 0
    ]


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    """A 2-step run with a curriculum and a synced reference (its state.pt has every field a GRPO run
    saves), its checkpoint's state, and the optimizer, schedule and sampler a resume of it builds
    (caught on their way into `check_state` during one real resume)."""
    from grpokit.train import checkpoint

    out = tmp_path_factory.mktemp("state") / "run"
    extra = ["save_steps=0", "curriculum=true", "sync_ref_model=true", "ref_model_sync_steps=1", "beta=0.04"]
    assert main(["train", f"output_dir={out}", "max_steps=2", *TINY, *extra]) == 0
    caught = {}
    real = checkpoint.check_state

    def catch(state, path, optimizer, scheduler, sampler, reference=None):
        caught.update(optimizer=optimizer, scheduler=scheduler, sampler=sampler, reference=reference)
        return real(state, path, optimizer, scheduler, sampler, reference)

    checkpoint.check_state = catch
    try:
        assert main(["train", f"output_dir={out}", "max_steps=2", "resume=true", *TINY, *extra]) == 0
    finally:
        checkpoint.check_state = real
    state = torch.load(out / "checkpoint-2" / "state.pt", weights_only=True)
    return out, extra, state, caught


def test_the_state_a_run_writes_passes_its_own_check(resumable):
    from grpokit.train.checkpoint import check_state

    out, _, state, parts = resumable
    assert {"reference", "optimizer", "scheduler", "prompts", "rng", "eval_before"} <= set(state)
    assert "curriculum" in state["prompts"]
    assert check_state(state, out / "checkpoint-2", **parts) is state


def test_every_field_of_state_pt_with_a_value_no_run_writes_is_one_line(resumable):
    from grpokit.train.checkpoint import check_state

    out, _, state, parts = resumable
    leaves = _picked_leaves(state)
    assert len(leaves) > 40
    for path, value in leaves:
        shown = ".".join(map(str, path))
        for bad in _bad_values(path, value):
            try:
                check_state(_set(state, path, bad), out / "checkpoint-2", **parts)
            except CheckpointError as refused:
                line = str(refused)
            else:
                raise AssertionError(f"{shown} = {bad!r} was not refused")
            assert "\n" not in line and "in its state.pt, " in line, (shown, bad, line)
            # the line names the field (or, for a list cut short / a wrong container, the field holding it)
            assert any(".".join(map(str, path[:n])) in line for n in range(len(path), 0, -1)), (shown, line)
    # what the issue found: a curriculum pool value of 7, a data position of 10^12, a step of 1e9
    for path, bad, said in [
        (
            ("prompts", "curriculum", "pool", 0),
            7,
            "prompts.curriculum.pool.0: input should be less than or equal to 2",
        ),
        (("prompts", "position"), 10**12, "prompts.position is 1000000000000, past the"),
        (("step",), 10**9, "step is 1000000000, but this is checkpoint-2"),
        (("step",), 1e9, "step: input should be a valid integer"),
        (
            ("scheduler", "last_epoch"),
            10**12,
            "scheduler.last_epoch is 1000000000000, past the optimizer's 2 updates",
        ),
    ]:
        with pytest.raises(CheckpointError, match=said.replace(".", "\\.")):
            check_state(_set(state, path, bad), out / "checkpoint-2", **parts)


@pytest.mark.slow
def test_a_resume_refuses_each_edited_field_in_one_line_and_leaves_the_run_unchanged(
    resumable, tmp_path, capsys
):
    """Through the command line: one edited field at a time (the manifest rewritten to match, so the
    checkpoint is not taken as damaged), exit code 2, one line, the run directory byte for byte."""
    import shutil

    out, extra, state, _ = resumable
    run = tmp_path / "run"
    shutil.copytree(out, run)
    checkpoint = run / "checkpoint-2"
    for path, value in _picked_leaves(state):
        bad = _bad_values(path, value)[1]  # of the right type's neighbourhood: a shape, a range, a length
        torch.save(_set(state, path, bad), checkpoint / "state.pt")
        write_manifest(checkpoint)
        before = snapshot(run)
        code = main(["train", f"output_dir={run}", "max_steps=3", "resume=true", *TINY, *extra])
        line = _one_line(capsys.readouterr().err)
        assert code == 2 and "in its state.pt, " in line, (path, line)
        assert snapshot(run) == before, path


ALERT = {"step": 1, "name": "zero_spread", "value": 1.0, "threshold": 0.5, "advice": "a warm start"}


def _edit_jsonl(path: Path, row: int, field: str | None, value) -> None:
    """Line `row` of a JSONL file with `field` set to `value` (the whole row replaced when None)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[row] = value if field is None else {**rows[row], field: value}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _edit_manifest(checkpoint: Path, edit) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    edit(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _edit_config(checkpoint: Path, key: str, value: str) -> None:
    lines = (checkpoint / "config.yaml").read_text().splitlines()
    lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line for line in lines]
    (checkpoint / "config.yaml").write_text("\n".join(lines) + "\n")


def _state_file_edits():
    """(what, edit(run)) for each field of each other file a resume reads: metrics.jsonl, alerts.jsonl,
    the checkpoint's manifest.json and config.yaml; valid JSON (or YAML) of the wrong shape or range."""
    edits = []
    for field, bad in [
        ("step", "x"),
        ("step", -1),
        ("step", 1.5),
        ("step", [1]),
        ("loss", "x"),
        ("loss", [1]),
    ]:
        edits.append(
            (
                f"metrics.jsonl {field}={bad!r}",
                lambda run, f=field, b=bad: _edit_jsonl(run / "metrics.jsonl", 1, f, b),
            )
        )
    edits.append(("metrics.jsonl row=[]", lambda run: _edit_jsonl(run / "metrics.jsonl", 1, None, [])))
    for field, bad in [
        ("step", "x"),
        ("step", -1),
        ("name", 5),
        ("name", ""),
        ("value", "x"),
        ("threshold", [1]),
        ("advice", 7),
    ]:
        edits.append(
            (
                f"alerts.jsonl {field}={bad!r}",
                lambda run, f=field, b=bad: _edit_jsonl(run / "alerts.jsonl", 0, f, b),
            )
        )
    edits.append(("alerts.jsonl row=[]", lambda run: _edit_jsonl(run / "alerts.jsonl", 0, None, [])))
    for what, edit in [
        ("format=2", lambda m: m.update(format=2)),
        ("files=[]", lambda m: m.update(files=[])),
        ("size=-1", lambda m: m["files"]["state.pt"].update(size=-1)),
        ("size='x'", lambda m: m["files"]["state.pt"].update(size="x")),
        ("sha256='zz'", lambda m: m["files"]["state.pt"].update(sha256="zz")),
    ]:
        edits.append((f"manifest.json {what}", lambda run, e=edit: _edit_manifest(run / "checkpoint-2", e)))
    for key, bad in [("learning_rate", "x"), ("seed", "-5"), ("num_generations", "[4]")]:
        edits.append(
            (f"config.yaml {key}={bad}", lambda run, k=key, b=bad: _edit_config(run / "checkpoint-2", k, b))
        )
    return edits


@pytest.mark.slow
def test_every_field_of_the_other_files_a_resume_reads_edited_is_one_line_and_changes_nothing(
    resumable, tmp_path, capsys
):
    """metrics.jsonl, alerts.jsonl, the checkpoint's manifest.json and config.yaml: one field at a time
    set to valid JSON (or YAML) of the wrong type or range, then a resume: exit code 2, one line, the
    run directory byte for byte (a manifest that no longer vouches for the only checkpoint leaves
    nothing to resume from; a config.yaml value is refused as the option's own error)."""
    import shutil

    out, extra, _, _ = resumable
    base = tmp_path / "base"
    shutil.copytree(out, base)
    (base / "alerts.jsonl").write_text(json.dumps(ALERT) + "\n")
    for what, edit in _state_file_edits():
        run = tmp_path / "run"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(base, run)
        edit(run)
        before = snapshot(run)
        code = main(["train", f"output_dir={run}", "max_steps=3", "resume=true", *TINY, *extra])
        err = capsys.readouterr().err
        assert code == 2, (what, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 2, (
            what,
            err,
        )  # + the --debug hint
        assert snapshot(run) == before, what
