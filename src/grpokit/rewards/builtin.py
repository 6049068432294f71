"""Built-in reward functions, TRL's convention: f(prompts, completions, **columns) -> list[float | None].

Dataset columns arrive as keyword lists (one value per completion); `completion_ids` (token ids
per completion) is passed too. None means "cannot score this one" and never counts as 0.
Functions that need settings are made by a factory (`overlong_penalty(4096, 512)`). Every function
here reads completions as text, also when prompts are conversations (`text_reward`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

RewardFunc = Callable[..., list[float | None]]

_NUMBER = r"-?\d+(?:\.\d+)?(?:/\d+)?"


def text_reward(fn: RewardFunc) -> RewardFunc:
    """Marks a reward function that reads each completion as its text. Others get TRL's form when
    prompts are conversations: [{"role": "assistant", "content": text}] (`scoring.score_completions`)."""
    fn.takes_text = True  # type: ignore[attr-defined]
    return fn


def _answer_in_marker(text: str, tag: str) -> str | None:
    match = re.search(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return match.group(1).strip() if match else None


def _last_token(text: str) -> str:
    parts = text.strip().split()
    return parts[-1] if parts else ""


@text_reward
def exact_answer(
    prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float | None]:
    """1.0 when the completion's answer equals the `answer` column, else 0.0; None where the row has
    no reference answer. The completion's answer is the text inside <answer>…</answer> when
    present, otherwise the completion's last whitespace-separated token."""
    if answer is None:
        raise ValueError("exact_answer needs an 'answer' column in the dataset.")
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        if reference is None:
            scores.append(None)
            continue
        given = _answer_in_marker(completion, "answer")
        given = _last_token(completion) if given is None else given
        scores.append(1.0 if given == str(reference).strip() else 0.0)
    return scores


