"""The built-in playground: ``GET /`` serves a static page (no build step, no CDN: it works offline),
and ``GET /v1/slots`` the live adapter table it polls.

- ``/`` and ``/playground/*`` (the page, its script modules and stylesheet from ``static/``) need no
  API key: the page asks for one when a ``/v1`` call answers 401, and keeps it in memory only.
- ``/v1/slots`` sits behind the same auth as every ``/v1`` call, and answers only keys that may see every
  adapter (``may_view``; 403 otherwise: a scoped key must not learn other tenants' adapters). Its data is
  ONE engine call,
  ``adapter_snapshot()`` (the shape is documented in ``loraplex/adapters/snapshot.py``), plus
  ``runtime_adapters``: whether this server accepts ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
  The page loads and unloads through those endpoints, so it gets exactly the API's checks and errors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from loraplex.server.openai.errors import ServerError

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/playground"


def mount_playground(app: FastAPI, adapter_snapshot: Callable[[], Awaitable[dict[str, Any]]],
                     runtime_adapters: bool, may_view: Callable[[Request], bool] = lambda request: True) -> None:
    """Add ``GET /``, ``/playground/*`` and ``GET /v1/slots`` to ``app``. ``adapter_snapshot`` is the
    engine client's (``EngineClient.adapter_snapshot``: a worker thread or the engine process takes the
    adapter manager's lock, never the event loop)."""

    @app.get("/", include_in_schema=False)
    async def playground_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="playground")

    @app.get("/v1/slots")
    async def adapter_slots(request: Request) -> dict[str, Any]:
        if not may_view(request):
            raise ServerError(403, "this API key is scoped to some adapters: it may not view the adapter table")
        snapshot = await adapter_snapshot()
        return {**snapshot, "runtime_adapters": runtime_adapters}
