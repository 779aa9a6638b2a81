"""The calculator tool: ``<calc>12 * (3 + 4)</calc>`` -> `` <result>84</result>``.

The observation starts with a space: BPE tokenizers merge the punctuation of ``</calc><result>`` into one token,
so a model shown that would end its call inside a token that already starts the next tag; after ``</calc>``
followed by a space, the call ends on a token of its own.

The expression is parsed with ``ast`` and evaluated over a whitelist (numbers, + - * / // % **, unary signs,
parentheses); nothing is ever passed to ``eval``. Exponents and results are bounded, so a call cannot stall the
worker thread.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from qerl_cli.tools import chat
from qerl_cli.tools.base import ToolOutput

OPEN, CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is shown to the model)."""


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        if isinstance(value, complex):
            raise CalcError("the result is not a real number")
        if abs(value) > MAX_MAGNITUDE:
            raise CalcError("the result is too large")
        return value
    raise CalcError("only numbers, + - * / // % ** and parentheses are allowed")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, or CalcError."""
    text = expression.strip().replace("\u00d7", "*").replace("\u2212", "-").replace("^", "**")
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None
    return _eval(tree)


def format_number(value: int | float) -> str:
    """Integers as integers (also 6.0 -> 6); other floats with up to 10 significant digits."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalcError("the result is not finite")
        if value.is_integer():
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


class Calculator:
    """``<calc>EXPR</calc>`` ends a turn; the observation is ``<result>VALUE</result>``."""

    name = "calculator"
    stop = (CLOSE, chat.CLOSE)
    observation_tokens = 16  # " <result>-1234.5678</result>" is 12 tokens in SmolLM2's BPE

    def find_call(self, text: str) -> str | None:
        if chat.CLOSE in text[-len(chat.CLOSE) - 8:]:
            return chat.parse_call(text, self.name, "expression")
        start = text.rfind(OPEN)
        if start < 0:
            return None
        end = text.find(CLOSE, start)
        # what follows the closer is the rest of the token that completed it: the stop string ended the turn there
        return None if end < 0 else text[start + len(OPEN):end]

    def strip_calls(self, text: str) -> str:
        text = chat.strip_tagged(text)
        text = re.sub(re.escape(OPEN) + r".*?(" + re.escape(CLOSE) + r"|$)", "", text, flags=re.S)
        return re.sub(re.escape(RESULT_OPEN) + r".*?(" + re.escape(RESULT_CLOSE) + r"|$)", "", text, flags=re.S)

    def run(self, call: str) -> ToolOutput:
        try:
            value = format_number(evaluate(call))
            return ToolOutput(self.shot_result(value), text=value)
        except CalcError as exc:
            return ToolOutput(self.shot_result(f"error: {exc}"), error=str(exc), text=f"error: {exc}")

    @staticmethod
    def shot_result(result: str) -> str:
        return f" {RESULT_OPEN}{result}{RESULT_CLOSE}"

    def describe(self) -> str:
        return (f"You may use a calculator: write {OPEN}expression{CLOSE} and its value appears after it as "
                f"{RESULT_OPEN}value{RESULT_CLOSE}.")

    def shot(self, call: str, result: str) -> str:
        return f"{OPEN}{call}{CLOSE}{self.shot_result(result)}"

    def schema(self) -> dict:
        return chat.schema(self.name, "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses).",
                           "expression", "the expression, e.g. 12 * (3 + 4)")
