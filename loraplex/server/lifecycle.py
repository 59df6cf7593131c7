"""The server's admission state: per-request timeouts (``--request-timeout``) and the drain on shutdown.

``ServerLifecycle`` (one per app, ``app.state.lifecycle``) knows every open generation request by its
engine streams (``guard``), and counts the HTTP requests in flight (``LifecycleMiddleware``).

- **Timeout**: each guarded request gets a timer; when it fires, every stream of the request ends with
  ``RequestTimedOut`` and is aborted in the engine (its KV blocks and adapter pin are returned). The
  client gets 504 (OpenAI's error body) or, once a stream has started, a final error event.
- **Drain** (``begin_drain``, called on SIGTERM by ``server/draining.py``): from then on every new
  request gets 503 and ``/health`` answers 503 ``{"status": "stopping"}``; requests already running go
  on. When none is left, or at the deadline, the server exits; at the deadline ``end_open`` ends what is
  still open with ``EngineUnavailable`` (503, or a final error event).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.client.base import RequestStream
from loraplex.errors import LoraplexError, RequestTimedOut
from loraplex.server.openai.errors import RETRY_AFTER_503_S, error_response

UNGUARDED_PATHS = ("/health", "/metrics")  # answered during a drain, and not waited for


class Guard:
    """One generation request's streams, registered until ``close``; ``fail`` ends them all."""

    def __init__(self, owner: ServerLifecycle, streams: Sequence[RequestStream]) -> None:
        self.streams = list(streams)
        self._owner = owner
        self._timer: asyncio.TimerHandle | None = None
        if owner.request_timeout is not None:
            seconds = owner.request_timeout
            error = RequestTimedOut(f"the request ran past the server's limit of {seconds:g} s (--request-timeout) "
                                    "and was stopped")
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, error)

    def fail(self, exc: LoraplexError) -> None:
        """End every stream of the request with ``exc`` and abort it in the engine (on the event loop)."""
        for stream in self.streams:
            stream.fail(exc)

    def _expire(self, exc: LoraplexError) -> None:
        self.fail(exc)
        self.close()

    def close(self) -> None:
        """The request is answered (or gone): stop its timer and forget it. Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
        self._owner.guards.discard(self)


class ServerLifecycle:
    """``request_timeout``: seconds a generation request may run (None: no limit)."""

    def __init__(self, request_timeout: float | None = None) -> None:
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        self.request_timeout = request_timeout
        # A streamed response whose body never started (its client left at once) never closes its guard:
        # weak references let it go with the response.
        self.guards: weakref.WeakSet[Guard] = weakref.WeakSet()
        self.active = 0  # HTTP requests in flight, /health and /metrics aside
        self.stopping = False
        self.deadline: float | None = None  # time.monotonic() by which a drain ends

    def guard(self, streams: Sequence[RequestStream]) -> Guard:
        """Register a submitted request's streams (on the event loop); ``close()`` the guard when it ends."""
        guard = Guard(self, streams)
        self.guards.add(guard)
        return guard

    def begin_drain(self, timeout: float) -> None:
        """Stop admitting; running requests may go on for ``timeout`` seconds. Safe in a signal handler."""
        if not self.stopping:
            self.deadline = time.monotonic() + timeout
            self.stopping = True

    @property
    def drained(self) -> bool:
        return self.stopping and self.active == 0

    @property
    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def end_open(self, exc: LoraplexError) -> int:
        """End every open generation request with ``exc``; how many there were."""
        guards = list(self.guards)
        for guard in guards:
            guard.fail(exc)
        return len(guards)


class LifecycleMiddleware:
    """Counts HTTP requests in flight; while the server drains, answers every new one 503 at once
    (``/health``: ``{"status": "stopping"}``; ``/metrics`` is still served)."""

    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.lifecycle.stopping and path != "/metrics":
            if path == "/health":
                response = JSONResponse({"status": "stopping", "detail": "the server is shutting down"}, 503,
                                        headers={"Retry-After": str(RETRY_AFTER_503_S)})
            else:
                response = error_response(503, "the server is shutting down and accepts no new requests")
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        if path in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        self.lifecycle.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.active -= 1
