"""The JSON and JSONL files a run leaves (train/run_files.py): everything grpokit's writers write is
read back, anything else is one line naming the file, the line and the field, and `grpokit report`
shows no traceback and no unescaped content from them."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from grpokit.cli import main
from grpokit.report import _file_name, write_report
from grpokit.train.alerts import Alert, AlertWatch
from grpokit.train.metrics import MetricsWriter, truncate_metrics_after, write_sft_metrics
from grpokit.train.reward import pair_metrics
from grpokit.train.reward_diagnostics import ScoredPairs, reward_diagnostics
from grpokit.train.run_files import (
    AlertRow,
    Calibration,
    MetricsRow,
    RewardDiagnostics,
    RunFileError,
    SftMetricsRow,
    check_run_files,
    read_json,
    read_jsonl,
)

GOOD = '{"step": 1, "loss": 0.5}\n'  # a metrics.jsonl line as MetricsWriter writes it
ALERT = {"step": 1, "name": "kl", "value": 0.9, "threshold": 0.5, "advice": "raise beta"}
SCRIPT = "<script>alert(1)</script>"
DAMAGED_LINE = "the file was edited or damaged: repair or delete that line"


def _lines(*rows: object) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _diagnostics(padding: dict | None = None, nan: bool = False) -> dict:
    """reward_diagnostics.json as train/reward.py writes it, from real scored pairs."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 30, (2, 40), generator=g)  # [2, 40]
    scores = 0.1 * lengths + torch.randn(2, 40, generator=g)  # [2, 40]
    if nan:
        scores[0, 0] = float("nan")
    pairs = ScoredPairs(scores[0] + 1, scores[1], lengths[0], lengths[1])
    found = reward_diagnostics(pairs, pair_metrics(pairs), padding or {"num_sequences": 0})
    return json.loads(json.dumps(found | {"step": 3}))


