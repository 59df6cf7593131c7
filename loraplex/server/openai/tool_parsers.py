"""Tool-call parsers: a chat completion's text -> (content, tool calls).

``tool_choice: "auto"`` leaves the model free and parses its own tool-call format (``PARSERS``, one
entry per format; Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as
Qwen2.5 / Qwen3 / Hermes write them, is the default). ``"required"`` and a named function constrain the
output to JSON (``tools.py``), parsed here by ``parse_required`` and ``parse_named``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""

    def body(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a streamed delta)."""
        entry = {"id": self.id or new_call_id(), "type": "function",
                 "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


Parsed = tuple[str | None, list[ToolCall]]  # (content left, tool calls)

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    """``<tool_call>{"name", "arguments"}</tool_call>`` blocks; the text before the first is the content. A
    block that is not such JSON leaves the whole text as content (no calls)."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes}
DEFAULT_PARSER = "hermes"


def parse_required(text: str) -> Parsed:
    """The JSON array ``[{"name", "parameters"}, ...]`` that ``tool_choice: "required"`` constrains to."""
    try:
        calls = json.loads(text)
    except ValueError:  # cut short (max_tokens): no call
        return text, []
    return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def parse_named(name: str) -> Callable[[str], Parsed]:
    """A named ``tool_choice``: the whole output is that function's arguments."""
    def parse(text: str) -> Parsed:
        try:
            json.loads(text)
        except ValueError:  # cut short (max_tokens): no call
            return text, []
        return None, [ToolCall(name, text)]
    return parse
