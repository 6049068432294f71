"""Reward functions: the TRL convention f(prompts, completions, **columns) -> list[float | None]."""

from .builtin import (
    BUILTIN_REWARDS,
    answers_from,
    env_reward,
    exact_answer,
    extract_math_answer,
    format_tags,
    length_penalty,
    make_format_tags,
    math_answer,
    overlong_penalty,
    parse_number,
)
from .loading import RewardReferenceError, load_reward_reference, named_reward, split_reference
from .remote import RemoteReward, RemoteRewardError
from .reward_model import RewardModelFunction
from .scoring import (
    CallRules,
    RewardFunctionError,
    RewardScores,
    renamed_rewards,
    reward_name,
    reward_names,
    score_completions,
)
from .serving import RewardServer, ServeLimits

__all__ = [
    "BUILTIN_REWARDS",
    "answers_from",
    "CallRules",
    "env_reward",
    "RewardFunctionError",
    "RemoteReward",
    "RemoteRewardError",
    "RewardModelFunction",
    "RewardServer",
    "ServeLimits",
    "RewardReferenceError",
    "load_reward_reference",
    "named_reward",
    "split_reference",
    "RewardScores",
    "exact_answer",
    "extract_math_answer",
    "format_tags",
    "length_penalty",
    "make_format_tags",
    "math_answer",
    "overlong_penalty",
    "parse_number",
    "renamed_rewards",
    "reward_name",
    "reward_names",
    "score_completions",
]
