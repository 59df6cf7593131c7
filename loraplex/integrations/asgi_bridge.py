"""Carry one HTTP request across a process boundary and run it through an in-process ASGI app.

The Ray Serve ingress turns the request it received into a ``ForwardedRequest`` (plain, picklable
data); the engine replica runs it through the very FastAPI app ``loraplex serve`` uses
(``loraplex.server.app.create_app``) with ``call_asgi``, which yields a ``ResponseStart`` and then
the body chunks as the app sends them, so server-sent events stream through unchanged. Closing the
iterator early (the client went away) tells the app ``http.disconnect``, which aborts the request
in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

Header = tuple[bytes, bytes]


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as data: what an ASGI ``http`` scope needs, plus the whole body."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[Header, ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
            "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
            "client": self.client, "server": ("127.0.0.1", 80), "state": {},
        }


@dataclass(frozen=True)
class ResponseStart:
    """Status and headers of a response; its body follows as ``bytes`` chunks."""

    status: int
    headers: tuple[Header, ...]

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), None)


_END = object()  # put on the message queue when the app returns


async def call_asgi(app: ASGIApp, request: ForwardedRequest,
                    extra_headers: Sequence[Header] = ()) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``request`` through ``app``: yields one ``ResponseStart`` (with ``extra_headers`` added),
    then every non-empty body chunk. Raises what the app raised if it failed before responding."""
    messages: asyncio.Queue[Any] = asyncio.Queue()  # ASGI messages, then an exception or _END
    gone = asyncio.Event()  # set when our consumer stops listening
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        except Exception as exc:  # surfaced to the consumer below
            messages.put_nowait(exc)
        messages.put_nowait(_END)

    task = asyncio.ensure_future(run())
    complete = False
    try:
        while not complete:
            message = await messages.get()
            if message is _END:
                complete = True
            elif isinstance(message, BaseException):
                complete = True
                raise message
            elif message["type"] == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                yield ResponseStart(message["status"], headers + tuple(extra_headers))
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                complete = not message.get("more_body", False)
                if body:
                    yield bytes(body)
    finally:
        gone.set()  # the response is over, or our consumer left: either way the app may stop listening
        if not complete:  # the consumer left mid-response: the app aborts its request, then stops
            await asyncio.sleep(0)
            task.cancel()
