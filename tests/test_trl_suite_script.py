"""scripts/trl_suite.py, which runs TRL's own GRPOTrainer tests against grpokit from outside the
project: its offline fixture is what TRL's tests load (the three hub ids, through transformers' and
datasets' own loaders with the hub unreachable), and it stages TRL's file with only its import changed,
never inside the project."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "trl_suite.py"


def _script():
    spec = importlib.util.spec_from_file_location("grpokit_trl_suite_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # (builds two models and two datasets: 8 s)
def test_the_fixture_loads_offline_as_trls_tests_load_it(tmp_path):
    suite = _script()
    suite.build_fixture(tmp_path / "hf")
    code = f"""
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
train = load_dataset("{suite.ZEN}", "standard_prompt_only", split="train")
test = load_dataset("{suite.ZEN}", "conversational_prompt_only", split="test")
assert (len(train), len(test)) == (17, 2), (len(train), len(test))
assert train[0] == {{"prompt": "Beautiful is better than"}}
assert test[0]["prompt"][0]["role"] == "user"
causal = AutoModelForCausalLM.from_pretrained("{suite.CAUSAL}")
scorer = AutoModelForSequenceClassification.from_pretrained("{suite.CLASSIFIER}")
tok = AutoTokenizer.from_pretrained("{suite.CLASSIFIER}")
assert scorer.config.num_labels == 1 and scorer.config.pad_token_id == tok.pad_token_id
chat = [{{"role": "user", "content": "hi"}}]
assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False).endswith("assistant\\n")
assert causal(**tok("Readability", return_tensors="pt")).logits.shape[-1] >= len(tok)
print("ok")
"""
    env = os.environ | {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_trls_file_is_staged_outside_the_project_with_only_its_import_changed(tmp_path):
    suite = _script()
    trl_tests = tmp_path / "trl_tests"
    trl_tests.mkdir()
    body = "from trl import GRPOConfig, GRPOTrainer\n\ndef test_x():\n    assert GRPOTrainer\n"
    (trl_tests / "test_grpo_trainer.py").write_text(body)
    (trl_tests / "conftest.py").write_text("")
    (trl_tests / "testing_utils.py").write_text(
        "from trl.import_utils import (\n    is_no_such_package_available,\n)\nX = 1\n"
    )
    ours = suite.stage(trl_tests, tmp_path / "scratch", "grpokit") / "tests"
    theirs = suite.stage(trl_tests, tmp_path / "scratch", "trl") / "tests"
    assert (ours / "test_grpo_trainer.py").read_text() == body.replace("from trl ", "from grpokit ")
    assert (theirs / "test_grpo_trainer.py").read_text() == body
    helpers = (ours / "testing_utils.py").read_text()
    assert "is_no_such_package_available = getattr(" in helpers  # a helper TRL dropped, defined first
    (trl_tests / "test_grpo_trainer.py").write_text("import trl\n")
    with pytest.raises(SystemExit, match="has no line 'from trl import GRPOConfig, GRPOTrainer'"):
        suite.stage(trl_tests, tmp_path / "again", "grpokit")
    refused = subprocess.run(
        [sys.executable, str(SCRIPT), "--trl-tests", str(trl_tests), "--scratch", str(ROOT / "scratch")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0 and "must lie outside the project" in refused.stderr
    assert not (ROOT / "scratch").exists()
