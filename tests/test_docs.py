"""The docs (docs/, Sphinx with MyST Markdown): built offline with warnings as errors, their reference
pages what the code generates now, and every relative link of the README and the docs resolving."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")  # a Markdown link's target, without its anchor


def _script():
    spec = importlib.util.spec_from_file_location(
        "grpokit_docs_reference", ROOT / "scripts" / "docs_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_what_the_code_generates(capsys):
    """An option, default, description or command changed without regenerating the reference fails
    here, naming the page and the command that regenerates it."""
    assert _script().main(["--check"]) == 0, capsys.readouterr().out


def test_every_config_option_appears_in_the_reference_with_its_description():
    from grpokit.config.reference import CONFIGS

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    for schema in CONFIGS:
        for name, field in schema.model_fields.items():
            assert f"| `{name}` |" in page, (schema.__name__, name)
            assert field.description, (schema.__name__, name)  # (the schema refuses one without, too)


@pytest.mark.slow  # a whole Sphinx build (2.6 s): the full suite runs it, the fast tier stays under 75 s
def test_the_docs_build_offline_with_warnings_as_errors(tmp_path):
    """Sphinx reads every page (no network: the suite blocks it), and any warning (a broken cross
    reference, a missing image, a page in no table of contents) fails the build."""
    import warnings

    from sphinx.cmd.build import build_main

    arguments = ["-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(tmp_path / "html")]
    with warnings.catch_warnings():  # myst-parser's use of Sphinx APIs Sphinx plans to remove: not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        assert build_main(arguments) == 0
    assert (tmp_path / "html" / "reference" / "config.html").is_file()
    api = (tmp_path / "html" / "reference" / "api.html").read_text()  # autodoc found the functions
    assert "grpo_loss" in api and "GRPO-family policy loss" in api and "GRPOTrainer" in api


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, _ in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_alert_has_its_troubleshooting_entry():
    """Each alert the trainer fires (train/alerts.py: its _fire and Alert calls, and the threshold
    alerts of ABOVE) has a `### name` entry in docs/troubleshooting.md, and each threshold of
    config/alerts.py is named there."""
    from grpokit.config.alerts import ALERT_THRESHOLDS
    from grpokit.train.alerts import ABOVE

    source = (ROOT / "src" / "grpokit" / "train" / "alerts.py").read_text()
    fired = set(re.findall(r'(?:_fire|Alert)\(\s*step,\s*"(\w+)"', source)) | set(ABOVE)
    assert {"non_finite", "entropy_collapse", "length_blowup", "zero_spread", "reward_hacking"} <= fired
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert [name for name in sorted(fired) if f"### `{name}`" not in page] == []
    assert [name for name in ALERT_THRESHOLDS if f"`{name}`" not in page] == []


def test_metric_patterns_match_the_keys_runs_write_and_nothing_else():
    from grpokit.train.metric_names import describe, undescribed

    logged = [
        "rewards/exact_answer/mean",
        "rewards/remote:127.0.0.1:8000/score/std",  # a reward server's name holds slashes
        "eval/pass@8",
        "eval/calibration/0.5-1/accuracy",
        "eval/rewards/format_tags/mean",
        "async/staleness",
    ]
    assert undescribed(logged) == []
    assert describe("eval/accuracy").startswith("held-out: ")
    assert undescribed(["rewards/x/median", "pass@k", "calibration/a-b/count", "clip_ratio/low_max"]) == [
        "calibration/a-b/count",
        "clip_ratio/low_max",
        "pass@k",
        "rewards/x/median",
    ]


def _long_paragraphs(limit: int = 10) -> list[str]:
    """Prose paragraphs of docs/*.md over `limit` lines (code blocks, lists, tables, headings and the
    generated reference pages aside)."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if "reference" in page.relative_to(ROOT / "docs").parts:
            continue
        in_code, paragraph, start = False, [], 0
        for number, line in enumerate([*page.read_text().splitlines(), ""], 1):
            if line.strip().startswith("```"):
                in_code, paragraph = not in_code, []
                continue
            if in_code:
                continue
            if line.strip():
                start = start if paragraph else number
                paragraph.append(line)
                continue
            first = paragraph[0].lstrip() if paragraph else ""
            prose = first and not first.startswith(("|", "-", "*", "#", ">", "{")) and not first[0].isdigit()
            if prose and len(paragraph) > limit:
                found.append(f"{page.relative_to(ROOT)}:{start} ({len(paragraph)} lines)")
            paragraph = []
    return found


def test_no_paragraph_in_the_docs_is_over_ten_lines():
    """The docs read as references: a longer paragraph becomes a list, a table or several paragraphs."""
    assert _long_paragraphs() == []
    assert len(_long_paragraphs(limit=4)) > 20  # (the walk does find paragraphs: many run over 4 lines)


def test_every_module_of_src_is_in_the_maintainers_map():
    """docs/reference/modules.md (linked from docs/maintainers.md) names every module of src/grpokit,
    under its folder, with a one-line job from its docstring: a module without one fails here."""
    page = (ROOT / "docs" / "reference" / "modules.md").read_text()
    assert "reference/modules.md" in (ROOT / "docs" / "maintainers.md").read_text()
    src = ROOT / "src" / "grpokit"
    sections = re.split(r"^## `(.+?)/`$", page, flags=re.MULTILINE)
    listed = {folder: body for folder, body in zip(sections[1::2], sections[2::2], strict=True)}
    for module in sorted(src.rglob("*.py")):
        body = listed.get(str(module.parent.relative_to(src.parent)), "")
        row = re.search(rf"^\| `{re.escape(module.name)}` \| (.+) \|$", body, flags=re.MULTILINE)
        assert row is not None and len(row.group(1)) > 10, module.relative_to(ROOT)
