"""The GRPO loss variants: the one declaration of `LossType` and the one table, `LOSS_TYPES`, of what
each variant is.

It lives in its own file with no torch import so that both sides can share it without breaking a
rule: `ops.policy_loss` (the variants' math) must not import the config, and `config` (the
`loss_type` option, the plan) must not import torch. ops and config are both the bottom layer, so the
config reading this file is no arrow back up.

Everything that differs between loss kinds outside the math is a field of `LossVariant`: the trainer
asks the table (`LOSS_TYPES[loss_type].teacher`, ...), never compares `loss_type` with a name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "opd", "gkd"]
TeacherSignal = Literal["logps", "distributions"]


@dataclass(frozen=True)
class LossVariant:
    """What one loss_type is: its surrogate and normaliser (the math, `ops.policy_loss`), and what a
    step must give it."""

    surrogate: str | None  # key of SURROGATES; None: no policy-gradient surrogate (and so no ratio)
    aggregation: str  # key of AGGREGATIONS
    # what the loss reads of a teacher model: the log-probs of the sampled tokens ("logps"), its whole
    # next-token distributions ("distributions": same vocabulary as the policy), or nothing (None)
    teacher: TeacherSignal | None = None
    # some steps learn from completions the student did not write (the dataset's answers, or the
    # teacher's samples), chosen per step
    demonstrations: bool = False

    @property
    def has_ratio(self) -> bool:
        """Whether the loss weighs π_θ / π_old (else old-policy log-probs are never needed)."""
        return self.surrogate is not None

    @property
    def reads_rewards(self) -> bool:
        """Whether rewards reach the loss (through the advantages)."""
        return self.surrogate is not None

    @property
    def needs_teacher(self) -> bool:
        return self.teacher is not None

    @property
    def learns_from_spread_only(self) -> bool:
        """Whether a group whose rewards are all equal teaches this loss nothing: the group-relative
        advantage is its only signal (a teacher's term differs token by token whatever the rewards)."""
        return self.reads_rewards and not self.needs_teacher

    @property
    def global_normaliser(self) -> bool:
        """Whether the loss divides by the whole batch's token count (else a mean per micro-batch)."""
        return self.aggregation == "global_token_mean"


# The one table that names the variants. A test checks it covers `LossType` exactly.
LOSS_TYPES: dict[str, LossVariant] = {
    "grpo": LossVariant("clipped", "sequence_mean"),  # DeepSeekMath
    "bnpo": LossVariant("clipped", "local_token_mean"),
    "dr_grpo": LossVariant("clipped", "constant_length"),  # Dr. GRPO (Liu et al. 2025)
    "dapo": LossVariant("clipped", "global_token_mean"),  # DAPO (Yu et al. 2025)
    "cispo": LossVariant("cispo", "global_token_mean"),  # MiniMax-M1
    "sapo": LossVariant("sapo", "sequence_mean"),  # Soft Adaptive Policy Optimization
    "luspo": LossVariant("clipped", "sequence_sum_mean"),  # length-unbiased sequence PO
    "vespo": LossVariant("vespo", "global_token_mean"),
    # on-policy distillation: dapo's surrogate and normaliser over per-token advantages that carry the
    # teacher's reverse KL (`ops.distillation_advantages`)
    "opd": LossVariant("clipped", "global_token_mean", teacher="logps"),
    # generalised knowledge distillation (GKD, Agarwal et al. 2024): no surrogate, the per-token loss is
    # the generalised JSD to the teacher over whole distributions (`ops.chunked_generalized_jsd`), its
    # token mean over the whole batch; a share (1 − lmbda) of its steps learn from demonstrations;
    # `grpo_loss` refuses it, `loss_weight` knows its normaliser
    "gkd": LossVariant(None, "global_token_mean", teacher="distributions", demonstrations=True),
}
# the loss types `grpo_loss` computes: those with a policy-gradient surrogate
POLICY_LOSS_TYPES: tuple[str, ...] = tuple(name for name, v in LOSS_TYPES.items() if v.surrogate is not None)
