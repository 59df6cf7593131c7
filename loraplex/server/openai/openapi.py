"""``/openapi.json`` that tells the truth: every status a route can answer, every range the server checks.

FastAPI's generated schema is completed here, once per app: its 422 (which the server never sends:
validation errors are 400) is replaced by the error statuses each route declares (and 401 on ``/v1``
routes when an API key is set); the fields loraplex does not implement are listed with the neutral
values it accepts (``strict_fields.py``), and so are unknown fields (``additionalProperties``); the
limits that depend on the served model (context length, vocabulary) are filled in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from loraplex.models.pooling_config import ModelPooling
from loraplex.server.openai.embeddings import complete_embedding_schema
from loraplex.server.openai.schemas import ErrorResponse
from loraplex.server.openai.scoring import complete_scoring_schema
from loraplex.server.openai.strict_fields import (
    CHAT_UNIMPLEMENTED,
    COMPLETION_UNIMPLEMENTED,
    GENERIC_NEUTRAL,
    MESSAGE_UNIMPLEMENTED,
    VLLM_DEFAULTS,
)
from loraplex.server.openai.structured import NESTED_PARTS
from loraplex.server.tenancy.access import KEYED_PATHS, needs_key

STATUS_TEXT = {
    400: "Invalid request: OpenAI's error body, `param` names the field",
    401: "Missing or wrong API key",
    403: "Runtime adapter loading disabled, or the path is outside the adapter roots",
    404: "Unknown model or adapter, or no adapter at that path",
    409: "Adapter name already loaded, or its files changed on disk",
    413: "The request body is larger than the server's limit (--max-request-bytes)",
    415: "The body is not of the media type the route takes (PUT /v1/adapters/{name}: application/octet-stream)",
    507: "The adapter's saved embed_tokens/lm_head rows would pass the saved-rows memory budget",
    503: "The engine is not running (starting, stopped, or its process died), a request-preparation worker "
         "died while preparing this request, the server is shutting down, or its queue is full "
         "(--max-waiting-requests: then `Retry-After` says in how many seconds to retry)",
    429: "Over this API key's limit (max_concurrent_requests, tokens_per_minute): `Retry-After` says when to retry",
    504: "The request ran past the server's --request-timeout and was stopped",
}
GENERATION_ERRORS = (400, 404, 409, 413, 503, 504)  # what /v1/completions and /v1/chat/completions may answer
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying (a 503 of a full queue)",
                               "schema": {"type": "integer", "minimum": 0}}}
DRAINING = "The server is shutting down and admits no new request"


def documented(ok: type[BaseModel] | None, *errors: int, stream: bool = False,
               ok_media: str = "application/json") -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=``: its 200 body and its error statuses (OpenAI's error body)."""
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": STATUS_TEXT[status]} for status in errors}
    if 503 in responses:
        responses[503]["headers"] = RETRY_AFTER
    content: dict[str, Any] = {}
    if stream:
        content["text/event-stream"] = {"schema": {  # one event (OpenAPI 3.1: the schema describes each event)
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string", "description": (
                "a JSON chunk (the response's object with `.chunk` choices and `delta`s), an error body, or the "
                "final `[DONE]`")}, "event": {"type": "string"}}}}
    if ok_media != "application/json":
        content[ok_media] = {"schema": {"type": "string"}}
    responses[200] = {"description": "OK", **({"model": ok} if ok else {}), **({"content": content} if content else {})}
    return responses


def neutral_schema(values: tuple[Any, ...], why: str) -> dict[str, Any]:
    """The JSON schema accepting exactly ``values`` (JSON equality)."""
    options = []
    for v in values:
        if v is None:
            options.append({"type": "null"})
        elif v == [] and isinstance(v, list):
            options.append({"type": "array", "maxItems": 0})
        elif v == {} and isinstance(v, dict):
            options.append({"type": "object", "maxProperties": 0})
        else:
            options.append({"const": v})
    return {"anyOf": options, "description": f"Not implemented ({why}): only these neutral values are accepted; "
                                             "anything else is a 400 naming this field."}


def integer_below(n: int) -> str:
    """A regex matching the decimal integers in ``[0, n)`` without leading zeros (``n >= 1``)."""
    top = str(n - 1)
    parts = ["0"]
    for length in range(1, len(top)):  # every shorter length, fully
        parts.append("[1-9]" + "[0-9]" * (length - 1))
    for i, digit in enumerate(top):  # same length as top: a prefix of top, one smaller digit, then anything
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            parts.append(top[:i] + f"[{low}-{int(digit) - 1}]" + "[0-9]" * (len(top) - i - 1))
    if top != "0":
        parts.append(top)
    return "^(" + "|".join(sorted(set(parts), key=len)) + ")$"


