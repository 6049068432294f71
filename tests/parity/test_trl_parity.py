"""grpokit against TRL 1.16.0 itself, executed side by side on fresh random float64 inputs.

TRL's loss lives inside `GRPOTrainer._compute_loss(self, model, inputs)`, which reads ~20
attributes of a fully built trainer (model, accelerator, config). Building one needs a model and
a dataset, so instead the unbound method runs on a minimal stand-in `self` whose log-prob hook
returns the given tensors: every line of TRL's loss and metric code runs unmodified, on one
process with gradient accumulation 1. The same for `RewardTrainer.compute_loss`.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpokit.ops import bradley_terry_loss, grpo_loss
from tests.helpers import random_batch

pytestmark = pytest.mark.parity
D = torch.float64
# TRL builds SAPO's per-row temperatures with torch.where on Python floats, which makes them float32
# (its default 1.05 becomes 1.0499999523): a float32-exact temperature keeps the comparison exact.
SAPO_NEG = 1.0625
ALL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


@functools.cache
def _trl() -> SimpleNamespace:
    """TRL's trainers, imported by the first test that runs one (importing TRL takes ~2 s: a worker
    that collects this module and runs none of it does not pay)."""
    pytest.importorskip("trl", reason="the parity reference; installed by `bash scripts/setup.sh test`")
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.reward_trainer import RewardTrainer

    return SimpleNamespace(GRPOTrainer=GRPOTrainer, RewardTrainer=RewardTrainer)


class _OneProcess:
    num_processes = 1

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor


def trl_grpo_loss(
    batch, lp, *, loss_type, level, beta, epsilon, epsilon_high, delta, q, bias_kl, max_len, is_ratio=None
):
    args = SimpleNamespace(
        use_bias_correction_kl=bias_kl,
        delta=delta,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=SAPO_NEG,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=1,
    )
    me = SimpleNamespace(
        args=args,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        top_entropy_quantile=q,
        max_completion_length=max_len,
        accelerator=_OneProcess(),
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        off_policy_mask_threshold=None,
        use_vllm=is_ratio is not None,  # TRL weighs by importance_sampling_ratio only with vLLM
        vllm_importance_sampling_correction=is_ratio is not None,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=_trl().GRPOTrainer.get_gamma_weights,
        get_off_policy_mask=_trl().GRPOTrainer.get_off_policy_mask,
    )
    me.get_high_entropy_mask = lambda e, m, thr: _trl().GRPOTrainer.get_high_entropy_mask(me, e, m, thr)
    me._get_per_token_logps_and_entropies = lambda *a, **k: (lp, batch["entropies"], None)
    B, T = lp.shape
    mask = batch["mask"].long()  # TRL's completion_mask is an integer tensor
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": batch["adv"],
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        "num_items_in_batch": mask.sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = _trl().GRPOTrainer._compute_loss(me, None, inputs)
    return loss, {name: values[-1] for name, values in me._metrics["train"].items()}


def ours(batch, lp, **options):
    """grpokit's grpo_loss on a parity batch (max_completion_length 9, TRL's float32 SAPO temperature)."""
    return grpo_loss(
        lp,
        batch["adv"],
        batch["mask"],
        old_logps=batch["old"],
        ref_logps=batch["ref"],
        entropies=batch["entropies"],
        max_completion_length=9,
        sapo_temperature_neg=SAPO_NEG,
        **options,
    )


VARIANTS = {
    "base": {},
    "epsilon_high": {"epsilon_high": 0.28},
    "delta": {"delta": 1.3},
    "top_entropy": {"q": 0.5},
    "no_bias_kl": {"bias_kl": False},
}


@pytest.mark.parametrize(
    ("loss_type", "level", "beta", "variant"),
    [  # the KL bias correction only exists when beta != 0
        case
        for case in itertools.product(ALL_LOSS_TYPES, ["token", "sequence"], [0.0, 0.04], VARIANTS)
        if not (case[3] == "no_bias_kl" and case[2] == 0.0)
    ],
)
def test_grpo_loss_matches_trl_1_16(loss_type, level, beta, variant):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{loss_type}|{level}|{beta}|{variant}".encode()))
    batch = random_batch(gen, B=6, T=7, empty_row=True)
    options = dict(epsilon=0.2, epsilon_high=None, delta=None, q=1.0, bias_kl=True) | VARIANTS[variant]

    lp_trl = batch["lp"].clone().requires_grad_()
    trl_loss, trl_metrics = trl_grpo_loss(
        batch, lp_trl, loss_type=loss_type, level=level, beta=beta, max_len=9, **options
    )
    trl_loss.backward()

    lp = batch["lp"].clone().requires_grad_()
    out = ours(
        batch,
        lp,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon=options["epsilon"],
        epsilon_high=options["epsilon_high"],
        delta=options["delta"],
        top_entropy_quantile=options["q"],
        use_bias_correction_kl=options["bias_kl"],
    )
    out.loss.backward()

    torch.testing.assert_close(out.loss, trl_loss.detach(), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(lp.grad, lp_trl.grad, rtol=1e-6, atol=1e-12)
    assert set(out.metrics) == set(trl_metrics), "grpokit reports exactly TRL's metric names"
    for name, value in trl_metrics.items():
        torch.testing.assert_close(
            out.metrics[name], torch.tensor(value, dtype=D), rtol=1e-6, atol=1e-12, msg=name
        )


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("loss_type", [t for t in ALL_LOSS_TYPES if t != "vespo"])
def test_sampling_weights_weigh_the_loss_as_trls_importance_sampling_correction(loss_type, per_sequence):
    """`sampling_weights` (π_old/q per token [B, T] or per sequence [B, 1]) enter the loss exactly as
    TRL's `importance_sampling_ratio`: on the policy term, not the KL term (beta 0.04 here)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"is|{loss_type}|{per_sequence}".encode()))
    batch = random_batch(gen, B=6, T=7, empty_row=True)
    shape = (6, 1) if per_sequence else (6, 7)
    weights = torch.rand(shape, generator=gen, dtype=D) * 2.5  # includes 0-ish and > 1 weights
    options = dict(epsilon=0.2, epsilon_high=None, delta=None, q=1.0, bias_kl=True)
    lp_trl = batch["lp"].clone().requires_grad_()
    trl_loss, trl_metrics = trl_grpo_loss(
        batch, lp_trl, loss_type=loss_type, level="token", beta=0.04, max_len=9, is_ratio=weights, **options
    )
    trl_loss.backward()
    lp = batch["lp"].clone().requires_grad_()
    out = ours(batch, lp, sampling_weights=weights, loss_type=loss_type, beta=0.04)
    out.loss.backward()
    torch.testing.assert_close(out.loss, trl_loss.detach(), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(lp.grad, lp_trl.grad, rtol=1e-6, atol=1e-12)
    unweighted = ours(batch, batch["lp"], loss_type=loss_type, beta=0.04)
    assert (out.loss - unweighted.loss).abs() > 1e-6  # the weights did something


def trl_reward_loss(chosen, rejected, margin, coefficient):
    me = SimpleNamespace(
        args=SimpleNamespace(center_rewards_coefficient=coefficient),
        model=SimpleNamespace(training=True),
        accelerator=_OneProcess(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    scores = torch.cat([chosen, rejected])[:, None]  # TRL runs chosen and rejected as one batch -> [2B, 1]
    inputs = {
        "input_ids": torch.zeros(len(scores), 3, dtype=torch.long),
        "attention_mask": torch.ones(len(scores), 3),
    }
    if margin is not None:
        inputs["margin"] = margin
    loss = _trl().RewardTrainer.compute_loss(me, lambda **kw: SimpleNamespace(logits=scores), inputs)
    return loss, {k: v[-1] for k, v in me._metrics["train"].items()}


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("coefficient", [None, 0.01])
def test_bradley_terry_matches_trl_reward_trainer(with_margin, coefficient):
    gen = torch.Generator().manual_seed(7)
    chosen = torch.randn(16, generator=gen, dtype=D, requires_grad=True)
    rejected = torch.randn(16, generator=gen, dtype=D, requires_grad=True)
    margin = torch.rand(16, generator=gen, dtype=D) if with_margin else None
    trl_loss, trl_metrics = trl_reward_loss(chosen, rejected, margin, coefficient)
    trl_grads = torch.autograd.grad(trl_loss, (chosen, rejected))
    out = bradley_terry_loss(chosen, rejected, margin=margin, center_rewards_coefficient=coefficient)
    grads = torch.autograd.grad(out.loss, (chosen, rejected))
    torch.testing.assert_close(out.loss, trl_loss, rtol=1e-6, atol=1e-12)
    for ours, theirs in zip(grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-12)
    for name in ("accuracy", "margin"):
        torch.testing.assert_close(
            out.metrics[name], torch.tensor(trl_metrics[name], dtype=D), rtol=1e-6, atol=1e-12
        )


def test_defaults_are_trl_1_16_grpo_config_defaults():
    """Every grpo_loss keyword TRL's GRPOConfig also has takes TRL's default (loss_type, beta, ε...)."""
    import inspect

    _trl()  # skipped without TRL
    from trl import GRPOConfig

    config = GRPOConfig(output_dir="/tmp/unused-grpokit-parity", report_to=[], use_cpu=True, bf16=False)
    ours = {
        n: p.default for n, p in inspect.signature(grpo_loss).parameters.items() if p.default is not p.empty
    }
    shared = set(ours) & set(vars(config))
    assert {
        "loss_type",
        "beta",
        "epsilon",
        "epsilon_high",
        "delta",
        "importance_sampling_level",
        "top_entropy_quantile",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
        "use_bias_correction_kl",
    } <= shared
    for name in shared - {"max_completion_length"}:  # ours: None = the width T; TRL's config: 256
        assert ours[name] == getattr(config, name), name
