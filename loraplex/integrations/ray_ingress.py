"""``Ingress``: the one HTTP entry of a Ray Serve deployment. It parses no protocol: it reads the
``model`` field of a completion or chat body, forwards the raw request to an engine replica with
that adapter as Serve's multiplexed model id (so Serve prefers a replica already holding it), and
relays the replica's response (server-sent events included) as it arrives.

Failures: if the replica dies before it sent anything, the request is re-sent (``retries`` times)
to another replica, then answered with a 503; if it dies mid-stream, the stream ends with an
OpenAI error event and ``data: [DONE]``. No request waits on a dead replica.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from loraplex.integrations.asgi_bridge import ForwardedRequest, ResponseStart
from loraplex.integrations.ray_config import RayServeConfig
from loraplex.server.openai.errors import error_body, error_response
from loraplex.server.tenancy.access import BearerAuthMiddleware
from loraplex.server.tenancy.keys import KeyTable

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
RUNTIME_LOADING = (
    "loraplex serve-ray loads adapters lazily on each replica: put the PEFT adapter folder at "
    "<adapter root>/NAME (start with --adapter-root DIR) and send model=NAME; "
    "/v1/load_lora_adapter and /v1/unload_lora_adapter are not available"
)


def routing_key(request: ForwardedRequest, base_names: frozenset[str]) -> str:
    """The multiplexed model id for ``request``: the adapter its ``model`` field names, or "" (any
    replica) for the base model, other endpoints and bodies the replica will reject anyway."""
    if request.method != "POST" or request.path not in GENERATION_PATHS:
        return ""
    try:
        model = json.loads(request.body).get("model")
    except (ValueError, AttributeError):
        return ""
    return model if isinstance(model, str) and model not in base_names else ""


@serve.ingress()
class Ingress:
    def __init__(self, engines: DeploymentHandle, config: RayServeConfig) -> None:
        self.engines = engines
        self.config = config
        self.base_names = config.base_model_names

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="loraplex on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)
        if self.config.api_key:
            app.add_middleware(BearerAuthMiddleware, keys=KeyTable.single(self.config.api_key))

        @app.post("/v1/load_lora_adapter")
        @app.post("/v1/unload_lora_adapter")
        async def runtime_loading() -> Response:
            return error_response(403, RUNTIME_LOADING)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
        async def forward(request: Request) -> Response:
            return await self.forward(request)

        return app

    async def forward(self, request: Request) -> Response:
        client = request.scope.get("client")
        forwarded = ForwardedRequest(
            method=request.method, path=request.url.path, query_string=request.scope.get("query_string", b""),
            headers=tuple(request.scope["headers"]), body=await request.body(),
            client=tuple(client) if client else None,
        )
        key = routing_key(forwarded, self.base_names)
        failure: RayActorError | None = None
        for attempt in range(self.config.retries + 1):
            stream = self.engines.options(stream=True, multiplexed_model_id=key).handle_http.remote(forwarded)
            try:
                start = await stream.__anext__()
            except RayActorError as exc:
                failure = exc
                logger.warning("engine replica failed before answering %s %s (attempt %d): %s",
                               forwarded.method, forwarded.path, attempt + 1, exc)
                continue
            except StopAsyncIteration:
                return error_response(502, "the engine replica closed the response without answering")
            assert isinstance(start, ResponseStart)
            response = StreamingResponse(_relay(stream, start), status_code=start.status)
            response.raw_headers = list(start.headers)
            return response
        return error_response(503, f"every engine replica tried failed before answering "
                                   f"({self.config.retries + 1} attempt(s)): {type(failure).__name__}; "
                                   "retry the request")


async def _relay(stream: DeploymentResponseGenerator, start: ResponseStart) -> AsyncIterator[bytes]:
    """The body chunks; a replica failure mid-body ends a server-sent event stream with an error
    event. Stopping early (the client left) cancels the replica's generator, aborting the request."""
    try:
        async for chunk in stream:
            yield chunk
    except RayActorError as exc:
        logger.warning("engine replica failed mid-response: %s", exc)
        if (start.header("content-type") or "").startswith("text/event-stream"):
            message = f"the engine replica serving this request failed mid-stream ({type(exc).__name__}); retry it"
            yield f"data: {json.dumps(error_body(message, 'internal_error', None, 503))}\n\n".encode()
            yield b"data: [DONE]\n\n"
    finally:
        stream.cancel()
