"""Pure tensor math of GRPO and Bradley–Terry reward modelling.

Rules for everything in this package: torch only (never transformers or torch.distributed), no
config objects, no `.item()`, no logging, never an in-place write to an input. Every semantic
choice is a named argument, and every variant is chosen from one table:

    LOSS_TYPES          loss_type -> (surrogate, aggregation)
    SURROGATES          clipped | cispo | sapo | vespo
    AGGREGATIONS        how [B, T] per-token losses become a scalar
    IMPORTANCE_LEVELS   token | sequence | sequence_token
    NEGATIVE_ADVANTAGE_CLIPS  ppo | easydel
    KL_ESTIMATORS       k1 | k2 | k3
    REWARD_SCALES       group | batch | none

Shape letters: P prompts, G completions per prompt, B = P·G rows, T completion width,
V vocabulary, R reward functions.
"""

from .advantages import (
    REWARD_SCALES,
    GroupAdvantages,
    RewardScale,
    combine_rewards,
    decoupled_advantages,
    distillation_advantages,
    group_advantages,
)
from .divergence import Divergence, HeadStates, chunked_generalized_jsd, generalized_jsd
from .kl import KL_ESTIMATORS, KLEstimator, kl_penalty
from .linear_logps import linear_logps
from .logprobs import (
    TokenLogps,
    completion_logits,
    completion_logps,
    entropy_from_logits,
    selective_log_softmax,
    sequence_logps,
    token_logps,
    token_logps_and_entropy,
)
from .masking import masked_mean, masked_sum
from .outputs import LossOutput
from .policy_loss import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    LOSS_TYPES,
    NEGATIVE_ADVANTAGE_CLIPS,
    POLICY_LOSS_TYPES,
    SURROGATES,
    ImportanceSamplingLevel,
    LossType,
    NegativeAdvantageClip,
    grpo_loss,
    loss_weight,
    off_policy_sequence_mask,
    top_entropy_mask,
)
from .reward_loss import bradley_terry_loss
from .sampling_correction import SAMPLING_CORRECTIONS, SamplingCorrection, sampling_weights

__all__ = [
    "generalized_jsd",
    "chunked_generalized_jsd",
    "Divergence",
    "HeadStates",
    "distillation_advantages",
    "decoupled_advantages",
    "loss_weight",
    "SAMPLING_CORRECTIONS",
    "SamplingCorrection",
    "sampling_weights",
    "AGGREGATIONS",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "POLICY_LOSS_TYPES",
    "NEGATIVE_ADVANTAGE_CLIPS",
    "REWARD_SCALES",
    "SURROGATES",
    "GroupAdvantages",
    "ImportanceSamplingLevel",
    "KLEstimator",
    "LossOutput",
    "linear_logps",
    "LossType",
    "NegativeAdvantageClip",
    "RewardScale",
    "TokenLogps",
    "bradley_terry_loss",
    "combine_rewards",
    "completion_logits",
    "completion_logps",
    "entropy_from_logits",
    "group_advantages",
    "grpo_loss",
    "off_policy_sequence_mask",
    "top_entropy_mask",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "selective_log_softmax",
    "sequence_logps",
    "token_logps",
    "token_logps_and_entropy",
]
