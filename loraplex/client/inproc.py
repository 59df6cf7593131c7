"""``AsyncEngine``: the engine's step loop in a thread beside an asyncio server (an ``EngineClient``).

The in-process engine client: for embedding (``create_app(Engine)``), tests and Ray Serve replicas.
``loraplex serve`` runs the engine in its own process instead (``client/process.py``), so the
step loop never shares a GIL with the HTTP side.

Threads, and what each one does:

- the **event loop** (HTTP handlers) routes and submits requests, consumes their outputs, and aborts a
  request whose consumer went away (cancelled task, closed iterator, disconnected client);
- ONE **step thread** calls ``engine.step()`` while the engine has work and sleeps on a
  ``threading.Event`` otherwise; it turns each step's ``EngineOutput`` s into ``RequestOutput`` s (the
  client's ``OutputProcessor``) and hands them to their requests' ``asyncio.Queue`` s through one
  ``loop.call_soon_threadsafe`` per step;
- **worker threads** (``asyncio.to_thread``) run adapter calls, which read and validate files: neither
  the event loop nor the step thread ever waits on disk.

``engine_directory(engine)`` is the ``AdapterDirectory`` of an engine in this process (tokenizers are
the engine's own objects; nothing is read twice); ``sync_directory`` brings it up to date whenever the
engine's version table moved, whoever moved it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from loraplex.adapters.versions import HeldVersion
from loraplex.client.base import EngineClient, EngineHealth
from loraplex.client.directory import AdapterDirectory
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import NewRequest, RequestTags
from loraplex.engine.step_loop import run_step_loop
from loraplex.engine.wire import unpacked_kwargs
from loraplex.errors import EngineUnavailable

logger = logging.getLogger(__name__)


def engine_directory(engine: Engine) -> AdapterDirectory:
    """An ``AdapterDirectory`` over ``engine``'s version table (call ``sync_directory`` before routing)."""

    def own_tokenizer(held: HeldVersion) -> Any:
        return engine.tokenizer_of(held.version_id)

    directory = AdapterDirectory(engine.tokenizer, engine.model_config.vocab_size, own_tokenizer)
    sync_directory(directory, engine)
    return directory


def sync_directory(directory: AdapterDirectory, engine: Engine) -> None:
    """Install the engine's version table if it changed since ``directory`` last saw it (a cheap compare)."""
    if engine.adapters.generation != directory.generation:
        directory.update(engine.version_view())


class AsyncEngine(EngineClient):
    """Wraps a thread-safe ``Engine`` (see docs/internals.md) for asyncio callers."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self.config = engine.config
        self.info = engine.info()
        self.tokenizer = engine.tokenizer
        self.directory = engine_directory(engine)
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._died: EngineHealth | None = None  # set when the step thread died of an exception

    @classmethod
    def from_config(cls, config: EngineConfig, adapters: Sequence[tuple[str, str]] = ()) -> AsyncEngine:
        """A new ``Engine`` of ``config`` in this process with ``adapters`` (name, folder) loaded, as a client."""
        engine = Engine(config)
        for name, path in adapters:
            engine.load_adapter(name, path)
        return cls(engine)

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

    def _sync_versions(self) -> None:
        sync_directory(self.directory, self.engine)

    def _check_serving(self) -> None:
        if self._died is not None:  # checked under the lock that _fail_all takes: no stream is missed
            raise EngineUnavailable(f"the engine is dead: {self._died.detail}")

    async def _enqueue(self, requests: list[NewRequest], tags: RequestTags) -> None:
        self.start()
        self.engine.add_requests(requests, tags)
        self._wakeup.set()

    def _abort_in_engine(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._wakeup.set()

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        call = getattr(self.engine, method)
        result = await asyncio.to_thread(lambda: call(*args, **unpacked_kwargs(kwargs)))
        self._wakeup.set()  # an unload may end queued requests
        return result

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

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.engine.abort_request(request_id)
        self._fail_streams(ids, exc)
