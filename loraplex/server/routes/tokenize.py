"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with the tokenizer of the ``model``'s current version
(an adapter's own, when it ships one), in the preparation workers."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.errors import RequestError
from loraplex.server.context import context
from loraplex.server.openai.openapi import documented
from loraplex.server.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from loraplex.server.openai.schemas import DetokenizeResponse, TokenizeResponse

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=documented(TokenizeResponse, 400, 404, 413))
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> dict:
    """A prompt, or chat messages rendered as ``/v1/chat/completions`` renders them."""
    ctx = context(request)
    ids, strs = await ctx.preparer.tokenize(body, ctx.current(request, body.model))
    return {"count": len(ids), "max_model_len": ctx.client.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=documented(DetokenizeResponse, 400, 404, 413))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    ctx = context(request)
    version = ctx.current(request, body.model)
    if any(not 0 <= t < version.vocab_size for t in body.tokens):  # wider for an adapter that adds tokens
        raise RequestError(f"tokens must be token ids in [0, {version.vocab_size})", "tokens")
    return {"prompt": await ctx.preparer.detokenize(body.tokens, version)}
