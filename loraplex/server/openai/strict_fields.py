"""Nothing silently dropped: request fields loraplex does not implement are accepted only with a neutral value.

A field is *implemented* when it is declared on the request model (``protocol.py``). Every other field
of OpenAI's request (and every unknown one) is checked here: a neutral value (null, false, 0, "", [],
{} or the field's documented default, which clients such as LangChain send) is accepted and means
what not sending it means; anything else is a 400 whose ``param`` names the field. The same tables
publish each field's accepted values in the OpenAPI schema (``openapi.py``) and docs/server.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from loraplex.errors import RequestError

# Values neutral for any field, including unknown ones.
GENERIC_NEUTRAL: tuple[Any, ...] = (None, False, 0, "", [], {})

# OpenAI fields loraplex does not implement yet: field -> (the values accepted, why it is refused).
FUNCTIONS_GONE = "OpenAI's deprecated functions API is not implemented: use tools and tool_choice"
COMPLETION_UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "best_of (server-side ranking of extra choices) is not implemented; use n"),
    "suffix": ((None, ""), "suffix (insertion) is not implemented"),
}
CHAT_UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), FUNCTIONS_GONE),
    "function_call": ((None, "none"), FUNCTIONS_GONE),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "metadata": ((None, {}), "stored completions are not implemented"),
    "store": ((None, False), "stored completions are not implemented"),
    "service_tier": ((None, "auto", "default"), "service tiers are not implemented"),
    "verbosity": ((None, "medium"), "verbosity is not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "prompt_cache_key": ((None, ""), "prompt cache keys are not implemented (prefix caching needs none)"),
    "prompt_cache_options": ((None, {}), "prompt cache options are not implemented"),
    "prompt_cache_retention": ((None,), "prompt cache retention is not implemented"),
    "moderation": ((None,), "moderation is not implemented"),
}
# vLLM extensions not implemented, accepted at vLLM's default (what loraplex does anyway).
VLLM_DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "skip_special_tokens": ((None, True), "special tokens are always skipped in text"),
    "spaces_between_special_tokens": ((None, True), "not implemented"),
    "include_stop_str_in_output": ((None, False), "not implemented: the stop string is never included"),
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "beam search is not implemented"),
    "add_generation_prompt": ((None, True), "the chat template always gets add_generation_prompt=True"),
    "continue_final_message": ((None, False), "not implemented"),
    "echo": ((None, False), "chat echo is not implemented"),  # on chat only: completions implement it
    "guided_decoding_backend": ((None, "xgrammar", "auto"), "one backend (xgrammar); vLLM removed this field"),
    "guided_whitespace_pattern": ((None,), "not implemented (structured_outputs.disable_any_whitespace is)"),
}
# Message fields beside role/content: passed to the chat template, or neutral only.
MESSAGE_PASSED = ("name", "tool_call_id")
MESSAGE_UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "function_call": ((None,), FUNCTIONS_GONE),
    "audio": ((None,), "audio is not supported"),
    "refusal": ((None,), "refusals are not supported in input messages"),
}


def same_value(a: Any, b: Any) -> bool:
    """JSON equality: ``false`` is not ``0``, ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def check_extra_fields(extra: Mapping[str, Any], table: Mapping[str, tuple[tuple[Any, ...], str]],
                       where: str = "") -> None:
    """Raise ``RequestError`` (param = the field, or ``where`` for nested objects) for the first field of
    ``extra`` (the body's undeclared fields) whose value is not neutral for it."""
    for name, value in extra.items():
        allowed, why = table.get(name, (GENERIC_NEUTRAL, "unknown field"))
        if not any(same_value(value, ok) for ok in allowed):
            accepted = ", ".join(json.dumps(v) for v in allowed)
            raise RequestError(f"{where + '.' if where else ''}{name}: {why}; loraplex accepts only {accepted} "
                               "here", where or name)
