"""Test helpers importable as `tests.helpers`: the tiny run's settings, a run's metrics and alerts,
the tests a string names, random batches and small transformers models."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository

# ----------------------------------------------------------------------------- the tiny run

# The tests' tiny Llama (model=tiny): 16 wide, 1 layer of 2 heads. Config keywords, for the API.
TINY_MODEL_VALUES: dict[str, Any] = {
    "tiny_hidden_size": 16,
    "tiny_num_layers": 1,
    "tiny_num_heads": 2,
    "tiny_intermediate_size": 32,
}
# A GRPO run of seconds: 2 steps of 4 prompts x 4 completions of at most 4 tokens, no evaluation,
# checkpoint or sample completions but at the end. `tests.train.helpers.tiny_config` builds on it.
TINY_RUN_VALUES: dict[str, Any] = {
    **TINY_MODEL_VALUES,
    "max_steps": 2,
    "prompts_per_step": 4,
    "num_generations": 4,
    "micro_batch_size": 8,
    "max_completion_length": 4,
    "num_eval_prompts": 4,
    "eval_steps": 0,
    "save_steps": 0,
    "log_completions_steps": 0,
    "learning_rate": 1e-2,
    "progress": False,
}


def overrides(values: Mapping[str, Any]) -> list[str]:
    """Config keywords as the command line's key=value overrides (True -> true, None -> null, lists)."""

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if value is None:
            return "null"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(map(text, value)) + "]"
        return str(value)

    return [f"{key}={text(value)}" for key, value in values.items()]


def tiny_run(*unset: str, **values: Any) -> list[str]:
    """TINY_RUN with `values` replacing or adding to its settings, and the keys named in `unset`
    left out (to the preset and the defaults): a test's differences from the tiny run, explicitly."""
    settings = TINY_RUN_VALUES | {"sft_steps": 0}  # the addition preset warms up for 1000 steps
    missing = set(unset) - set(settings)
    assert not missing, f"tiny_run: {sorted(missing)} are not set by the tiny run"
    return overrides({k: v for k, v in settings.items() if k not in unset} | values)


# `grpokit train` (the addition preset) made tiny and fast: TINY_RUN_VALUES, without the warm start
TINY_RUN: list[str] = tiny_run()
# the tiny model alone, for the commands that are not a GRPO run (sft, reward) and for runs of their own
TINY_MODEL: list[str] = overrides(TINY_MODEL_VALUES)

# ----------------------------------------------------------------------------- a run's files


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `run_dir`/metrics.jsonl, in order: the steps' (with a loss) and the evaluations';
    FileNotFoundError where the run wrote none."""
    return _jsonl(Path(run_dir) / "metrics.jsonl")


def read_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `run_dir`/metrics.jsonl that a training step wrote (those with a loss), in order."""
    return [row for row in read_metrics(run_dir) if "loss" in row]


def read_alerts(run_dir: str | Path) -> list[dict[str, Any]]:
    """The alerts in `run_dir`/alerts.jsonl, in order; none where the file is absent (a run writes it
    at its first alert)."""
    path = Path(run_dir) / "alerts.jsonl"
    return _jsonl(path) if path.is_file() else []


def defined_tests(path: str | Path) -> set[str]:
    """The test functions defined at the top level of the test file `path` (read with ast: nothing is
    imported); FileNotFoundError where there is no such file."""
    tree = ast.parse(Path(path).read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


_REFERENCE = re.compile(
    r"(?P<file>(?:tests/)?(?:\w+/)*test_\w+\.py)(?:::(?P<name>test_\w+\*?))?"
    r"|(?P<bare>\btest_\w+\*?)(?P<below>\s*\(below\))?"
)


def named_tests(text: str, folder: Path, here: Path | None = None) -> dict[str, bool]:
    """Each test that `text` names, as written, and whether it exists: `file.py` and `file.py::test_name`
    (the file in `folder`, or in the repository when it starts with `tests/`; `test_prefix*`: any test
    of that prefix), and a bare `test_name`: a test of the file named last before it, or of `here` where
    none is or `(below)` follows it. Files are read with ast; nothing is imported."""
    found: dict[str, bool] = {}
    last = here
    for match in _REFERENCE.finditer(text):
        if match["file"]:
            last = ROOT / match["file"] if match["file"].startswith("tests/") else folder / match["file"]
            name, written = match["name"], match[0]
        path = here if match["below"] else last
        if not match["file"]:
            name, written = match["bare"], f"{match['bare']} (in {path.name if path else '?'})"
        exists = path is not None and path.is_file()
        if exists and name:
            tests = defined_tests(path)
            exists = any(t.startswith(name[:-1]) for t in tests) if name.endswith("*") else name in tests
        found[written] = exists
    return found


# ----------------------------------------------------------------------------- batches and models


def random_batch(
    gen: torch.Generator, B: int = 6, T: int = 7, *, empty_row: bool = False
) -> dict[str, torch.Tensor]:
    """A float64 off-policy batch: lp, old (= lp + 0.3·N), ref (= lp + 0.2·N), entropies, advantages,
    and a bool mask whose rows have lengths 1..T (row 0 all-masked when `empty_row`)."""
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05  # [B, T]
    lengths = torch.randint(1, T + 1, (B,), generator=gen)  # [B]
    if empty_row:
        lengths[0] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    return {
        "lp": lp,
        "old": lp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "ref": lp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        # float32-representable: TRL takes the entropy quantile in float32 (`.float()`), exact on these
        "entropies": (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 + 0.01).float().double(),
        "adv": torch.randn(B, generator=gen, dtype=torch.float64),
        "mask": mask,
    }


def small_llama(
    shape: tuple[int, int, int, int, int, int], *, tied: bool = False, bias: bool = False, seed: int = 0
) -> torch.nn.Module:
    """A randomly initialised transformers Llama of `shape` = (V, H, layers, heads, kv heads,
    intermediate), without dropout; `bias`: q/k/v/o biases, as Qwen2 has on q/k/v."""
    from transformers import LlamaForCausalLM

    from grpokit.models.hf import llama_config

    V, H, layers, heads, kv_heads, intermediate = shape
    config = llama_config(
        H,
        layers,
        heads,
        V,
        2048,
        intermediate,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
        attention_bias=bias,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
