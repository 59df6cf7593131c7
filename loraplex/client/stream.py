"""``RequestStream``: the outputs of one submitted request, handed from the step loop's thread to the
event loop that consumes them (``deliver``: one ``call_soon_threadsafe`` per event loop and step)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from loraplex.client.output import RequestOutput

logger = logging.getLogger(__name__)


class Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """Outputs of one submitted request, in order; the last one has ``finished`` set. An exception put
    on the stream (the engine failed or died) is raised to the consumer and ends it.

    ``abort()`` (idempotent, also called when a ``generate`` consumer stops early) cancels the
    request in the engine, which frees its KV blocks and its adapter pin.
    """

    def __init__(self, owner: Aborts, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.done = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the stream's event loop (producers schedule it with ``deliver``)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._owner.abort(self.request_id)

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (raised to its consumer after the outputs already delivered) and abort
        the request in the engine, which frees its KV blocks and adapter pin; on the stream's event loop."""
        if not self.done:
            self._owner.abort(self.request_id)
            self.put(exc)


def deliver(items: Iterable[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Hand items to their streams from any thread: ONE ``call_soon_threadsafe`` per event loop, so a
    producer wakes each loop once per step rather than once per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the consumers' event loop is closed
            logger.debug("dropping %d outputs: their event loop is closed", len(batch))


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.put(item)
