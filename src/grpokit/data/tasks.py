"""Built-in tasks: small, deterministic for a seed, with disjoint train and held-out splits, a
reward function and an exact accuracy. Their alphabets make a character tokenizer, so the demo
and the tests run without downloading anything.

    addition   "12+34="      -> "46"                         (a, b < 100)
    countdown  "3,5,7;22:"   -> an expression reaching 22    (each given number at most once)
    reverse    "1234>"       -> "4321"                       (3 to 6 digits)
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class Task:
    name: str
    alphabet: str  # every character prompts and answers use (for `char_tokenizer`)
    train: list[dict[str, Any]]  # rows with a "prompt" column and the columns the reward reads
    eval: list[dict[str, Any]]  # held out: no prompt appears in train
    is_correct: Callable[[str, dict[str, Any]], bool]
    max_prompt_length: int
    max_completion_length: int

    def reward(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float | None]:
        """1.0 for a correct completion, else 0.0 (the TRL reward-function convention)."""
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
        return [1.0 if self.is_correct(c, row) else 0.0 for c, row in zip(completions, rows, strict=True)]

    def accuracy(self, completions: list[str], rows: list[dict[str, Any]]) -> float:
        """Fraction of completions that are exactly right."""
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions for {len(rows)} rows.")
        return sum(self.is_correct(c, r) for c, r in zip(completions, rows, strict=True)) / max(len(rows), 1)


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


_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and the integer literals of an arithmetic expression (+ − × ÷, parentheses),
    or None if it is anything else (names, calls, powers, division by zero...)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("not allowed")

    try:
        return walk(tree), numbers
    except (ValueError, ZeroDivisionError):
        return None


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


TASKS: dict[str, Callable[..., Task]] = {"addition": addition, "countdown": countdown, "reverse": reverse}


def get_task(name: str, seed: int = 0, num_eval: int = 200) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}.")
    return TASKS[name](seed=seed, num_eval=num_eval)
