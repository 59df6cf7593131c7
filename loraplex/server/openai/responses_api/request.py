"""A ``POST /v1/responses`` body and its chat completion body.

``input`` is a string (one user message) or a list of items: messages (``role`` and ``content``, a string
or ``input_text`` / ``output_text`` parts), ``function_call`` (``call_id``, ``name``, ``arguments``) and
``function_call_output`` (``call_id``, ``output``); ``reasoning`` items are dropped. ``instructions`` is
the system message (not carried to a follow-up: as OpenAI); ``tools`` are function tools (the flat shape);
``text.format`` is ``text``, ``json_object`` or ``json_schema`` (structured outputs); ``max_output_tokens``,
``temperature``, ``top_p``, ``seed``, ``parallel_tool_calls``, ``tool_choice``, ``reasoning.effort``,
``user``, ``metadata``, ``store`` and ``previous_response_id`` are implemented; any other field is a 400
naming it unless neutral (``strict_fields.check_extra_fields``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.engine.sampling.params import TEMPERATURE_MAX
from loraplex.errors import RequestError
from loraplex.server.openai.protocol import Int, _Body, ranged

RESPONSES_UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "background responses are not implemented"),
    "include": ((None, []), "include is not implemented"),
    "truncation": ((None, "disabled"), "only truncation \"disabled\" is implemented"),
    "service_tier": ((None, "auto", "default"), "service tiers are not implemented"),
    "prompt": ((None,), "prompt templates are not implemented"),
    "conversation": ((None,), "conversations are not implemented: use previous_response_id"),
    "max_tool_calls": ((None,), "max_tool_calls is not implemented"),
    "top_logprobs": ((None, 0), "logprobs are not implemented on /v1/responses"),
    "prompt_cache_key": ((None, ""), "prompt cache keys are not implemented (prefix caching needs none)"),
    "safety_identifier": ((None, ""), "not implemented on /v1/responses"),
}


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(_Body):
    unimplemented: ClassVar = RESPONSES_UNIMPLEMENTED
    model: str
    input: str | list[_Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: Int | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: float | None = ranged(minimum=0, maximum=TEMPERATURE_MAX)  # the chat body's ranges
    top_p: float | None = ranged(exclusiveMinimum=0, maximum=1)
    seed: Int | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (consecutive function calls join one assistant message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            message = _item_message(item)
            if message is None:
                continue
            last = messages[-1] if messages else None
            if message.get("tool_calls") and last is not None and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].extend(message["tool_calls"])
            else:
                messages.append(message)
        return messages

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion body of this request after ``history`` (the previous response's conversation)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if not history and not self.input_messages():
            raise RequestError("input holds no message", "input")
        body: dict[str, Any] = {"model": self.model, "messages": [*system, *history, *self.input_messages()],
                                "stream": bool(self.stream)}
        for name in ("temperature", "top_p", "seed", "parallel_tool_calls", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise RequestError("text.format json_schema needs a schema", "text")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": bool(fmt.strict)}}
        return body


CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
               "reasoning_effort": "reasoning"}  # a chat refusal's param -> the Responses field it came from


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise RequestError(f"input content parts of type {part.get('type')!r} are not supported (text only)",
                               "input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _item_message(item: _Item) -> dict[str, Any] | None:
    if item.type == "message":
        if item.role is None:
            raise RequestError("an input message needs a role", "input")
        return {"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)}
    if item.type == "function_call":
        if not item.name or item.call_id is None:
            raise RequestError("a function_call item needs call_id and name", "input")
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                   "arguments": item.arguments or "{}"}}]}
    if item.type == "function_call_output":
        if item.call_id is None:
            raise RequestError("a function_call_output item needs call_id", "input")
        return {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
    if item.type == "reasoning":
        return None
    raise RequestError(f"input items of type {item.type!r} are not supported", "input")


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\"}",
                           "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}
