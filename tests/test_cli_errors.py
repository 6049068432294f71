"""A user's mistake at the command line, in a data file or in the machine (a full disk, a read-only
filesystem, device=cuda without a GPU) is one line naming the culprit and the fix, exit code 2, never
a traceback; `--debug` shows the traceback; a bug in grpokit still shows its traceback. And every test
runs in its own directory, whatever the directory pytest was started from holds."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from unittest import mock

import pytest

from grpokit import cli, user_errors
from grpokit.cli import main
from grpokit.data import DataError, load_preferences, load_prompts
from grpokit.models.device import DeviceError
from grpokit.train.distributed import choose_backend
from tests.helpers import named_tests

REPO_ROOT = Path(__file__).resolve().parents[1]
NOT_UTF8 = b"\xff"  # never valid in UTF-8; Latin-1's \xff is what a file saved in the wrong encoding holds
DEEP = 100_000  # nesting levels: far past the recursion json.loads can follow


def _file(tmp: Path, name: str, data: bytes) -> Path:
    (tmp / name).write_bytes(data)
    return tmp / name


def _latin1_jsonl(tmp: Path, name: str = "prompts.jsonl") -> Path:
    """Line 1 fine, line 2 holds a byte that is not UTF-8 at (byte) column 13."""
    return _file(tmp, name, b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "' + NOT_UTF8 + b'"}\n')


def _latin1_preferences(tmp: Path) -> Path:
    return _file(
        tmp,
        "pairs.jsonl",
        b'{"chosen": "2", "rejected": "3"}\n{"chosen": "caf' + NOT_UTF8 + b'", "rejected": "x"}\n',
    )


def _deep_jsonl(tmp: Path, name: str = "prompts.jsonl") -> Path:
    deep = "[" * DEEP + "]" * DEEP
    return _file(tmp, name, f'{{"prompt": "a"}}\n{{"prompt": {deep}}}\n'.encode())


def _raising(error: BaseException, command: str = "train"):
    """A context in which the handler of `command` raises `error` (what a checkpoint writer on a full
    disk, or a bug, would raise from inside a run)."""

    def handler(args):
        raise error

    return mock.patch.object(cli, f"_cmd_{command.replace('-', '_')}", handler)


def _main_raising(error: BaseException, *argv: str, command: str = "train") -> int:
    with _raising(error, command):
        return main([command, *argv])


def _disk_full(tmp: Path) -> int:
    """A full disk while writing a checkpoint; the filesystem reports 12 MB free (disk_usage is faked
    so that the number is known; it must be asked about the nearest directory that exists)."""
    target = tmp / "runs" / "x" / "checkpoint-40" / "state.pt"  # none of runs/x/... exists
    usage = namedtuple("usage", "total used free")

    def disk_usage(path):
        assert Path(path) == tmp, f"free space asked of {path}, not of the nearest existing parent {tmp}"
        return usage(10**9, 10**9 - 12 * 10**6, 12 * 10**6)

    with mock.patch.object(shutil, "disk_usage", disk_usage):
        return _main_raising(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target)))


def _earlier_run(tmp: Path) -> Path:
    run = tmp / "old"
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    return run


def _damaged_metrics(tmp: Path) -> int:
    run = tmp / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step: 2}\n{"step": 3, "loss": 0.2}\n')
    return main(["report", str(run)])


def _not_a_model(tmp: Path) -> int:
    (tmp / "empty").mkdir()
    return main(["eval", f"model={tmp / 'empty'}", "num_eval_prompts=4"])


# (case id, callable taking tmp_path, error class or the CLI's exit code, text the message must contain).
# A CLI case returns main()'s exit code; its stderr must be the error line and the --debug hint only.
BAD_CLI_INPUTS = [
    # ------------------------------------------------------------------ data files that are not UTF-8
    (
        "jsonl not UTF-8",
        lambda t: load_prompts(_latin1_jsonl(t)),
        DataError,
        "prompts.jsonl: line 2 is not valid UTF-8 (byte 0xff at column 13); save the file as UTF-8",
    ),
    (
        "json not UTF-8",
        lambda t: load_prompts(_file(t, "p.json", b'[\n {"prompt": "a"},\n {"prompt": "\xe9"}\n]\n')),
        DataError,
        "p.json: line 3 is not valid UTF-8",
    ),
    (
        "csv not UTF-8",
        lambda t: load_prompts(_file(t, "p.csv", b"prompt,answer\n1+1=,2\n2+2=,4\n\x93quoted\x94,5\n")),
        DataError,
        "p.csv: line 4 is not valid UTF-8 (byte 0x93 at column 1)",
    ),
    (
        "preference file not UTF-8",
        lambda t: load_preferences(_latin1_preferences(t)),
        DataError,
        "pairs.jsonl: line 2 is not valid UTF-8 (byte 0xff at column 16)",
    ),
    # ------------------------------------------------------------------ JSON nested past the recursion limit
    (
        "jsonl nested 100000 deep",
        lambda t: load_prompts(_deep_jsonl(t)),
        DataError,
        f"prompts.jsonl: line 2 nests lists or objects {DEEP + 1} levels deep",
    ),
    (
        "json nested 100000 deep",
        lambda t: load_prompts(
            _file(t, "p.json", f'[\n{{"prompt": "a"}},\n{{"prompt": {"[" * DEEP}{"]" * DEEP}}}\n]'.encode())
        ),
        DataError,
        f"p.json: line 3 nests lists or objects {DEEP + 2} levels deep",
    ),
    (
        "preference file nested 100000 deep",
        lambda t: load_preferences(
            _file(t, "pairs.jsonl", f'{{"chosen": "a", "rejected": {"[" * DEEP}{"]" * DEEP}}}'.encode())
        ),
        DataError,
        "pairs.jsonl: line 1 nests",
    ),
    # ------------------------------------------------------------------ the same through each command
    (
        "train on a dataset not UTF-8",
        lambda t: main(["train", "task=null", f"dataset={_latin1_jsonl(t)}", f"output_dir={t / 'run'}"]),
        2,
        "prompts.jsonl: line 2 is not valid UTF-8",
    ),
    (
        "sft on a dataset nested too deep",
        lambda t: main(["sft", "task=null", f"dataset={_deep_jsonl(t)}", f"output_dir={t / 'run'}"]),
        2,
        "prompts.jsonl: line 2 nests",
    ),
    (
        "eval on an eval_dataset not UTF-8",
        lambda t: main(["eval", "task=null", f"eval_dataset={_latin1_jsonl(t)}"]),
        2,
        "prompts.jsonl: line 2 is not valid UTF-8",
    ),
    (
        "reward on preferences not UTF-8",
        lambda t: main(
            ["reward", "task=null", f"dataset={_latin1_preferences(t)}", f"output_dir={t / 'run'}"]
        ),
        2,
        "pairs.jsonl: line 2 is not valid UTF-8",
    ),
    # ------------------------------------------------------------------ a device the machine lacks
    (
        "train device=cuda without a GPU",
        lambda t: main(["train", "device=cuda", f"output_dir={t / 'run'}"]),
        2,
        "device=cuda but torch sees no CUDA GPU",
    ),
    (
        "torchrun device=cuda without a GPU",
        lambda t: choose_backend("cuda", cuda_count=0, local_rank=0, local_world_size=2),
        DeviceError,
        "device=cuda but torch sees no CUDA GPU; use device=cpu or device=auto.",
    ),
    (
        "torchrun device=cuda:3 on a machine with one GPU",
        lambda t: choose_backend("cuda:3", cuda_count=1, local_rank=0, local_world_size=1),
        DeviceError,
        "device=cuda:3 but this machine has 1 GPU(s).",
    ),
    (
        "demo --device cuda:3 without a GPU",
        lambda t: main(["demo", "--device", "cuda:3", "--steps", "1"]),
        2,
        "device=cuda:3 but torch sees no CUDA GPU",
    ),
    # ----------------------------------------------------------- the machine: an OSError while a command runs
    (
        "disk full",
        _disk_full,
        2,
        "no space left on device writing '{t}/runs/x/checkpoint-40/state.pt' (12.0 MB free on that "
        "filesystem); free some space or choose another output_dir. Earlier checkpoints are kept.",
    ),
    (
        "disk quota exceeded",
        lambda t: _main_raising(
            OSError(errno.EDQUOT, "Disk quota exceeded", str(t / "m.jsonl")), command="reward"
        ),
        2,
        "disk quota exceeded writing '{t}/m.jsonl' (",
    ),
    (
        "read-only filesystem",
        lambda t: _main_raising(OSError(errno.EROFS, "Read-only file system", str(t / "run"))),
        2,
        "'{t}/run' is on a read-only filesystem; choose a path on a writable one",
    ),
    (
        "permission denied",
        lambda t: _main_raising(
            PermissionError(errno.EACCES, "Permission denied", str(t / "run")), command="sft"
        ),
        2,
        "permission denied on '{t}/run'; give this user access to it, or choose another path.",
    ),
    (
        "a directory where a file belongs",
        lambda t: _main_raising(
            IsADirectoryError(errno.EISDIR, "Is a directory", str(t / "d")), str(t), command="report"
        ),
        2,
        "'{t}/d' is a directory where a file is expected",
    ),
    (
        "a file where a directory belongs",
        lambda t: _main_raising(
            NotADirectoryError(errno.ENOTDIR, "Not a directory", str(t / "f")), command="eval"
        ),
        2,
        "'{t}/f' is not a directory",
    ),
    (
        "a path that does not exist",
        lambda t: _main_raising(FileNotFoundError(errno.ENOENT, "No such file", str(t / "gone.py"))),
        2,
        "'{t}/gone.py' does not exist; check the path.",
    ),
    (
        "export into a path that is a file",
        lambda t: main(["export", str(t / "checkpoint"), str(_file(t, "out", b"x"))]),
        2,
        "'{t}/out' is not a directory (it, or a folder on its path, is a file)",
    ),
    (
        "output_dir holds an earlier run",
        lambda t: main(["train", f"output_dir={_earlier_run(t)}"]),
        2,
        "already holds a run (checkpoint-1, metrics.jsonl); continue it with resume=true",
    ),
    # ------------------------------------------------------------------ paths that name nothing usable
    (
        "config file missing, through the command line",
        lambda t: main(["train", str(t / "nonexistent.yaml")]),
        2,
        "nonexistent.yaml' does not exist",
    ),
    (
        "report of a missing directory",
        lambda t: main(["report", str(t / "nowhere")]),
        2,
        "has no metrics.jsonl",
    ),
    (
        "report of a damaged metrics file",
        _damaged_metrics,
        2,
        "run/metrics.jsonl: line 2 is not valid JSON",
    ),
    (
        "export of a missing checkpoint",
        lambda t: main(["export", str(t / "checkpoint-9"), str(t / "out")]),
        2,
        "checkpoint-9' does not exist",
    ),
    ("eval of a directory that is no model", _not_a_model, 2, "has no config.json"),
    (
        # (simulated: a real one on a machine with more memory would allocate, not fail)
        "eval of a completion length far past the host's memory",
        lambda t: _main_raising(
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 25586634752 bytes. Error code 12 (Cannot allocate memory)"
            ),
            command="eval",
        ),
        2,
        "out of host memory: a tensor of 23.8 GiB could not be allocated; lower max_completion_length",
    ),
]


@pytest.mark.parametrize(
    ("case", "call", "expected", "text"), BAD_CLI_INPUTS, ids=[c[0] for c in BAD_CLI_INPUTS]
)
def test_bad_cli_input_gets_one_clear_line(tmp_path, capsys, case, call, expected, text):
    text = text.replace("{t}", str(tmp_path))
    if isinstance(expected, int):
        assert call(tmp_path) == expected
        err = capsys.readouterr().err.strip().splitlines()
        # the error line and the hint, nothing else: no traceback, no second message
        assert len(err) == 2 and err[1] == "(run with --debug for the traceback)", err
        assert err[0].startswith("grpokit ") and ": error: " in err[0], err
        assert text in err[0], err[0]
    else:
        with pytest.raises(expected) as caught:
            call(tmp_path)
        assert text in str(caught.value), str(caught.value)
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device", "/somewhere/state.pt"),
        PermissionError(errno.EACCES, "Permission denied", "/somewhere"),
        FileExistsError("output_dir 'x' already holds a run"),
    ],
    ids=["ENOSPC", "EACCES", "run exists"],
)
def test_debug_shows_the_traceback(error):
    with _raising(error), pytest.raises(type(error)):
        main(["--debug", "train"])


@pytest.mark.parametrize("where", ["after the command", "at the end"])
def test_debug_anywhere_on_the_line_shows_the_traceback(tmp_path, where):
    """`grpokit train --debug ...` and `grpokit train ... --debug` as `grpokit --debug train ...`."""
    args = ["train", "device=cuda", f"output_dir={tmp_path / 'run'}"]
    args = [args[0], "--debug", *args[1:]] if where == "after the command" else [*args, "--debug"]
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        main(args)
    assert main(args[:1] + [a for a in args[1:] if a != "--debug"]) == 2  # without it: one line


def test_debug_shows_the_device_error_as_raised(tmp_path):
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        main(["--debug", "train", "device=cuda", f"output_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize(
    "error",
    [KeyError("score"), OSError(errno.EIO, "Input/output error", "/x"), ConnectionError("refused")],
    ids=["a bug", "EIO", "network"],
)
def test_a_bug_or_an_unknown_os_error_still_shows_its_traceback(error):
    """Only the errors a user can fix are caught: grpokit's own bugs and the rest propagate."""
    with _raising(error), pytest.raises(type(error)):
        main(["train"])


