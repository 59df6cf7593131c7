"""Running one completion or chat completion: submit, then answer whole or as server-sent events.

Every error that can be known before the first byte (unknown model, invalid field, prompt too long)
is raised before the response starts, so it gets its real status code. An error after that (a
streamed request whose adapter failed to load) is sent as a final ``data: {"error": ...}`` event.
A client that disconnects, streamed or not, aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplex.engine.async_engine import AsyncEngine, RequestStream
from loraplex.engine.request import RequestOutput, SamplingParams
from loraplex.errors import LoraplexError, RequestError, UnknownAdapter
from loraplex.server.errors import ServerError, loraplex_error_event, loraplex_error_response
from loraplex.server.metrics import ServerMetrics
from loraplex.server.protocol import ResponseBuilder, error_body

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One request to run: what to generate and how to answer."""

    builder: ResponseBuilder
    prompt: str | list[int]
    params: SamplingParams
    adapter: str | None
    stream: bool
    include_usage: bool
    prompt_param: str  # the field a too-long prompt is blamed on: "prompt" or "messages"


class _Timing:
    """Time to first token and decode time of one request, for the metrics."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None

    def saw(self, out: RequestOutput) -> None:
        if out.token_ids:
            now = time.monotonic()
            self.first = self.first if self.first is not None else now
            self.last = now

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def decode(self) -> float | None:
        return None if self.first is None or self.last is None else self.last - self.first


async def run_generation(engine: AsyncEngine, metrics: ServerMetrics, gen: Generation,
                         request: Request) -> Response:
    timing = _Timing()
    try:
        stream = await engine.submit(gen.builder.id, gen.prompt, gen.params, gen.adapter)
    except UnknownAdapter as exc:
        metrics.observe_request(gen.adapter, "rejected", None, None, None)
        raise ServerError(404, f"model {gen.builder.model!r} not found: it is neither the base model "
                          "nor a loaded adapter (see GET /v1/models)", "model") from exc
    except RequestError as exc:
        metrics.observe_request(gen.adapter, "rejected", None, None, None)
        if exc.param == "prompt":
            exc.param = gen.prompt_param
        raise
    if gen.stream:
        events = _events(stream, gen, metrics, timing)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    final = await _collect_unless_disconnected(stream, request, timing)
    if final is None:  # the client left; its request is aborted
        metrics.observe_request(gen.adapter, "abort", None, None, None)
        return Response(status_code=499)
    metrics.observe_request(gen.adapter, final.finish_reason or "unknown", final, timing.ttft, timing.decode)
    if final.finish_reason == "error" and final.error is not None:
        return loraplex_error_response(final.error)
    return JSONResponse(gen.builder.full(final))


async def _collect(stream: RequestStream, timing: _Timing) -> RequestOutput:
    last = None
    async for out in stream:
        timing.saw(out)
        last = out
    assert last is not None and last.finished
    return last


async def _collect_unless_disconnected(stream: RequestStream, request: Request,
                                       timing: _Timing) -> RequestOutput | None:
    """The final output, or None if the client disconnected first (the request is then aborted)."""
    collect = asyncio.ensure_future(_collect(stream, timing))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((collect, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            stream.abort()
    return collect.result() if collect.done() and not collect.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _events(stream: RequestStream, gen: Generation, metrics: ServerMetrics,
                  timing: _Timing) -> AsyncIterator[str]:
    """OpenAI chunks, then ``data: [DONE]``. Cancellation (client gone) aborts the request."""
    builder, status, final = gen.builder, "abort", None
    try:
        if builder.chat:
            yield _sse(builder.chunk("", first=True))
        async for out in stream:
            timing.saw(out)
            if out.finish_reason == "error":
                final, status = out, "error"
                err = out.error or LoraplexError("generation failed")
                yield _sse(loraplex_error_event(err))
                break
            if out.delta_text or out.finished:
                yield _sse(builder.chunk(out.delta_text, out.finish_reason if out.finished else None))
            if out.finished:
                final, status = out, out.finish_reason or "unknown"
                if gen.include_usage:
                    yield _sse(builder.usage_chunk(out))
        yield "data: [DONE]\n\n"
    except LoraplexError as exc:
        status = "error"
        yield _sse(loraplex_error_event(exc))
        yield "data: [DONE]\n\n"
    except Exception:
        status = "error"
        logger.exception("stream %s failed", builder.id)
        yield _sse(error_body("internal server error", "internal_error", None, 500))
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()
        metrics.observe_request(gen.adapter, status, final, timing.ttft, timing.decode)
