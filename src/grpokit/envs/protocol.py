"""What an environment is to a multi-turn rollout.

An episode starts from a dataset row and alternates turns: the policy writes (until EOS, or until
one of the environment's `stop_strings`, such as a tool call's closing marker), the environment
answers with an observation, and so on, until the environment says done or `max_turns` policy turns
have been written. Only the policy's tokens are trained; the environment's are context.

    env = factory()                  # a fresh environment per episode: no state leaks between them
    first = env.reset(row)           # text appended after the prompt before the first turn ("" = none)
    observation, reward, done = env.step(policy_text)   # after every policy turn

`reset` may take `seed` as a keyword (`reset(row, seed=...)`): a 31-bit number derived from the run's
seed, the step, the prompt and the episode's place in its group, so a resumed run re-creates every
episode exactly (as long as the environment is deterministic given it: a tool that times out depends
on the clock), and an evaluation gives each held-out row the same seed whatever the batch size.
`step` may run on a worker thread, concurrently with other episodes' steps (each its own object).
With conversational prompts (message lists through the chat template), each observation joins the
transcript as a message of the environment's `observation_role` ("user" unless the factory has an
`observation_role` attribute; "tool" for tools; None keeps plain text inside the assistant's turn)
through the model's chat template (`envs.chat`), after the policy's end-of-turn token, and the next
policy turn opens with the assistant's generation prompt; the rollout's completion text is then the
last policy turn (the answer), and each episode's messages go to conversational reward functions as
TRL passes them. `reset`'s first text opens the assistant's first turn as plain text.
`reward` is None when the turn earns nothing; an episode's environment reward is the sum of the
rewards it returned (None if it never returned one). An environment may also have
`metrics() -> dict[str, float]` (counts, such as tool calls and tool errors; the same keys every
time), summed over the episodes of a batch and logged per episode as `env/<name>`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

from .chat import ChatTurns


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> str: ...

    def step(self, text: str) -> tuple[str, float | None, bool]: ...


class EnvStep(NamedTuple):
    """What the environment answers to one policy turn."""

    observation: str  # appended to the transcript as context (not trained); ignored when done
    reward: float | None  # None: this turn earns nothing
    done: bool  # the episode ends here


class EnvironmentFailure(RuntimeError):
    """An environment broke its contract (raised, or returned something else than documented)."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """How a rollout runs episodes: a factory of fresh environments, and the turn limit."""

    factory: Callable[[], Any]  # () -> Environment, called once per episode
    max_turns: int = 4  # policy turns per episode at most
    stop_strings: tuple[str, ...] = ()  # end a policy turn besides EOS (a tool call's closing marker)
    name: str = "environment"  # how errors name it
    tool_schemas: tuple[dict[str, Any], ...] = ()  # JSON schemas of its tools, for chat templates
    # the final answer of a transcript is the text after the last occurrence of this (a tool response's
    # closing marker); None: the whole transcript. Accuracy against an answer column judges that text
    answer_after: str | None = None
    markers: tuple[str, ...] = ()  # the texts its transcripts are built of (a tiny tokenizer needs them)
    # with conversational prompts, the role of an observation's message through the chat template
    # (envs.chat); None: observations are plain text appended inside the assistant's turn
    observation_role: str | None = "user"
    chat_variant: EnvironmentSpec | None = (
        None  # what runs instead with conversational prompts (tools: bare results)
    )
    chat: bool = False  # episodes continue through the chat template (`for_chat`)
    chat_template_kwargs: dict[str, Any] | None = None  # what the template is rendered with (chat)
    # chat: how a policy turn reads as a message (tools: the call parsed into tool_calls); None: its text
    turn_message: Callable[[str], dict[str, Any]] | None = None

    def final_answer(self, transcript: str) -> str:
        """The text after the last `answer_after` marker (the whole transcript without one), stripped."""
        if self.answer_after is None:
            return transcript.strip()
        return transcript.rpartition(self.answer_after)[2].strip()

    def for_chat(self, template_kwargs: dict[str, Any] | None = None) -> EnvironmentSpec:
        """The spec episodes of conversational prompts run: observations as messages of
        `observation_role` through the chat template, the final answer the last policy turn (the
        rollout's completion text). Unchanged when `observation_role` is None (plain-text observations)."""
        if self.chat or self.observation_role is None:
            return self
        base = self.chat_variant or self
        return replace(
            base, chat=True, chat_variant=None, answer_after=None, chat_template_kwargs=template_kwargs
        )

    def chat_turns(self, tokenizer: Any) -> ChatTurns | None:
        """How episodes continue through `tokenizer`'s chat template (None: plain-text observations)."""
        if not self.chat or self.observation_role is None:
            return None
        return ChatTurns.of(tokenizer, self.observation_role, self.chat_template_kwargs)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be ≥ 1, got {self.max_turns}.")
        if not callable(self.factory):
            raise TypeError(f"the environment factory must be callable, got {type(self.factory).__name__}.")
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(
                f"{self.name}: stop_strings must be non-empty strings, got {self.stop_strings!r}."
            )
        object.__setattr__(self, "stop_strings", stops)  # one string given alone: a one-string tuple


def reset_episode(env: Any, row: dict[str, Any], seed: int, name: str) -> str:
    """`env.reset(row)` (with `seed=` when it takes one), checked: the first observation text."""
    reset = getattr(env, "reset", None)
    if reset is None or not callable(getattr(env, "step", None)):
        raise EnvironmentFailure(
            f"{name}: the factory returned {type(env).__name__}, which lacks reset(row) and step(text)."
        )
    try:
        takes_seed = "seed" in inspect.signature(reset).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        takes_seed = False
    try:
        first = reset(row, seed=seed) if takes_seed else reset(row)
    except Exception as error:
        raise EnvironmentFailure(f"{name}.reset raised {type(error).__name__}: {error}") from error
    if first is None:
        return ""
    if not isinstance(first, str):
        raise EnvironmentFailure(f"{name}.reset must return a string (or None), got {type(first).__name__}.")
    return first


def step_episode(env: Any, text: str, name: str) -> EnvStep:
    """`env.step(text)`, checked: an `EnvStep`."""
    try:
        out = env.step(text)
    except Exception as error:
        raise EnvironmentFailure(f"{name}.step raised {type(error).__name__}: {error}") from error
    if not (isinstance(out, tuple) and len(out) == 3):
        raise EnvironmentFailure(
            f"{name}.step must return (observation, reward or None, done), got {type(out).__name__}."
        )
    observation, reward, done = out
    if not isinstance(observation, str):
        raise EnvironmentFailure(
            f"{name}.step's observation must be a string, got {type(observation).__name__}."
        )
    if reward is not None:
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise EnvironmentFailure(
                f"{name}.step's reward must be a number or None, got {reward!r}."
            ) from None
    return EnvStep(observation, reward, bool(done))


def episode_metrics(env: Any) -> dict[str, float]:
    """The environment's own counts (`metrics()`), or none."""
    metrics = getattr(env, "metrics", None)
    return {k: float(v) for k, v in metrics().items()} if callable(metrics) else {}
