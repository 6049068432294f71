"""Sphinx configuration of grpokit's docs: Markdown pages read by MyST, built offline (no intersphinx,
no remote images or themes) with warnings as errors (tests/test_docs.py)."""

project = "grpokit"
author = "the grpokit authors"
extensions = ["myst_parser", "sphinx.ext.autodoc"]  # autodoc: the API reference
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # `[text](page.md#a-heading)` links resolve
myst_enable_extensions = ["colon_fence"]
html_theme = "alabaster"  # (shipped with Sphinx: nothing fetched)
html_static_path: list[str] = []
suppress_warnings: list[str] = []
autodoc_typehints = "description"  # (signatures stay short; types listed with the parameters)


def _verbatim(app, what, name, obj, options, lines):  # noqa: ARG001 - Sphinx's event signature
    """grpokit's docstrings are plain text (shape comments, formulas), not reStructuredText: each is
    shown as written, as a literal block."""
    if lines:
        lines[:] = ["::", "", *("    " + line for line in lines), ""]


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim)
