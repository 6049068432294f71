"""Reward-model diagnostics, computed once at the end of a reward-model run (`reward_diagnostics.json`).

* calibration: per bucket of |margin| (|r_chosen − r_rejected|), the pair count, the observed accuracy
  (strict r_c > r_r: the evaluation's `calibration/<bucket>/accuracy`, reused) and the accuracy the
  Bradley–Terry model predicts, mean(sigmoid(|margin|)); a calibrated model has them equal. Their
  count-weighted mean absolute difference is the expected calibration error.
* accuracy by margin bucket: the evaluation's calibration table, as it is.
* length bias: the Pearson correlation between a sequence's score and its token length (chosen and
  rejected sequences together, as scored: after truncation), the share of pairs of unequal lengths whose
  longer sequence scores strictly higher, and up to `MAX_POINTS` (length, score) points for a plot.
* padding invariance: a few held-out sequences scored alone (no padding) and batched with a longer one,
  left- and right-padded; the largest |Δscore|. A model that reads its padding shows a large value.

The inputs are the held-out pairs as the evaluation scored them (`ScoredPairs`), so nothing is scored
twice; only the padding check runs the model again, on at most `PADDING_SAMPLE` short sequences.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..models import Precision, model_device, reward_scores

DIAGNOSTICS_FILE = "reward_diagnostics.json"  # in the run's output_dir
CALIBRATION_EDGES = (0.0, 0.5, 1.0, 2.0, 4.0, math.inf)  # buckets of |r_chosen − r_rejected|
MAX_POINTS = 300  # (length, score) points kept for the scatter plot: chosen and rejected of 150 pairs
PADDING_SAMPLE = 16  # sequences the padding check scores alone and batched
PADDING_EXTRA = 8  # the batch's longest sequence is this many tokens longer than the sample's (≤ max_length)


@dataclass(frozen=True)
class ScoredPairs:
    """Held-out pairs as an evaluation scored them: pair i is (chosen[i], rejected[i]). On the host,
    float32 scores; lengths are the tokens each sequence had when scored (after truncation)."""

    chosen: torch.Tensor  # [n] float32
    rejected: torch.Tensor  # [n] float32
    chosen_lengths: torch.Tensor  # [n] int64
    rejected_lengths: torch.Tensor  # [n] int64

    @property
    def gap(self) -> torch.Tensor:
        return self.chosen - self.rejected  # [n]


def margin_buckets(gap: torch.Tensor) -> Iterator[tuple[str, float, float, torch.Tensor]]:
    """(name, lo, hi, mask [n] bool) for each bucket lo ≤ |gap| < hi of `CALIBRATION_EDGES`."""
    size = gap.abs()
    for lo, hi in zip(CALIBRATION_EDGES[:-1], CALIBRATION_EDGES[1:], strict=True):
        yield f"{lo:g}-{hi:g}", lo, hi, (size >= lo) & (size < hi)


# ----------------------------------------------------------------------------- calibration


def calibration(scored: ScoredPairs, metrics: dict[str, float]) -> dict[str, Any]:
    """Per bucket: count, observed accuracy (the evaluation's `calibration/<bucket>/accuracy` in
    `metrics`, not recomputed) and predicted accuracy mean(sigmoid(|gap|)); None where a bucket is
    empty. Plus the expected calibration error, Σ count/n · |observed − predicted|."""
    gap = scored.gap.double()  # [n]
    buckets, ece, total = [], 0.0, len(gap)
    for name, lo, hi, inside in margin_buckets(gap):
        count = int(inside.sum())
        observed = metrics.get(f"calibration/{name}/accuracy") if count else None
        predicted = torch.sigmoid(gap[inside].abs()).mean().item() if count else None
        if observed is not None and predicted is not None:
            ece += count / total * abs(observed - predicted)
        buckets.append(
            {
                "bucket": name,
                "lo": lo,
                "hi": None if math.isinf(hi) else hi,  # JSON has no infinity
                "count": count,
                "observed_accuracy": observed,
                "predicted_accuracy": predicted,
            }
        )
    return {"buckets": buckets, "expected_calibration_error": ece if total else None}


def accuracy_by_margin(metrics: dict[str, float]) -> list[dict[str, Any]]:
    """The evaluation's calibration table as rows {bucket, count, accuracy} (None: an empty bucket)."""
    rows = []
    for lo, hi in zip(CALIBRATION_EDGES[:-1], CALIBRATION_EDGES[1:], strict=True):
        name = f"{lo:g}-{hi:g}"
        rows.append(
            {
                "bucket": name,
                "count": int(metrics.get(f"calibration/{name}/count", 0)),
                "accuracy": metrics.get(f"calibration/{name}/accuracy"),
            }
        )
    return rows


# ----------------------------------------------------------------------------- length bias


