"""A tool-call choice's message, whole (``final_message``) or as streamed deltas (``ToolCallStream``), as
vLLM's server sends them: content as it is known; per call a first delta with ``id``, ``type`` and the
function's ``name`` (``arguments: ""``), then ``arguments`` fragments as they are generated."""

from __future__ import annotations

from typing import Any

from loraplex.server.openai.tool_parsers.calls import ToolCall, ToolParser, new_call_id


def final_message(parser: ToolParser, text: str, finish_reason: str | None
                  ) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, calls, finish reason) of a finished choice. Whole calls end it with ``"tool_calls"`` (a
    stop) or keep its reason; a forced call cut short (``max_tokens``) is reported as the partial call it
    is; otherwise the text is content and there is no call."""
    scan = parser.scan(text)
    content, calls = scan.parsed(text)
    if calls:
        return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
    partial = [ToolCall(c.name, c.arguments) for c in scan.calls if c.name]
    if parser.forced and partial and not scan.invalid:
        return None, partial, finish_reason
    return text, [], finish_reason


class ToolCallStream:
    """One choice's deltas: ``delta(text, finish_reason)`` with the choice's whole text so far (and its finish
    reason once finished) gives the delta fields to send now and the finish reason to report."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_arguments: list[int] = []

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        scan = self.parser.scan(text)
        content = scan.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(scan.content))
        entries: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
                entries.append({"index": index, "id": self.ids[index], "type": "function",
                                "function": {"name": call.name, "arguments": ""}})
            if len(call.arguments) > self.sent_arguments[index]:
                entries.append({"index": index, "function": {"arguments": call.arguments[self.sent_arguments[index]:]}})
                self.sent_arguments[index] = len(call.arguments)
        reason = None
        if finished:
            _, calls, reason = final_message(self.parser, text, finish_reason)
            if not calls and not self.ids:  # no call after all: whatever was held back is content
                content += text[self.sent_content:]
                self.sent_content = len(text)
        delta: dict[str, Any] = {"content": content} if content else {}
        if entries:
            delta["tool_calls"] = entries
        return delta, reason
