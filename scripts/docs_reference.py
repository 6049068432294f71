"""The docs' reference pages, generated from the code (docs/reference/): every config option from the
schema (`grpokit.config.reference.config_reference`), every command's `--help` from the parser, and
every metric a run logs (`grpokit.train.metric_names`).

    python3 scripts/docs_reference.py          # write them
    python3 scripts/docs_reference.py --check  # exit 1 naming each page that differs (the suite's test)

A page edited by hand, or an option, default or command changed without regenerating, fails
tests/test_docs.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "reference"
WIDTH = "100"  # argparse wraps --help to $COLUMNS: one width, so that the page is the same everywhere


def cli_page() -> str:
    """`grpokit --help` and each command's, as the parser prints them."""
    from grpokit.cli import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here
        parts = [
            "# Command line reference",
            "",
            "Generated from the parser (`python3 scripts/docs_reference.py`): each command's `--help`.",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
        ]
        for name, command in commands.items():
            parts += ["", f"## grpokit {name}", "", "```text", command.format_help().rstrip(), "```"]
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
    return "\n".join(parts) + "\n"


def config_page() -> str:
    from grpokit.config.reference import config_reference

    return config_reference()


def modules_page() -> str:
    """Every module of src/grpokit, folder by folder, with its docstring's first sentence: the part of
    the maintainers' map that cannot go stale (a module added, moved or renamed changes it)."""
    import ast

    src = ROOT / "src" / "grpokit"
    lines = [
        "# Every module",
        "",
        "Generated from the code (`python3 scripts/docs_reference.py`): each module of `src/grpokit` with",
        "the first sentence of its docstring, folder by folder. The [maintainers' map](../maintainers.md)",
        "says how the layers fit together.",
    ]
    folders: dict[str, list[Path]] = {}
    for path in sorted(src.rglob("*.py")):
        folders.setdefault(str(path.parent.relative_to(src.parent)), []).append(path)
    for folder, paths in folders.items():
        lines += ["", f"## `{folder}/`", "", "| module | what it holds |", "|---|---|"]
        for path in paths:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            first = " ".join(doc.split("\n\n")[0].split())
            first = first.split(". ")[0]
            first += "" if not first or first[-1] in ".?!:" else "."
            cell = first.replace("|", "\\|")
            lines.append(f"| `{path.name}` | {cell} |")
    return "\n".join(lines) + "\n"


def pages() -> dict[Path, str]:
    from grpokit.train.metric_names import metrics_reference

    return {
        DOCS / "cli.md": cli_page(),
        DOCS / "config.md": config_page(),
        DOCS / "metrics.md": metrics_reference(),
        DOCS / "modules.md": modules_page(),
    }


def main(argv: list[str]) -> int:
    stale = []
    for path, text in pages().items():
        if "--check" in argv:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for name in stale:
        print(f"{name} differs from what the code generates: run python3 scripts/docs_reference.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
