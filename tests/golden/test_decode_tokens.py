"""Tokens unchanged: the tokens and sampling log-probs that grpokit's decode loop draws for fixed
seeds, in every decode mode, single- and multi-turn, held against `decode_tokens.json`.

The file was written by the code before generation was collapsed into one loop (issue 24:
`python -m tests.golden.test_decode_tokens` writes it); the same seeds must give the same tokens and
log-probs within 1e-6 in float32 on CPU. A change that moves a draw by one uniform number, reorders
the processed distribution or drops a prefix-sharing step shows up here as a different token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.envs import EnvironmentSpec
from grpokit.models import build_policy, char_tokenizer

GOLDEN = Path(__file__).with_name("decode_tokens.json")
ALPHABET = "0123456789+=-*[]{}"
PROMPTS = ["12+3=", "7-8=", "1=", "99*9="]  # ragged: left padding matters
T = 12

# sampling settings: plain, every processor, greedy, and a stop string
SETTINGS = {
    "plain": dict(temperature=1.0),
    "processed": dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    "greedy": dict(temperature=0.0),
    "stop": dict(temperature=1.0, stop_strings=("]",)),
}
# (model, decode loop): the lean Llama forward and transformers' forward (attention dropout > 0 keeps
# a Llama off the lean path), the eager loop and the static-shape step
MODES = {
    "lean-eager": ("lean", "eager"),
    "lean-static": ("lean", "static"),
    "transformers-eager": ("transformers", "eager"),
}


class Echo:
    """Answers turn k with "{k}", pays 0.5 a turn, done after 3 turns; turns end at EOS or "]"."""

    stop_strings = ("]",)

    def __init__(self) -> None:
        self.k = 0

    def reset(self, row, seed):
        return ""

    def step(self, text):
        self.k += 1
        return "{" + str(self.k) + "}", 0.5, self.k >= 3


def _policy(kind: str):
    tok = char_tokenizer(ALPHABET)
    model = build_policy(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        vocab_size=len(tok),
        dropout=0.0 if kind == "lean" else 0.1,
        max_seq_len=128,
        seed=11,
    )
    return model.eval(), tok


def _engine(kind: str, loop: str, environment=None) -> PolicyEngine:
    model, tok = _policy(kind)
    return PolicyEngine.create(
        model,
        tok,
        EngineSpec(decode_loop=loop),
        environment=environment,
    )


def _draw(engine: PolicyEngine, setting: str, seed: int, multi_turn: bool) -> dict:
    from grpokit.rollout import SamplingParams

    params = SamplingParams(num_generations=3, max_completion_length=T, seed=seed, **SETTINGS[setting])
    rows = [{"prompt": p} for p in PROMPTS] if multi_turn else None
    out = engine.generate(PROMPTS, params, rows)
    return {
        "tokens": out.completion_ids.tolist(),
        "mask": out.completion_mask.int().tolist(),
        "logps": out.sampling_logps.tolist(),
    }


def cases() -> list[tuple[str, str, str, int]]:
    """(name, mode, setting, seed): single-turn in every mode and setting, multi-turn per model."""
    out = []
    for mode in MODES:
        for setting in SETTINGS:
            if mode == "lean-static" and setting == "stop":
                continue  # stop strings run the eager loop
            for seed in (0, 1):
                out.append((f"{mode}/{setting}/{seed}", mode, setting, seed))
    for kind in ("lean", "transformers"):
        for setting in ("plain", "processed"):
            out.append((f"multi-turn-{kind}/{setting}/0", f"multi-turn-{kind}", setting, 0))
    return out


def record(mode: str, setting: str, seed: int) -> dict:
    if mode.startswith("multi-turn-"):
        spec = EnvironmentSpec(Echo, max_turns=3, stop_strings=Echo.stop_strings, name="echo")
        engine = _engine(mode.removeprefix("multi-turn-"), "eager", spec)
        return _draw(engine, setting, seed, multi_turn=True)
    kind, loop = MODES[mode]
    return _draw(_engine(kind, loop), setting, seed, multi_turn=False)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name,mode,setting,seed", cases(), ids=[c[0] for c in cases()])
def test_same_seeds_draw_the_same_tokens(golden, name, mode, setting, seed):
    want, got = golden[name], record(mode, setting, seed)
    assert got["tokens"] == want["tokens"], name
    assert got["mask"] == want["mask"], name
    assert torch.allclose(torch.tensor(got["logps"]), torch.tensor(want["logps"]), atol=1e-6, rtol=0), name


def test_the_golden_file_covers_every_case(golden):
    assert sorted(golden) == sorted(c[0] for c in cases())
    # the cases are not degenerate: sampled rows differ, stop strings and EOS end some rows early
    plain = golden["lean-eager/plain/0"]["tokens"]
    assert len({tuple(r) for r in plain}) > 6
    assert any(0 in row for row in golden["lean-eager/stop/0"]["mask"])


if __name__ == "__main__":  # write the golden file from the code as it is
    table = {name: record(mode, setting, seed) for name, mode, setting, seed in cases()}
    GOLDEN.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    print(f"wrote {len(table)} cases to {GOLDEN}", file=sys.stderr)
