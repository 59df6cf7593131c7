"""Tool-call parsers: a chat completion's text -> (content, tool calls), whole or as it streams.

``tool_choice: "auto"`` leaves the model free and reads its own format: ``--tool-call-parser NAME``
(vLLM's names, ``PARSERS``), or the format its chat template writes (``detect_parser``: per adapter
version, since an adapter may ship its own template), Hermes' by default. ``"required"`` and a named
function constrain the output to compact JSON (``tools.py``), read by ``REQUIRED`` and ``NamedParser``.
"""

from __future__ import annotations

from loraplex.server.openai.tool_parsers.calls import Parsed, PartialCall, Scan, ToolCall, ToolParser, new_call_id
from loraplex.server.openai.tool_parsers.json_calls import (
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PHI4_MINI_JSON,
    REQUIRED,
)
from loraplex.server.openai.tool_parsers.named import NamedParser
from loraplex.server.openai.tool_parsers.pythonic import PYTHONIC
from loraplex.server.openai.tool_parsers.stream import ToolCallStream, final_message

PARSERS: dict[str, ToolParser] = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL,
                                  "pythonic": PYTHONIC, "granite": GRANITE, "phi4_mini_json": PHI4_MINI_JSON}
DEFAULT_PARSER = "hermes"

# What a chat template writes for a tool call -> its format (the first match wins).
_TEMPLATE_SIGNS = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call|>", "granite"),
    ("functools[", "phi4_mini_json"),
    ("[func_name1(", "pythonic"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name', "llama3_json"),
)


def detect_parser(chat_template: str | None) -> str:
    """The tool-call format ``chat_template`` teaches its model (``DEFAULT_PARSER`` when it shows none)."""
    return next((name for sign, name in _TEMPLATE_SIGNS if sign in (chat_template or "")), DEFAULT_PARSER)


def parser_for(configured: str | None, chat_template: str | None) -> ToolParser:
    """``tool_choice: "auto"``'s parser: the configured one (``--tool-call-parser``), else the template's."""
    return PARSERS[configured or detect_parser(chat_template)]


__all__ = ["DEFAULT_PARSER", "PARSERS", "REQUIRED", "NamedParser", "Parsed", "PartialCall", "Scan", "ToolCall",
           "ToolCallStream", "ToolParser", "detect_parser", "final_message", "new_call_id", "parser_for"]
