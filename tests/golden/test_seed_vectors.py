"""Golden tests: grpokit against the outputs of the reference implementations on one shared input
(shared/reference/seed_vectors.json: EasyDeL grpo_step's loss tail, a TRL snapshot's _compute_loss,
DI-engine grpo_policy_error, all executed from their source).

The references ran in float32; grpokit runs in float64 on the same float32 inputs. Loss, gradient
and metrics agree to float32 round-off, so every comparison uses rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from grpokit.ops import grpo_loss

from .seed_compat import di_engine_grpo_policy_error, easydel_grpo_step_loss

D = torch.float64
TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs(vectors):
    raw = vectors["inputs"]
    get = lambda key: torch.tensor(raw[key], dtype=D)  # noqa: E731
    return {k: get(k) for k in ("lp", "old", "ref", "entropies", "advantages")} | {"mask": get("mask").bool()}


def _case_kwargs(case: str) -> dict:
    """'grpo|token|q=0.5|delta=1.5' -> grpo_loss kwargs (β 0.04, ε 0.2, ε_high 0.28 or 5 for cispo)."""
    loss_type, level, q, *extra = case.split("|")
    kw = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        top_entropy_quantile=float(q[2:]),
        beta=0.04,
        epsilon=0.2,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
    )
    for item in extra:
        if item == "delta=1.5":
            kw["delta"] = 1.5
        elif item == "symmetric eps=0.2":
            kw["epsilon_high"] = 0.2
        else:
            raise AssertionError(f"unknown case suffix {item!r}")
    return kw


def _cases(system):
    import json
    from pathlib import Path

    return list(json.loads((Path(__file__).parent / "seed_vectors.json").read_text())[system])


EASYDEL_METRICS = {
    "mean_kl": "kl",
    "mean_entropy": "entropy",
    "clip_ratio/low_mean": "clip_ratio/low_mean",
    "clip_ratio/high_mean": "clip_ratio/high_mean",
    "clip_ratio/region_mean": "clip_ratio/region_mean",
    "cispo_clip_ratio": "cispo_clip_ratio",
}


@pytest.mark.parametrize("case", _cases("easydel"))
def test_easydel_grpo_step(seed_vectors, case):
    x = _inputs(seed_vectors)
    expected = seed_vectors["easydel"][case]
    kw = _case_kwargs(case)
    lp = x["lp"].clone().requires_grad_()
    out = easydel_grpo_step_loss(
        lp,
        x["advantages"],
        x["mask"],
        ref_logps=x["ref"],
        old_logps=x["old"],
        entropies=x["entropies"] if kw["top_entropy_quantile"] < 1 else None,
        num_items_in_batch=int(x["mask"].sum()),
        **kw,
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(expected["loss"], dtype=D), **TOL)
    for name, value in expected["metrics"].items():
        if name in EASYDEL_METRICS and value == value:  # NaN = "not computed" in EasyDeL
            torch.testing.assert_close(
                out.metrics[EASYDEL_METRICS[name]], torch.tensor(value, dtype=D), **TOL, msg=name
            )
    grad = torch.tensor(expected["grad_wrt_lp"], dtype=D)
    if kw["loss_type"] != "cispo":
        torch.testing.assert_close(lp.grad, grad, **TOL)
    else:
        # EasyDeL does not detach CISPO's clamped weight (a defect grpokit does not copy): its
        # gradient carries the extra term −A·lp·∂min(r, ε_h)/∂lp. For token-level weights inside
        # the cap that term is −A·lp·r·m/N per token: add it to ours and EasyDeL's must appear.
        assert not torch.allclose(lp.grad, grad, **TOL)
        if kw["importance_sampling_level"] == "token" and kw["top_entropy_quantile"] == 1.0:
            m = x["mask"].to(D)
            r = torch.exp(x["lp"] - x["old"])
            extra = -x["advantages"][:, None] * x["lp"] * r * m / m.sum()
            torch.testing.assert_close(lp.grad + extra, grad, **TOL)


TRL_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
)


@pytest.mark.parametrize("case", _cases("trl"))
def test_trl_snapshot_compute_loss(seed_vectors, case):
    """The snapshot predates TRL 1.16's bias-corrected KL default, so use_bias_correction_kl=False;
    TRL's dr_grpo divides by max_completion_length = 5 = T here."""
    x = _inputs(seed_vectors)
    expected = seed_vectors["trl"][case]
    lp = x["lp"].clone().requires_grad_()
    out = grpo_loss(
        lp,
        x["advantages"],
        x["mask"],
        old_logps=x["old"],
        ref_logps=x["ref"],
        entropies=x["entropies"],
        use_bias_correction_kl=False,
        max_completion_length=5,
        **_case_kwargs(case),
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(expected["loss"], dtype=D), **TOL)
    torch.testing.assert_close(lp.grad, torch.tensor(expected["grad_wrt_lp"], dtype=D), **TOL)
    assert set(expected["metrics"]) <= set(TRL_METRICS)
    for name, value in expected["metrics"].items():
        torch.testing.assert_close(out.metrics[name], torch.tensor(value, dtype=D), **TOL, msg=name)


def test_di_engine_grpo_policy_error(seed_vectors):
    """DI-engine's loss on the same log-probs equals TRL's symmetric-ε grpo (−0.0143491); its two
    monitors are unmasked means over all 20 positions."""
    x = _inputs(seed_vectors)
    expected = seed_vectors["di_engine"]["clip=0.2,beta=0.04"]
    # Logits whose log-softmax at `action` reproduces lp/old/ref exactly: put the log-prob at the
    # action index and log(1 − p) on one other token, so the row normalises to 1.
    action = torch.zeros(4, 5, dtype=torch.long)

    def logits_for(logp):
        other = torch.log1p(-logp.exp())
        return torch.stack([logp, other], dim=-1)  # [B, S, 2]

    out = di_engine_grpo_policy_error(
        logits_for(x["lp"]),
        logits_for(x["old"]),
        logits_for(x["ref"]),
        action,
        x["advantages"],
        x["mask"].to(D),
        clip_ratio=0.2,
        beta=0.04,
    )
    torch.testing.assert_close(out.loss, torch.tensor(expected["loss"], dtype=D), **TOL)
    torch.testing.assert_close(
        out.metrics["approx_kl"], torch.tensor(expected["info"]["approx_kl"], dtype=D), **TOL
    )
    torch.testing.assert_close(
        out.metrics["clipfrac"], torch.tensor(expected["info"]["clipfrac"], dtype=D), **TOL
    )
