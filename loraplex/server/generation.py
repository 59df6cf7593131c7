"""Running one completion or chat completion: submit every choice, then answer whole or as server-sent events.

Every choice (``n`` per prompt, for each prompt of a prompt list) is its own engine request; all are
submitted in one engine call so they are admitted together. Every error that can be known before the
first byte (unknown model, invalid field, prompt too long) is raised before the response starts, so
it gets its real status code. An error after that (a streamed request whose adapter failed to load)
is sent as a final ``data: {"error": ...}`` event. A client that disconnects, streamed or not,
aborts its requests in the engine.

The request arrives routed: its ``Version`` (decided once, first, by ``EngineClient.route``) prepared
its prompts, is the one every choice is submitted on, and names the answer: ``system_fingerprint`` (in
every streamed chunk too) is its content hash (the base model: the checkpoint's fingerprint) and the
``x-loraplex-adapter-version`` header its id (``v<id>``, or ``base``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplex.client.base import EngineClient
from loraplex.client.directory import Version
from loraplex.client.output import RequestOutput
from loraplex.client.stream import RequestStream
from loraplex.engine.request import NO_TAGS, RequestTags, SamplingParams
from loraplex.errors import LoraplexError, QueueFull, RequestError, UnknownAdapter
from loraplex.server.lifecycle import Guard, ServerLifecycle
from loraplex.server.metrics import ServerMetrics
from loraplex.server.openai.errors import ServerError, error_body, loraplex_error_event, loraplex_error_response
from loraplex.server.openai.responses import ResponseBuilder
from loraplex.server.tracing import TracedRequest

logger = logging.getLogger(__name__)

VERSION_HEADER = "x-loraplex-adapter-version"


@dataclass
class Generation:
    """One request to run: what to generate and how to answer."""

    builder: ResponseBuilder
    prompts: list[list[int]]  # one or more, tokenized by ``version``; each gets params.n choices
    params: SamplingParams
    version: Version  # the adapter version the request was routed to
    stream: bool
    include_usage: bool
    field_of: Callable[[str | None], str | None]  # the body field an engine refusal's param names
    user: str | None = None  # the client's end-user id, kept for metrics and tenancy
    tags: RequestTags = NO_TAGS  # the caller's tenant and the request's priority
    on_end: Callable[[int], None] = lambda generated_tokens: None  # called once, when the request ends
    arrived_ns: int = 0  # when its HTTP request arrived (Unix ns), for its trace

    def trace(self, metrics: ServerMetrics, headers: Mapping[str, str], status: str, finals: list[RequestOutput],
              timing: _Timing) -> None:
        """Its span tree, when tracing is on (``metrics.tracer``)."""
        if metrics.tracer is None:
            return
        builder = self.builder
        metrics.tracer.record(headers, TracedRequest(
            operation="chat" if builder.chat else "text_completion", model=builder.model, adapter=self.version.name,
            adapter_version=self.version.label, tenant=self.tags.tenant, arrived_ns=self.arrived_ns or timing.start_ns,
            submitted_ns=timing.start_ns, ended_ns=time.time_ns(), max_tokens=self.params.max_tokens,
            outputs=tuple(finals), status=status))

    def observe(self, metrics: ServerMetrics, status: str, out: RequestOutput | None, timing: _Timing) -> None:
        metrics.observe_request(self.version.name, status, out, timing.ttft, timing.decode, tenant=self.tags.tenant,
                                e2e=timing.elapsed() if out is not None else None)


class _Timing:
    """Time to first token and decode time of one request, for the metrics."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.start_ns = time.time_ns()
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

    def elapsed(self) -> float:
        """Seconds since submission."""
        return time.monotonic() - self.start

    @property
    def decode(self) -> float | None:
        return None if self.first is None or self.last is None else self.last - self.first


def model_not_found(model: str) -> ServerError:
    """The 404 of a model that is neither the base model nor a loaded adapter the caller may use (one body
    for both cases: adapter names do not leak)."""
    return ServerError(404, f"model {model!r} not found: it is neither the base model nor a loaded adapter "
                       "(see GET /v1/models)", "model")


