"""``EngineReplica``: one Ray Serve replica = one ``Engine`` (own slots, host cache, step thread) plus
the same FastAPI app ``loraplex serve`` runs, called in-process for each forwarded request.

Adapter loading is lazy and per replica: the router sends a request for ``model=NAME`` with NAME as
Serve's multiplexed model id; the replica's ``@serve.multiplexed`` loader registers
``<root>/NAME`` in its engine on first use (an adapter given at start is already registered), and
from then on Serve routes NAME's requests to this replica while it has room. Each response carries
``x-loraplex-replica`` (this replica's id) and, for adapter requests, ``x-loraplex-adapter-cache``
(``hit`` when this replica already held the adapter, else ``miss``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import torch
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.types import ASGIApp

from loraplex.client.inproc import AsyncEngine
from loraplex.errors import AdapterNotFound, LoraplexError
from loraplex.integrations.asgi_bridge import ForwardedRequest, Header, ResponseStart, call_asgi
from loraplex.integrations.ray_config import AFFINITY_HEADER, REPLICA_HEADER, RayServeConfig
from loraplex.server.app import create_app
from loraplex.server.on_demand import AdapterRoots, OnDemandLoader
from loraplex.server.openai.errors import ServerError, error_response, loraplex_error_response

logger = logging.getLogger(__name__)


class _Held:
    """What the multiplexed loader returns for an adapter; Serve calls ``__del__`` when it drops the
    adapter from this replica's set (LRU). The engine keeps the adapter registered."""

    def __init__(self, held: set[str], name: str) -> None:
        self._held, self.name, self._dropped = held, name, False
        held.add(name)

    def __del__(self) -> None:
        if not self._dropped:  # Serve calls it on eviction; the garbage collector may call it again
            self._dropped = True
            self._held.discard(self.name)


class EngineReplica:
    """A Serve deployment class: an engine and its app; ``handle_http`` serves forwarded requests."""

    def __init__(self, config: RayServeConfig) -> None:
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.async_engine = AsyncEngine.from_config(config.engine, config.adapters)
        self.startup = frozenset(name for name, _ in config.adapters)
        self.roots = AdapterRoots(config.adapter_roots)  # the single server's --load-on-demand code
        # Auth is checked once, at the ingress; runtime loads are replaced by lazy loading.
        self.app = create_app(self.async_engine, served_model_name=config.served_model_name, api_key="")
        self.async_engine.start()
        self.loader = OnDemandLoader(self.async_engine, self.roots)
        self.held: set[str] = set()  # adapters in this replica's Serve multiplexing set

        async def hold(name: str) -> _Held:
            return await self._register(name)

        self._hold = serve.multiplexed(max_num_models_per_replica=config.max_adapters_per_replica)(hold)
        logger.info("replica %s ready: %s, %d startup adapter(s), roots %s", self.replica_id,
                    self.async_engine.model_name, len(self.startup), [str(r) for r in self.roots.roots])

    def __del__(self) -> None:
        self.async_engine.shutdown()

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose step loop died is restarted."""
        if not self.async_engine.running:
            raise RuntimeError(f"replica {self.replica_id}: the engine's step loop is not running")

    def registered(self, name: str) -> bool:
        return self.async_engine.has_adapter(name)

    async def _register(self, name: str) -> _Held:
        """The multiplexed loader: register ``name`` in the engine unless it already is."""
        if not self.registered(name) and not await self.loader.ensure(name):
            raise AdapterNotFound(f"adapter {name!r} is no longer in the adapter roots")
        return _Held(self.held, name)

    async def _prepare(self, name: str) -> tuple[ASGIApp | None, Header | None]:
        """Load adapter ``name`` here if it is servable. Returns (an error response to send instead
        of running the request, or None; the affinity header, or None for unknown names)."""
        hit = name in self.held
        try:
            if not (self.registered(name) or self.roots.find(name)):
                return None, None  # the app answers 404, naming the model
            await self._hold(name)
        except LoraplexError as exc:
            return loraplex_error_response(exc), None
        except ServerError as exc:
            return error_response(exc.status, str(exc), exc.param), None
        return None, (AFFINITY_HEADER.encode(), b"hit" if hit else b"miss")

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Serve one forwarded HTTP request: a ``ResponseStart``, then the body chunks."""
        headers = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        name = serve.get_multiplexed_model_id()
        app: ASGIApp = self.app
        if name:
            error, affinity = await self._prepare(name)
            app = error or app
            headers += [affinity] if affinity else []
        elif request.method == "GET" and request.path == "/v1/models" and self.roots.roots:
            app = await self._models_response(request)
        async for item in call_asgi(app, request, headers):
            yield item

    async def _models_response(self, request: ForwardedRequest) -> ASGIApp:
        """The app's ``/v1/models`` with this replica's lazily loaded adapters replaced by every
        adapter in the roots, so the list is the same whichever replica answers."""
        start, *chunks = [item async for item in call_asgi(self.app, request)]
        assert isinstance(start, ResponseStart)
        content = b"".join(c for c in chunks if isinstance(c, bytes))
        if start.status != 200:
            return Response(content, start.status, media_type=start.header("content-type"))
        base, *adapters = json.loads(content)["data"]
        cards = [base] + [card for card in adapters if card["id"] in self.startup]
        for name, folder in self.roots.adapters(skip=self.startup):
            cards.append({"id": name, "object": "model", "created": int(folder.stat().st_mtime),
                          "owned_by": "loraplex", "root": str(folder), "parent": base["id"]})
        return JSONResponse({"object": "list", "data": cards})