def test_disk_full_without_a_path_still_one_line(capsys):
    """A write() on a full disk raises ENOSPC without a file name: the line says so, names no number."""
    assert _main_raising(OSError(errno.ENOSPC, "No space left on device")) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert line == (
        "grpokit train: error: no space left on device writing a file; free some space or choose "
        "another output_dir. Earlier checkpoints are kept."
    )


def test_free_space_is_measured_on_the_real_filesystem(tmp_path):
    """Unfaked: the number in the line is the free space of tmp_path's filesystem, in decimal units."""
    shown = user_errors.free_space(str(tmp_path / "not" / "yet" / "state.pt"))
    free = shutil.disk_usage(tmp_path).free
    value, unit = shown.split()
    scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]
    # the filesystem is shared with other processes: its free space may move a little between the calls
    assert abs(float(value) * scale - free) <= 0.05 * scale + 0.01 * free


def test_sizes_read_as_people_read_them():
    assert [user_errors.readable_size(n) for n in (0, 999, 12_000_000, 1_500_000_000, 3e12)] == [
        "0.0 B",
        "999.0 B",
        "12.0 MB",
        "1.5 GB",
        "3.0 TB",
    ]


@pytest.mark.slow  # seconds in a subprocess: the full suite runs it, the fast tier stays under 90 s
def test_cuda_without_a_gpu_through_the_command_line(tmp_path):
    """The real `python -m grpokit` (the test process hides GPUs: CUDA_VISIBLE_DEVICES is empty)."""
    result = subprocess.run(
        [sys.executable, "-m", "grpokit", "train", "device=cuda", f"output_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "device=cuda but torch sees no CUDA GPU" in errors[0], result.stderr


def test_a_torn_last_metrics_line_is_left_out_of_the_report(tmp_path):
    """A run killed while writing a metrics line still has a report: the torn line alone is dropped."""
    from grpokit.report import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 0.5}]


