"""The structure of src/grpokit, read with `ast` alone (nothing is imported).

    python3 scripts/structure.py            # figures, then every finding
    python3 scripts/structure.py --list     # and every room and arrow
    python3 scripts/structure.py --json     # the same as JSON

Rooms are the modules (a package is its `__init__`). Arrows are the distinct import edges between
grpokit modules: module-level and lazy imports inside functions, relative imports resolved,
`from pkg import name` pointing at the submodule when `name` is one and at `pkg/__init__` otherwise.
Circles are strongly connected components of more than one node, among modules and among layers
(top-level folders; each top-level module is its own node). Arrows back up go from a lower layer
to a higher one in LAYERS. tests/test_package.py holds the findings as invariants.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "grpokit"
PACKAGE = "grpokit"
# Lower imports nothing higher. Top-level modules (trainer.py, cli.py, __init__.py, ...) are 5.
# presets/ holds YAML files only (its __init__ is empty): it sits at the bottom.
LAYERS = {
    "ops": 0,
    "config": 0,
    "presets": 0,
    "net": 0,
    "models": 1,
    "envs": 1,
    "data": 1,
    "rewards": 1,
    "rollout": 2,
    "engine": 3,
    "train": 4,
    "serve": 5,
}
TOP_LAYER = 5
# train/'s own order, lower first: a step's parts <- the step (and where its batch comes from) <- the
# run scaffold around steps <- the commands. A train module not named here is a finding too.
TRAIN_GROUPS = {
    "parts": (
        "alerts batch checkpoint checkpoint_state distributed evaluation events hub_push in_flight inputs "
        "memory_check metric_names metrics optim progress reward_diagnostics run_files rundir threads trainee"
    ),
    "step": "async_rollout batch_source before_update distill draw grpo_step rollout_worker sft update",
    "run scaffold": "run step_failures step_watch",
    "commands": "__init__ doctor eval_run grpo grpo_setup reward sft_run toy_demo",
}
TRAIN_LAYERS = {name: rank for rank, names in enumerate(TRAIN_GROUPS.values()) for name in names.split()}
MAX_PARAMETERS = 7
CONFIG_TYPES = ("GRPOConfig", "SFTConfig", "RewardConfig")
CONFIG_NAMES = ("cfg",)
Where = Callable[[str, int], str]  # (module, line) -> 'grpokit/path.py:line'


@dataclass(frozen=True)
class Finding:
    """One function or import, located: `where` is path:line relative to src/."""

    where: str
    name: str
    detail: str = ""


@dataclass
class Structure:
    rooms: list[str]
    arrows: list[tuple[str, str]]
    module_circles: list[list[str]]
    layer_circles: list[list[str]]
    arrows_back_up: list[tuple[str, str]]
    train_arrows_back_up: list[tuple[str, str]] = field(default_factory=list)  # within train/ (TRAIN_GROUPS)
    train_unplaced: list[str] = field(default_factory=list)  # train modules TRAIN_GROUPS does not name
    private_imports: list[Finding] = field(default_factory=list)
    long_functions: list[Finding] = field(default_factory=list)
    config_functions: list[Finding] = field(default_factory=list)

    def figures(self) -> dict[str, int]:
        return {
            "rooms": len(self.rooms),
            "arrows": len(self.arrows),
            "module circles": len(self.module_circles),
            "layer circles": len(self.layer_circles),
            "arrows back up": len(self.arrows_back_up),
            "train/ arrows back up": len(self.train_arrows_back_up) + len(self.train_unplaced),
            "private names across modules": len(self.private_imports),
            f"functions over {MAX_PARAMETERS} parameters": len(self.long_functions),
            "functions taking the whole config": len(self.config_functions),
        }


# ----------------------------------------------------------------------------- modules and imports


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root (`pkg/__init__.py` is `pkg`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def _resolve_base(module: str, node: ast.ImportFrom, files: dict[str, Path]) -> str | None:
    """The absolute module named by a `from ... import` (None: outside grpokit)."""
    if node.level == 0:
        return node.module if node.module and node.module.split(".")[0] == PACKAGE else None
    package = module if _is_package(module, files) else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _existing(name: str, files: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a grpokit module."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


@dataclass(frozen=True)
class _Import:
    source: str
    target: str
    names: tuple[str, ...]  # the names imported from target (empty for `import target`)
    line: int


def _imports(module: str, tree: ast.AST, files: dict[str, Path]) -> list[_Import]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _existing(alias.name, files) if alias.name.split(".")[0] == PACKAGE else None
                if target:
                    out.append(_Import(module, target, (), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, node, files)
            if base is None or _existing(base, files) is None:
                continue
            rest = []
            for alias in node.names:
                if f"{base}.{alias.name}" in files:  # `from pkg import submodule`
                    out.append(_Import(module, f"{base}.{alias.name}", (), node.lineno))
                else:
                    rest.append(alias.name)
            if rest:
                out.append(_Import(module, _existing(base, files), tuple(rest), node.lineno))
    return out


def layer_of(module: str) -> tuple[str, int | None]:
    """(layer node, rank): the top-level folder, or the top-level module itself at TOP_LAYER."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__", TOP_LAYER
    if len(parts) == 2 and parts[1] not in LAYERS:
        return parts[1], TOP_LAYER
    return parts[1], LAYERS.get(parts[1])


