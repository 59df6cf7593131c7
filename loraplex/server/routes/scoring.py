"""``POST /classify``, ``/score`` and ``/rerank`` (vLLM's shapes, also under ``/v1``; see
``server/openai/scoring.py``), on ``pool_prompts`` as ``/v1/embeddings``: one routing decision, every input a
prefill-only pooling row of that version, batched with whatever else runs.

Classification, and scoring under a cross-encoder, read the routed version's classification head (its class
names come with the ``Version``; the engine applies the head the request was admitted on). Scores:
``sigmoid(logit)`` of a one-label head on the pair; without a head ``cos(e_1, e_2)`` of the texts' embeddings
under the model's pooling.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplex.client.directory import Version
from loraplex.client.output import softmax
from loraplex.engine.pooling.params import CLASSIFICATION
from loraplex.errors import RequestError
from loraplex.server.context import context
from loraplex.server.generation import VERSION_HEADER
from loraplex.server.openai.embeddings import model_pooling_params
from loraplex.server.openai.openapi import GENERATION_ERRORS, documented
from loraplex.server.openai.scoring import (
    ClassificationRequest,
    ClassificationResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    classification_response,
    input_field,
    rerank_response,
    score_response,
    score_texts,
)
from loraplex.server.routes.embeddings import pool_prompts

router = APIRouter()


def _class_labels(version: Version, model: str) -> tuple[str, ...]:
    if version.class_labels is None:
        raise RequestError(f"model {model!r} has no classification head: classification needs a SEQ_CLS adapter "
                           "(a PEFT adapter saving 'score' or 'classifier' in modules_to_save)", "model")
    return version.class_labels


def sigmoid(logit: float) -> float:
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))


def cosine(a: list[float], b: list[float]) -> float:
    """``a . b / max(||a|| ||b||, 1e-12)`` in float64."""
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / max(norms, 1e-12)


@router.post("/classify", response_model=None, responses=documented(ClassificationResponse, *GENERATION_ERRORS))
@router.post("/v1/classify", response_model=None, include_in_schema=False)
async def classify(request: Request) -> Response:
    ctx = context(request)
    parsed = await ctx.preparer.parse_pooling(await request.body(), "classify")
    body: ClassificationRequest = parsed.body
    version = await ctx.route(request, body.model)
    class_labels = _class_labels(version, body.model)
    prompts = (await ctx.preparer.pooling(parsed, version, "classify")).prompt_token_ids
    logits = await pool_prompts(request, ctx, body.model, version, prompts, CLASSIFICATION, body.priority, "input")
    if isinstance(logits, Response):
        return logits
    return JSONResponse(classification_response(body.model, [softmax(z) for z in logits], class_labels,
                                                sum(len(p) for p in prompts)), headers={VERSION_HEADER: version.label})


async def _scored(request: Request, task: str,
                  respond: Callable[[ScoreRequest | RerankRequest, list[float], int], dict]) -> Response:
    """A score or rerank body's answer: ``respond(body, one score per pair, prompt tokens)``, or the response
    that ended the request."""
    ctx = context(request)
    parsed = await ctx.preparer.parse_pooling(await request.body(), task)
    body: ScoreRequest | RerankRequest = parsed.body
    version = await ctx.route(request, body.model)
    pairs = body.pairs()
    cross_encoder = version.class_labels is not None
    if cross_encoder and len(version.class_labels) != 1:
        raise RequestError(f"model {body.model!r}'s classification head has {len(version.class_labels)} labels: "
                           "scoring needs a one-label (cross-encoder) head; /classify serves this one", "model")
    pooling = CLASSIFICATION if cross_encoder else model_pooling_params(request.app.state.pooling)
    prompts = (await ctx.preparer.pooling(parsed, version, task)).prompt_token_ids
    vectors = await pool_prompts(request, ctx, body.model, version, prompts, pooling, body.priority,
                                 input_field(body))
    if isinstance(vectors, Response):
        return vectors
    if cross_encoder:
        scores = [sigmoid(z[0]) for z in vectors]
    else:
        by_text = dict(zip(score_texts(pairs), vectors, strict=True))
        scores = [cosine(by_text[a], by_text[b]) for a, b in pairs]
    return JSONResponse(respond(body, scores, sum(len(p) for p in prompts)), headers={VERSION_HEADER: version.label})


@router.post("/score", response_model=None, responses=documented(ScoreResponse, *GENERATION_ERRORS))
@router.post("/v1/score", response_model=None, include_in_schema=False)
async def score(request: Request) -> Response:
    return await _scored(request, "score", lambda body, scores, tokens: score_response(body.model, scores, tokens))


@router.post("/rerank", response_model=None, responses=documented(RerankResponse, *GENERATION_ERRORS))
@router.post("/v1/rerank", response_model=None, include_in_schema=False)
async def rerank(request: Request) -> Response:
    return await _scored(request, "rerank", rerank_response)  # type: ignore[arg-type]  # a rerank body