# ----------------------------------------------------------------------------- the working directory


def test_every_test_runs_in_its_own_empty_directory(tmp_path):
    """A test starts in its own tmp_path (tests/conftest.py), not where pytest was started: a checkout
    in which `python3 -m grpokit train` wrote runs/addition cannot reach any test."""
    assert Path.cwd() == tmp_path and Path.cwd() != REPO_ROOT
    assert list(tmp_path.iterdir()) == []


def _fake_earlier_run(directory: Path) -> None:
    """What the README's first command leaves behind: a run in runs/addition (the preset's output_dir)."""
    run = directory / "runs" / "addition"
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    (run / "checkpoint-1" / "state.pt").write_bytes(b"not a real state")


# the two tests that broke in a pytest started beside an earlier run (see below)
BESIDE_AN_EARLIER_RUN = [
    "tests/config/test_config_and_cli.py::test_bad_config_fails_before_any_model_is_loaded",
    "tests/test_cli_errors.py::test_every_test_runs_in_its_own_empty_directory",
]


def test_the_tests_run_beside_an_earlier_run_exist():
    named = named_tests(" ".join(BESIDE_AN_EARLIER_RUN), REPO_ROOT)
    assert list(named) == BESIDE_AN_EARLIER_RUN and all(named.values()), named


