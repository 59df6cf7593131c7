"""Access control: who may call the API, and which adapter folders it may load at run time.

- ``BearerAuthMiddleware``: with an API key set, every ``/v1/*`` call needs
  ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and ``/metrics`` stay open. A plain ASGI
  middleware (not ``BaseHTTPMiddleware``) so streamed responses and client disconnects pass through.
- ``AdapterPathPolicy``: runtime loading is off unless enabled. With adapter roots set, a path is
  accepted only if it resolves (``..`` collapsed, every symlink followed) inside one of them, so
  neither ``../`` nor a symlink can reach a folder outside (403). With loading enabled and no roots,
  any path is accepted (and a warning is logged).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.server.errors import ServerError, error_response

logger = logging.getLogger(__name__)


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self.authorized(scope):
            response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self._key)


class AdapterPathPolicy:
    def __init__(self, allow_runtime_adapters: bool, adapter_roots: Iterable[str | Path] = ()) -> None:
        self.enabled = allow_runtime_adapters
        self.roots = tuple(Path(r).expanduser().resolve() for r in adapter_roots)
        if self.enabled and not self.roots:
            logger.warning("runtime adapter loading is on with no --adapter-root: any path can be loaded")

    def check_enabled(self) -> None:
        """Raise ``ServerError(403)`` unless runtime loading and unloading are enabled."""
        if not self.enabled:
            raise ServerError(
                403, "runtime adapter loading is disabled; start the server with --allow-runtime-adapters"
            )

    def check(self, path: str) -> Path:
        """The resolved folder to load; raises ``ServerError(403)`` when policy forbids it."""
        self.check_enabled()
        if "\x00" in path:  # no folder can have that name
            raise ServerError(404, "no adapter folder at a path with a NUL character", "lora_path")
        resolved = Path(path).expanduser().resolve()
        if self.roots and not any(resolved.is_relative_to(root) for root in self.roots):
            raise ServerError(
                403, f"{path!r} is outside the allowed adapter roots (after resolving '..' and symlinks): "
                f"{', '.join(str(r) for r in self.roots)}", "lora_path",
            )
        return resolved
