"""A reward model in reward_funcs, as TRL takes one: a hub id, a directory or a loaded
sequence-classification model, scored with its own tokenizer (or TRL's reward_processing_classes) over
prompt + completion, the head's first logit (TRL 1.16's GRPOTrainer._calculate_rewards)."""

from __future__ import annotations

import pytest
import torch

from grpokit import GRPOTrainer
from grpokit.rewards import RewardModelFunction
from tests.hub_cache import QWEN, snapshot

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
PROMPTS = ["1+2=", "3+3=", "12+30="]
COMPLETIONS = ["3", "six", "42 is the answer"]


@pytest.fixture(scope="module")
def reward_dir(hub_home, tmp_path_factory):
    """A tiny sequence-classification model (the test hub's Qwen2 with a scalar head) saved with its
    tokenizer, as a trained reward model's directory is."""
    from grpokit.models import load_reward_model

    loaded = load_reward_model(snapshot(hub_home, QWEN))
    torch.manual_seed(0)
    torch.nn.init.normal_(loaded.model.score.weight, std=1.0)  # (a head that tells texts apart)
    where = tmp_path_factory.mktemp("reward") / "tiny-reward"
    loaded.model.save_pretrained(where)
    loaded.tokenizer.save_pretrained(where)
    return where


def _trl_scores(model, tokenizer, prompts, completions) -> torch.Tensor:
    """TRL 1.16's scoring of a reward model, written out: the texts prompt + completion, right-padded,
    no special tokens added, logits[:, 0]."""
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = tokenizer(
        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    with torch.inference_mode():
        return model(**inputs).logits[:, 0]


def test_a_reward_models_directory_in_reward_funcs_scores_as_trl_does(reward_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    trainer = GRPOTrainer("tiny", [str(reward_dir), "exact_answer"], None, ROWS)
    scorer = trainer.reward_funcs[0]
    assert isinstance(scorer, RewardModelFunction) and scorer.__name__ == "tiny-reward"
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    expected = _trl_scores(model, AutoTokenizer.from_pretrained(reward_dir), PROMPTS, COMPLETIONS)
    got = torch.tensor(scorer(PROMPTS, COMPLETIONS))
    # left padding with explicit positions (grpokit) against right padding (TRL): the same attention
    # over the same tokens, up to float32 summation order
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got, expected)
    assert len(set(got.tolist())) == 3  # (the texts are told apart: the check can fail)


def test_a_loaded_reward_model_takes_reward_processing_classes_or_its_own(reward_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    trainer = GRPOTrainer(
        "tiny", [model, "exact_answer"], None, ROWS, reward_processing_classes=[tokenizer, None]
    )
    given = trainer.reward_funcs[0]
    assert given.model is model and given.tokenizer is tokenizer and not given.eos
    assert trainer.reward_processing_classes == [tokenizer, None]  # TRL's attribute: None for a function
    own = GRPOTrainer("tiny", model, None, ROWS).reward_funcs[0]  # loaded from where the model came from
    assert own.tokenizer.get_vocab() == tokenizer.get_vocab()
    expected = _trl_scores(model, tokenizer, PROMPTS, COMPLETIONS)
    assert torch.allclose(torch.tensor(given(PROMPTS, COMPLETIONS)), expected, atol=1e-5, rtol=0)


def test_reward_processing_classes_must_match_the_reward_functions(reward_dir):
    with pytest.raises(ValueError) as error:
        GRPOTrainer("tiny", [str(reward_dir), "exact_answer"], None, ROWS, reward_processing_classes=[None])
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("reward_processing_classes holds 1 tokenizers for 2 reward functions")


def test_names_that_are_not_models_stay_what_they_were(tmp_path):
    """A built-in reward, a reference to a function and a path to a Python file are not reward models."""
    from grpokit.trainer import _names_a_model

    (tmp_path / "rewards.py").write_text(
        "def f(prompts, completions, **_):\n    return [0.0] * len(prompts)\n"
    )
    assert not _names_a_model("exact_answer")
    assert not _names_a_model("pkg.mod.f") and not _names_a_model("pkg.mod:f")
    assert not _names_a_model(f"{tmp_path}/rewards.py:f") and not _names_a_model("http://127.0.0.1:1/score")
    assert _names_a_model("trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5")
