"""Built-in tools: `calc`, an exact calculator (no `eval`: a parsed expression of literals)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

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


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * /, parentheses.

    Args:
        expression: for example "48213+90577" or "(3+4)*5/2".
    """
    result = evaluate_expression(expression)
    if result is None:
        raise ValueError(f"cannot evaluate {expression!r}: only integers, + - * / and parentheses")
    value = result[0]
    return str(value.numerator) if value.denominator == 1 else str(value)


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calc": calc}
