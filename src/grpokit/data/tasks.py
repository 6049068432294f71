"""Built-in tasks: small, deterministic for a seed, with disjoint train and held-out splits, a
reward function and an exact accuracy. Their alphabets make a character tokenizer, so the demo
and the tests run without downloading anything.

    addition   "12+34="      -> "46"                         (a, b < 100)
    countdown  "3,5,7;22:"   -> an expression reaching 22    (each given number at most once)
    reverse    "1234>"       -> "4321"                       (3 to 6 digits)
    chain      "37+25+18+41+9="                              (5 to 10 terms: completions of 32-128
               -> "37+25=62,62+18=80,80+41=121,121+9=130;130"  tokens, every running total written)
    tool_addition  "48213+90577=" -> "138790"                (5-digit numbers; with a `calc` tool:
                   [calc("48213+90577")]{138790}138790        call, the tool's answer, the final answer)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ..envs.builtin import evaluate_expression
from .task import Task


def _split(
    rows: list[dict[str, Any]], num_eval: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    random.Random(seed).shuffle(rows)
    if not 0 < num_eval < len(rows):
        raise ValueError(f"num_eval must be in [1, {len(rows) - 1}], got {num_eval}.")
    return rows[num_eval:], rows[:num_eval]


def _answer_is(completion: str, row: dict[str, Any]) -> bool:
    return completion.strip() == row["answer"]


def addition(seed: int = 0, num_eval: int = 200) -> Task:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(100) for b in range(100)]
    train, held_out = _split(rows, num_eval, seed)
    return Task(
        "addition", "0123456789+=", train, held_out, _answer_is, max_prompt_length=6, max_completion_length=4
    )


def reverse(seed: int = 0, num_eval: int = 200, size: int = 5000) -> Task:
    rng = random.Random(seed + 1)
    seen: set[str] = set()
    while len(seen) < size:
        seen.add("".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6))))
    rows = [{"prompt": f"{s}>", "answer": s[::-1]} for s in sorted(seen)]
    train, held_out = _split(rows, num_eval, seed)
    return Task(
        "reverse", "0123456789>", train, held_out, _answer_is, max_prompt_length=7, max_completion_length=7
    )


def _countdown_correct(completion: str, row: dict[str, Any]) -> bool:
    result = evaluate_expression(completion)
    if result is None:
        return False
    value, used = result
    available = list(row["numbers"])
    for n in used:  # each given number at most once
        if n not in available:
            return False
        available.remove(n)
    return value == row["target"]


def countdown(seed: int = 0, num_eval: int = 200, size: int = 5000) -> Task:
    rng = random.Random(seed + 2)
    rows: dict[str, dict[str, Any]] = {}
    while len(rows) < size:
        numbers = [rng.randint(1, 20) for _ in range(3)]
        a, b, c = rng.sample(numbers, 3)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        solution = f"({a}{op1}{b}){op2}{c}"
        target = eval(solution)  # noqa: S307 - digits and + - * only, built here
        if 1 <= target <= 200:
            prompt = f"{','.join(map(str, numbers))};{target}:"
            rows.setdefault(
                prompt, {"prompt": prompt, "numbers": numbers, "target": target, "solution": solution}
            )
    train, held_out = _split(list(rows.values()), num_eval, seed)
    return Task("countdown", "0123456789+-*/(),;:", train, held_out, _countdown_correct, 13, 16)


def chain_answer(completion: str) -> str:
    """The final answer of a chain solution: what follows its last ';', stripped ('' when none)."""
    return completion.rpartition(";")[2].strip() if ";" in completion else ""


def _chain_correct(completion: str, row: dict[str, Any]) -> bool:
    return chain_answer(completion) == row["result"]


def chain_solution(terms: list[int], style: str) -> str:
    """A worked sum, every running total written: "full" writes each step whole (37+25=62,62+18=80),
    "short" only the term added and the new total (+25=62,+18=80); both end with ";" and the sum."""
    total, steps = terms[0], []
    for term in terms[1:]:
        before, total = total, total + term
        steps.append(f"{before}+{term}={total}" if style == "full" else f"+{term}={total}")
    return ",".join(steps) + f";{total}"


CHAIN_TERM, CHAIN_COUNT = (1, 9), (8, 16)


def chain(seed: int = 0, num_eval: int = 200, size: int = 20000) -> Task:
    """Sums of 5 to 10 two-digit numbers, solved step by step. A row's "answer" is its worked solution
    (what a warm start learns) in one of two styles drawn per row: "full" (about 10.5 tokens a step)
    or "short" (about 6.5), so a solution's length is partly the policy's own choice; "result" is the
    sum, the exact answer after the last ';' that the reward checks."""
    rng = random.Random(seed + 4)
    rows: dict[str, dict[str, Any]] = {}
    while len(rows) < size:
        terms = [rng.randint(*CHAIN_TERM) for _ in range(rng.randint(*CHAIN_COUNT))]
        prompt = "+".join(map(str, terms)) + "="
        style = rng.choice(("full", "short"))
        rows.setdefault(
            prompt,
            {
                "prompt": prompt,
                "answer": chain_solution(terms, style),
                "result": str(sum(terms)),
                "style": style,
            },
        )
    train, held_out = _split(list(rows.values()), num_eval, seed)
    return Task(
        "chain",
        "0123456789+=,;",
        train,
        held_out,
        _chain_correct,
        max_prompt_length=32,
        max_completion_length=128,  # the longest full solution is 103 tokens: room for a policy's own length
    )


def final_answer(completion: str, response_end: str = "}") -> str:
    """The text after the last tool response (a whole completion when there is none), stripped."""
    return completion.rpartition(response_end)[2].strip()


def _tool_answer_is(completion: str, row: dict[str, Any]) -> bool:
    return final_answer(completion) == row["answer"]


# what tool_addition's transcripts may hold: calls, answers and the tool's error messages
TOOL_ALPHABET = "0123456789+-*/=()[]{}\"'.,:;_ abcdefghijklmnopqrstuvwxyz"


def tool_addition(seed: int = 0, num_eval: int = 200, size: int = 20000) -> Task:
    """Sums of two 5-digit numbers: too long for a tiny model to add reliably, easy with `calc`."""
    rng = random.Random(seed + 3)
    rows: dict[str, dict[str, Any]] = {}
    while len(rows) < size:
        a, b = rng.randint(10000, 99999), rng.randint(10000, 99999)
        prompt, answer = f"{a}+{b}=", str(a + b)
        rows[prompt] = {
            "prompt": prompt,
            "answer": answer,
            "demonstration": [[f'[calc("{a}+{b}")]', True], ["{" + answer + "}", False], [answer, True]],
        }
    train, held_out = _split(list(rows.values()), num_eval, seed)
    return Task(
        "tool_addition",
        TOOL_ALPHABET,
        train,
        held_out,
        _tool_answer_is,
        max_prompt_length=12,
        max_completion_length=40,  # call (21) + response (8) + answer (6) + EOS, and room for an error
        tools=("calc",),
        tool_call_format="brackets",
        max_completion_length_without_tools=7,
    )


TASKS: dict[str, Callable[..., Task]] = {
    "addition": addition,
    "countdown": countdown,
    "chain": chain,
    "reverse": reverse,
    "tool_addition": tool_addition,
}


def get_task(name: str, seed: int = 0, num_eval: int = 200) -> Task:
    """A built-in task, or reasoning_gym:NAME (data/reasoning_gym.py)."""
    prefix, _, generator = name.partition(":")
    if prefix == "reasoning_gym" and generator:
        from .reasoning_gym import reasoning_gym_task

        return reasoning_gym_task(generator, seed=seed, num_eval=num_eval)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}.")
    return TASKS[name](seed=seed, num_eval=num_eval)
