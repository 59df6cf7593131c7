"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (both streamable).

One path for both: parse the body in a worker → route its ``model`` to a version once
(``ServerContext.route``) → prepare the prompts with that version's tokenizer and chat template (a worker
again) → admit the caller's lease (tenant limits) → ``run_generation`` submits every choice on that
version and answers whole or as server-sent events.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loraplex.client.directory import Version
from loraplex.engine.request import RequestTags, SamplingParams
from loraplex.server.context import context
from loraplex.server.generation import Generation, run_generation
from loraplex.server.openai.openapi import GENERATION_ERRORS, documented
from loraplex.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.openai.reasoning import REASONING_PARSERS
from loraplex.server.openai.responses import ResponseBuilder
from loraplex.server.openai.schemas import ChatCompletionResponse, CompletionResponse
from loraplex.server.openai.tool_parsers import ToolParser, parser_for
from loraplex.server.prepare.worker import Prepared
from loraplex.server.tenancy.access import caller
from loraplex.server.tenancy.quotas import Demand

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


router = APIRouter()


def demand(prompts: list[list[int]], params: SamplingParams, max_model_len: int) -> Demand:
    """What a request may take at most: its prompts, each choice's ``max_tokens`` (capped by the rest of the
    context), one engine seat per choice of each prompt."""
    most = sum(params.n * max(0, min(params.max_tokens, max_model_len - len(p))) for p in prompts)
    return Demand(sum(len(p) for p in prompts), most, params.n * len(prompts))


def tenancy(request: Request, body: Any, prepared: Prepared, params: SamplingParams) -> dict[str, Any]:
    """The caller's ``Generation`` fields: tenant and priority, and a lease within its limits (else 429;
    ``run_generation`` ends it)."""
    key, ctx = caller(request), context(request)
    lease = ctx.quotas.admit(key, demand(prepared.prompt_token_ids, params, ctx.client.max_model_len))
    return {"tags": RequestTags(key.tenant, body.priority or 0), "on_end": lease.release}


def auto_tool_parser(request: Request, version: Version) -> ToolParser:
    """``tool_choice: "auto"``'s parser: ``--tool-call-parser``, else the format of the version's template."""
    template = getattr(version.tokenizer, "chat_template", None)
    return parser_for(getattr(request.app.state, "tool_call_parser", None), template)


@router.post("/v1/completions", response_model=None,
             responses=documented(CompletionResponse, *GENERATION_ERRORS, stream=True))
async def completions(request: Request) -> Response:
    arrived_ns, ctx = time.time_ns(), context(request)
    parsed = await ctx.preparer.parse_completion(await request.body())
    body: CompletionRequest = parsed.body
    version = await ctx.route_body(request, body.model, body.lora_scale, body.mix())
    prepared = await ctx.preparer.completion(parsed, version, COMPLETION_DEFAULT_MAX_TOKENS)
    params = body.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
    gen = Generation(
        builder=ResponseBuilder(chat=False, model=body.model, tokens=ctx.token_texts(version), n=params.n,
                                echo=bool(body.echo), prompt_texts=prepared.prompt_texts,
                                show_prompt_logprobs=body.prompt_logprobs is not None),
        prompts=prepared.prompt_token_ids, params=params, version=version, stream=bool(body.stream),
        include_usage=body.include_usage, field_of=body.field_of, user=body.user,
        **tenancy(request, body, prepared, params), arrived_ns=arrived_ns,
    )
    return await run_generation(ctx.client, ctx.metrics, gen, request, ctx.lifecycle)


@router.post("/v1/chat/completions", response_model=None,
             responses=documented(ChatCompletionResponse, *GENERATION_ERRORS, stream=True))
async def chat_completions(request: Request) -> Response:
    arrived_ns = time.time_ns()
    return await chat_response(request, await request.body(), arrived_ns)


async def chat_response(request: Request, raw: bytes, arrived_ns: int) -> Response:
    """The chat completion of the body ``raw`` (``/v1/responses`` runs through here too), which arrived at
    ``arrived_ns`` (``time.time_ns()``: the trace's start)."""
    ctx = context(request)
    parsed = await ctx.preparer.parse_chat(raw)
    body: ChatCompletionRequest = parsed.body
    version: Version = await ctx.route_body(request, body.model, body.lora_scale, body.mix())
    prepared = await ctx.preparer.chat(parsed, version)  # the version's own chat template
    prompt_ids = prepared.prompt_token_ids[0]
    params = body.sampling_params(max(ctx.client.max_model_len - len(prompt_ids), 1))  # default: the rest
    gen = Generation(
        builder=ResponseBuilder(chat=True, model=body.model, tokens=ctx.token_texts(version), n=params.n,
                                show_prompt_logprobs=body.prompt_logprobs is not None,
                                tool_parser=body.tool_parser(auto_tool_parser(request, version)),
                                reasoning_parser=REASONING_PARSERS.get(request.app.state.reasoning_parser or "")),
        prompts=[prompt_ids], params=params, version=version, stream=bool(body.stream),
        include_usage=body.include_usage, field_of=body.field_of, user=body.user or body.safety_identifier,
        **tenancy(request, body, prepared, params), arrived_ns=arrived_ns,
    )
    return await run_generation(ctx.client, ctx.metrics, gen, request, ctx.lifecycle)
