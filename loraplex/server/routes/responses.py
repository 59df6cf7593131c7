"""``POST /v1/responses`` (streamable), ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API over
the chat path (``openai/responses_api/``). A stored response (``store``, default true) is kept per tenant
(``ResponseStore``: LRU, size cap, TTL) for ``previous_response_id`` and ``GET``; another tenant's id is a 404."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from loraplex.errors import RequestError
from loraplex.server.openai.errors import ServerError
from loraplex.server.openai.openapi import GENERATION_ERRORS, documented
from loraplex.server.openai.responses_api.output import ResponseEvents, conversation_of, from_chat
from loraplex.server.openai.responses_api.request import CHAT_FIELDS, ResponsesRequest
from loraplex.server.openai.responses_api.store import ResponseStore, StoredResponse
from loraplex.server.routes.generate import chat_response
from loraplex.server.tenancy.access import caller

router = APIRouter()


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "response_store", None) is None:
        state.response_store = ResponseStore()
    return state.response_store


def _not_found(response_id: str, param: str | None = None) -> ServerError:
    return ServerError(404, f"response {response_id!r} not found (not stored, expired, or another key's)", param)


@router.post("/v1/responses", response_model=None, responses=documented(None, *GENERATION_ERRORS, stream=True))
async def create_response(request: Request) -> Response:
    arrived_ns = time.time_ns()
    try:
        body = ResponsesRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    tenant, history = caller(request).tenant, []
    if body.previous_response_id:
        previous = _store(request).get(tenant, body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    chat = body.chat_body(history)
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    try:
        answer = await chat_response(request, json.dumps(chat).encode(), arrived_ns)
    except RequestError as exc:  # name the Responses field
        exc.param = CHAT_FIELDS.get(exc.param or "", exc.param)
        raise
    if answer.status_code != 200:
        return answer
    keep = (lambda out: _store(request).put(tenant, out["id"], StoredResponse(
        out, chat["messages"][1 if body.instructions else 0:] + conversation_of(out["output"])))
            ) if body.store is not False else (lambda out: None)
    if not isinstance(answer, StreamingResponse):
        out = from_chat(body, json.loads(bytes(answer.body)))
        keep(out)
        return JSONResponse(out, headers={k: v for k, v in answer.headers.items() if k.startswith("x-loraplex")})
    return StreamingResponse(_events(answer, ResponseEvents(body), keep), media_type="text/event-stream",
                             headers={k: v for k, v in answer.headers.items() if k.lower() != "content-type"})


async def _events(answer: StreamingResponse, events: ResponseEvents, keep: Any) -> AsyncIterator[str]:
    """The chat stream's chunks as Responses events; a chat error event becomes an ``error`` event."""
    inner = answer.body_iterator
    try:
        for event in events.start():
            yield event
        async for piece in inner:
            text = piece if isinstance(piece, str) else bytes(piece).decode()
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    error = chunk["error"]
                    yield events.event("error", code=str(error.get("code")), message=error["message"],
                                        param=error.get("param"))
                    continue
                for event in events.chunk(chunk):
                    yield event
        if events.final is not None:
            keep(events.final)
    finally:
        await inner.aclose()  # type: ignore[attr-defined]


@router.get("/v1/responses/{response_id}", responses=documented(None, 404))
async def stored_response(response_id: str, request: Request) -> dict:
    """The stored response; 404 for one not stored, expired, or another tenant's."""
    stored = _store(request).get(caller(request).tenant, response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.body


@router.delete("/v1/responses/{response_id}", responses=documented(None, 404))
async def delete_stored_response(response_id: str, request: Request) -> dict:
    """Forget a stored response; 404 for one not stored, expired, or another tenant's."""
    if not _store(request).delete(caller(request).tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
