"""Shared fixtures. Ops tests run in float64 unless a test is about another dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

GOLDEN_DIR = Path(__file__).parent / "golden"


@pytest.fixture(scope="session")
def seed_vectors() -> dict:
    """Outputs of the reference implementations on one shared input (shared/reference/seed_vectors.json)."""
    return json.loads((GOLDEN_DIR / "seed_vectors.json").read_text())


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
