"""``POST /v1/embeddings``, and what every pooling route shares (``pool_prompts``): as the generation routes,
parse the body in a worker → route its ``model`` to a version once (``ServerContext.route``) → tokenize its
inputs with that version's tokenizer (a worker again) → admit the caller's lease (tenant limits: its prompt
tokens, one seat per input) → submit every input as a prefill-only pooling request on that version, in one
engine call (they are admitted together, batched with whatever else runs) → answer with one vector per input,
in order.

The pooling (type, normalization, allowed truncations) is the served model's (``app.state.pooling``: its
``sentence-transformers`` config, the causal-LM default, or ``--pooling``).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplex.client.directory import Version
from loraplex.engine.pooling.params import PoolingParams
from loraplex.engine.request import RequestTags, SamplingParams
from loraplex.errors import LoraplexError, RequestError, UnknownAdapter
from loraplex.server.context import ServerContext, context
from loraplex.server.generation import VERSION_HEADER, _collect_unless_disconnected, _Timing, model_not_found
from loraplex.server.openai.embeddings import EmbeddingRequest, EmbeddingResponse, embedding_response
from loraplex.server.openai.errors import loraplex_error_response
from loraplex.server.openai.openapi import GENERATION_ERRORS, documented
from loraplex.server.openai.scoring import input_field
from loraplex.server.tenancy.access import caller
from loraplex.server.tenancy.quotas import Demand

router = APIRouter()


async def pool_prompts(request: Request, ctx: ServerContext, body_model: str, version: Version,
                       prompts: list[list[int]], pooling: PoolingParams, priority: int | None,
                       field: str = "input") -> list[list[float]] | Response:
    """Every prompt's pooled vector on ``version`` (``PoolingParams``: an embedding, or a head's logits), in
    order; or the response that ends the request: 499 when the client left, the first failure's error. An
    engine refusal of a prompt names ``field``."""
    key, start = caller(request), time.monotonic()
    lease = ctx.quotas.admit(key, Demand(sum(len(p) for p in prompts), 0, len(prompts)))
    params = SamplingParams(max_tokens=0, pooling=pooling)
    request_id = f"pool-{time.monotonic_ns()}"
    try:
        try:
            streams = await ctx.client.submit_many([(f"{request_id}-{i}", p, params) for i, p in enumerate(prompts)],
                                                   version, RequestTags(key.tenant, priority or 0))
        except UnknownAdapter as exc:  # its version was unloaded since it was routed
            raise model_not_found(body_model) from exc
        except RequestError as exc:
            exc.param = field if exc.param == "prompt" else exc.param
            raise
        guard = ctx.lifecycle.guard(streams)
        try:
            finals = await _collect_unless_disconnected(streams, request, _Timing())
        finally:
            guard.close()
    finally:
        lease.release(0)
    if finals is None:  # the client left; its requests were aborted
        ctx.metrics.observe_request(version.name, "abort", None, None, None, tenant=key.tenant)
        return Response(status_code=499)
    for final in finals:
        ctx.metrics.observe_request(version.name, final.finish_reason or "unknown", final, None, None,
                                    tenant=key.tenant, e2e=time.monotonic() - start)
    failed = next((f.error or LoraplexError("pooling failed") for f in finals if f.embedding is None), None)
    if failed is not None:
        return loraplex_error_response(failed)
    return [f.embedding for f in finals]


@router.post("/v1/embeddings", response_model=None, responses=documented(EmbeddingResponse, *GENERATION_ERRORS))
async def embeddings(request: Request) -> Response:
    ctx = context(request)
    parsed = await ctx.preparer.parse_pooling(await request.body(), "embeddings")
    body: EmbeddingRequest = parsed.body
    version = await ctx.route(request, body.model)
    pooling = body.pooling(request.app.state.pooling)
    prompts = (await ctx.preparer.pooling(parsed, version, "embeddings")).prompt_token_ids
    vectors = await pool_prompts(request, ctx, body.model, version, prompts, pooling, body.priority,
                                 input_field(body))
    if isinstance(vectors, Response):
        return vectors
    return JSONResponse(embedding_response(body.model, vectors, sum(len(p) for p in prompts), body.encoding_format),
                        headers={VERSION_HEADER: version.label})
