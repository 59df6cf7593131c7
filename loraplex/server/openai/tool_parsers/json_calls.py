"""Tool-call formats whose calls are JSON objects ``{"name": ..., "arguments" | "parameters": {...}}`` after a
marker (vLLM's parser names):

- ``hermes``: ``<tool_call>{...}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3); content: the text before;
- ``llama3_json``: the output is ``<|python_tag|>`` or ``{``, then objects separated by ``;`` (Llama 3.x);
- ``mistral``: ``[TOOL_CALLS][{...}, ...]`` (the marker is a special token: without it, a leading ``[{``);
- ``granite``: ``<|tool_call|>[{...}, ...]`` (Granite 3.0; 3.1 writes ``<tool_call>``; also a leading ``[{``);
- ``phi4_mini_json``: ``functools[{...}, ...]`` (Phi-4-mini).

A call's ``arguments`` is the text of its arguments object exactly as generated, so the fragments a stream
sends add up to the whole response's arguments; an object still being generated gives its name once the
name's string is closed and its arguments as far as they go (``scan_json``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from loraplex.server.openai.tool_parsers.calls import PartialCall, Scan, held_back

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def json_end(text: str, start: int) -> int | None:
    """The index after the JSON object or array opening at ``text[start]``; None while it is unclosed."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _string_end(text: str, start: int) -> int | None:
    """The index after the JSON string opening at ``text[start]``; None while it is unclosed."""
    escaped = False
    for i in range(start + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None


def partial_call(obj: str, complete: bool) -> PartialCall | None:
    """The call in one object's text (``complete``: the object is closed); None if it is no call."""
    if complete:
        try:
            call = json.loads(obj)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
    name = _NAME.search(obj)
    found = _ARGUMENTS.search(obj)
    if found is None:
        return PartialCall(json.loads(f'"{name.group(1)}"') if name else None, "{}" if complete else "", complete)
    start = found.end()
    if start < len(obj) and obj[start] == '"':  # arguments given as a JSON string holding the object
        end = _string_end(obj, start)
        raw = json.loads(obj[start:end]) if end is not None else ""
    else:
        end = json_end(obj, start) if start < len(obj) and obj[start] in "{[" else None
        raw = obj[start:end] if end is not None else obj[start:]
    return PartialCall(json.loads(f'"{name.group(1)}"') if name else None, raw, complete and end is not None)


def scan_json(text: str, start: int) -> tuple[list[PartialCall], bool]:
    """Every JSON object from ``text[start:]`` on, read as a call; anything between objects (separators,
    markers, brackets) is skipped. Returns (calls, invalid: a closed object is no call)."""
    calls, i = [], start
    while (i := text.find("{", i)) != -1:
        end = json_end(text, i)
        call = partial_call(text[i:end] if end is not None else text[i:], end is not None)
        if call is None:
            return calls, True
        calls.append(call)
        if end is None:
            break
        i = end
    return calls, False


@dataclass(frozen=True)
class JsonCallsParser:
    """A format of JSON call objects after one of ``markers``; ``leading`` are starts of the whole output
    (after whitespace) that begin calls as well (a marker skipped as a special token, Llama's bare ``{``)."""

    markers: tuple[str, ...]
    leading: tuple[str, ...] = ()
    forced: bool = False

    def scan(self, text: str) -> Scan:
        stripped = text.lstrip()
        if self.leading and any(stripped.startswith(s) for s in self.leading):
            calls, invalid = scan_json(text, 0)
            return Scan("", calls, invalid)
        if self.leading and not stripped:
            return Scan("")
        found = [(at, m) for m in self.markers if (at := text.find(m)) != -1]
        if not found:
            return Scan(held_back(text, self.markers + self.leading if not stripped else self.markers))
        at, marker = min(found)
        calls, invalid = scan_json(text, at + len(marker))
        return Scan(text[:at], calls, invalid)


HERMES = JsonCallsParser(("<tool_call>",))
LLAMA3_JSON = JsonCallsParser(("<|python_tag|>",), leading=("{",))
MISTRAL = JsonCallsParser(("[TOOL_CALLS]",), leading=("[{",))
GRANITE = JsonCallsParser(("<|tool_call|>", "<tool_call>"), leading=("[{",))
PHI4_MINI_JSON = JsonCallsParser(("functools",))
REQUIRED = JsonCallsParser((), leading=("[",), forced=True)  # tool_choice "required": [{"name", "parameters"}]
