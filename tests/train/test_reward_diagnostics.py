"""Reward-model diagnostics (train/reward_diagnostics.py) and their section of `grpokit report`."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from grpokit.models import Precision
from grpokit.report import write_report
from grpokit.train.reward import HeldOut, diagnose, pair_metrics, score_pairs, train_reward
from grpokit.train.reward_diagnostics import (
    MAX_POINTS,
    ScoredPairs,
    calibration,
    length_bias,
    padding_invariance,
    pearson,
    reward_diagnostics,
)
from grpokit.train.run_files import check_run_files
from tests.helpers import read_metrics
from tests.train.test_reward_model import PAIRS, TOK, reward_cfg, tiny_rm

PLOTS = ("calibration", "accuracy_by_margin", "length_bias")


def scored(chosen, rejected, chosen_lengths=None, rejected_lengths=None) -> ScoredPairs:
    n = len(chosen)
    return ScoredPairs(
        torch.tensor(chosen, dtype=torch.float32),  # [n]
        torch.tensor(rejected, dtype=torch.float32),  # [n]
        torch.tensor(chosen_lengths or [1] * n),  # [n]
        torch.tensor(rejected_lengths or [1] * n),  # [n]
    )


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------- by hand


def test_length_bias_by_hand():
    """Pairs (length, score): A (1, 1) vs (3, 2): the longer wins; B (4, 4) vs (2, 3): the longer wins;
    C (2, 5) vs (6, 0): the shorter wins; D (3, 1) vs (3, 2): equal lengths, left out of the share.
    Lengths 1 4 2 3 3 2 6 3 (mean 3), scores 1 4 5 1 2 3 0 2 (mean 2.25): Σdl·ds = −6, Σdl² = 16,
    Σds² = 19.5, so r = −6 / √312."""
    bias = length_bias(scored([1, 4, 5, 1], [2, 3, 0, 2], [1, 4, 2, 3], [3, 2, 6, 3]))
    assert bias["correlation"] == pytest.approx(-6 / math.sqrt(312), abs=1e-12)
    assert bias["longer_wins"] == pytest.approx(2 / 3, abs=1e-12)
    assert (bias["num_unequal_pairs"], bias["num_equal_length_pairs"]) == (3, 1)
    assert bias["points"] == {
        "chosen": [[1, 1.0], [4, 4.0], [2, 5.0], [3, 1.0]],
        "rejected": [[3, 2.0], [2, 3.0], [6, 0.0], [3, 2.0]],
    }
    # a tie in score is no win for the longer sequence; all lengths equal: no share, no correlation
    assert length_bias(scored([1.0], [1.0], [2], [5]))["longer_wins"] == 0.0
    flat = length_bias(scored([1, 2], [3, 4], [7, 7], [7, 7]))
    assert flat["longer_wins"] is None and flat["correlation"] is None
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])) == pytest.approx(1.0)


def test_length_bias_keeps_a_few_hundred_points_spread_over_the_pairs():
    n = 1000
    many = scored(list(range(n)), [-x for x in range(n)], list(range(n)), [x + 1 for x in range(n)])
    points = length_bias(many)["points"]
    assert len(points["chosen"]) == len(points["rejected"]) == MAX_POINTS // 2
    assert points["chosen"][0] == [0, 0.0] and points["chosen"][-1] == [n - 1, float(n - 1)]
    assert points["rejected"][-1] == [n, -float(n - 1)]  # pair i's rejected point is pair i's


def test_calibration_predicts_accuracy_with_the_bradley_terry_sigmoid():
    """Gaps 0.2, −0.3 (bucket 0-0.5), 1.5 (1-2), 3 (2-4), −5 (4-inf); 0.5-1 is empty."""
    pairs = scored([0.2, 0.0, 1.5, 3.0, 0.0], [0.0, 0.3, 0.0, 0.0, 5.0])
    metrics = pair_metrics(pairs)
    table = {b["bucket"]: b for b in calibration(pairs, metrics)["buckets"]}
    expected = {  # bucket: (count, observed, predicted)
        "0-0.5": (2, 0.5, (sigmoid(0.2) + sigmoid(0.3)) / 2),
        "0.5-1": (0, None, None),
        "1-2": (1, 1.0, sigmoid(1.5)),
        "2-4": (1, 1.0, sigmoid(3.0)),
        "4-inf": (1, 0.0, sigmoid(5.0)),
    }
    for name, (count, observed, predicted) in expected.items():
        row = table[name]
        assert (row["count"], row["observed_accuracy"]) == (count, observed), name
        # float32 scores: the gaps carry ~1e-7 round-off
        assert row["predicted_accuracy"] == (
            None if predicted is None else pytest.approx(predicted, abs=1e-6)
        )
    assert table["4-inf"]["hi"] is None  # JSON has no infinity
    ece = sum(c / 5 * abs(o - p) for c, o, p in expected.values() if c)
    assert calibration(pairs, metrics)["expected_calibration_error"] == pytest.approx(ece, abs=1e-6)


def test_the_evaluation_table_is_reused_not_recomputed():
    """Observed accuracy and accuracy by margin come from the evaluation's metrics as they are."""
    pairs = scored([0.2, 0.0, 1.5], [0.0, 0.3, 0.0])
    metrics = pair_metrics(pairs) | {"calibration/0-0.5/accuracy": 0.125}  # a value only the metrics hold
    found = reward_diagnostics(pairs, metrics, {"num_sequences": 0})
    assert found["calibration"]["buckets"][0]["observed_accuracy"] == 0.125
    assert found["accuracy_by_margin"][0] == {"bucket": "0-0.5", "count": 2, "accuracy": 0.125}
    assert found["accuracy_by_margin"][2] == {"bucket": "1-2", "count": 1, "accuracy": 1.0}
    assert found["accuracy_by_margin"][1] == {"bucket": "0.5-1", "count": 0, "accuracy": None}


