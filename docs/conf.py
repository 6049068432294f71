"""Sphinx configuration of grpokit's docs: Markdown pages read by MyST, built offline (no intersphinx,
no remote images or themes) with warnings as errors (tests/test_docs.py)."""

project = "grpokit"
author = "the grpokit authors"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # `[text](page.md#a-heading)` links resolve
myst_enable_extensions = ["colon_fence"]
html_theme = "alabaster"  # (shipped with Sphinx: nothing fetched)
html_static_path: list[str] = []
suppress_warnings: list[str] = []
