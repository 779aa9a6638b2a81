"""Tools and environments for multi-turn episodes (docs/tools.md): the Python sandbox, the calculator, user
environments, and the episode bookkeeping the trainer and ``qerl eval`` share."""

from __future__ import annotations

from qerl_cli.errors import QerlError
from qerl_cli.tools.base import Tool, ToolOutput
from qerl_cli.tools.calculator import Calculator
from qerl_cli.tools.python_tool import PythonTool
from qerl_cli.tools.sandbox import SandboxLimits

TOOL_NAMES = ("python", "calculator")

__all__ = ["TOOL_NAMES", "Calculator", "PythonTool", "SandboxLimits", "Tool", "ToolOutput", "make_tool"]


def make_tool(name: str, limits: SandboxLimits | None = None) -> Tool:
    """A built-in tool by name: "python" (sandboxed, ``limits``) or "calculator"."""
    if name == "python":
        return PythonTool(limits)
    if name == "calculator":
        return Calculator()
    raise QerlError(f"unknown tool {name!r}: use one of {', '.join(TOOL_NAMES)}")
