"""``GET /v1/models``: the base model (when the caller's key may use it) and every loaded adapter it may use."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.server.context import context
from loraplex.server.openai.openapi import documented
from loraplex.server.openai.schemas import ModelList
from loraplex.server.tenancy.access import caller

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=documented(ModelList, 503))
async def list_models(request: Request) -> dict:
    ctx, key = context(request), caller(request)
    cards = [ctx.adapter_card(info) for info in await ctx.client.list_adapters() if key.may_use(info.name)]
    if key.base_model:
        cards.insert(0, ctx.model_card(ctx.base_name, str(ctx.client.config.model), None, ctx.started))
    return {"object": "list", "data": cards}
