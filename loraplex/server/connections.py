"""Connection-level limits: what one client's sockets may hold, whatever it sends (uvicorn's settings, plus a
header timeout uvicorn lacks).

- ``header_timeout``: a connection must deliver a request's whole header within this many seconds of being
  opened (or of its previous response, on a kept-alive connection), else it is closed. uvicorn arms its
  keep-alive timer only after a response, so a client sending its headers byte by byte (slowloris) held its
  socket for ever. ``HeaderTimeoutProtocol`` is uvicorn's h11 protocol with that timer.
- ``timeout_keep_alive``: an idle kept-alive connection is closed after this many seconds (uvicorn's).
- ``h11_max_incomplete_event_size``: the most bytes of an incomplete request header (uvicorn's; past it the
  connection gets 400 and is closed).
- ``limit_concurrency``: the most connections and tasks at once; past it new requests get 503 (uvicorn's).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    timeout_keep_alive: float = 5.0  # uvicorn's default
    h11_max_incomplete_event_size: int = 16 * 1024  # uvicorn's default
    limit_concurrency: int | None = None

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keywords for these limits (``http``: the protocol with the header timeout)."""
        protocol = type("LimitedH11Protocol", (HeaderTimeoutProtocol,), {"header_timeout": self.header_timeout})
        return {"http": protocol, "timeout_keep_alive": self.timeout_keep_alive,
                "h11_max_incomplete_event_size": self.h11_max_incomplete_event_size,
                "limit_concurrency": self.limit_concurrency}


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request header is not complete within
    ``header_timeout`` seconds of the connection (or of the previous response)."""

    header_timeout: float = ConnectionLimits.header_timeout

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the header is in (or the connection is done)
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's header gets the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