def _add_fields(schema: dict[str, Any], table: Mapping[str, tuple[tuple[Any, ...], str]]) -> None:
    props = schema.setdefault("properties", {})
    for name, (values, why) in table.items():
        props.setdefault(name, neutral_schema(values, why))
    schema["additionalProperties"] = neutral_schema(GENERIC_NEUTRAL, "unknown field")


def install_openapi(app: FastAPI, *, max_model_len: int, auth: bool,
                    served: Callable[[], tuple[list[str], int]],
                    bodies: Mapping[str, type[BaseModel]] = {},  # noqa: B006 - read only
                    pooling: ModelPooling | None = None,
                    heads: Callable[[], dict[str, int | None] | None] = lambda: None) -> None:
    """Replace ``app.openapi`` with the completed schema, built on first use and cached until
    ``reset_openapi``. ``served()`` gives the model names a request may use now and the widest
    vocabulary among them (an adapter may add tokens). ``bodies`` (path -> model) are the POST bodies
    that routes read by hand (parsed off the event loop), put back into the schema. ``pooling``: the served
    model's embedding defaults (what ``/v1/embeddings``' ``dimensions`` may be). ``heads()``: each served adapter's
    number of classes (None: no head), None where names must not be listed (``complete_scoring_schema``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="OpenAI-compatible API over one base model and its LoRA adapters.")
            _add_bodies(schema, bodies)
            models, vocab = served()
            _complete(schema, vocab, max_model_len, auth, models)
            if "EmbeddingRequest" in schema["components"]["schemas"]:
                complete_embedding_schema(schema["components"]["schemas"]["EmbeddingRequest"], vocab, models,
                                          pooling or ModelPooling())
            complete_scoring_schema(schema["components"]["schemas"], models[0], vocab, heads())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_bodies(schema: dict[str, Any], bodies: Mapping[str, type[BaseModel]]) -> None:
    if not bodies:
        return
    refs, defs = models_json_schema([(model, "validation") for model in bodies.values()],
                                    ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, model in bodies.items():
        content = {"application/json": {"schema": refs[(model, "validation")]}}
        schema["paths"][path]["post"]["requestBody"] = {"content": content, "required": True}


def reset_openapi(app: FastAPI) -> None:
    """Rebuild the schema on its next request (the served adapters changed)."""
    app.openapi_schema = None


def _complete(schema: dict[str, Any], vocab: int, max_len: int, auth: bool, models: list[str]) -> None:
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            responses.setdefault("503", {"description": DRAINING, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
            if auth and needs_key(path):
                responses["401"] = {"description": STATUS_TEXT[401], "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
                operation["security"] = [{"bearer": []}]
            limited = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", *KEYED_PATHS)
            if auth and path in limited:  # a key's limits (tenancy/quotas.py)
                responses["429"] = {"description": STATUS_TEXT[429], "headers": RETRY_AFTER, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    components = schema["components"]
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for name in ("HTTPValidationError", "ValidationError"):
        components["schemas"].pop(name, None)
    schemas = components["schemas"]
    token = {"minimum": 0, "maximum": vocab - 1, "description": "A token id below the vocabulary of the model "
             "named (an adapter that adds tokens has a wider one; this bound is the widest served now), else 400."}
    _add_fields(schemas["CompletionRequest"], {**COMPLETION_UNIMPLEMENTED, **VLLM_DEFAULTS})
    _add_fields(schemas["ChatCompletionRequest"], {**CHAT_UNIMPLEMENTED, **VLLM_DEFAULTS})
    _add_fields(schemas["ChatMessage"], MESSAGE_UNIMPLEMENTED)
    for model in ("StreamOptions", "LoadAdapterRequest", "UnloadAdapterRequest", *NESTED_PARTS):
        _add_fields(schemas[model], {})
    for model in ("EmbeddingRequest", "ClassificationRequest", "ScoreRequest", "RerankRequest"):
        if model in schemas:
            _add_fields(schemas[model], {})
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[model]["properties"]
        props["model"]["examples"] = models
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["description"] = (f"The prompt's tokens plus this must fit the context ({max_len} "
                                               "tokens), else 400.")
        props["stop_token_ids"]["items"] = {"type": "integer", **token}
        props["logit_bias"]["propertyNames"] = {"pattern": integer_below(vocab)}
    # top_logprobs > 0 needs logprobs: true (a 400 on top_logprobs otherwise)
    schemas["ChatCompletionRequest"]["if"] = {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                                              "required": ["top_logprobs"]}
    schemas["ChatCompletionRequest"]["then"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    prompt["items"] = {**prompt["items"], **token, "items": token}
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = {"type": "integer", **token}
    for model in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        schemas[model]["properties"]["model"]["examples"] = models