def _reachable(start: str, succ: dict[str, set[str]]) -> set[str]:
    """Every node a path of one or more arrows leads to from `start`."""
    seen: set[str] = set()
    todo = list(succ.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += succ.get(node, ())
    return seen


def circles(nodes: list[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one node, each sorted: v and w share one when
    each reaches the other. One search per node; a few hundred arrows make that instant."""
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in edges:
        if a != b:
            succ.setdefault(a, set()).add(b)
    reach = {n: _reachable(n, succ) for n in succ}
    found = {tuple(sorted({v} | {w for w in reach[v] if v in reach[w]})) for v in succ}
    return sorted(list(c) for c in found if len(c) > 1)


# ----------------------------------------------------------------------------- functions


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    """The parameters a caller passes: not the receiver (self, cls, or the `ctx` torch hands to an
    autograd.Function's forward and backward); *args and **kwargs count one each."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    if positional and positional[0].arg in ("self", "cls", "ctx"):
        positional = positional[1:]
    extra = [a for a in (args.vararg, args.kwarg) if a is not None]
    return [*positional, *args.kwonlyargs, *extra]


def _takes_config(param: ast.arg) -> bool:
    if param.arg in CONFIG_NAMES:
        return True
    if param.annotation is None:
        return False
    text = ast.unparse(param.annotation)
    return any(re.search(rf"\b{name}\b", text) for name in CONFIG_TYPES)


def _qualified_functions(tree: ast.AST):
    """(qualified name, function node) for every def, methods and nested ones included."""

    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


# ----------------------------------------------------------------------------- the analysis


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(name: str) -> bool:
    return any(_private(part) for part in name.split(".")[1:])


def _function_findings(module: str, tree: ast.AST, where: Where) -> tuple[list[Finding], list[Finding]]:
    """(functions over MAX_PARAMETERS, functions taking the whole config) of one module."""
    long_functions, config_functions = [], []
    for name, fn in _qualified_functions(tree):
        params = _parameters(fn)
        if len(params) > MAX_PARAMETERS:
            long_functions.append(Finding(where(module, fn.lineno), name, f"{len(params)} parameters"))
        taking = [p.arg for p in params if _takes_config(p)]
        if taking:
            config_functions.append(Finding(where(module, fn.lineno), name, ", ".join(taking)))
    return long_functions, config_functions


def _layer_edges(edges: set[tuple[str, str]]) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(arrows between layers, module arrows from a lower layer to a higher one)."""
    layer_edges, back_up = set(), set()
    for a, b in edges:
        (la, ra), (lb, rb) = layer_of(a), layer_of(b)
        if la != lb:
            layer_edges.add((la, lb))
        if ra is not None and rb is not None and ra < rb:
            back_up.add((a, b))
    return layer_edges, back_up


def train_rank(module: str) -> int | None:
    """A train module's rank in TRAIN_GROUPS (the package itself is "__init__"); None: not named."""
    parts = module.split(".")
    if parts[:2] != [PACKAGE, "train"]:
        return None
    return TRAIN_LAYERS.get(parts[2] if len(parts) > 2 else "__init__")


def _train_findings(files: dict[str, Path], edges: set[tuple[str, str]]) -> tuple[list, list[str]]:
    """(arrows within train/ from a lower group to a higher one, train modules in no group)."""
    train = [m for m in files if m.split(".")[:2] == [PACKAGE, "train"]]
    unplaced = sorted(m for m in train if train_rank(m) is None)
    back_up = set()
    for a, b in edges:
        ra, rb = train_rank(a), train_rank(b)
        if ra is not None and rb is not None and ra < rb:
            back_up.add((a, b))
    return sorted(back_up), unplaced


def _private_findings(imports: list[_Import], files: dict[str, Path], where: Where) -> list[Finding]:
    found = set()
    for i in imports:
        if i.source == i.target:
            continue
        names = [n for n in i.names if _private(n)]
        # a package's __init__ may re-export the public names of its own modules
        reexport = _is_package(i.source, files) and i.target.startswith(f"{i.source}.") and bool(i.names)
        if names:
            found.add(Finding(where(i.source, i.line), f"{i.target}: {', '.join(names)}", i.source))
        elif _private_module(i.target) and not reexport:
            found.add(Finding(where(i.source, i.line), i.target, i.source))
    return sorted(found, key=lambda f: f.where)


def analyse(root: Path = ROOT) -> Structure:
    root = Path(root)
    files = module_files(root)
    where = lambda module, line: f"{files[module].relative_to(root.parent)}:{line}"  # noqa: E731
    imports: list[_Import] = []
    long_functions, config_functions = [], []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        imports += _imports(module, tree, files)
        long, config = _function_findings(module, tree, where)
        long_functions += long
        config_functions += config
    edges = {(i.source, i.target) for i in imports if i.source != i.target}
    layer_edges, back_up = _layer_edges(edges)
    train_back_up, unplaced = _train_findings(files, edges)
    return Structure(
        rooms=sorted(files),
        arrows=sorted(edges),
        module_circles=circles(sorted(files), edges),
        layer_circles=circles(sorted({layer_of(m)[0] for m in files}), layer_edges),
        arrows_back_up=sorted(back_up),
        train_arrows_back_up=train_back_up,
        train_unplaced=unplaced,
        private_imports=_private_findings(imports, files, where),
        long_functions=long_functions,
        config_functions=config_functions,
    )


# ----------------------------------------------------------------------------- output


def _short(module: str) -> str:
    return module.removeprefix(f"{PACKAGE}.")


def render(s: Structure, listing: bool = False) -> str:
    lines = [f"{name}: {value}" for name, value in s.figures().items()]
    if listing:
        lines += ["", "rooms:", *(f"  {_short(m)}" for m in s.rooms)]
        lines += ["", "arrows:", *(f"  {_short(a)} -> {_short(b)}" for a, b in s.arrows)]
    sections = [
        ("module circles", [" <-> ".join(map(_short, c)) for c in s.module_circles]),
        ("layer circles", [" <-> ".join(c) for c in s.layer_circles]),
        (
            "arrows back up",
            [
                f"{_short(a)} ({layer_of(a)[1]}) -> {_short(b)} ({layer_of(b)[1]})"
                for a, b in s.arrows_back_up
            ],
        ),
        (
            "train/ arrows back up (TRAIN_GROUPS)",
            [f"{_short(a)} -> {_short(b)}" for a, b in s.train_arrows_back_up]
            + [f"{_short(m)}: in no group of TRAIN_GROUPS" for m in s.train_unplaced],
        ),
        ("private names across modules", [f"{f.where}  {f.name}" for f in s.private_imports]),
        (
            f"functions over {MAX_PARAMETERS} parameters",
            [f"{f.where}  {f.name} ({f.detail})" for f in s.long_functions],
        ),
        (
            "functions taking the whole config",
            [f"{f.where}  {f.name} ({f.detail})" for f in s.config_functions],
        ),
    ]
    for title, items in sections:
        if items:
            lines += ["", f"{title}:", *(f"  {item}" for item in items)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--list", action="store_true", help="also list every room and arrow")
    parser.add_argument("--root", type=Path, default=ROOT, help="the package folder (default src/grpokit)")
    args = parser.parse_args(argv)
    s = analyse(args.root)
    if args.json:
        print(json.dumps({"figures": s.figures(), **asdict(s)}, indent=1))
    else:
        print(render(s, listing=args.list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
