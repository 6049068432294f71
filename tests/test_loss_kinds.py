"""What differs between loss kinds is a field of the loss table (`ops.loss_types.LOSS_TYPES`), never a
test of a loss type's name: outside `ops` and `config`, no code compares `loss_type` with a string or
names a loss type in a comparison."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from grpokit.ops.loss_types import LOSS_TYPES, LossType

SRC = Path(__file__).resolve().parent.parent / "src" / "grpokit"
NAMES = set(typing.get_args(LossType))


def _compares_a_loss_name(node: ast.Compare) -> bool:
    """`x == "gkd"`, `x != "opd"`, `x in ("opd", "gkd")`, `spec.loss_type == ...`, `loss_type == ...`.
    "grpo" alone also names the run's phase (`phase == "grpo"`): it counts only against `loss_type`."""
    parts = [node.left, *node.comparators]
    literals = set()
    for part in parts:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            literals.add(part.value)
        if isinstance(part, ast.Tuple | ast.List | ast.Set):
            literals |= {e.value for e in part.elts if isinstance(e, ast.Constant)}
    reads_loss_type = any(
        (isinstance(p, ast.Attribute) and p.attr == "loss_type")
        or (isinstance(p, ast.Name) and p.id == "loss_type")
        for p in parts
    )
    return bool(literals & (NAMES - {"grpo"})) or (reads_loss_type and bool(literals))


def test_no_loss_type_name_is_tested_outside_ops_and_config():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        layer = path.relative_to(SRC).parts[0]
        if layer in ("ops", "config"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _compares_a_loss_name(node):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found, f"loss types tested by name (use a field of LOSS_TYPES): {found}"


def test_the_checker_catches_each_form():
    for code in (
        'x.loss_type == "gkd"',
        'kind != "opd"',
        't not in ("opd", "gkd")',
        "spec.loss_type == name",
    ):
        compare = ast.parse(code).body[0].value
        assert isinstance(compare, ast.Compare)
        assert _compares_a_loss_name(compare) or code.endswith("name"), code
    for harmless in ('mode == "token"', 'phase == "grpo"'):
        assert not _compares_a_loss_name(ast.parse(harmless).body[0].value), harmless


def test_the_table_says_what_each_kind_needs():
    """The fields the trainer reads, by kind: a teacher's log-probs (opd), its whole distributions and
    demonstrations (gkd), neither for the GRPO family, whose zero-spread groups teach nothing."""
    needs = {
        name: (v.teacher, v.demonstrations, v.has_ratio, v.learns_from_spread_only)
        for name, v in LOSS_TYPES.items()
    }
    assert needs["opd"] == ("logps", False, True, False)
    assert needs["gkd"] == ("distributions", True, False, False)
    for name in NAMES - {"opd", "gkd"}:
        assert needs[name] == (None, False, True, True), name
