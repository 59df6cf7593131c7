"""The OpenAI-compatible FastAPI app: ``create_app(engine, ...)``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamable),
``GET /v1/models``, ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``, ``GET /openapi.json``,
and the playground (``GET /``, ``GET /v1/slots``: see ``loraplex.server.playground``). The ``model``
field names the base model or an adapter.
The engine's step loop runs in one background thread (see ``loraplex.engine.async_engine``),
started with the app and stopped with it.
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
from loraplex.engine.engine import Engine
from loraplex.errors import RequestError, UnknownAdapter
from loraplex.server.access import AdapterPathPolicy, BearerAuthMiddleware
from loraplex.server.errors import ServerError, install_error_handlers
from loraplex.server.generation import Generation, run_generation
from loraplex.server.metrics import CONTENT_TYPE, ServerMetrics
from loraplex.server.openapi import documented, install_openapi, reset_openapi
from loraplex.server.playground import mount_playground
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadAdapterRequest,
    render_chat,
)
from loraplex.server.responses import ResponseBuilder, TokenTexts
from loraplex.server.schemas import (
    AdapterLoaded,
    AdapterUnloaded,
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
) -> FastAPI:
    """An app serving ``engine``: an ``Engine``, an ``AsyncEngine``, or an ``LLM`` (its ``.engine`` is served).

    ``served_model_name`` defaults to ``engine.model_name``; ``api_key`` defaults to
    ``$LORAPLEX_API_KEY`` (no auth when neither is set). Runtime adapter loading is off unless
    ``allow_runtime_adapters``; ``adapter_roots`` then bound the folders it may read.
    """
    if not isinstance(engine, (Engine, AsyncEngine)):
        engine = engine.engine  # an LLM
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    core = async_engine.engine
    base_name = served_model_name or core.model_name
    base_aliases = {base_name, core.model_name, str(core.config.model)}
    policy = AdapterPathPolicy(allow_runtime_adapters, adapter_roots)
    metrics = ServerMetrics(core)
    async_engine.step_observers.append(metrics.observe_step)
    started = int(time.time())
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        owns = not async_engine.running
        async_engine.start()
        yield
        if owns:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="loraplex", lifespan=lifespan)
    install_error_handlers(app)

    def served_models() -> tuple[list[str], int]:
        """The names a request may use now, and the widest vocabulary among them (adapters may add tokens)."""
        infos = core.list_adapters()
        return [base_name, *(a.name for a in infos)], max([core.model_config.vocab_size,
                                                            *(a.vocab_size or 0 for a in infos)])

    install_openapi(app, max_model_len=core.max_model_len, auth=bool(api_key), served=served_models)
    token_texts: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()  # per tokenizer
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    mount_playground(app, core.adapter_snapshot, runtime_adapters=policy.enabled)

    def adapter_for(model: str) -> str | None:
        return None if model in base_aliases else model

    def tokenizer_for(model: str) -> Any:
        """The tokenizer serving ``model``: the adapter's own if it ships one, else the base's (404 on
        ``model`` if it is neither the base nor an adapter; 400 if the model has no tokenizer)."""
        try:
            tokenizer = core.tokenizer_for(adapter_for(model))
        except UnknownAdapter as exc:
            raise ServerError(404, f"model {model!r} not found (see GET /v1/models)", "model") from exc
        if tokenizer is None:
            raise RequestError(f"model {model!r} has no tokenizer", "model")
        return tokenizer

    def texts_for(model: str) -> TokenTexts:
        """The token strings of ``model``'s tokenizer (cached per tokenizer), for logprobs; ``.tokenizer`` is
        None for an unknown model (``run_generation`` answers it with 404) or one without a tokenizer."""
        try:
            tokenizer = core.tokenizer_for(adapter_for(model))
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

    loaded_at: dict[str, int] = {}  # adapter name -> when the API loaded it (else: server start)

    def adapter_card(info: Any) -> dict:
        return model_card(info.name, str(info.path), base_name, loaded_at.get(info.name, started))

    @app.get("/health", response_model=None, responses=documented(Health, 503))
    async def health() -> Response:
        if not async_engine.running:
            return JSONResponse({"status": "error", "detail": "step loop not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_model=None, responses=documented(None, ok_media=CONTENT_TYPE.split(";")[0]))
    async def prometheus() -> Response:
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> dict:
        infos = await asyncio.to_thread(core.list_adapters)
        cards = [model_card(base_name, str(core.config.model), None, started)]
        cards += [adapter_card(info) for info in infos]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions", response_model=None, responses=documented(CompletionResponse, 400, 404, 409,
                                                                            stream=True))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = body.prompts()
        params = body.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
        texts = texts_for(body.model)
        echoed = [p if isinstance(p, str) else tokenizer_for(body.model).decode(p) for p in prompts if body.echo]
        gen = Generation(
            builder=ResponseBuilder(chat=False, model=body.model, tokens=texts, n=params.n, echo=bool(body.echo),
                                    prompt_texts=echoed, show_prompt_logprobs=body.prompt_logprobs is not None),
            prompts=prompts,
            params=params,
            adapter=adapter_for(body.model),
            stream=bool(body.stream),
            include_usage=body.include_usage,
            prompt_param="prompt",
            user=body.user,
        )
        return await run_generation(async_engine, metrics, gen, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses=documented(ChatCompletionResponse, 400, 404, 409, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        texts = texts_for(body.model)  # the adapter's own tokenizer and chat template, if it ships them
        prompt_ids = body.prompt_ids(texts.tokenizer if texts.tokenizer is not None else core.tokenizer)
        room = max(core.max_model_len - len(prompt_ids), 1)  # default max_tokens: the rest of the context
        params = body.sampling_params(room)
        gen = Generation(
            builder=ResponseBuilder(chat=True, model=body.model, tokens=texts, n=params.n,
                                    show_prompt_logprobs=body.prompt_logprobs is not None),
            prompts=[prompt_ids],
            params=params,
            adapter=adapter_for(body.model),
            stream=bool(body.stream),
            include_usage=body.include_usage,
            prompt_param="messages",
            user=body.user or body.safety_identifier,
        )
        return await run_generation(async_engine, metrics, gen, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=documented(TokenizeResponse, 400, 404))
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's ``/tokenize``: a prompt, or chat messages rendered as ``/v1/chat/completions`` renders them."""
        tokenizer = tokenizer_for(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = render_chat(tokenizer, [m.template_message() for m in body.messages])
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=documented(DetokenizeResponse, 400, 404))
    async def detokenize(body: DetokenizeRequest) -> dict:
        tokenizer = tokenizer_for(body.model)
        vocab = core.vocab_size_for(adapter_for(body.model))  # wider for an adapter that adds tokens
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestError(f"tokens must be token ids in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/load_lora_adapter", response_model=AdapterLoaded,
              responses=documented(AdapterLoaded, 400, 403, 404, 409, 507))
    async def load_lora_adapter(body: LoadAdapterRequest) -> dict:
        path = policy.check(body.lora_path)
        if body.lora_name in base_aliases:
            raise ServerError(400, f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
        try:
            info = await async_engine.load_adapter(body.lora_name, str(path))
        except Exception:
            metrics.runtime_loads.labels("error").inc()
            raise
        metrics.runtime_loads.labels("ok").inc()
        loaded_at[body.lora_name] = int(time.time())
        reset_openapi(app)  # its name and vocabulary join the schema
        logger.info("loaded adapter %r from %s", body.lora_name, path)
        return {"status": "ok", "message": f"adapter {body.lora_name!r} loaded", **adapter_card(info)}

    @app.post("/v1/unload_lora_adapter", response_model=AdapterUnloaded,
              responses=documented(AdapterUnloaded, 400, 403, 404))
    async def unload_lora_adapter(body: UnloadAdapterRequest) -> dict:
        policy.check_enabled()
        await async_engine.unload_adapter(body.lora_name)
        reset_openapi(app)
        logger.info("unloaded adapter %r", body.lora_name)
        return {"status": "ok", "message": f"adapter {body.lora_name!r} unloaded", "id": body.lora_name}

    return app
