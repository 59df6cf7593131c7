"""``GET /v1/models``: the base model (when the caller's key may use it) and every loaded adapter it may use;
``GET /v1/models/{id}``: one of them (404 with OpenAI's body for any other name)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.server.context import context
from loraplex.server.generation import model_not_found
from loraplex.server.openai.openapi import documented
from loraplex.server.openai.schemas import ModelCard, ModelList
from loraplex.server.tenancy.access import caller

router = APIRouter()


async def _cards(request: Request) -> list[dict]:
    ctx, key = context(request), caller(request)
    cards = [ctx.adapter_card(info) for info in await ctx.client.list_adapters() if key.may_use(info.name)]
    if key.base_model:
        cards.insert(0, ctx.model_card(ctx.base_name, str(ctx.client.config.model), None, ctx.started))
    return cards


@router.get("/v1/models", response_model=ModelList, responses=documented(ModelList, 503))
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": await _cards(request)}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=documented(ModelCard, 404, 503))
async def retrieve_model(model_id: str, request: Request) -> dict:
    """The card ``GET /v1/models`` lists for ``model_id`` (any of the base model's names gives the base's)."""
    ctx = context(request)
    wanted = ctx.base_name if ctx.adapter_for(model_id) is None else model_id
    card = next((c for c in await _cards(request) if c["id"] == wanted), None)
    if card is None:
        raise model_not_found(model_id)
    return card
