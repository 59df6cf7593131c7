"""``AsyncEngine``: the engine's step loop beside an asyncio server.

Threads, and what each one does:

- the **event loop** (HTTP handlers) submits requests, consumes their outputs, and aborts a request
  whose consumer went away (cancelled task, closed iterator, disconnected client);
- ONE **step thread** calls ``engine.step()`` while the engine has work and sleeps on a
  ``threading.Event`` otherwise; it hands each step's ``RequestOutput`` s to their requests'
  ``asyncio.Queue`` s through one ``loop.call_soon_threadsafe`` per step;
- **worker threads** (``asyncio.to_thread``) run adapter loads and unloads, which read and
  validate files: neither the event loop nor the step thread ever waits on disk.

``add_request`` and ``abort_request`` are called on the event loop: the engine makes them cheap
(validate, tokenize, put into its inbox; the step thread drains the inbox between steps).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from loraplex.engine.request import RequestOutput, SamplingParams
from loraplex.errors import RequestError

logger = logging.getLogger(__name__)

StepObserver = Callable[[float, list[RequestOutput]], None]  # (step seconds, outputs)
_IDLE_POLL_S = 0.005  # back-off when the engine has queued work but could not schedule any


class RequestStream:
    """Outputs of one submitted request, in order; the last one has ``finished`` set.

    ``abort()`` (idempotent, also called when a ``generate`` consumer stops early) cancels the
    request in the engine, which frees its KV blocks and its adapter pin.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.done = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop (the step thread schedules it with ``call_soon_threadsafe``)."""
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


class AsyncEngine:
    """Wraps a thread-safe ``Engine`` (see docs/internals.md) for asyncio callers."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.step_observers: list[StepObserver] = []
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the step thread (idempotent)."""
        if self.running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="loraplex-step", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request still streaming and stop the step thread."""
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.engine.abort_request(request_id)
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    async def submit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None = None
    ) -> RequestStream:
        """Queue a request; raises the engine's ``UnknownAdapter`` / ``RequestError`` before queuing."""
        return (await self.submit_many([(request_id, prompt, params, adapter)]))[0]

    async def submit_many(
        self, items: Sequence[tuple[str, str | list[int], SamplingParams, str | None]]
    ) -> list[RequestStream]:
        """Queue ``(request_id, prompt, params, adapter)`` requests in one engine call (admitted together:
        the choices and prompts of one API request); raises before any is queued."""
        self.start()
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, item[0], loop) for item in items]
        with self._lock:
            taken = [s.request_id for s in streams if s.request_id in self._streams]
            if taken or len({s.request_id for s in streams}) < len(streams):
                raise RequestError(f"request id {(taken or [''])[0]!r} is already in use", "request_id")
            self._streams.update((s.request_id, s) for s in streams)
        try:
            self.engine.add_requests(items)
        except BaseException:
            for stream in streams:
                self._forget(stream.request_id)
            raise
        self._wakeup.set()
        return streams

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, adapter: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; stopping early aborts it in the engine."""
        stream = await self.submit(request_id or f"req-{time.monotonic_ns()}", prompt, params, adapter)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Stop delivering outputs and abort the request in the engine (a no-op once it finished)."""
        self._forget(request_id)
        self.engine.abort_request(request_id)
        self._wakeup.set()

    async def load_adapter(self, name: str, path: str) -> Any:
        """``engine.load_adapter`` in a worker thread; returns its ``AdapterInfo``."""
        return await asyncio.to_thread(self.engine.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self.engine.unload_adapter, name)
        self._wakeup.set()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _run(self) -> None:
        logger.info("step loop started")
        while not self._stopping:
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in the engine: fail what is in flight, keep serving
                logger.exception("engine step failed; failing every request in flight")
                self._fail_all(exc)
                continue
            elapsed = time.perf_counter() - start
            for observe in self.step_observers:
                observe(elapsed, outputs)
            self._deliver(outputs)
            if not outputs:
                self._wakeup.wait(_IDLE_POLL_S)
                self._wakeup.clear()
        logger.info("step loop stopped")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(out.request_id), out) for out in outputs]
            for out in outputs:
                if out.finished:
                    self._streams.pop(out.request_id, None)
        self._send([(stream, out) for stream, out in targets if stream is not None])

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            self.engine.abort_request(stream.request_id)
        self._send([(stream, exc) for stream in streams])

    @staticmethod
    def _send(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Hand a step's items to their streams: ONE ``call_soon_threadsafe`` per event loop, so the step
        thread wakes each loop once per step rather than once per request (less GIL ping-pong)."""
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
