"""What a tool-call parser finds in a chat completion's text: ``Scan`` (the content, the calls so far)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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


Parsed = tuple[str | None, list[ToolCall]]  # (content left, tool calls)


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is generated: ``name`` once its whole name is known, ``arguments`` the text of
    its arguments so far (only ever growing as the text grows), ``complete`` once its arguments are whole."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass(frozen=True)
class Scan:
    """A text read by a parser: ``content`` (the text that is no call; only ever growing as the text grows,
    so a marker still being generated is held back), the calls in order, and ``invalid`` when a call block
    holds no valid call (the whole text is then content, as vLLM answers)."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)
    invalid: bool = False

    def parsed(self, text: str) -> Parsed:
        """The finished text's (content, calls): every call whole, else no call and the text as content."""
        if self.invalid or not self.calls or not all(c.complete and c.name for c in self.calls):
            return text, []
        return self.content.strip() or None, [ToolCall(str(c.name), c.arguments) for c in self.calls]


class ToolParser(Protocol):
    """A tool-call format: ``scan`` reads a text, whole or as far as it is generated. ``forced``: the output
    is constrained to the calls (``tool_choice`` required or named): a call cut short is reported as it is."""

    forced: bool

    def scan(self, text: str) -> Scan: ...


def held_back(text: str, markers: tuple[str, ...]) -> str:
    """``text`` without a trailing piece that could begin one of ``markers`` (it may still become one)."""
    for cut in range(min(len(text), max(map(len, markers))), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return text[:-cut]
    return text
