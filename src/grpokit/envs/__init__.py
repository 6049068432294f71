"""Environments and tools for multi-turn rollouts: the protocol (`Environment`, `EnvironmentSpec`),
plain functions as tools (`tool_environment`, `TOOL_CALL_FORMATS`, `tool_schema`) and built-in tools.
This layer knows nothing of models or training."""

from .builtin import BUILTIN_TOOLS, calc, evaluate_expression
from .chat import ChatTemplateError, ChatTurns
from .protocol import (
    Environment,
    EnvironmentFailure,
    EnvironmentSpec,
    EnvStep,
    episode_metrics,
    reset_episode,
    step_episode,
)
from .tools import (
    TOOL_CALL_FORMATS,
    MalformedCall,
    ToolCall,
    ToolCallFormat,
    ToolEnvironment,
    parse_call,
    tool_environment,
    tool_schema,
)

__all__ = [
    "BUILTIN_TOOLS",
    "ChatTemplateError",
    "ChatTurns",
    "TOOL_CALL_FORMATS",
    "EnvStep",
    "Environment",
    "EnvironmentFailure",
    "EnvironmentSpec",
    "MalformedCall",
    "ToolCall",
    "ToolCallFormat",
    "ToolEnvironment",
    "calc",
    "episode_metrics",
    "evaluate_expression",
    "parse_call",
    "reset_episode",
    "step_episode",
    "tool_environment",
    "tool_schema",
]