def test_score_pairs_gives_each_sequence_its_score_and_length():
    """Lengths are the tokens scored (prompt + completion + EOS); scores are the model's for each pair."""
    model = tiny_rm()
    evaluated = score_pairs(model, TOK, PAIRS, max_length=32, batch_size=3)  # batches of 3 and 1 pairs
    assert evaluated.chosen_lengths.tolist() == [len(p["prompt"] + p["chosen"]) + 1 for p in PAIRS]
    assert evaluated.rejected_lengths.tolist() == [len(p["prompt"] + p["rejected"]) + 1 for p in PAIRS]
    whole = score_pairs(model, TOK, PAIRS, max_length=32, batch_size=8)
    torch.testing.assert_close(evaluated.chosen, whole.chosen, rtol=0, atol=1e-5)
    torch.testing.assert_close(evaluated.rejected, whole.rejected, rtol=0, atol=1e-5)
    assert not torch.equal(whole.chosen, whole.rejected)


# ----------------------------------------------------------------------------- padding invariance


def embedding() -> torch.nn.Embedding:
    """One random number per token (the pad token's too), the same in every test."""
    weight = torch.randn(len(TOK), 1, generator=torch.Generator().manual_seed(0))  # [V, 1]
    return torch.nn.Embedding.from_pretrained(weight, freeze=False)


class WidthScorer(torch.nn.Module):
    """Reads padding: its score grows with the batch's width, whatever the attention mask says."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = embedding()

    def forward(self, input_ids, attention_mask, **_):
        real = (self.embed(input_ids)[..., 0] * attention_mask).sum(-1)  # [n]
        return SimpleNamespace(logits=(real + 0.1 * input_ids.shape[1])[:, None])  # [n, 1]


class MeanPoolScorer(torch.nn.Module):
    """Reads padding: it averages every position's embedding, padding included (ignores the mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = embedding()

    def forward(self, input_ids, attention_mask, **_):
        return SimpleNamespace(logits=self.embed(input_ids)[..., 0].mean(-1, keepdim=True))  # [n, 1]