def _run_dir(tmp_path, files: dict[str, str | bytes]):
    run = tmp_path / "run"
    run.mkdir()
    for name, content in ({"metrics.jsonl": GOOD} | files).items():
        (run / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return run


def _report_error(tmp_path, capsys, files: dict[str, str | bytes]) -> str:
    """`grpokit report` of a run holding `files` (beside a good metrics.jsonl unless given): exit 2,
    the error line and the --debug hint only. Returns the error line."""
    run = _run_dir(tmp_path, files)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[1] == "(run with --debug for the traceback)", lines
    assert lines[0].startswith("grpokit report: error: "), lines
    return lines[0]


def _report_ok(tmp_path, capsys, files: dict[str, str | bytes]) -> str:
    """`grpokit report` of a run holding `files` succeeds; returns the page."""
    run = _run_dir(tmp_path, files)
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    return (run / "report" / "index.html").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- what the writers write


@pytest.mark.custom_metrics  # a bool "flag": the writer's handling of a bool tensor
def test_every_row_metrics_writer_writes_is_read_back(tmp_path):
    writer = MetricsWriter(tmp_path)
    metrics = {
        "loss": torch.tensor(0.25),
        "grad_norm": torch.tensor(float("inf")),  # not finite: written as null
        "kl": float("nan"),
        "num_pairs": 16,
        "skipped_update": 0.0,
        "flag": torch.tensor(True),  # a bool tensor's .item() is a bool
        "env/reward": torch.tensor(-3.5, dtype=torch.float64),
    }
    for step in range(4):
        writer.write(step, metrics)
    writer.write(3, {"accuracy": 0.5, "calibration/0-0.5/count": 3.0}, prefix="eval/")
    writer.close()
    path = tmp_path / "metrics.jsonl"
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert read_jsonl(path, MetricsRow) == written
    assert written[0]["grad_norm"] is None and written[0]["flag"] is True
    truncate_metrics_after(tmp_path, 2)  # a resume at step 2 keeps the rows as written
    assert path.read_text() == "".join(json.dumps(row) + "\n" for row in written[:3])


def test_the_warm_start_rows_are_read_back_with_a_loss_that_was_not_finite(tmp_path):
    write_sft_metrics(tmp_path, [0.75, float("nan"), float("inf"), 0.5])
    rows = read_jsonl(tmp_path / "sft_metrics.jsonl", SftMetricsRow)
    assert [r["sft_step"] for r in rows] == [1, 2, 3, 4] and math.isnan(rows[1]["sft/loss"])


def test_every_alert_the_watch_writes_is_read_back_and_resumed(tmp_path):
    watch = AlertWatch({"kl": 1})  # an int threshold, as a config may give it
    fired = watch.update(1, {"kl": 5.0, "loss": 0.1})
    fired += watch.update(2, {"loss": float("nan"), "skipped_update": 1.0})
    assert sorted(a.name for a in fired) == ["kl", "non_finite"]
    AlertWatch.write(tmp_path, fired + [Alert(3, "zero_spread", 0.75, 0.5, "")])
    (tmp_path / "metrics.jsonl").write_text(_lines({"step": 1, "kl": 5.0, "loss": 0.1}))
    rows = read_jsonl(tmp_path / "alerts.jsonl", AlertRow)
    assert [r["name"] for r in rows] == ["kl", "non_finite", "zero_spread"]
    resumed = AlertWatch()
    resumed.resume(tmp_path, 2)
    assert resumed.fired == {"kl", "non_finite"}
    assert [r["step"] for r in read_jsonl(tmp_path / "alerts.jsonl", AlertRow)] == [1, 2]


@pytest.mark.parametrize(
    "padding",
    [
        {"num_sequences": 0},
        {
            "num_sequences": 16,
            "max_abs_delta": float("nan"),
            "left": 0.5,
            "right": 0.25,
            "max_padding": 9,
            "num_padded": 15,
            "compute_dtype": "bfloat16",
            "tolerance": 5e-2,
            "invariant": False,
        },
    ],
)
def test_the_reward_diagnostics_and_calibration_a_reward_run_writes_are_read_back(tmp_path, padding):
    found = _diagnostics(padding, nan=True)
    (tmp_path / "reward_diagnostics.json").write_text(json.dumps(found, indent=1))
    g = torch.Generator().manual_seed(1)
    pairs = ScoredPairs(
        torch.randn(8, generator=g), torch.randn(8, generator=g), torch.ones(8), torch.ones(8)
    )
    (tmp_path / "calibration.json").write_text(json.dumps(pair_metrics(pairs), indent=1))
    diagnostics = read_json(tmp_path / "reward_diagnostics.json", RewardDiagnostics)
    assert diagnostics.step == 3 and diagnostics.num_pairs == 40
    assert diagnostics.padding_invariance.num_sequences == padding["num_sequences"]
    assert read_json(tmp_path / "calibration.json", Calibration).num_pairs == 8
    check_run_files(tmp_path)


def test_a_run_directory_without_those_files_is_fine_and_a_damaged_one_names_its_file(tmp_path):
    check_run_files(tmp_path)  # nothing to read
    (tmp_path / "metrics.jsonl").write_text(GOOD)
    (tmp_path / "calibration.json").write_text('{"accuracy": 0.5}')
    with pytest.raises(RunFileError, match=re.escape("calibration.json: 'margin' is missing")):
        check_run_files(tmp_path)
    (tmp_path / "calibration.json").unlink()
    (tmp_path / "alerts.jsonl").write_text(_lines(ALERT, ALERT | {"step": -1}))
    with pytest.raises(RunFileError, match=re.escape("alerts.jsonl: line 2: 'step' must be a whole number")):
        check_run_files(tmp_path)


# ----------------------------------------------------------------------------- the readers' lines


def test_a_field_of_the_wrong_type_is_named_with_its_file_line_and_the_fix(tmp_path):
    path = tmp_path / "alerts.jsonl"
    path.write_text(_lines(ALERT, ALERT | {"step": 2}) + '{"step": "two"}\n')
    with pytest.raises(RunFileError) as caught:
        read_jsonl(path, AlertRow)
    assert str(caught.value) == (
        f"{path}: line 3: 'step' must be a whole number of at least 0 (got 'two'); {DAMAGED_LINE}"
    )


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("[1, 2]", "line 2 is not a JSON object (got a list)"),
        ('"step"', "line 2 is not a JSON object (got 'step')"),
        ('{"loss": 0.4}', "line 2: 'step' is missing"),
        ('{"step": true}', "line 2: 'step' must be a whole number of at least 0 (got true)"),
        ('{"step": 2.0}', "line 2: 'step' must be a whole number of at least 0 (got 2.0)"),
        ('{"step": 99999999999999999999}', "line 2: 'step' is too large"),
        ('{"step": 2, "loss": "low"}', "line 2: 'loss' must be a number or null (got 'low')"),
        ('{"step": 2, "a\\nb": [1]}', "line 2: 'a\\nb' must be a number or null (got a list)"),
        ('{"step": 2, "loss": 1e400e}', "line 2 is not valid JSON (Expecting ',' delimiter at column 26)"),
        (
            '{"step": 2, "x": ' + "9" * 5000 + "}",
            "line 2 cannot be read as JSON (a number of more than 4300 digits)",
        ),
        (
            '{"step": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "line 2 cannot be read as JSON (nested too",
        ),
    ],
    ids=[
        "list",
        "string",
        "no step",
        "bool step",
        "float step",
        "huge step",
        "string value",
        "list value",
        "not json",
        "huge int",
        "deep",
    ],
)
def test_a_metrics_line_that_is_not_a_row_is_one_line(tmp_path, line, said):
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + line + "\n" + GOOD)
    with pytest.raises(RunFileError) as caught:
        read_jsonl(path, MetricsRow)
    message = str(caught.value)
    assert message.startswith(f"{path}: {said}") and message.endswith(DAMAGED_LINE), message
    assert "\n" not in message and len(message) < 300, message


