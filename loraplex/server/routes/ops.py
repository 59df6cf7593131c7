"""What operators and scrapers read: ``GET /health`` (the engine's state; 503 unless it serves) and
``GET /metrics`` (Prometheus text).

``/health`` also reads the step loop's heartbeat (``EngineClient.heartbeat``): with requests open and no
step's outputs for ``--stall-timeout`` seconds (a stopped engine process, a step that never ends), it is
503 ``{"status": "stalled"}``, so a load balancer stops sending work to a server that would only queue it.
An idle engine (nothing open) is never stalled."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplex.client.base import EngineHealth
from loraplex.server.context import context
from loraplex.server.metrics import CONTENT_TYPE
from loraplex.server.openai.errors import RETRY_AFTER_503_S
from loraplex.server.openai.openapi import documented
from loraplex.server.openai.schemas import Health

router = APIRouter()
DEFAULT_STALL_TIMEOUT_S = 60.0  # a long prompt's whole prefill in one step took ~20 s on 2 cores


@router.get("/health", response_model=None, responses=documented(Health, 503))
async def health(request: Request) -> Response:
    ctx = context(request)
    state = ctx.client.health()
    pending, age = ctx.client.heartbeat()
    if state.ok and pending and age > ctx.stall_timeout:
        state = EngineHealth("stalled", f"{pending} requests are open and no engine step finished for {age:.1f} s "
                             f"(--stall-timeout {ctx.stall_timeout:g})")
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
