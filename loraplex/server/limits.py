"""Request limits, checked before a request costs anything: the body size (413 before the body is
read in full) and the number of ``stop`` strings (every streamed token is matched against each).

``--max-request-bytes`` defaults to ``default_max_request_bytes(max_model_len)``: 64 bytes per token
of context (a JSON-escaped token of text is rarely more than 12 bytes, a token id at most 7), and at
least 1 MiB, so any request that can fit the context fits the limit with a wide margin.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.errors import RequestError
from loraplex.server.openai.errors import ServerError, error_response

BYTES_PER_CONTEXT_TOKEN = 64
MIN_DEFAULT_REQUEST_BYTES = 1 << 20
MAX_STOP_STRINGS = 64


def default_max_request_bytes(max_model_len: int) -> int:
    return max(MIN_DEFAULT_REQUEST_BYTES, BYTES_PER_CONTEXT_TOKEN * max_model_len)


def check_stop(stop: str | Sequence[str] | None) -> None:
    """Raise ``RequestError`` on ``stop`` when it lists more than ``MAX_STOP_STRINGS`` strings: every
    output token is matched against each of them (as OpenAI, which allows 4, bounds the count; the
    strings' length is bounded by the body size)."""
    if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop lists {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")


def _too_large(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes (--max-request-bytes)"


class BodyLimitMiddleware:
    """Answers 413 (OpenAI's error body) for a request whose body exceeds ``max_bytes``: at once when
    its ``Content-Length`` says so, before any of the body is read; otherwise (chunked uploads) as soon
    as the bytes received pass the limit, when the app reading the body gets ``ServerError(413)``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, _too_large(self.max_bytes))(scope, receive, send)
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise ServerError(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, bounded_receive, send)
