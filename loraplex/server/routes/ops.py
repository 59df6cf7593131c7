"""What operators and scrapers read: ``GET /health`` (the engine's state; 503 unless it serves) and
``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplex.server.context import context
from loraplex.server.metrics import CONTENT_TYPE
from loraplex.server.openai.errors import RETRY_AFTER_503_S
from loraplex.server.openai.openapi import documented
from loraplex.server.openai.schemas import Health

router = APIRouter()


@router.get("/health", response_model=None, responses=documented(Health, 503))
async def health(request: Request) -> Response:
    state = context(request).client.health()
    if not state.ok:
        return JSONResponse({"status": state.state, "detail": state.detail}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_503_S)})
    faults = {"step_failures": state.step_failures, "last_step_error": state.last_step_error}
    return JSONResponse({"status": "ok", **(faults if state.step_failures else {})})


@router.get("/metrics", response_model=None, responses=documented(None, 503, ok_media=CONTENT_TYPE.split(";")[0]))
async def prometheus(request: Request) -> Response:
    ctx = context(request)
    stats = await ctx.client.stats()
    return Response(await asyncio.to_thread(ctx.metrics.render, stats), media_type=CONTENT_TYPE)