def test_a_byte_that_is_not_utf8_is_named_by_line_and_column(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(GOOD.encode() + b'{"step": 2, "lo\xffss": 0.4}\n')
    with pytest.raises(RunFileError, match=re.escape("line 2 is not valid UTF-8 (byte 0xff at column 16)")):
        read_jsonl(path, MetricsRow)
    diagnostics = tmp_path / "reward_diagnostics.json"
    diagnostics.write_bytes(b'{\n "num_pairs": 3,\n "step": "\xe9"\n}')
    with pytest.raises(RunFileError, match=re.escape("line 3 is not valid UTF-8 (byte 0xe9 at column 11)")):
        read_json(diagnostics, RewardDiagnostics)


def test_blank_lines_and_a_torn_last_line_are_left_out_a_torn_middle_line_is_not(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n" + GOOD + "  \n\n" + '{"step": 2}\r\n' + '{"step": 3, "lo')
    assert read_jsonl(path, MetricsRow) == [{"step": 1, "loss": 0.5}, {"step": 2}]
    path.write_text(GOOD + '{"step": 3}')  # whole, only the newline is missing: kept
    assert read_jsonl(path, MetricsRow)[-1] == {"step": 3}
    path.write_text(GOOD + '{"step": 3, "lo\n' + GOOD)
    with pytest.raises(RunFileError, match="line 2 is not valid JSON"):
        read_jsonl(path, MetricsRow)


def test_a_nested_field_is_named_by_its_path(tmp_path):
    path = tmp_path / "reward_diagnostics.json"
    found = _diagnostics()
    found["calibration"]["buckets"][2]["count"] = "3"
    path.write_text(json.dumps(found, indent=1))
    with pytest.raises(RunFileError) as caught:
        read_json(path, RewardDiagnostics)
    assert str(caught.value) == (
        f"{path}: 'calibration.buckets[2].count' must be a whole number of at least 0 (got '3'); "
        "the file was edited or damaged: repair or delete it"
    )
    found = _diagnostics()
    found["length_bias"]["points"]["chosen"][0] = [3]
    path.write_text(json.dumps(found))
    with pytest.raises(
        RunFileError, match=re.escape("'length_bias.points.chosen[0]' must be a [tokens, score]")
    ):
        read_json(path, RewardDiagnostics)


# ----------------------------------------------------------------------------- resuming from damaged files


def test_a_resume_refuses_a_damaged_metrics_line_and_changes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + "[1]\n" + GOOD)
    before = path.read_bytes()
    with pytest.raises(RunFileError, match="metrics.jsonl: line 2 is not a JSON object"):
        truncate_metrics_after(tmp_path, 1)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_an_alert_resume_refuses_a_damaged_file_before_it_changes_alerts_jsonl(tmp_path):
    alerts = tmp_path / "alerts.jsonl"
    alerts.write_text(_lines(ALERT, ALERT | {"step": 5, "name": "entropy_collapse"}))
    (tmp_path / "metrics.jsonl").write_text(GOOD + '{"step": "2"}\n')
    before = alerts.read_bytes()
    with pytest.raises(RunFileError, match=re.escape("metrics.jsonl: line 2: 'step' must be")):
        AlertWatch().resume(tmp_path, 2)
    assert alerts.read_bytes() == before  # not yet cut at step 2
    alerts.write_text(_lines(ALERT | {"name": ""}))
    with pytest.raises(
        RunFileError, match=re.escape("alerts.jsonl: line 1: 'name' must be a non-empty string")
    ):
        AlertWatch().resume(tmp_path, 2)
    AlertWatch().resume(tmp_path, 0)  # a fresh start reads neither: it starts a new alerts.jsonl
    assert not alerts.exists()


# ----------------------------------------------------------------------------- grpokit report


def test_report_a_metrics_row_that_is_not_an_object(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"metrics.jsonl": GOOD + "[1, 2]\n"})
    assert f"{tmp_path / 'run' / 'metrics.jsonl'}: line 2 is not a JSON object (got a list)" in line