async def run_generation(engine: EngineClient, metrics: ServerMetrics, gen: Generation, request: Request,
                         lifecycle: ServerLifecycle) -> Response:
    """Submit, then answer; the request's streams are guarded by ``lifecycle`` (its timeout, the drain)."""
    timing = _Timing()
    choices = gen.params.choices()
    items = [(f"{gen.builder.id}-{i * len(choices) + j}", prompt, params)
             for i, prompt in enumerate(gen.prompts) for j, params in enumerate(choices)]
    generated, streaming, traced = 0, False, ("error", [])
    try:
        try:
            gen.builder.system_fingerprint = gen.version.content_hash or await engine.base_fingerprint()
            streams = await engine.submit_many(items, gen.version, gen.tags)
        except UnknownAdapter as exc:  # its version was unloaded since it was routed
            gen.observe(metrics, "rejected", None, timing)
            raise model_not_found(gen.builder.model) from exc
        except RequestError as exc:
            gen.observe(metrics, "rejected", None, timing)
            exc.param = gen.field_of(exc.param)
            raise
        except QueueFull:  # 503 with Retry-After
            gen.observe(metrics, "rejected", None, timing)
            raise
        guard = lifecycle.guard(streams)
        headers = {VERSION_HEADER: gen.version.label}
        if gen.stream:
            streaming = True  # _events ends it
            events = _events(streams, gen, metrics, timing, guard, request.headers)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        try:
            finals = await _collect_unless_disconnected(streams, request, timing)
        except LoraplexError:  # timed out (504), ended by the shutdown or the engine's end (503)
            gen.observe(metrics, "error", None, timing)
            raise
        finally:
            guard.close()
        if finals is None:  # the client left; its requests are aborted
            gen.observe(metrics, "abort", None, timing)
            traced = ("abort", [])
            return Response(status_code=499)
        traced = ("done", finals)
        generated = sum(len(f.token_ids) for f in finals)
        for final in finals:
            gen.observe(metrics, final.finish_reason or "unknown", final, timing)
        failed = next((f for f in finals if f.finish_reason == "error" and f.error is not None), None)
        if failed is not None:
            return loraplex_error_response(failed.error)
        return JSONResponse(gen.builder.full(finals), headers=headers)
    finally:
        if not streaming:
            gen.on_end(generated)
            gen.trace(metrics, request.headers, *traced, timing)


async def _collect(stream: RequestStream, timing: _Timing) -> RequestOutput:
    last = None
    async for out in stream:
        timing.saw(out)
        last = out
    assert last is not None and last.finished
    return last


async def _collect_unless_disconnected(streams: list[RequestStream], request: Request,
                                       timing: _Timing) -> list[RequestOutput] | None:
    """Every choice's final output, or None if the client disconnected first (all are then aborted)."""
    collect = asyncio.ensure_future(asyncio.gather(*(_collect(s, timing) for s in streams)))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((collect, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            for stream in streams:
                stream.abort()
    return collect.result() if collect.done() and not collect.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(choice index, output)`` from every stream, in arrival order."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class _Chunks:
    """The streamed chunk of each new output of a request's choices (None when it brings nothing to send):
    new text and its tokens' logprobs, per choice; choice 0 of a prompt carries its prompt logprobs."""

    def __init__(self, builder: ResponseBuilder, choices: int) -> None:
        self.builder = builder
        self.latest: dict[int, RequestOutput] = {}
        self.sent_tokens = [0] * choices  # generated tokens already sent, per choice
        self.sent_text = [0] * choices  # characters already sent, per choice (legacy text_offset)

    def chunk(self, index: int, out: RequestOutput) -> dict | None:
        builder = self.builder
        self.latest[index] = out
        end = len(out.token_ids)
        first = not builder.chat and self.sent_tokens[index] == 0 and self.sent_text[index] == 0
        if not (out.delta_text or out.finished or (out.logprobs is not None and end > self.sent_tokens[index])
                or (first and builder.echo)):
            return None
        if builder.chat:
            choice = builder.chat_delta(index, out, self.sent_tokens[index], end, out.delta_text)
            if choice is None:  # a tool-call choice with nothing to send yet
                return None
        else:
            scored = self.latest.get(index - index % builder.n, out).prompt_logprobs
            choice = builder.completion_choice(index, out, scored, self.sent_tokens[index], end, first,
                                               out.delta_text, self.sent_text[index])
            self.sent_text[index] += len(choice["text"])
        choice["finish_reason"] = (choice["finish_reason"] or out.finish_reason) if out.finished else None
        self.sent_tokens[index] = end
        return builder.chunk(choice)


async def _events(streams: list[RequestStream], gen: Generation, metrics: ServerMetrics, timing: _Timing,
                  guard: Guard, headers: Mapping[str, str]) -> AsyncIterator[str]:
    """OpenAI chunks (each carrying one choice's new text and its tokens' logprobs), then ``data: [DONE]``.
    Cancellation (client gone) aborts every choice."""
    builder, status = gen.builder, "abort"
    finals: dict[int, RequestOutput] = {}
    chunks = _Chunks(builder, len(streams))
    roled: set[int] = set()  # chat choices whose role chunk is out: sent when its first token exists (as vLLM)
    try:
        async for index, out in _merged(streams):
            timing.saw(out)
            if out.finish_reason == "error":
                chunks.latest[index] = out
                status = "error"
                yield _sse(loraplex_error_event(out.error or LoraplexError("generation failed")))
                break
            if builder.chat and index not in roled and (out.token_ids or out.finished):
                roled.add(index)
                yield _sse(builder.role_chunk(index))
            chunk = chunks.chunk(index, out)
            if chunk is not None:
                yield _sse(chunk)
            if out.finished:
                finals[index] = out
        if len(finals) == len(streams):
            status = "done"
            for out in finals.values():
                gen.observe(metrics, out.finish_reason or "unknown", out, timing)
            if gen.include_usage:
                yield _sse(builder.usage_chunk([finals[i] for i in range(len(streams))]))
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
        guard.close()
        for stream in streams:
            stream.abort()
        if status != "done":
            gen.observe(metrics, status, None, timing)
        gen.on_end(sum(len(out.token_ids) for out in chunks.latest.values()))
        gen.trace(metrics, headers, status, [finals[i] for i in sorted(finals)], timing)
