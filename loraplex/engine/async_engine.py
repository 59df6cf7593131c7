"""``AsyncEngine``: the engine's step loop in a thread beside an asyncio server (an ``EngineClient``).

The in-process engine client: for embedding (``create_app(Engine)``), tests and Ray Serve replicas.
``loraplex serve`` runs the engine in its own process instead (``engine/process_client.py``), so the
step loop never shares a GIL with the HTTP side.

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
from collections.abc import Sequence
from typing import Any

from loraplex.engine.client import EngineClient, EngineHealth, EngineInfo, RequestStream, deliver, route_outputs
from loraplex.engine.request import NO_TAGS, RequestOutput, RequestTags, SamplingParams
from loraplex.engine.step_loop import run_step_loop
from loraplex.engine.tokenizers import TokenizerTable
from loraplex.errors import EngineUnavailable, RequestError

logger = logging.getLogger(__name__)



class AsyncEngine(EngineClient):
    """Wraps a thread-safe ``Engine`` (see docs/internals.md) for asyncio callers."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.config = engine.config
        self.info = EngineInfo.of(engine)
        self.tokenizer = engine.tokenizer
        self.step_observers = []  # typed by EngineClient
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._died: EngineHealth | None = None  # set when the step thread died of an exception

    def health(self) -> EngineHealth:
        if self._died is not None:
            return self._died
        if self._thread is not None and self._thread.is_alive():
            return EngineHealth("ready", step_failures=self.engine.step_failures,
                                last_step_error=self.engine.last_step_error)
        return EngineHealth("stopped", "step loop not running")

    def start(self) -> None:
        """Start the step thread (idempotent); ``EngineUnavailable`` once it died (the engine's state is unknown)."""
        if self._died is not None:
            raise EngineUnavailable(f"the engine is dead: {self._died.detail}")
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

    async def submit_many(
        self, items: Sequence[tuple[str, str | list[int], SamplingParams, str | None]], tags: RequestTags = NO_TAGS
    ) -> list[RequestStream]:
        """Queue ``(request_id, prompt, params, adapter)`` requests in one engine call (admitted together:
        the choices and prompts of one API request); raises before any is queued."""
        self.start()
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, item[0], loop) for item in items]
        with self._lock:
            if self._died is not None:  # checked under the lock that _fail_all takes: no stream is missed
                raise EngineUnavailable(f"the engine is dead: {self._died.detail}")
            taken = [s.request_id for s in streams if s.request_id in self._streams]
            if taken or len({s.request_id for s in streams}) < len(streams):
                raise RequestError(f"request id {(taken or [''])[0]!r} is already in use", "request_id")
            self._streams.update((s.request_id, s) for s in streams)
        try:
            self.engine.add_requests(items, **tags.kwargs())
        except BaseException:
            for stream in streams:
                self._forget(stream.request_id)
            raise
        self._wakeup.set()
        return streams

    def abort(self, request_id: str) -> None:
        """Stop delivering outputs and abort the request in the engine (a no-op once it finished)."""
        self._forget(request_id)
        self.engine.abort_request(request_id)
        self._wakeup.set()

    async def load_adapter(self, name: str, path: str, new_version: bool = False) -> Any:
        """``engine.load_adapter`` in a worker thread; returns its ``AdapterInfo``."""
        return await asyncio.to_thread(self.engine.load_adapter, name, path, new_version)

    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(getattr(self.engine, method), *args)

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self.engine.unload_adapter, name)
        self._wakeup.set()

    async def list_adapters(self) -> list[Any]:
        return await asyncio.to_thread(self.engine.list_adapters)

    async def stats(self) -> Any:
        return await asyncio.to_thread(self.engine.stats)

    async def adapter_snapshot(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.engine.adapter_snapshot)

    def tokenizer_for(self, adapter: str | None) -> Any:
        return self.engine.tokenizer_for(adapter)

    def vocab_size_for(self, adapter: str | None) -> int:
        return self.engine.vocab_size_for(adapter)

    def served_adapters(self) -> dict[str, int]:
        return {i.name: i.vocab_size or self.vocab_size for i in self.engine.list_adapters()}

    def tokenizer_table(self) -> TokenizerTable:
        return self.engine.tokenizer_table()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _run(self) -> None:
        logger.info("step loop started")
        try:
            run_step_loop(self.engine, self._wakeup, lambda: self._stopping, self._on_step, self._fail_all)
        except BaseException as exc:  # the thread dies: health turns "dead", open requests end with an error
            logger.critical("the step loop died; failing every open request", exc_info=exc)
            with self._lock:
                self._died = EngineHealth("dead", f"the step loop died: {type(exc).__name__}: {exc}")
            self._fail_all(EngineUnavailable(self._died.detail))
            return
        logger.info("step loop stopped")

    def _on_step(self, seconds: float, outputs: list[RequestOutput]) -> None:
        for observe in self.step_observers:
            observe(seconds, outputs)
        route_outputs(self._streams, self._lock, outputs)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            self.engine.abort_request(stream.request_id)
        deliver([(stream, exc) for stream in streams])