class LastPositionScorer(torch.nn.Module):
    """Reads padding on the right only: it scores the batch's last position, not the last real token
    (with left padding that is the same token)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = embedding()

    def forward(self, input_ids, attention_mask, **_):
        return SimpleNamespace(logits=self.embed(input_ids[:, -1]))  # [n, 1]


def sequences(lengths) -> list[list[int]]:
    return [[1 + (i + j) % (len(TOK) - 1) for j in range(n)] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("scorer", [WidthScorer, MeanPoolScorer])
@pytest.mark.parametrize("lengths", [[3, 5, 9, 4], [6] * 20])
def test_padding_check_catches_a_model_that_reads_padding(scorer, lengths):
    """Sequences of different lengths, or all of one length (then the batch's longer filler pads them
    all): a model that reads its padding is reported, by far more than round-off."""
    found = padding_invariance(scorer(), sequences(lengths), TOK.pad_token_id, max_length=32)
    assert found["num_sequences"] == min(len(lengths), 16) and found["num_padded"] == found["num_sequences"]
    assert found["max_abs_delta"] > 1e-2 and not found["invariant"]
    assert found["max_abs_delta"] == max(found["left"], found["right"])


def test_right_padding_is_checked_too():
    found = padding_invariance(LastPositionScorer(), sequences([3, 5, 9, 4]), TOK.pad_token_id, max_length=32)
    assert found["left"] < 1e-6 and found["right"] > 1e-2 and not found["invariant"]


def test_the_reward_model_does_not_read_padding():
    """The real reward model, through the trainer's own path (held-out pairs -> sample -> check):
    scores alone and batched, left- or right-padded, agree to float32 round-off."""
    model = tiny_rm()
    evaluated = score_pairs(model, TOK, PAIRS, max_length=32)
    found = diagnose(model, TOK, PAIRS, (evaluated, pair_metrics(evaluated)), max_length=32)
    padding = found["padding_invariance"]
    assert padding["num_sequences"] == 2 * len(PAIRS) and padding["num_padded"] == 2 * len(PAIRS)
    assert padding["max_padding"] >= 8 and padding["compute_dtype"] == "float32"
    assert padding["max_abs_delta"] <= 1e-5 and padding["invariant"]
    assert model.training  # left as it was found


def test_no_room_for_padding_is_said_not_hidden():
    """Every sequence already max_length long: nothing can be padded, and the check says so."""
    found = padding_invariance(WidthScorer(), sequences([6, 6]), TOK.pad_token_id, max_length=6)
    assert (found["num_padded"], found["max_padding"]) == (0, 0) and found["max_abs_delta"] < 1e-6


def test_diagnosing_after_an_evaluation_scores_only_the_padding_sample(tmp_path):
    """The final evaluation's scores are reused: diagnose runs the model on the 8 sequences of the
    padding sample alone, then twice on them plus the filler (left, right), and on nothing else."""
    model = tiny_rm()
    rows = []
    model.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    held_out = HeldOut(model, TOK, PAIRS, 32, 8, Precision(), tmp_path)
    held_out.evaluate()
    assert rows == [2 * len(PAIRS)]
    held_out.diagnose(step=3)
    assert rows[1:] == [1] * 8 + [9, 9]
    assert json.loads((tmp_path / "reward_diagnostics.json").read_text())["step"] == 3


def test_held_out_diagnoses_the_final_model_when_resumed_at_the_last_step(tmp_path):
    """No evaluation in this process yet (a run resumed at its last step): it scores now."""
    held_out = HeldOut(tiny_rm(), TOK, PAIRS, 32, 8, Precision(), tmp_path)
    held_out.diagnose(step=7)
    found = json.loads((tmp_path / "reward_diagnostics.json").read_text())
    metrics = json.loads((tmp_path / "calibration.json").read_text())
    assert found["step"] == 7 and found["num_pairs"] == len(PAIRS) == metrics["num_pairs"]
    assert [b["count"] for b in found["accuracy_by_margin"]] == [
        metrics[f"calibration/{b['bucket']}/count"] for b in found["accuracy_by_margin"]
    ]


# ----------------------------------------------------------------------------- the report


def assert_png(path) -> None:
    import matplotlib.pyplot as plt

    assert path.is_file() and path.stat().st_size > 0, path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = plt.imread(path)  # decodes the whole file
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, (path, image.shape)
    assert image[..., :3].std() > 0.01, f"{path} is blank"


def fake_run(tmp_path, padding: dict) -> object:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.7}) + "\n")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 30, (2, 50), generator=g)  # [2, 50]
    scores = 0.1 * lengths + torch.randn(2, 50, generator=g)  # [2, 50]
    pairs = ScoredPairs(scores[0] + 1, scores[1], lengths[0], lengths[1])
    found = reward_diagnostics(pairs, pair_metrics(pairs), padding) | {"step": 1}
    (run / "reward_diagnostics.json").write_text(json.dumps(found))
    return run


def test_report_shows_the_diagnostics_and_a_padding_failure(tmp_path):
    padding = {"num_sequences": 16, "max_abs_delta": 0.5, "left": 0.5, "right": 0.25, "max_padding": 9}
    run = fake_run(tmp_path, padding | {"compute_dtype": "float32", "tolerance": 1e-3, "invariant": False})
    page = write_report(run).read_text()
    for name in PLOTS:
        assert_png(run / "report" / f"{name}.png")
        assert f"src='{name}.png'" in page
    section = page[page.index("<h2>Reward model diagnostics</h2>") : page.index("<h2>Config</h2>")]
    assert all(f"src='{name}.png'" in section for name in PLOTS)
    assert "max |Δscore| = 0.5 over 16 sequences" in section and "NOT INVARIANT" in section
    assert "src='loss.png'" in page  # the curves are still there


def test_report_of_a_run_without_diagnostics_has_no_such_section(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.7}) + "\n")
    page = write_report(run).read_text()
    assert "Reward model diagnostics" not in page and not (run / "report" / "calibration.png").exists()
    (run / "reward_diagnostics.json").write_text('{"num_pairs": 3, "calib')
    with pytest.raises(ValueError, match="reward_diagnostics.json is not valid JSON"):
        write_report(run)


def test_a_reward_run_then_report_shows_its_diagnostics(tmp_path):
    """A tiny reward-model run writes reward_diagnostics.json from its final evaluation; the report
    plots it."""
    result = train_reward(reward_cfg(tmp_path, max_steps=2))
    out = tmp_path / "rm"
    found = json.loads((out / "reward_diagnostics.json").read_text())
    last = read_metrics(out)[-1]
    assert found["step"] == 2 == result.steps and found["num_pairs"] == 16
    for row in found["accuracy_by_margin"]:  # the final evaluation's table, as logged
        assert row["count"] == last[f"eval/calibration/{row['bucket']}/count"]
        assert row["accuracy"] == last.get(f"eval/calibration/{row['bucket']}/accuracy")
    assert sum(b["count"] for b in found["calibration"]["buckets"]) == 16
    bias = found["length_bias"]
    assert len(bias["points"]["chosen"]) == 16 and bias["correlation"] is not None
    assert found["padding_invariance"]["max_abs_delta"] <= 1e-5 and found["padding_invariance"]["invariant"]
    check_run_files(out)  # calibration.json and the rest: what the run wrote is read back
    page = write_report(out).read_text()
    section = page[page.index("<h2>Reward model diagnostics</h2>") : page.index("<h2>Config</h2>")]
    for name in PLOTS:
        assert_png(out / "report" / f"{name}.png")
        assert f"src='{name}.png'" in section
    assert "Padding invariance: max |Δscore|" in section and ": invariant." in section