@pytest.mark.slow
def test_the_suite_passes_where_an_earlier_run_lives(tmp_path):
    """The README's order on a fresh clone: `python3 -m grpokit train` (writes runs/addition), then
    `python3 -m pytest` from the same directory. The two tests that broke there run in a pytest started
    from a directory holding such a run (each CLI call without output_dir would stop on it). The one
    that runs in-process stands for both (the other starts the same command in two more processes),
    with the check that the test's directory is its own."""
    started_in = tmp_path / "checkout"
    started_in.mkdir()
    _fake_earlier_run(started_in)
    tests = BESIDE_AN_EARLIER_RUN
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:benchmark",  # pytest-benchmark would create its .benchmarks folder where pytest starts
            "--rootdir",
            str(REPO_ROOT),
            "-c",
            str(REPO_ROOT / "pyproject.toml"),
            "--basetemp",
            str(tmp_path / "basetemp"),
            *(str(REPO_ROOT / test) for test in tests),
        ],
        cwd=started_in,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and f"{len(tests)} passed" in result.stdout, result.stdout[-3000:]
    # the earlier run is untouched and nothing else was written where pytest was started
    assert sorted(p.relative_to(started_in).as_posix() for p in started_in.rglob("*")) == [
        "runs",
        "runs/addition",
        "runs/addition/checkpoint-1",
        "runs/addition/checkpoint-1/state.pt",
        "runs/addition/metrics.jsonl",
    ]


