"""Response bodies as pydantic models: they document every 200 and error body in ``/openapi.json``.

Handlers build these bodies as plain dicts (``responses.py``); the models are the contract those dicts
follow, checked by the schemathesis run in the test suite (``response_schema_conformance``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry for one token id."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs; ``text_offset`` are offsets into the choice's ``text``."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None  # the content hash of the adapter version (or base) that answered
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None  # with tools: finish_reason is then "tool_calls"
    reasoning_content: str | None = None  # with --reasoning-parser: the model's thinking, kept out of content


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None  # the content hash of the adapter version (or base) that answered
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class AdapterLoaded(ModelCard):
    status: Literal["ok"]
    message: str


class AdapterUnloaded(BaseModel):
    status: Literal["ok"]
    message: str
    id: str


class AdapterVersion(BaseModel):
    id: str  # "v<number>"
    content_hash: str
    path: str
    loaded_at: float  # Unix time
    requests_served: int


class AdapterVersions(BaseModel):
    name: str
    current: str  # the version id new requests run on (without a split)
    split: dict[str, float] | None  # version id -> share of new requests, when split
    versions: list[AdapterVersion]  # held, oldest first
    pinned: bool = False  # pinned to a device slot (POST /v1/adapters/{name}/pin)


class AdapterVersionList(BaseModel):
    object: Literal["list"]
    data: list[AdapterVersions]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's ``GET /tokenizer_info``: the tokenizer's ``tokenizer_config.json`` fields (any), its class and
    chat template."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    chat_template: str | None = None


class Health(BaseModel):
    status: Literal["ok", "error"]
    detail: str | None = None
    step_failures: int | None = None  # engine steps that raised (each failed only its own requests), if any
    last_step_error: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail = Field(description="OpenAI's error body")
