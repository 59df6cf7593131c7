"""Structured-output request fields: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` (and its
older ``guided_*`` names), translated into one ``StructuredOutputsParams``.

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``; on chat and,
  as vLLM's extension, on completions.
- ``structured_outputs``: vLLM's object: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, with ``disable_any_whitespace`` (``structural_tag`` and ``whitespace_pattern`` are 400).
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``: the names vLLM used before
  0.12, accepted as ``structured_outputs`` of that kind.

At most one of them constrains a request (else a 400 naming the second). The constraint is checked when
the body is parsed (its grammar is built without a tokenizer), so a bad schema is a 400 naming the field
the client sent before anything is queued.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.errors import RequestError
from loraplex.server.openai.strict_fields import check_extra_fields

# The nested request objects (this module's and tools.py's): undeclared fields neutral only, in the schema too.
NESTED_PARTS = ("ResponseFormat", "JsonSchemaFormat", "StructuredOutputsRequest", "Tool", "FunctionDefinition",
                "NamedToolChoice", "FunctionName", "MessageToolCall", "FunctionCall")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _Part(BaseModel):
    """A nested request object: undeclared fields must be neutral (``strict_fields``)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    where: ClassVar[str] = ""

    @model_validator(mode="after")
    def _nothing_dropped(self) -> _Part:
        check_extra_fields(self.model_extra or {}, {}, self.where)
        return self


class JsonSchemaFormat(_Part):
    where: ClassVar[str] = "response_format"
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    where: ClassVar[str] = "response_format"
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Part):
    """vLLM's ``structured_outputs`` object (its ``StructuredOutputsParams`` fields)."""

    where: ClassVar[str] = "structured_outputs"
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False  # one backend (xgrammar): nothing to fall back to

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar, json_object=self.json_object,
            disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties,
            whitespace_pattern=self.whitespace_pattern, structural_tag=self.structural_tag)


class StructuredFields(BaseModel):
    """The structured-output fields of a completion or chat request (a mixin of the request bodies)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _constraint_compiles(self) -> StructuredFields:
        self.structured_constraint()  # a bad schema is a 400 while the body is parsed
        return self

    def structured_constraint(self) -> StructuredOutputsParams | None:
        """The request's constraint (validated), or None; ``RequestError`` naming the field it came from."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise RequestError("response_format.json_schema.schema is required for type json_schema",
                                   "response_format")
            found.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.schema_)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.params()))
        for name, kind in GUIDED.items():
            if getattr(self, name) is not None:
                found.append((name, StructuredOutputsParams(**{kind: getattr(self, name)})))
        if len(found) > 1:
            raise RequestError(f"{found[1][0]}: only one structured-output constraint per request (already given "
                               f"by {found[0][0]})", found[1][0])
        if not found:
            return None
        field, params = found[0]
        params.validate(field)
        return params