def test_report_a_metrics_row_without_a_step(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"metrics.jsonl": GOOD + '{"loss": 0.4}\n'})
    assert "metrics.jsonl: line 2: 'step' is missing; " + DAMAGED_LINE in line


def test_report_a_step_that_is_not_a_whole_number(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"metrics.jsonl": GOOD + json.dumps({"step": SCRIPT}) + "\n"})
    assert "metrics.jsonl: line 2: 'step' must be a whole number of at least 0 (got '<script>al" in line


def test_report_a_metric_value_that_is_not_a_number(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"metrics.jsonl": GOOD + '{"step": 2, "loss": "low"}\n'})
    assert "metrics.jsonl: line 2: 'loss' must be a number or null (got 'low')" in line


def test_report_a_metrics_line_that_is_not_utf8(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"metrics.jsonl": GOOD.encode() + b'{"step": 2, "\xff": 1}\n'})
    assert "metrics.jsonl: line 2 is not valid UTF-8 (byte 0xff at column 14)" in line


def test_report_a_metrics_line_nested_past_the_recursion_limit(tmp_path, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    line = _report_error(tmp_path, capsys, {"metrics.jsonl": GOOD + f'{{"step": 2, "x": {deep}}}\n'})
    assert "metrics.jsonl: line 2 cannot be read as JSON (nested too deeply)" in line


def test_report_a_metrics_line_with_an_integer_of_thousands_of_digits(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"metrics.jsonl": GOOD + '{"step": ' + "9" * 5000 + "}\n"})
    assert "metrics.jsonl: line 2 cannot be read as JSON (a number of more than 4300 digits)" in line


def test_report_an_alert_without_a_name(tmp_path, capsys):
    alert = {k: v for k, v in ALERT.items() if k != "name"}
    line = _report_error(tmp_path, capsys, {"alerts.jsonl": _lines(ALERT, alert)})
    assert "alerts.jsonl: line 2: 'name' is missing" in line


def test_report_an_alert_value_that_is_not_a_number(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"alerts.jsonl": _lines(ALERT | {"value": "big"})})
    assert "alerts.jsonl: line 1: 'value' must be a number (got 'big')" in line


def test_report_a_warm_start_row_without_its_step(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"sft_metrics.jsonl": _lines({"sft/loss": 0.4})})
    assert "sft_metrics.jsonl: line 1: 'sft_step' is missing" in line


def test_report_reward_diagnostics_that_are_a_list(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"reward_diagnostics.json": "[1, 2]"})
    assert "reward_diagnostics.json is not a JSON object (got a list)" in line


def test_report_reward_diagnostics_with_a_field_of_the_wrong_type(tmp_path, capsys):
    found = _diagnostics()
    found["accuracy_by_margin"][1]["accuracy"] = "high"
    line = _report_error(tmp_path, capsys, {"reward_diagnostics.json": json.dumps(found)})
    assert "reward_diagnostics.json: 'accuracy_by_margin[1].accuracy' must be a number or null" in line


def test_report_reward_diagnostics_with_a_step_that_is_html(tmp_path, capsys):
    line = _report_error(
        tmp_path, capsys, {"reward_diagnostics.json": json.dumps(_diagnostics() | {"step": SCRIPT})}
    )
    assert "reward_diagnostics.json: 'step' must be a whole number of at least 0" in line


def test_report_reward_diagnostics_that_are_not_utf8(tmp_path, capsys):
    line = _report_error(tmp_path, capsys, {"reward_diagnostics.json": b'{"num_pairs": "\xff"}'})
    assert "reward_diagnostics.json: line 1 is not valid UTF-8 (byte 0xff at column 16)" in line


def test_report_an_alert_name_matplotlib_would_read_as_math(tmp_path, capsys):
    page = _report_ok(tmp_path, capsys, {"alerts.jsonl": _lines(ALERT | {"name": "$\\foo$"})})
    assert "$\\foo$" in page


def test_report_metric_values_too_large_to_plot(tmp_path, capsys):
    rows = _lines({"step": 1, "loss": 1e308}, {"step": 2, "loss": -1e308}, {"step": 3, "loss": 0.5})
    page = _report_ok(tmp_path, capsys, {"metrics.jsonl": rows})
    assert "src='loss.png'" in page


