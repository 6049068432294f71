"""The config reference (config/reference.py): every option of every config, rendered from its field."""

from __future__ import annotations

import pytest

from grpokit.config import GRPOConfig, RewardConfig, SFTConfig
from grpokit.config.reference import config_reference, reference_rows

CONFIGS = (GRPOConfig, RewardConfig, SFTConfig)


def _tables(text: str) -> dict[str, dict[str, list[str]]]:
    """config class -> option -> its row's cells, read back from the Markdown."""
    tables: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = tables.setdefault(line.split()[1], {})
        elif current is not None and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").replace("\\|", "\0").split("|")]
            cells = [c.replace("\0", "|") for c in cells]
            current[cells[0].strip("`")] = cells
    return tables


@pytest.mark.parametrize("schema", CONFIGS)
def test_the_reference_covers_every_field(schema):
    tables = _tables(config_reference())
    rows = tables[schema.__name__]
    assert list(rows) and set(rows) == set(schema.model_fields)
    for name, cells in rows.items():
        assert len(cells) == 7, (name, cells)  # option, type, default, bounds, TRL, resume, description
        option, type_, default, _, _, resume, description = cells
        assert type_ and default.startswith("`") and description, (name, cells)
        assert resume.split(":")[0] in ("fixed", "applied", "invocation"), (name, resume)


def test_the_reference_says_what_each_field_declares():
    rows = {r["name"]: r for r in reference_rows(GRPOConfig)}
    assert rows["top_p"]["bounds"] == "> 0, ≤ 1" and rows["top_p"]["type"] == "float"
    assert rows["loss_type"]["type"].startswith("'grpo' | 'bnpo'")
    assert (
        rows["max_completion_length"]["type"] == "int | None"
        and rows["max_completion_length"]["default"] == "null"
    )
    assert rows["reward_weights"]["bounds"] == "each ≥ -1e+06, ≤ 1e+06"
    assert rows["dtype"]["trl"] == "bf16, fp16"  # rules in config/trl_names.py
    assert rows["dataset"]["trl"] == "dataset_name"  # a plain rename, declared on the field
    assert rows["learning_rate"]["trl"] == "learning_rate"  # TRL's own name
    assert rows["prompts_per_step"]["trl"] == (
        "per_device_train_batch_size, gradient_accumulation_steps, steps_per_generation"
    )
    assert rows["seed"]["resume"].startswith("fixed: ") and rows["resume"]["resume"].startswith("invocation")
    assert rows["max_steps"]["resume"] == "applied: where the run ends (and a decaying schedule reaches 0)"
    assert rows["beta"]["description"] == GRPOConfig.model_fields["beta"].description
    sft = {r["name"]: r for r in reference_rows(SFTConfig)}
    assert "prompts_per_step" not in sft and sft["batch_size"]["trl"] == ""