def parse_number(text: str) -> Fraction | None:
    """A number written as an integer, a decimal or a fraction a/b (with optional sign), exactly."""
    text = text.strip().replace(",", "").replace("$", "")
    text = re.sub(r"\\frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", text)
    if not re.fullmatch(_NUMBER, text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{…}, braces balanced (so \\boxed{\\frac{1}{2}} works)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_math_answer(completion: str) -> Fraction | None:
    """The last \\boxed{…} value if any, else the last number in the text."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return parse_number(boxed)
    numbers = re.findall(_NUMBER, completion.replace(",", ""))
    return parse_number(numbers[-1]) if numbers else None


@text_reward
def math_answer(
    prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float | None]:
    """1.0 when the completion's final number equals the reference numerically (1/2 = 0.5 = 2/4),
    0.0 when it differs or the completion has no number; None where the reference is no number."""
    if answer is None:
        raise ValueError("math_answer needs an 'answer' column in the dataset.")
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = parse_number(str(reference)) if reference is not None else None
        if expected is None:
            scores.append(None)
            continue
        given = extract_math_answer(completion)
        scores.append(1.0 if given is not None and given == expected else 0.0)
    return scores


def make_format_tags(tags: Sequence[str] = ("think", "answer")) -> RewardFunc:
    """A reward of 1.0 when the completion is exactly the given tags in order
    (`<think>…</think><answer>…</answer>`, whitespace between them allowed), else 0.0."""
    pattern = re.compile(r"^\s*" + r"\s*".join(rf"<{t}>.*?</{t}>" for t in tags) + r"\s*$", flags=re.DOTALL)

    @text_reward
    def format_tags(prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float | None]:
        return [1.0 if pattern.match(c) else 0.0 for c in completions]

    return format_tags


format_tags = make_format_tags()


def _lengths(completions: Sequence[str], completion_ids: Sequence[Sequence[int]] | None) -> list[int]:
    if completion_ids is None:
        raise ValueError(
            "this reward needs `completion_ids` (token ids per completion); the trainer passes them."
        )
    return [len(ids) for ids in completion_ids]


def overlong_penalty(max_completion_length: int, soft_punish_cache: int) -> RewardFunc:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), L = completion length in tokens:
    0                              for L ≤ L_max − L_cache
    (L_max − L_cache − L)/L_cache  for L_max − L_cache < L ≤ L_max   (0 … −1, linear)
    −1                             for L > L_max
    """
    if not 0 <= soft_punish_cache <= max_completion_length:
        raise ValueError("soft_punish_cache must be in [0, max_completion_length].")
    start = max_completion_length - soft_punish_cache

    @text_reward
    def overlong(
        prompts: Sequence[Any], completions: Sequence[str], completion_ids: Any = None, **_: Any
    ) -> list[float | None]:
        out: list[float | None] = []
        for n in _lengths(completions, completion_ids):
            if n <= start:
                out.append(0.0)
            elif n <= max_completion_length:
                out.append((start - n) / soft_punish_cache)
            else:
                out.append(-1.0)
        return out

    overlong.__name__ = "overlong_penalty"
    return overlong


def length_penalty(max_completion_length: int, coefficient: float = 1.0) -> RewardFunc:
    """−coefficient · L / L_max: a steady pull towards shorter completions (L in tokens)."""
    if max_completion_length < 1:
        raise ValueError("max_completion_length must be ≥ 1.")

    @text_reward
    def penalty(
        prompts: Sequence[Any], completions: Sequence[str], completion_ids: Any = None, **_: Any
    ) -> list[float | None]:
        return [-coefficient * n / max_completion_length for n in _lengths(completions, completion_ids)]

    penalty.__name__ = "length_penalty"
    return penalty


@text_reward
def env_reward(prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> list[float | None]:
    """What a multi-turn episode's environment paid: the sum of the rewards its steps returned (None,
    unscored, when it returned none). Read from the `env_reward` column multi-turn rollouts add."""
    paid = columns.get("env_reward")
    if paid is None:
        raise ValueError(
            "the env reward reads what an environment paid, and these completions come from no "
            "environment; set tools or environment, or choose another reward"
        )
    return list(paid)


_HASH_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")  # GSM8K's final-answer line: "#### 1,234"


def hash_answer(completion: str) -> Fraction | None:
    """The number after the last `####` of a completion (commas and a `$` allowed), as GSM8K's
    solutions end and verl's strict GSM8K scorer reads them; None when there is none."""
    found = _HASH_ANSWER.findall(completion.replace("$", ""))
    return parse_number(found[-1]) if found else None


@text_reward
def gsm8k_answer(
    prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float | None]:
    """1.0 when the number after the completion's last `####` equals the reference (`answer`, a number
    or a whole GSM8K solution ending in `#### N`), else 0.0: a right number without the marker earns
    nothing, as in verl's strict scorer. None where the reference holds no number."""
    if answer is None:
        raise ValueError("gsm8k_answer needs an 'answer' column in the dataset.")
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        text = "" if reference is None else str(reference)
        expected = hash_answer(text) if "####" in text else parse_number(text)
        if expected is None:
            scores.append(None)
            continue
        given = hash_answer(completion)
        scores.append(1.0 if given is not None and given == expected else 0.0)
    return scores


@text_reward
def gsm8k_format(prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float | None]:
    """1.0 when the completion ends with its answer line, `#### N` (N a number), else 0.0."""
    return [1.0 if re.search(r"####\s*-?[\d,]*\.?\d+\s*$", c.replace("$", "")) else 0.0 for c in completions]


# the built-in rewards by name (config: reward_funcs: [exact_answer]; Python: reward_funcs=["exact_answer"]);
# with a built-in task, "task" names its reward too (config.schema.BUILTIN_REWARDS lists them all)
BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "env": env_reward,
    "exact_answer": exact_answer,
    "math_answer": math_answer,
    "format_tags": format_tags,
    "gsm8k_answer": gsm8k_answer,
    "gsm8k_format": gsm8k_format,
}


# the built-in rewards made for the run's max_completion_length (config: reward_funcs: [overlong_penalty]):
# DAPO's soft overlong punishment over the last fifth of the length (its 4096 of 20480), and the
# steady pull towards shorter completions
LENGTH_REWARDS: dict[str, Callable[[int], RewardFunc]] = {
    "overlong_penalty": lambda length: overlong_penalty(length, max(1, length // 5)),
    "length_penalty": lambda length: length_penalty(length),
}


# the built-in rewards that compare with the row's reference answer, read from the `answer` column
ANSWER_READERS = frozenset({"exact_answer", "math_answer", "gsm8k_answer"})


def answers_from(fn: RewardFunc, column: str) -> RewardFunc:
    """`fn` reading the reference answers from `column` (the config's answer_column) when it is a
    built-in reward that compares with them, else `fn` itself. A user's own function gets every
    column by its own name, as TRL passes them."""
    if column == "answer" or fn not in {BUILTIN_REWARDS[name] for name in ANSWER_READERS}:
        return fn

    @functools.wraps(fn)  # its name (metrics) and takes_text
    def reading(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        return fn(prompts, completions, **{**columns, "answer": columns.get(column)})

    return reading
