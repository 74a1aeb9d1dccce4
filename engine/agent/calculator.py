"""The ``calculator`` tool: evaluates an arithmetic expression without ``eval``.

The expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, unary signs and
parentheses are evaluated (exact integers stay exact; ``/`` gives a float only when the division
is not exact). Powers and results are bounded so that ``9**9**9`` is an error, not a hung worker.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any, Union

from hyflow.agent.tools import Tool, ToolResult, function_schema

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200  # characters
MAX_EXPONENT = 64
MAX_DIGITS = 100


class CalculatorError(ValueError):
    """An expression the calculator refuses (the message is shown to the model)."""


def _check_size(value: Fraction) -> Fraction:
    if len(str(abs(value.numerator))) > MAX_DIGITS or len(str(value.denominator)) > MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("numbers must be finite")
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be integers of at most {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            return _check_size(left ** int(right))
        return _check_size(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalculatorError(f"unsupported syntax {type(node).__name__}: use numbers, + - * / // % ** and "
                          "parentheses")


def format_number(value: Fraction) -> str:
    """An exact integer as digits, anything else as a float (up to 12 significant digits)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


def calculate(expression: str) -> str:
    """The value of ``expression`` as text; :class:`CalculatorError` for what it refuses."""
    expression = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not expression:
        raise CalculatorError("empty expression")
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expressions are limited to {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
    return format_number(_eval(tree))


class Calculator(Tool):
    """``calculator(expression)``: the value of an arithmetic expression."""

    @classmethod
    def default_schema(cls) -> dict:
        return function_schema("calculator", "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                               {"expression": {"type": "string", "description": "e.g. 347*28+5"}}, ["expression"])

    def execute(self, arguments: dict[str, Any]) -> Union[str, ToolResult]:
        try:
            return calculate(str(arguments["expression"]))
        except CalculatorError as exc:
            return ToolResult(f"Error: {exc}", error=True)
