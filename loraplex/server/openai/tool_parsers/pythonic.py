"""vLLM's ``pythonic`` tool-call format: the whole output is a Python list of calls with keyword arguments of
literals, ``[get_weather(city="Paris", unit="C"), get_time()]`` (Llama 3.2 / 4 and Gemma-style fine-tunes).

Arguments become a JSON object (``json.dumps`` of the literals), so a call's arguments go out in one
fragment once its closing parenthesis is generated; its name goes out as soon as its ``(`` is.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from loraplex.server.openai.tool_parsers.calls import PartialCall, Scan

_CALL_START = re.compile(r"\s*,?\s*([A-Za-z_][\w.]*)\s*\(")


def _close_paren(text: str, start: int) -> int | None:
    """The index after the ``)`` closing the ``(`` at ``text[start - 1]``; None while unclosed."""
    depth, quote, escaped = 1, "", False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _arguments(call_text: str) -> str | None:
    """The call's keyword arguments as a JSON object; None if it is no call of literals."""
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in node.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class PythonicParser:
    forced: bool = False

    def scan(self, text: str) -> Scan:
        stripped = text.lstrip()
        if not stripped:
            return Scan("")
        if not stripped.startswith("["):
            return Scan(text)
        calls, i = [], len(text) - len(stripped) + 1
        while (match := _CALL_START.match(text, i)) is not None:
            end = _close_paren(text, match.end())
            if end is None:
                calls.append(PartialCall(match.group(1)))
                return Scan("", calls)
            arguments = _arguments(text[match.start(1):end])
            if arguments is None:
                return Scan("", calls, invalid=True)
            calls.append(PartialCall(match.group(1), arguments, complete=True))
            i = end
        rest = text[i:].strip()
        if rest in ("", ","):  # the list is still open: more may come
            return Scan("", [*calls, PartialCall(None)])
        return Scan("", calls, invalid=rest != "]")


PYTHONIC = PythonicParser()
