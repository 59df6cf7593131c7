"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, with the tokenizer of the
``model``'s current version (an adapter's own, when it ships one); the first two in the preparation workers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from loraplex.errors import RequestError
from loraplex.server.context import context
from loraplex.server.openai.openapi import documented
from loraplex.server.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from loraplex.server.openai.schemas import DetokenizeResponse, TokenizeResponse, TokenizerInfo

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=documented(TokenizeResponse, 400, 404, 413))
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> dict:
    """A prompt, or chat messages rendered as ``/v1/chat/completions`` renders them."""
    ctx = context(request)
    ids, strs = await ctx.preparer.tokenize(body, ctx.current(request, body.model or ctx.base_name))
    return {"count": len(ids), "max_model_len": ctx.client.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=documented(DetokenizeResponse, 400, 404, 413))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    ctx = context(request)
    version = ctx.current(request, body.model or ctx.base_name)
    if any(not 0 <= t < version.vocab_size for t in body.tokens):  # wider for an adapter that adds tokens
        raise RequestError(f"tokens must be token ids in [0, {version.vocab_size})", "tokens")
    return {"prompt": await ctx.preparer.detokenize(body.tokens, version)}


def _json_safe(value: Any) -> Any:
    """vLLM's conversion: an added token is its text; mappings and lists element-wise; anything else that JSON
    cannot carry, its ``str``."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """vLLM's ``GET /tokenizer_info`` body: the tokenizer's ``init_kwargs`` (its ``tokenizer_config.json``)
    without file paths, plus ``tokenizer_class`` and the chat template it renders with."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for path_field in ("vocab_file", "merges_file"):  # as vLLM
        config.pop(path_field, None)
    config = _json_safe(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses=documented(TokenizerInfo, 400, 404))
async def tokenizer_info(request: Request, model: str | None = None) -> dict:
    """The tokenizer of ``model`` (default: the base model), as vLLM serves it (lm-eval's remote tokenizer)."""
    ctx = context(request)
    return tokenizer_config(ctx.current(request, model or ctx.base_name).tokenizer)
