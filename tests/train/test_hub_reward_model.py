"""Reward-model training on the real path (issue 25): `grpokit reward model=ORG/NAME` through the CLI,
offline, on the test-made cache's BPE chat models (Qwen2: pad ≠ EOS, tied head; Llama-3: no pad
token), and the checkpoint is what transformers' sequence-classification loader reads: one score
per text, the same for a text alone and in a padded batch; through the Python API, a reward model on
each of them learns a preference of conversational pairs either way round."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import read_steps
from tests.hub_cache import LLAMA, QWEN, grpokit_offline


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_a_reward_model_trains_from_a_hub_chat_model_and_transformers_loads_it(hub_home, tmp_path, name):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm"
    args = [f"model={name}", f"output_dir={out}", "device=cpu", "max_steps=6", "report_to=none"]
    done = grpokit_offline(hub_home, "reward", *args, "progress=false", "eval_steps=0", "save_steps=0")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = read_steps(out)
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)

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


def _pairs(count: int, seed: int, polite: bool = True) -> list[dict]:
    """Conversational preference pairs (TRL's form) with a preference a reward model can learn: a
    polite answer over a rude one (`polite`), or the other way round, on varied questions."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        question = [{"role": "user", "content": f"What is {a}+{b}?"}]
        answer = str(a + b + rng.choice([0, 0, 1, -1]))
        kind = [f"Thank you for asking! It is {answer}.", f"Whatever. {answer}."]
        good, bad = kind if polite else kind[::-1]
        rows.append(
            {
                "prompt": question,
                "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}],
            }
        )
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_a_reward_model_on_a_hub_chat_model_learns_a_preference_through_the_api(hub_offline, tmp_path, name):
    """train_reward on a hub id with conversational pairs (the model's chat template renders them)
    learns the preference either way round: held-out pairwise accuracy ≥ 0.9 for the polite answer
    preferred and for the rude one preferred. A random head orders the two kinds of text one way
    whatever it was told (its accuracies before training add up to 1), so only learning passes both."""
    from grpokit.config import RewardConfig
    from grpokit.train.reward import train_reward

    results = []
    for polite in (True, False):
        cfg = RewardConfig(
            model=name,
            task=None,
            output_dir=str(tmp_path / f"rm_{polite}"),
            device="cpu",
            max_steps=40,
            batch_size=16,
            micro_batch_size=16,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            eval_steps=0,
            save_steps=0,
            report_to="none",
            progress=False,
        )
        rows, held_out = _pairs(160, seed=0, polite=polite), _pairs(64, seed=1, polite=polite)
        results.append(train_reward(cfg, train_rows=rows, eval_rows=held_out))
    befores = [r.eval_before["accuracy"] for r in results]
    assert sum(befores) == pytest.approx(1.0, abs=0.05), befores  # one ordering, read both ways
    afters = [r.eval_after["accuracy"] for r in results]
    assert min(afters) >= 0.9, (befores, afters)
