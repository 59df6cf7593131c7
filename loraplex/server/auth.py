"""Bearer-token auth for ``/v1/*``: with an API key set, every call there needs
``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open.

A plain ASGI middleware (not ``BaseHTTPMiddleware``) so streamed responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.server.errors import error_response


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self.authorized(scope):
            response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        given = Headers(scope=scope).get("authorization", "").strip().encode()
        return secrets.compare_digest(given, self._expected)
