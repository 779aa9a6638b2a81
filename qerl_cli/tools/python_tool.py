"""The Python tool: a turn that ends in a fenced ```python block runs it in the sandbox (tools/sandbox.py) and
the model sees what it printed in an ```output block, then continues.

    ```python
    print(17 * 23)
    ```
    ```output
    391
    ```

The stop string ``"```\\n"`` ends the model's turn at the closing fence; a turn that ends without one (EOS, the
task's own stop) carries no call. A crash, a timeout or a refused resource is shown to the model as the
observation (the last line of the traceback, or what the sandbox stopped), and recorded as the step's error.
"""

from __future__ import annotations

import re

from qerl_cli.tools import chat
from qerl_cli.tools.base import ToolOutput
from qerl_cli.tools.sandbox import SandboxLimits, run_python

OPEN = "```python"
FENCE = "```"
NO_OUTPUT = "(no output; print() what you want to see)"


class PythonTool:
    """Code in a ```python block, run in a fresh sandboxed process per call."""

    name = "python"
    stop = ("```\n", chat.CLOSE)
    observation_tokens = 128  # a few printed lines in the output fence

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.limits.check()

    def find_call(self, text: str) -> str | None:
        if chat.CLOSE in text[-len(chat.CLOSE) - 8:]:  # the closer, and at most the rest of its token
            return chat.parse_call(text, self.name, "code")
        start = text.rfind(OPEN)
        if start < 0:
            return None
        body = text[start + len(OPEN):]
        if not body[:1].isspace():  # ```pythonic is not an opener
            return None
        end = body.find(FENCE)
        if end < 0:
            return None
        # what follows the closing fence is the rest of the token that completed the stop string
        code = body[:end].strip("\n")
        return code if code.strip() else None

    def strip_calls(self, text: str) -> str:
        return re.sub(re.escape(OPEN) + r"\s.*?(" + re.escape(FENCE) + r"|$)", "", chat.strip_tagged(text), flags=re.S)

    def run(self, call: str) -> ToolOutput:
        result = run_python(call, self.limits)
        text = result.stdout.rstrip("\n")
        if result.error is not None:
            text = f"{text}\n{result.error}" if text else result.error
        elif result.truncated:
            text += "\n(output truncated)"
        return ToolOutput(self.shot_result(text or NO_OUTPUT), error=result.error, text=text or NO_OUTPUT)

    @staticmethod
    def shot_result(output: str) -> str:
        return f"```output\n{output}\n```\n"

    def describe(self) -> str:
        return "You may run Python code: write it in a ```python block, and what it prints is shown to you."

    def shot(self, call: str, result: str) -> str:
        return f"{OPEN}\n{call}\n{FENCE}\n{self.shot_result(result)}"

    def schema(self) -> dict:
        return chat.schema(self.name, "Run Python code in a fresh sandboxed process; returns what it printed.",
                           "code", "the Python program; print() what you want to see")
