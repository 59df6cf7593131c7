"""Access control: who may call the API, and which adapter folders it may load at run time.

- ``BearerAuthMiddleware``: with API keys set (``server/tenancy/keys.py``), every ``/v1/*`` call needs
  ``Authorization: Bearer KEY`` of a configured key (401 otherwise); ``/health`` stays open. ``/metrics``
  (every adapter's and tenant's traffic) stays open only with the single ``--api-key``; with a keys file it
  needs a key that may scrape (admin, or ``metrics = true``): 401 without a key, 403 with another.
  The key found is put in the request's scope (``caller(request)`` reads it); with scoped keys, a
  call outside ``/v1`` (``/tokenize``, ``/detokenize``: no key needed, as vLLM) gets the scope of its key
  if it sends one, else the base model's only (``ANONYMOUS``), so no path leaks adapter names. A plain ASGI
  middleware (not ``BaseHTTPMiddleware``) so streamed responses and client disconnects pass through.
- ``AdapterPathPolicy``: runtime loading is off unless enabled. With adapter roots set, a path is
  accepted only if it resolves (``..`` collapsed, every symlink followed) inside one of them, so
  neither ``../`` nor a symlink can reach a folder outside (403). With loading enabled and no roots,
  any path is accepted (and a warning is logged).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.server.openai.errors import ServerError, error_response
from loraplex.server.tenancy.keys import ANONYMOUS, OPEN_ACCESS, ApiKey, KeyTable

logger = logging.getLogger(__name__)

_SCOPE_KEY = "loraplex.api_key"


def caller(request: HTTPConnection) -> ApiKey:
    """The key a request authenticated with; ``OPEN_ACCESS`` when the server has no keys."""
    return request.scope.get(_SCOPE_KEY, OPEN_ACCESS)


# vLLM's pooling routes outside /v1: they run the model, so they need a key as /v1 does
KEYED_PATHS = ("/classify", "/score", "/rerank")


def needs_key(path: str) -> bool:
    """Whether a request to ``path`` must carry an API key (when the server has keys)."""
    return path.startswith("/v1") or path in KEYED_PATHS


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyTable) -> None:
        self.app = app
        self._keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and (needs_key(scope["path"]) or (
            scope["path"] == "/metrics" and not self._keys.open_metrics))
        if guarded:
            key = self.authorized(scope)
            if key is None:
                response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
            if scope["path"] == "/metrics" and not key.may_scrape:
                await error_response(403, "this API key may not read /metrics (it is neither an admin key nor "
                                     "a key with metrics = true)")(scope, receive, send)
                return
            scope[_SCOPE_KEY] = key
        elif scope["type"] == "http" and self._keys.scoped:
            scope[_SCOPE_KEY] = self.authorized(scope) or ANONYMOUS
        await self.app(scope, receive, send)

    def authorized(self, scope: Scope) -> ApiKey | None:
        scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
        key = self._keys.lookup(token.strip())
        return key if scheme.lower() == "bearer" else None


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

    def load_roots(self) -> list[str] | None:
        """The roots every file of a runtime load must resolve inside (the engine checks each file it opens:
        ``ForbiddenAdapterPath``, 403); None with no roots."""
        return [str(root) for root in self.roots] or None
