"""Tool calls in a chat template's own format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` from
the model, and the answer as the template's ``tool`` turn (Qwen2.5/3 and other templates with tool calling).

With ``--chat-template`` the prompts carry the tool's schema (``apply_chat_template(tools=[...])``; a template
without tool support ignores it), a turn may end in either a tagged call or the tool's own format, and the
observation is what the template renders for a ``tool`` message after the assistant's turn: it closes the
assistant turn, holds the output, and opens the next assistant turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from qerl_cli.errors import QerlError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_MARK = "\u0000qerl-turn\u0000"


def parse_call(text: str, name: str, argument: str) -> str | None:
    """The ``argument`` of the tagged call to tool ``name`` that ends ``text``, or None (no call, another tool,
    malformed JSON). ``arguments`` may be an object or a JSON string of one."""
    start = text.rfind(OPEN)
    end = text.find(CLOSE, start) if start >= 0 else -1
    if end < 0:
        return None
    try:
        call = json.loads(text[start + len(OPEN):end])
        args = call.get("arguments", call.get("parameters", {}))
        args = json.loads(args) if isinstance(args, str) else args
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(call, dict) or call.get("name") != name or not isinstance(args, dict):
        return None
    value = args.get(argument)
    return value if isinstance(value, str) and value.strip() else None


def strip_tagged(text: str) -> str:
    """``text`` without its tagged calls."""
    while (start := text.find(OPEN)) >= 0:
        end = text.find(CLOSE, start)
        text = text[:start] + ("" if end < 0 else text[end + len(CLOSE):])
    return text


def schema(name: str, description: str, argument: str, argument_description: str) -> dict[str, Any]:
    """The function schema chat templates take in ``tools=[...]``: one required string argument."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string",
                                                                    "description": argument_description}},
                       "required": [argument]}}}


def chat_observation(tokenizer: Any) -> Callable[[str], str]:
    """A function from a tool's output to the text that follows the assistant's call in ``tokenizer``'s chat
    template: the assistant turn closed, a ``tool`` turn holding the output, the next assistant turn opened."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise QerlError("--chat-template with a tool needs a tokenizer with a chat template")

    def render(output: str) -> str:
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK},
                    {"role": "tool", "content": output}]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render a tool turn says so here
            raise QerlError(f"the chat template cannot render a tool message ({type(exc).__name__}: {exc}); use "
                            "--no-chat-template with --tools") from exc
        if _MARK not in text:
            raise QerlError("the chat template dropped the assistant's text around a tool message; use "
                            "--no-chat-template with --tools")
        return text[text.index(_MARK) + len(_MARK):]

    render("")  # refused now, before any rollout, if the template cannot do it
    return render