def test_the_presets_micro_batch_adapts_to_a_smaller_step_and_only_yours_is_refused(capsys):
    """The addition preset's micro_batch_size=128 does not divide 2 prompts × 4 completions: left to the
    preset it becomes the largest divisor (8), as an unset one does; set by the user it is refused."""
    assert main(["print-config", "prompts_per_step=2", "num_generations=4"]) == 0
    printed = capsys.readouterr().out
    assert "\nmicro_batch_size: 8\n" in printed and "# preset addition\nmicro_batch_size" not in printed
    assert main(["print-config", "prompts_per_step=2", "num_generations=4", "micro_batch_size=128"]) == 2
    said = capsys.readouterr().err
    assert "must be divisible by micro_batch_size=128" in said and "Traceback" not in said


def test_print_config_shows_a_reward_models_config_and_eval_help_lists_what_eval_reads(capsys):
    assert main(["print-config", "reward_addition"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# a reward model's config (grpokit reward)") and "\nbatch_size: " in printed
    assert main(["print-config", "no_such_option=1"]) == 2  # neither config: the train config's error
    assert "unknown key 'no_such_option'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    shown = capsys.readouterr().out
    assert (
        "  num_eval_prompts = " in shown and "  pass_at_k = " in shown and "  learning_rate = " not in shown
    )
    for command in ("export", "report", "demo"):  # each says what it does, beyond its one-line help
        with pytest.raises(SystemExit):
            main([command, "--help"])
        description = capsys.readouterr().out.split("\n\n", 2)[1]
        assert len(description) > 150 and description.rstrip().endswith("."), (command, description)


def test_key_value_items_may_follow_an_option(tmp_path, capsys):
    """`grpokit serve-policy MODEL --port 8001 dtype=bfloat16` (as docs/async.md writes it) and
    `grpokit doctor --gpu-memory 8GiB KEY=VALUE`: the items after an option are the command's items,
    in order; an unknown option is still refused."""
    from grpokit.cli import build_parser

    assert main(["doctor", "--gpu-memory", "8GiB", "num_generations=1"]) == 2
    assert "num_generations" in capsys.readouterr().err  # the item reached the config
    with pytest.raises(SystemExit):
        main(["eval", "model=tiny", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
    args, extra = build_parser().parse_known_args(["serve-policy", "m", "a=1", "--port", "9", "b=2"])
    assert (args.items, extra, args.port) == (["a=1"], ["b=2"], 9)  # main() appends extra to items
