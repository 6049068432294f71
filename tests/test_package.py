"""Package hygiene: light imports, the public API, and the command line."""

from __future__ import annotations

import subprocess
import sys

import grpokit
import grpokit.ops


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_ops_does_not_import_transformers_or_distributed():
    """`import grpokit.ops` works with transformers made unimportable, and loads neither it nor
    torch.distributed's process groups."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'trl', 'accelerate'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import grpokit, grpokit.ops, grpokit.ops.compat\n"
        "assert not [m for m in sys.modules if m.startswith(('transformers', 'trl'))]\n"
        "print('ok')\n"
    )
    result = _run(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_ops_modules_import_only_torch_and_the_standard_library():
    import ast
    from pathlib import Path

    allowed = {"torch", "__future__", "collections", "dataclasses", "typing", "math"}
    for path in Path(grpokit.ops.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert node.func.attr not in ("item", "tolist"), (
                    f"{path.name}:{node.lineno} syncs with .{node.func.attr}()"
                )
            if isinstance(node, ast.Attribute) and node.attr == "distributed":
                raise AssertionError(f"{path.name}:{node.lineno} uses torch.distributed")
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not node.module.startswith("torch.distributed"), path.name
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


def test_public_api_is_explicit():
    for name in grpokit.ops.__all__:
        assert hasattr(grpokit.ops, name), name
    for name in grpokit.__all__:
        assert hasattr(grpokit, name), name


def test_cli_help_and_demo_run():
    result = subprocess.run(
        [sys.executable, "-m", "grpokit", "demo", "--steps", "3"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "greedy accuracy" in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "grpokit", "demo", "--loss-type", "ppo"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "invalid choice: 'ppo'" in bad.stderr and "'dapo'" in bad.stderr


def test_ci_runs_exactly_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(readme) == 2, "the README starts with exactly two commands"
    ci_command = (root / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command == readme[1]


def test_readme_python_example_runs():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["rollout"].completion_ids.shape[0] == 32
    assert namespace["scores"].rewards.shape == (32,)


def test_only_the_distributed_module_touches_torch_distributed():
    import ast
    from pathlib import Path

    root = Path(grpokit.__file__).parent
    users = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.startswith("torch.distributed") for n in names):
                users.add(path.relative_to(root).as_posix())
    assert users == {"train/distributed.py"}, users
