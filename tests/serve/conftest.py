"""The policy the serve tests serve: the test-made Qwen2 chat model (tests/hub_cache.py) in an engine,
built once per module (tests that change its weights put them back)."""

from __future__ import annotations

import pytest
import torch

from grpokit.config.specs import EngineSpec
from grpokit.engine import PolicyEngine
from tests.hub_cache import QWEN, snapshot


@pytest.fixture(scope="module")
def engine(hub_home):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = snapshot(hub_home, QWEN)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(where)
    return PolicyEngine.create(model, tokenizer, EngineSpec(decode_loop="eager"), device=torch.device("cpu"))
