"""Tool-call request fields: ``tools``, ``tool_choice``, ``parallel_tool_calls`` (OpenAI's shapes).

- ``tool_choice: "none"`` (or no tools): plain text; the tools still reach the chat template.
- ``"auto"`` (the default with tools): the model is free; its text is parsed for its own tool-call
  format (``tool_parsers``: ``--tool-call-parser``, else the one its chat template writes).
- ``"required"``: the output is constrained to a compact JSON array of ``{"name", "parameters"}`` (one of
  the tools each; at most one call without ``parallel_tool_calls``), as vLLM does for any model.
- ``{"type": "function", "function": {"name": N}}``: constrained to N's ``parameters`` schema, compact.

Forced JSON has no free whitespace (``disable_any_whitespace``): a small model otherwise spends its budget
on it; a forced call cut by ``max_tokens`` is reported as the partial call it is (``finish_reason``
``"length"``).

Responses then carry ``message.tool_calls`` (with ids) and ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.errors import RequestError
from loraplex.server.openai.structured import _Part
from loraplex.server.openai.tool_parsers import REQUIRED, NamedParser, ToolParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# For a chat template that cannot render tools (it never reads ``tools``): the tools go into the system
# prompt with this text before them (the request's ``tool_prompt`` replaces it, as LoRAX's), in the format
# the default (Hermes) parser reads.
DEFAULT_TOOL_PROMPT = ("You can call these functions. To call one, reply with <tool_call>{\"name\": <function "
                       "name>, \"arguments\": <arguments object>}</tool_call>. The functions:")


class FunctionDefinition(_Part):
    where: ClassVar[str] = "tools"
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    where: ClassVar[str] = "tools"
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Part):
    where: ClassVar[str] = "tool_choice"
    name: str


class NamedToolChoice(_Part):
    where: ClassVar[str] = "tool_choice"
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Part):
    where: ClassVar[str] = "messages"
    name: str
    arguments: str


class MessageToolCall(_Part):
    """A tool call in an assistant message of the conversation (as a response gave it)."""

    where: ClassVar[str] = "messages"
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_call(self) -> dict[str, Any]:
        """As chat templates take it: ``arguments`` as a mapping when it is a JSON object (Qwen's and
        Hermes' templates serialise it themselves)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class ToolFields(BaseModel):
    """The tool fields of a chat request (a mixin of ``ChatCompletionRequest``)."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    tool_prompt: str | None = None  # replaces DEFAULT_TOOL_PROMPT (for templates that cannot render tools)

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ToolFields:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in self._by_name():
            raise RequestError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                               "tool_choice")
        constraint = self.tool_constraint()
        if constraint is not None:
            constraint.validate("tools")  # a tool's parameters that are no JSON schema: a 400 on tools
        return self

    def _by_name(self) -> dict[str, FunctionDefinition]:
        return {t.function.name: t.function for t in self.tools or ()}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools] if self.tools else None

    def with_tool_prompt(self, conversation: list[dict[str, Any]], chat_template: str | None) -> list[dict[str, Any]]:
        """``conversation`` with the tools in its system prompt when the template does not render them itself."""
        tools = self.template_tools()
        if not tools or "tools" in (chat_template or ""):
            return conversation
        listed = (json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = "\n".join([self.tool_prompt or DEFAULT_TOOL_PROMPT, *listed])
        if conversation and conversation[0]["role"] == "system":
            first = conversation[0]
            return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *conversation[1:]]
        return [{"role": "system", "content": prompt}, *conversation]

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """The constraint ``"required"`` or a named choice puts on the output (None otherwise)."""
        choice, tools = self.tool_choice, self._by_name()
        if isinstance(choice, NamedToolChoice):
            return StructuredOutputsParams(json=tools[choice.function.name].parameters or ANY_OBJECT,
                                           disable_any_whitespace=True)
        if choice != "required":
            return None
        items = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": f.parameters or ANY_OBJECT},
             "required": ["name", "parameters"]} for name, f in tools.items()]}
        array = {"type": "array", "minItems": 1, "items": items}
        schema = array if self.parallel_tool_calls is not False else {**array, "maxItems": 1}
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def tool_parser(self, auto: ToolParser) -> ToolParser | None:
        """How this request's text becomes tool calls (None: it never does); ``auto`` reads the model's own
        format (``tool_choice: "auto"``)."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return NamedParser(choice.function.name)
        return REQUIRED if choice == "required" else auto