def pearson(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Pearson correlation of two [m] tensors (in float64); None where either is constant or m < 2."""
    x, y = x.double(), y.double()
    dx, dy = x - x.mean(), y - y.mean()  # [m]
    denominator = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    if len(x) < 2 or denominator == 0.0 or not math.isfinite(denominator):
        return None
    return float((dx * dy).sum()) / denominator


def length_bias(scored: ScoredPairs, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """Correlation of score with length over the 2n scored sequences; the share of pairs of unequal
    lengths whose longer sequence scores strictly higher (None when all pairs have equal lengths);
    up to `max_points` (length, score) points, from evenly spaced pairs, for a scatter plot."""
    lengths = torch.cat([scored.chosen_lengths, scored.rejected_lengths])  # [2n]
    scores = torch.cat([scored.chosen, scored.rejected])  # [2n]
    unequal = scored.chosen_lengths != scored.rejected_lengths  # [n] bool
    chosen_longer = scored.chosen_lengths > scored.rejected_lengths  # [n] bool
    longer_higher = torch.where(
        chosen_longer, scored.chosen > scored.rejected, scored.rejected > scored.chosen
    )  # [n] bool, meaningful where unequal
    num_unequal = int(unequal.sum())
    n = len(scored.chosen)
    keep = torch.linspace(0, n - 1, min(n, max_points // 2)).round().long() if n else torch.zeros(0).long()
    return {
        "correlation": pearson(lengths, scores),
        "longer_wins": float(longer_higher[unequal].double().mean()) if num_unequal else None,
        "num_unequal_pairs": num_unequal,
        "num_equal_length_pairs": n - num_unequal,
        "points": {
            "chosen": [[int(scored.chosen_lengths[i]), float(scored.chosen[i])] for i in keep],
            "rejected": [[int(scored.rejected_lengths[i]), float(scored.rejected[i])] for i in keep],
        },
    }


# ----------------------------------------------------------------------------- padding invariance


def padded_batch(
    sequences: Sequence[Sequence[int]], pad_id: int, side: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists on the `side` ("left" or "right"). -> ids [k, L], attention mask [k, L] bool"""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # [k, L]
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)  # [k, L]
    for i, s in enumerate(sequences):
        where = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, where], mask[i, where] = torch.tensor(list(s), dtype=torch.long), True
    return ids, mask


@torch.no_grad()
def padding_invariance(
    model: Any,
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    *,
    max_length: int,
    precision: Precision | None = None,
) -> dict[str, Any]:
    """Score each of `sequences` (token lists, at most `PADDING_SAMPLE` are used) alone, then batched
    with a longer filler sequence (up to `PADDING_EXTRA` tokens longer, within `max_length`), left- and
    right-padded; report the largest |Δscore| of each side and overall, how much padding the sample
    got, and whether the difference is round-off: within `tolerance`, 1e-3 × max(1, max |score|) in
    float32 (TF32 matmuls on a GPU round at ~1e-3) and 5e-2 × that in a 16-bit compute dtype."""
    was_training = model.training
    model.eval()
    device, precision = model_device(model), precision or Precision()
    sample = [list(s) for s in sequences[:PADDING_SAMPLE] if len(s)]
    if not sample:
        return {"num_sequences": 0}
    longest = max(sample, key=len)
    width = max(len(longest), min(max_length, len(longest) + PADDING_EXTRA))
    filler = (longest * math.ceil(width / len(longest)))[:width]  # real tokens, longer than the sample
    with precision.autocast(device):
        alone = torch.stack(
            [
                reward_scores(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.bool))[0]
                for s in sample
            ]
        ).float()  # [k]
        deltas = {}
        for side in ("left", "right"):
            ids, mask = padded_batch(sample + [filler], pad_id, side)  # [k + 1, L]
            batched = reward_scores(model, ids, mask).float()[: len(sample)]  # [k]
            deltas[side] = (batched - alone).abs().max().item()
    model.train(was_training)
    scale = max(1.0, alone.abs().max().item())
    tolerance = (1e-3 if precision.compute == torch.float32 else 5e-2) * scale
    worst = torch.tensor(list(deltas.values())).max().item()  # NaN, if any, wins
    return {
        "num_sequences": len(sample),
        "max_abs_delta": worst,
        "left": deltas["left"],
        "right": deltas["right"],
        "max_padding": width - min(len(s) for s in sample),
        "num_padded": sum(len(s) < width for s in sample),
        "compute_dtype": str(precision.compute).removeprefix("torch."),
        "tolerance": tolerance,
        "invariant": bool(worst <= tolerance),  # NaN is not
    }


# ----------------------------------------------------------------------------- all of them


def reward_diagnostics(
    scored: ScoredPairs,
    metrics: dict[str, float],
    padding: dict[str, Any],
) -> dict[str, Any]:
    """The contents of reward_diagnostics.json: `scored` and `metrics` from the same evaluation
    (`metrics` holds its calibration table), `padding` from `padding_invariance`."""
    return {
        "num_pairs": len(scored.chosen),
        "calibration": calibration(scored, metrics),
        "accuracy_by_margin": accuracy_by_margin(metrics),
        "length_bias": length_bias(scored),
        "padding_invariance": padding,
    }
