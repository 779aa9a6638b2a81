"""The tool protocol: how a tool call is found in a model turn, run, and shown back to the model (docs/tools.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ToolOutput:
    """What a call returned: the observation text shown to the model, and ``error`` (one line) when it failed.
    A failing call is still an observation (the model reads the error), never an exception."""

    observation: str
    error: str | None = None
    text: str = ""  # the result alone, without the tool's own formatting (a chat template formats it instead)


class Tool(Protocol):
    name: str
    stop: tuple[str, ...]  # strings that close a call: a model turn ends there, the tool runs
    # room one observation takes in an episode's token budget: what a default budget allows per call
    observation_tokens: int

    def find_call(self, text: str) -> str | None:
        """The payload (code, expression) of the call that ends ``text``, a model turn; None if it ends in none."""

    def strip_calls(self, text: str) -> str:
        """``text`` without its calls: what the answer graders score."""

    def run(self, call: str) -> ToolOutput:
        """Run one call (in a worker thread)."""

    def describe(self) -> str:
        """A prompt line telling the model how to call the tool."""

    def shot(self, call: str, result: str) -> str:
        """A worked call and its observation, as a prompt example."""

    def schema(self) -> dict:
        """The function schema a chat template shows the model (tools/chat.py)."""