def test_report_a_config_that_is_not_utf8(tmp_path, capsys):
    page = _report_ok(tmp_path, capsys, {"config.yaml": b"model: caf\xe9\n"})
    assert "model: caf\ufffd" in page


def test_the_report_escapes_every_string_it_shows(tmp_path, capsys):
    """HTML in every string field of the run's files the page shows: none of it is markup there (the
    page has no script of its own)."""
    name = "eval/" + SCRIPT
    metrics = _lines({"step": 1, "loss": 0.5}, {"step": 1, name: 0.5, "eval/accuracy": 0.25, "../../evil": 1})
    alert = ALERT | {"name": SCRIPT, "advice": SCRIPT + "<img src=x onerror=alert(1)>"}
    found = _diagnostics(
        {"num_sequences": 4, "max_abs_delta": 0.1, "compute_dtype": SCRIPT, "invariant": True}
    )
    for bucket in found["calibration"]["buckets"] + found["accuracy_by_margin"]:
        bucket["bucket"] = SCRIPT
    page = _report_ok(
        tmp_path,
        capsys,
        {
            "metrics.jsonl": metrics,
            "alerts.jsonl": _lines(alert),
            "config.yaml": f"model: {SCRIPT}\n",
            "reward_diagnostics.json": json.dumps(found),
        },
    )
    assert "<script" not in page.lower() and "<img src=x" not in page
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert page.count(escaped) >= 5  # the metric name, the alert, its advice, the config, the dtype
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["alerts.jsonl", "config.yaml", "metrics.jsonl", "report", "reward_diagnostics.json"]
    )
    assert "Reward model diagnostics" in page and (run / "report" / "calibration.png").is_file()


def test_a_figure_file_name_stays_in_the_report_directory():
    assert _file_name("../../x") == "______x" and _file_name("/etc/passwd") == "_etc_passwd"
    assert _file_name("") == "_" and _file_name("zero_spread") == "zero_spread"


def test_a_report_of_a_real_run_reads_every_file_it_wrote(tmp_path):
    """The report of a run written by MetricsWriter, write_sft_metrics and AlertWatch.write."""
    run = tmp_path / "run"
    writer = MetricsWriter(run)
    for step in range(1, 4):
        writer.write(step, {"loss": torch.tensor(0.5 / step), "reward": 0.25 * step, "kl": float("nan")})
    writer.write(3, {"accuracy": 0.5}, prefix="eval/")
    writer.close()
    write_sft_metrics(run, [1.0, float("nan"), 0.5])
    AlertWatch.write(run, AlertWatch({"kl": 0.1}).update(2, {"kl": 0.5}))
    page = write_report(run).read_text()
    assert "4 metric rows, last step 3" in page and "src='sft_loss.png'" in page and ">kl<" in page


def test_every_plot_names_its_y_axis_and_a_series_at_0_throughout_is_a_note(tmp_path, monkeypatch):
    """The clip ratios with one update a batch are 0 at every step: not drawn as flat lines; the
    clipping plot, with nothing else to draw, is left out and named in a note. Every plot drawn names
    its y axis with the unit (the warm start's loss too)."""
    import matplotlib.axes

    from grpokit.report import PLOTS, SFT_PLOT

    named: dict[str, str] = {}
    set_title = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "set_title",
        lambda ax, title, *a, **k: (named.__setitem__(title, ax.get_ylabel()), set_title(ax, title, *a, **k))[
            1
        ],
    )
    run = tmp_path / "run"
    writer = MetricsWriter(run)
    for step in range(1, 4):
        zeros = {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0}
        writer.write(step, {"reward": 0.25 * step, "entropy": 0.0, "entropy/target": 0.5} | zeros)
    writer.close()
    write_sft_metrics(run, [1.0, 0.5])
    page = write_report(run).read_text()
    assert "src='clipping.png'" not in page and not (run / "report" / "clipping.png").exists()
    assert (
        "clipping: clip_ratio/region_mean, clip_ratio/low_mean, clip_ratio/high_mean 0 at every step" in page
    )
    assert named == {
        "reward": PLOTS["reward"][1],
        "entropy": PLOTS["entropy"][1],  # (entropy itself 0 throughout: noted on the plot, not drawn)
        "sft_loss": SFT_PLOT[2],
    }
    assert all(label and "(" in label for _, label in PLOTS.values())  # each says its unit or range
