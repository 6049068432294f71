"""Nothing grpokit reads back can run code: a walk of src/grpokit with `ast` finds every call that could
unpickle (torch.load, pickle.load(s), marshal, dill, cloudpickle, joblib, numpy.load with pickles).

* torch.load must say weights_only=True (tensors and plain values only);
* pickle.loads is allowed only where the bytes come from a live process of the same run through a
  pipe, never a file: the functions named in PIPE_UNPICKLERS, each of which reads no file;
* nothing else that unpickles is called at all.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "grpokit"

# (module, function): pickle.loads of what the trainer process pickled and sent through the pipe
PIPE_UNPICKLERS = {("train/rollout_worker.py", "_setup_from_trainer")}
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "joblib", "shelve"}
FILE_READS = {"open", "read_bytes", "read_text", "load", "loads"}


def _name(node: ast.AST) -> str:
    """`a.b.c` for an attribute chain, `f` for a name, '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    return ""


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """Every call in `tree`, with the innermost function it is in ('<module>' for none)."""
    out: list[tuple[str, ast.Call]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                out.append((where, child))
            visit(child, inner)

    visit(tree, "<module>")
    return out


def _finding(module: str, where: str, call: ast.Call) -> str | None:
    """Why `call` (in function `where` of `module`) could unpickle what it did not make; None: it cannot."""
    name = _name(call.func)
    keywords = {k.arg: k.value for k in call.keywords}
    line = f"{module}:{call.lineno} {where}: {name}"
    if name.endswith("torch.load") or (name == "load" and "weights_only" in keywords):
        return None if _is_true(keywords.get("weights_only")) else f"{line} without weights_only=True"
    parts = name.split(".")
    if parts[0] in UNPICKLING_MODULES and parts[-1] in {"load", "loads", "open", "Unpickler"}:
        allowed = (module, where) in PIPE_UNPICKLERS and name == "pickle.loads"
        return None if allowed else f"{line} (unpickles)"
    pickles = keywords.get("allow_pickle")
    if name.endswith(("numpy.load", "np.load")) and pickles is not None and not _is_false(pickles):
        return f"{line} with allow_pickle"
    return None


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _findings(tree: ast.AST, module: str) -> list[str]:
    """What in `module` could unpickle data it did not make (`module`: its path under src/grpokit)."""
    return [f for where, call in _calls(tree) if (f := _finding(module, where, call)) is not None]


@functools.cache
def _sources() -> list[tuple[str, ast.AST]]:
    return [
        (p.relative_to(SRC).as_posix(), ast.parse(p.read_text(), str(p))) for p in sorted(SRC.rglob("*.py"))
    ]


def test_nothing_in_src_unpickles_what_a_file_holds():
    findings = [f for module, tree in _sources() for f in _findings(tree, module)]
    assert findings == []


def test_the_pipe_unpicklers_exist_and_read_no_file():
    """Each allowed pickle.loads is where the list says, and its function opens and reads nothing."""
    trees = dict(_sources())
    for module, name in PIPE_UNPICKLERS:
        functions = [n for n in ast.walk(trees[module]) if isinstance(n, ast.FunctionDef) and n.name == name]
        assert len(functions) == 1, (module, name)
        calls = {_name(c.func).split(".")[-1] for c in ast.walk(functions[0]) if isinstance(c, ast.Call)}
        assert "loads" in calls and not calls & (FILE_READS - {"loads"}), (module, name, calls)


def test_the_walk_finds_what_it_must():
    """The checker itself, on code that unpickles: each of these is a finding."""
    bad = """
import io, pickle, torch, numpy as np
def a(path):
    return torch.load(path)
def b(path):
    return torch.load(path, weights_only=False)
def c(path):
    return pickle.load(open(path, "rb"))
def d(data):
    return pickle.loads(data)
def e(path):
    return np.load(path, allow_pickle=True)
def f(path):
    import dill
    return dill.loads(open(path, "rb").read())
"""
    assert [f.split(" ")[1] for f in _findings(ast.parse(bad), "x.py")] == [
        "a:",
        "b:",
        "c:",
        "d:",
        "e:",
        "f:",
    ]
    good = "import torch\ndef g(path):\n    return torch.load(path, weights_only=True)\n"
    assert _findings(ast.parse(good), "x.py") == []
