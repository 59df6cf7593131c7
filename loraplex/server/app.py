"""The OpenAI-compatible FastAPI app: ``create_app(engine, ...)``. Wiring only: the state every route shares
(``ServerContext``), the middlewares, and the routers by concept:

- ``routes/generate.py``: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamable);
- ``routes/models.py``: ``GET /v1/models``, ``GET /v1/models/{id}``;
- ``routes/responses.py``: ``POST /v1/responses`` (streamable), ``GET``/``DELETE /v1/responses/{id}``;
- ``routes/adapters.py``: adapter management and versions;
- ``routes/tokenize.py``: ``POST /tokenize``, ``POST /detokenize``;
- ``routes/embeddings.py``: ``POST /v1/embeddings``;
- ``routes/scoring.py``: ``POST /classify``, ``/score``, ``/rerank`` (vLLM's; also under ``/v1``);
- ``routes/ops.py``: ``GET /health``, ``GET /metrics``;
- ``routes/playground.py``: ``GET /`` and ``GET /v1/slots``; ``openai/openapi.py``: ``GET /openapi.json``.

The ``model`` field names the base model or an adapter. With API keys (``tenancy/keys.py``) a caller sees
and uses only its scope, within its limits (``tenancy/quotas.py``), as its tenant (fair share).

The app drives its engine through ``EngineClient`` only (``loraplex.client``): an ``EngineProcess`` (the
engine core in its own process: what ``loraplex serve`` runs) or an in-process ``AsyncEngine`` (its step
loop in a thread; made here for an ``Engine`` or an ``LLM``). The event loop does only cheap work:
bounded bodies (``--max-request-bytes``, 413 before the body is read in full), auth, routing, streaming
bytes. Parsing generation bodies, chat templates, tokenization (``/tokenize`` and ``/detokenize``
included) and prompt length checks run in a worker pool (``prepare/``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from loraplex.client.base import EngineClient
from loraplex.client.inproc import AsyncEngine
from loraplex.models.pooling_config import model_pooling
from loraplex.server.context import ServerContext
from loraplex.server.lifecycle import LifecycleMiddleware, ServerLifecycle
from loraplex.server.limits import BodyLimitMiddleware, default_max_request_bytes
from loraplex.server.metrics import ServerMetrics
from loraplex.server.on_demand import AdapterRoots, OnDemandLoader
from loraplex.server.openai.embeddings import EmbeddingRequest
from loraplex.server.openai.errors import install_error_handlers
from loraplex.server.openai.openapi import install_openapi
from loraplex.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.openai.reasoning import REASONING_PARSERS
from loraplex.server.openai.responses_api.request import ResponsesRequest
from loraplex.server.openai.scoring import ClassificationRequest, RerankRequest, ScoreRequest
from loraplex.server.openai.tool_parsers import PARSERS
from loraplex.server.prepare.preparer import PrepareConfig, RequestPreparer
from loraplex.server.routes import adapters, embeddings, generate, models, ops, responses, scoring, tokenize
from loraplex.server.routes.ops import DEFAULT_STALL_TIMEOUT_S
from loraplex.server.routes.playground import mount_playground
from loraplex.server.tenancy.access import AdapterPathPolicy, BearerAuthMiddleware, caller
from loraplex.server.tenancy.keys import KeyTable
from loraplex.server.tenancy.quotas import TenantQuotas
from loraplex.server.tracing import RequestTracer

API_KEY_ENV = "LORAPLEX_API_KEY"
# the POST bodies routes read by hand (parsed off the event loop), put back into the OpenAPI schema
READ_BY_HAND = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest,
                "/classify": ClassificationRequest, "/score": ScoreRequest, "/rerank": RerankRequest}


def create_app(
    engine: Any,
    *,
    served_model_name: str | None = None,
    allow_runtime_adapters: bool = False,
    adapter_roots: Iterable[str | Path] = (),
    api_key: str | None = None,
    api_keys: KeyTable | str | Path | None = None,
    load_on_demand: bool = False,
    max_request_bytes: int | None = None,
    prepare_processes: int = 0,
    preparer: RequestPreparer | None = None,
    request_timeout: float | None = None,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
    tool_call_parser: str | None = None, reasoning_parser: str | None = None,
    otlp_traces_endpoint: str | None = None,
    pooling: str | None = None,
) -> FastAPI:
    """An app serving ``engine``: an ``EngineClient`` (a started ``EngineProcess``, an ``AsyncEngine``),
    an ``Engine`` or an ``LLM`` (both served in-process).

    ``served_model_name`` defaults to the engine's model name; ``api_key`` defaults to
    ``$LORAPLEX_API_KEY`` (no auth when neither is set); ``api_keys`` (a ``KeyTable`` or a keys file) sets
    scoped keys instead. Runtime adapter loading is off unless ``allow_runtime_adapters``; ``adapter_roots``
    then bound the folders it may read; ``load_on_demand`` loads ``<root>/NAME`` on NAME's first request.
    ``max_request_bytes`` bounds request bodies (default: ``default_max_request_bytes``, sized for the
    model's context). ``prepare_processes`` > 0 prepares requests in that many worker processes
    instead of two threads (see ``loraplex.server.prepare``); ``preparer``: a ``RequestPreparer`` made (and
    started) before the engine was, to serve with instead (its processes import while the engine loads; it
    is configured here, and ``prepare_processes`` is then ignored). ``request_timeout``: seconds a generation
    request may run before it is stopped (504); ``app.state.lifecycle`` drains the app on shutdown.
    ``stall_timeout``: seconds with requests open and no engine step before ``/health`` says ``stalled``.
    Parsers: ``_check_parsers``. ``pooling``: how ``/v1/embeddings`` pools (``last`` | ``mean`` | ``cls``; default:
    the model's ``sentence-transformers`` config, else ``last``: ``models/pooling_config.py``)."""
    _check_parsers(tool_call_parser, reasoning_parser)
    client = engine if isinstance(engine, EngineClient) else AsyncEngine(getattr(engine, "engine", engine))
    if load_on_demand and not adapter_roots:
        raise ValueError("load_on_demand needs at least one adapter root")
    keys = _keys(api_key, api_keys)
    base_name = served_model_name or client.model_name
    ctx = ServerContext(
        client=client, base_name=base_name,
        base_aliases=frozenset({base_name, client.model_name, str(client.config.model)}),
        policy=AdapterPathPolicy(allow_runtime_adapters, adapter_roots),
        metrics=ServerMetrics(client.has_adapter, _tracer(otlp_traces_endpoint)),  # adapter labels: loaded names
        lifecycle=ServerLifecycle(request_timeout),
        preparer=_configured(preparer or RequestPreparer(processes=prepare_processes), client),
        keys=keys, quotas=TenantQuotas(),
        on_demand=OnDemandLoader(client, AdapterRoots(adapter_roots)) if load_on_demand else None,
        started=int(time.time()), stall_timeout=stall_timeout)
    client.step_observers.append(ctx.metrics.observe_step)
    app = FastAPI(title="loraplex", lifespan=partial(_lifespan, ctx))
    install_error_handlers(app)
    app.state.pooling = model_pooling(client.model_path).overridden(pooling)
    install_openapi(app, max_model_len=client.max_model_len, auth=keys is not None, served=partial(_served_models, ctx),
                    bodies=READ_BY_HAND, pooling=app.state.pooling, heads=partial(_served_heads, ctx))
    _add_middlewares(app, ctx, max_request_bytes or default_max_request_bytes(client.max_model_len))
    app.state.tool_call_parser, app.state.reasoning_parser = tool_call_parser, reasoning_parser
    _install_routes(app, ctx)
    return app


def _install_routes(app: FastAPI, ctx: ServerContext) -> None:
    """What the handlers read from ``app.state`` (``context`` first), the playground and every router."""
    app.state.context = ctx
    app.state.lifecycle = ctx.lifecycle
    app.state.engine = ctx.client
    app.state.metrics = ctx.metrics
    app.state.on_demand = ctx.on_demand
    mount_playground(app, ctx.client.adapter_snapshot, runtime_adapters=ctx.policy.enabled,
                     may_view=lambda request: caller(request).adapters == ("*",))
    for routes in (ops, models, generate, responses, tokenize, adapters, embeddings, scoring):
        app.include_router(routes.router)


def _tracer(otlp_traces_endpoint: str | None) -> RequestTracer | None:
    """A trace per request exported to ``otlp_traces_endpoint`` (``loraplex.server.tracing``; the OpenTelemetry
    SDK loads only then), or None: tracing off."""
    return RequestTracer(otlp_traces_endpoint) if otlp_traces_endpoint else None


def _configured(preparer: RequestPreparer, client: EngineClient) -> RequestPreparer:
    preparer.configure(PrepareConfig(str(client.model_path) if client.tokenizer is not None else None,
                                     client.max_model_len), client.tokenizer)
    return preparer


def _check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """``tool_call_parser``: the tool-call format of ``tool_choice: "auto"`` (``openai.tool_parsers.PARSERS``;
    default: each version's chat template decides); ``reasoning_parser``: how chat text splits into
    ``reasoning_content`` and ``content`` (``openai.reasoning.REASONING_PARSERS``; default: it does not)."""
    for name, known, what in ((tool_call_parser, PARSERS, "tool call"), (reasoning_parser, REASONING_PARSERS,
                                                                         "reasoning")):
        if name is not None and name not in known:
            raise ValueError(f"unknown {what} parser {name!r}; choose one of {sorted(known)}")


def _add_middlewares(app: FastAPI, ctx: ServerContext, max_request_bytes: int) -> None:
    """Outermost first: the lifecycle (a draining server admits nothing), auth, then the body bound (413)."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if ctx.keys is not None:
        app.add_middleware(BearerAuthMiddleware, keys=ctx.keys)
    app.add_middleware(LifecycleMiddleware, lifecycle=ctx.lifecycle)


def _keys(api_key: str | None, api_keys: KeyTable | str | Path | None) -> KeyTable | None:
    """Scoped keys (a table or its file), else one key (``api_key`` or ``$LORAPLEX_API_KEY``), else none."""
    if isinstance(api_keys, KeyTable):
        return api_keys
    if api_keys is not None:
        return KeyTable.load(api_keys)
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    return KeyTable.single(api_key) if api_key else None


@asynccontextmanager
async def _lifespan(ctx: ServerContext, _: FastAPI) -> AsyncIterator[None]:
    """Start the engine (unless it serves already: then its owner stops it) and the workers; stop both after."""
    owns = not ctx.client.running
    ctx.client.start()
    await ctx.preparer.warm_up()
    await ctx.client.base_fingerprint()  # reads the checkpoint once, before the first request needs it
    yield
    if ctx.metrics.tracer is not None:  # flushes the spans not exported yet
        await asyncio.to_thread(ctx.metrics.tracer.shutdown)
    await asyncio.to_thread(ctx.preparer.shutdown)
    if owns:
        await asyncio.to_thread(ctx.client.shutdown)


def _served_heads(ctx: ServerContext) -> dict[str, int | None] | None:
    """Each served adapter's number of classes (None: no head); None under scoped keys (names must not leak)."""
    return None if ctx.keys is not None and ctx.keys.scoped else ctx.client.served_class_label_counts()


def _served_models(ctx: ServerContext) -> tuple[list[str], int]:
    """The names a request may use now, and the widest vocabulary among them (adapters may add tokens)."""
    vocab = ctx.client.served_adapters()
    named = [] if ctx.keys is not None and ctx.keys.scoped else list(vocab)  # scoped keys: names must not leak
    return [ctx.base_name, *named], max([ctx.client.vocab_size, *vocab.values()])
