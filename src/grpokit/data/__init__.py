"""Prompt datasets and the built-in tasks."""

from .prompts import DataError, PromptSampler, columns_of, load_prompts, render_prompt
from .tasks import TASKS, Task, evaluate_expression, get_task

__all__ = [
    "TASKS",
    "DataError",
    "PromptSampler",
    "Task",
    "columns_of",
    "evaluate_expression",
    "get_task",
    "load_prompts",
    "render_prompt",
]
