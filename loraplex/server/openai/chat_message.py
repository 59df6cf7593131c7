"""A chat choice's message from its text: whole (``message_fields``) or as streamed deltas (``ChoiceStream``),
with its reasoning split off first (``reasoning.py``, when a reasoning parser is on) and its tool calls read
from the rest (``tool_parsers``, when the request has tools)."""

from __future__ import annotations

from typing import Any

from loraplex.server.openai.reasoning import ReasoningParser, ReasoningStream
from loraplex.server.openai.tool_parsers import ToolCallStream, ToolParser, final_message


def message_fields(text: str, finish_reason: str | None, tools: ToolParser | None,
                   reasoning: ReasoningParser | None) -> tuple[dict[str, Any], str | None]:
    """A finished choice's message fields (``content``, ``tool_calls``, ``reasoning_content``) and finish
    reason."""
    fields: dict[str, Any] = {}
    if reasoning is not None:
        thought, text = reasoning.split(text)
        fields["reasoning_content"] = thought or None
    if tools is None:
        return {"content": text, **fields}, finish_reason
    content, calls, finish_reason = final_message(tools, text, finish_reason)
    if calls:
        fields["tool_calls"] = [c.body() for c in calls]
    return {"content": content, **fields}, finish_reason


class ChoiceStream:
    """One streamed choice: ``delta(text, finished, finish_reason)`` with its whole text so far gives the
    delta fields to send now and the finish reason to report (None: the engine's)."""

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolCallStream(tools) if tools is not None else None
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.sent_content = 0

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.delta(text, finished)
        if self.tools is not None:
            delta, reason = self.tools.delta(text, finished, finish_reason)
        else:
            piece, reason = text[self.sent_content:], None
            self.sent_content = max(self.sent_content, len(text))
            delta = {"content": piece} if piece else {}
        return ({"reasoning_content": thought, **delta} if thought else delta), reason
