"""Prompt datasets and the built-in tasks."""

from .answers import (
    ANSWER_FORMATS,
    AnswerFormat,
    apply_answer_format,
    demonstration,
    gsm8k_answer,
    solution_column,
)
from .curriculum import POOLS, Curriculum, CurriculumRule
from .custom import (
    answer_checker,
    check_characters,
    data_alphabet,
    has_answers,
    require_answers,
    require_demonstrations,
    sft_rows,
)
from .hub import dataset_splits, is_dataset_name
from .preferences import (
    PreferenceBatch,
    collate_preferences,
    load_preferences,
    pair_token_ids,
    preference_pairs,
    pretokenize,
)
from .prompts import DataError, PromptSampler, columns_of, load_prompts, render_prompt, with_system_prompt
from .task import Task
from .tasks import TASKS, evaluate_expression, get_task

__all__ = [
    "ANSWER_FORMATS",
    "AnswerFormat",
    "apply_answer_format",
    "demonstration",
    "solution_column",
    "dataset_splits",
    "gsm8k_answer",
    "is_dataset_name",
    "PreferenceBatch",
    "collate_preferences",
    "load_preferences",
    "pair_token_ids",
    "preference_pairs",
    "pretokenize",
    "TASKS",
    "answer_checker",
    "Curriculum",
    "CurriculumRule",
    "POOLS",
    "check_characters",
    "data_alphabet",
    "has_answers",
    "require_answers",
    "require_demonstrations",
    "sft_rows",
    "DataError",
    "PromptSampler",
    "Task",
    "columns_of",
    "evaluate_expression",
    "get_task",
    "load_prompts",
    "render_prompt",
    "with_system_prompt",
]
