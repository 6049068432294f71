"""Reward-model training on the real path (issue 25): `grpokit reward model=ORG/NAME` through the CLI,
offline, on the test-made cache's BPE chat models (Qwen2: pad ≠ EOS, tied head; Llama-3: no pad
token), and the checkpoint is what transformers' sequence-classification loader reads: one score
per text, the same for a text alone and in a padded batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.hub_cache import LLAMA, QWEN, offline_env


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_a_reward_model_trains_from_a_hub_chat_model_and_transformers_loads_it(hub_home, tmp_path, name):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm"
    args = [f"model={name}", f"output_dir={out}", "device=cpu", "max_steps=6", "report_to=none"]
    env = {**os.environ, **offline_env(hub_home), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "grpokit", "reward", *args, "progress=false", "eval_steps=0", "save_steps=0"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)

    checkpoint = out / "checkpoint-6"
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    texts = ["12+34=46", "7+8=15, since 7+8 is 15"]
    tokenizer.padding_side = "right"
    with torch.no_grad():
        alone = [model(**tokenizer([t], return_tensors="pt")).logits[0, 0] for t in texts]
        batch = model(**tokenizer(texts, return_tensors="pt", padding=True)).logits[:, 0]
    torch.testing.assert_close(batch, torch.stack(alone), rtol=0, atol=1e-5)  # float32 round-off
    assert alone[0] != alone[1]  # two texts, two scores: the head reads the text
