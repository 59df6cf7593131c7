"""The OpenAI-compatible FastAPI app: ``create_app(engine, ...)``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamable),
``GET /v1/models``, adapter management and versions (``loraplex.server.adapter_routes``),
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``, ``GET /openapi.json``,
and the playground (``GET /``, ``GET /v1/slots``: see ``loraplex.server.playground``). The ``model``
field names the base model or an adapter. With API keys (``loraplex.server.keys``) a caller sees and
uses only its scope, within its limits (``loraplex.server.quotas``), as its tenant (fair share).

The app drives its engine through ``EngineClient`` only (``loraplex.engine.client``): an
``EngineProcess`` (the engine core in its own process: what ``loraplex serve`` runs) or an in-process
``AsyncEngine`` (its step loop in a thread; made here for an ``Engine`` or an ``LLM``). The event loop
does only cheap work: bounded bodies (``--max-request-bytes``, 413 before the body is read in full),
auth, routing, streaming bytes. Parsing generation bodies, chat templates, tokenization (``/tokenize``
and ``/detokenize`` included) and prompt length checks run in a worker pool (``loraplex.server.prepare``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.client import EngineClient
from loraplex.engine.engine import Engine
from loraplex.engine.request import RequestTags
from loraplex.errors import RequestError, UnknownAdapter
from loraplex.server.access import AdapterPathPolicy, BearerAuthMiddleware, caller
from loraplex.server.adapter_routes import install_adapter_routes
from loraplex.server.errors import ServerError, install_error_handlers
from loraplex.server.generation import Generation, model_not_found, run_generation
from loraplex.server.keys import ApiKey, KeyTable
from loraplex.server.lifecycle import LifecycleMiddleware, ServerLifecycle
from loraplex.server.limits import BodyLimitMiddleware, default_max_request_bytes
from loraplex.server.metric_labels import loaded_check
from loraplex.server.metrics import CONTENT_TYPE, ServerMetrics
from loraplex.server.on_demand import AdapterRoots, OnDemandLoader
from loraplex.server.openapi import GENERATION_ERRORS, documented, install_openapi
from loraplex.server.playground import mount_playground
from loraplex.server.prepare import PrepareConfig, Prepared, RequestPreparer
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from loraplex.server.quotas import TenantQuotas
from loraplex.server.responses import ResponseBuilder, TokenTexts
from loraplex.server.schemas import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    Health,
    ModelList,
    TokenizeResponse,
)

logger = logging.getLogger(__name__)

API_KEY_ENV = "LORAPLEX_API_KEY"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
    request_timeout: float | None = None,
) -> FastAPI:
    """An app serving ``engine``: an ``EngineClient`` (a started ``EngineProcess``, an ``AsyncEngine``),
    an ``Engine`` or an ``LLM`` (both served in-process).

    ``served_model_name`` defaults to the engine's model name; ``api_key`` defaults to
    ``$LORAPLEX_API_KEY`` (no auth when neither is set); ``api_keys`` (a ``KeyTable`` or a keys file) sets
    scoped keys instead. Runtime adapter loading is off unless ``allow_runtime_adapters``; ``adapter_roots``
    then bound the folders it may read; ``load_on_demand`` loads ``<root>/NAME`` on NAME's first request.
    ``max_request_bytes`` bounds request bodies (default: ``default_max_request_bytes``, sized for the
    model's context). ``prepare_processes`` > 0 prepares requests in that many worker processes
    instead of two threads (see ``loraplex.server.prepare``). ``request_timeout``: seconds a generation
    request may run before it is stopped (504); ``app.state.lifecycle`` drains the app on shutdown.
    """
    client = _engine_client(engine)
    base_name = served_model_name or client.model_name
    base_aliases = {base_name, client.model_name, str(client.config.model)}
    policy = AdapterPathPolicy(allow_runtime_adapters, adapter_roots)
    metrics = ServerMetrics(loaded_check(client))  # adapter labels: loaded names only
    lifecycle = ServerLifecycle(request_timeout)
    client.step_observers.append(metrics.observe_step)
    preparer = RequestPreparer(
        PrepareConfig(str(client.model_path) if client.tokenizer is not None else None, client.max_model_len,
                      frozenset(base_aliases)), client=client, processes=prepare_processes)
    started = int(time.time())
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    keys = (api_keys if isinstance(api_keys, KeyTable) else KeyTable.load(api_keys) if api_keys is not None
            else KeyTable.single(api_key) if api_key else None)
    quotas = TenantQuotas()
    if load_on_demand and not adapter_roots:
        raise ValueError("load_on_demand needs at least one adapter root")
    on_demand = OnDemandLoader(client, AdapterRoots(adapter_roots)) if load_on_demand else None
    max_request_bytes = max_request_bytes or default_max_request_bytes(client.max_model_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        owns = not client.running
        client.start()
        await preparer.warm_up()
        await client.base_fingerprint()  # reads the checkpoint once, before the first request needs it
        yield
        await asyncio.to_thread(preparer.shutdown)
        if owns:
            await asyncio.to_thread(client.shutdown)

    app = FastAPI(title="loraplex", lifespan=lifespan)
    install_error_handlers(app)

    def served_models() -> tuple[list[str], int]:
        """The names a request may use now, and the widest vocabulary among them (adapters may add tokens)."""
        vocab = client.served_adapters()
        named = [] if keys is not None and keys.scoped else list(vocab)  # scoped keys: names must not leak
        return [base_name, *named], max([client.vocab_size, *vocab.values()])

    install_openapi(app, max_model_len=client.max_model_len, auth=keys is not None, served=served_models,
                    bodies={"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest})
    token_texts: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()  # per tokenizer
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if keys is not None:
        app.add_middleware(BearerAuthMiddleware, keys=keys)
    app.add_middleware(LifecycleMiddleware, lifecycle=lifecycle)  # outermost: a draining server admits nothing
    app.state.lifecycle = lifecycle
    app.state.engine = client
    app.state.metrics = metrics
    app.state.on_demand = on_demand
    mount_playground(app, client.adapter_snapshot, runtime_adapters=policy.enabled,
                     may_view=lambda request: caller(request).adapters == ("*",))

    def adapter_for(model: str) -> str | None:
        return None if model in base_aliases else model

    def known(model: str, key: ApiKey) -> str | None:
        """``model``'s adapter name (None: the base); 404 on ``model`` if it is neither the base nor an
        adapter ``key`` may use, 400 if the model has no tokenizer."""
        try:
            if not key.may_use(adapter_for(model)):
                raise UnknownAdapter(model)
            tokenizer = client.tokenizer_for(adapter_for(model))
        except UnknownAdapter as exc:
            raise ServerError(404, f"model {model!r} not found (see GET /v1/models)", "model") from exc
        if tokenizer is None:
            raise RequestError(f"model {model!r} has no tokenizer", "model")
        return adapter_for(model)

    def texts_for(model: str) -> TokenTexts:
        """The token strings of ``model``'s tokenizer (cached per tokenizer), for logprobs; ``.tokenizer`` is
        None for an unknown model (``run_generation`` answers it with 404) or one without a tokenizer."""
        try:
            tokenizer = client.tokenizer_for(adapter_for(model))
        except UnknownAdapter:
            tokenizer = None
        if tokenizer is None:
            return TokenTexts(None)
        if tokenizer not in token_texts:
            token_texts[tokenizer] = TokenTexts(tokenizer)
        return token_texts[tokenizer]

    def model_card(model_id: str, root: str, parent: str | None, created: int) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "loraplex",
                "root": root, "parent": parent}

    def adapter_card(info: Any) -> dict:
        return model_card(info.name, str(info.path), base_name, int(info.loaded_at) or started)

    async def prepare(request: Request, kind: str, *args: Any) -> tuple[Prepared, str | None]:
        """A generation request prepared, its adapter (None: the base) in the caller's scope (else 404 as an
        unknown model, before any on-demand load) and loaded on first use (``--load-on-demand``)."""
        prepared = await getattr(preparer, kind)(*args)
        adapter = adapter_for(prepared.body.model)
        if not caller(request).may_use(adapter):
            raise model_not_found(prepared.body.model)
        if adapter is not None and on_demand is not None and await on_demand.ensure(adapter):
            prepared = await getattr(preparer, kind)(*args)  # again, with the adapter's own tokenizer
        return prepared, adapter

    def tenancy(request: Request, prepared: Prepared) -> dict[str, Any]:
        """The caller's ``Generation`` fields: tenant and priority, and a lease within its limits (else 429;
        ``run_generation`` ends it)."""
        key = caller(request)
        lease = quotas.admit(key, sum(len(p) for p in prepared.prompt_token_ids))
        return {"tags": RequestTags(key.tenant, prepared.body.priority or 0), "on_end": lease.release}

    @app.get("/health", response_model=None, responses=documented(Health, 503))
    async def health() -> Response:
        state = client.health()
        if not state.ok:
            return JSONResponse({"status": state.state, "detail": state.detail}, status_code=503)
        faults = {"step_failures": state.step_failures, "last_step_error": state.last_step_error}
        return JSONResponse({"status": "ok", **(faults if state.step_failures else {})})

    @app.get("/metrics", response_model=None, responses=documented(None, 503, ok_media=CONTENT_TYPE.split(";")[0]))
    async def prometheus() -> Response:
        stats = await client.stats()
        return Response(await asyncio.to_thread(metrics.render, stats), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=documented(ModelList, 503))
    async def list_models(request: Request) -> dict:
        key = caller(request)
        infos = await client.list_adapters()
        cards = [model_card(base_name, str(client.config.model), None, started)] if key.base_model else []
        cards += [adapter_card(info) for info in infos if key.may_use(info.name)]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions", response_model=None,
              responses=documented(CompletionResponse, *GENERATION_ERRORS, stream=True))
    async def completions(request: Request) -> Response:
        prepared, adapter = await prepare(request, "completion", await request.body(), COMPLETION_DEFAULT_MAX_TOKENS)
        body: CompletionRequest = prepared.body
        params = body.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
        gen = Generation(
            builder=ResponseBuilder(chat=False, model=body.model, tokens=texts_for(body.model), n=params.n,
                                    echo=bool(body.echo), prompt_texts=prepared.prompt_texts,
                                    show_prompt_logprobs=body.prompt_logprobs is not None),
            prompts=prepared.prompt_token_ids,
            params=params,
            adapter=adapter,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            prompt_param="prompt",
            user=body.user,
            **tenancy(request, prepared),
        )
        return await run_generation(client, metrics, gen, request, lifecycle)

    @app.post("/v1/chat/completions", response_model=None,
              responses=documented(ChatCompletionResponse, *GENERATION_ERRORS, stream=True))
    async def chat_completions(request: Request) -> Response:
        prepared, adapter = await prepare(request, "chat", await request.body())  # the adapter's own chat template
        body: ChatCompletionRequest = prepared.body
        prompt_ids = prepared.prompt_token_ids[0]
        params = body.sampling_params(max(client.max_model_len - len(prompt_ids), 1))  # default: the rest
        gen = Generation(
            builder=ResponseBuilder(chat=True, model=body.model, tokens=texts_for(body.model), n=params.n,
                                    show_prompt_logprobs=body.prompt_logprobs is not None,
                                    tool_parser=body.tool_parser()),
            prompts=[prompt_ids],
            params=params,
            adapter=adapter,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            prompt_param="messages",
            user=body.user or body.safety_identifier,
            **tenancy(request, prepared),
        )
        return await run_generation(client, metrics, gen, request, lifecycle)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=documented(TokenizeResponse, 400, 404, 413))
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> dict:
        """vLLM's ``/tokenize``: a prompt, or chat messages rendered as ``/v1/chat/completions`` renders them."""
        ids, strs = await preparer.tokenize(body, known(body.model, caller(request)))
        return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=documented(DetokenizeResponse, 400, 404,
                                                                                       413))
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        adapter = known(body.model, caller(request))
        vocab = client.vocab_size_for(adapter)  # wider for an adapter that adds tokens
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestError(f"tokens must be token ids in [0, {vocab})", "tokens")
        return {"prompt": await preparer.detokenize(body.tokens, adapter)}

    install_adapter_routes(app, client, policy, metrics, base_aliases, adapter_card)
    return app


def _engine_client(engine: Any) -> EngineClient:
    if isinstance(engine, EngineClient):
        return engine
    return AsyncEngine(engine if isinstance(engine, Engine) else engine.engine)  # an Engine, or an LLM
