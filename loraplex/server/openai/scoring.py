"""vLLM's classification, scoring and reranking bodies (``POST /classify``, ``/score``, ``/rerank``, also under
``/v1``) and their responses.

- ``/classify``: ``input`` one text, texts, token ids or lists of them; each is classified by the model's
  classification head (a PEFT ``SEQ_CLS`` adapter's ``score``): ``probs = softmax(logits)``, ``label`` the most
  probable class's name.
- ``/score``: ``text_1`` and ``text_2``, each a text or a list of texts: one text against each of a list (on
  either side), or two lists of equal length pairwise. ``/rerank``: ``query`` against each of ``documents``,
  the ``top_n`` best first. A model with a classification head scores a pair as a cross-encoder: the pair
  tokenized together (``tokenizer(text_1, text_2)``, HF's sentence-pair encoding), ``score = sigmoid(logit)`` of
  its one-label head. A model without one scores as an embedder: ``score = cos(e_1, e_2)`` of the two texts' embeddings.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from loraplex.errors import RequestError
from loraplex.server.openai.embeddings import EmbeddingInput, EmbeddingRequest
from loraplex.server.openai.protocol import Int, _Body, prompt_list

PairInput = str | tuple[str, str] | list[int]  # a text, a (text_1, text_2) pair, or token ids
ListOrText = str | list[str]
_TEXTS = {"minLength": 1, "minItems": 1, "items": {"type": "string", "minLength": 1}}


class ClassificationRequest(_Body):
    """vLLM's ``/classify`` body: ``input`` one text, texts, token ids or lists of them (one result each)."""

    unimplemented: ClassVar = {}
    model: str
    input: EmbeddingInput = Field(json_schema_extra={"minLength": 1, "minItems": 1,
                                                     "items": {"minLength": 1, "minItems": 1}})
    user: str | None = None  # an end-user id: accepted, it changes nothing in the answer
    priority: Int | None = None  # vLLM's: lower is admitted first, within the caller's tenant

    def inputs(self) -> list[PairInput]:
        return list(prompt_list(self.input, "input"))

    def light(self) -> ClassificationRequest:
        """This body with its inputs emptied (a process worker reads them again from the raw bytes)."""
        return self.model_copy(update={"input": ""})


class ScoreRequest(_Body):
    """vLLM's ``/score`` body: ``text_1`` against ``text_2`` (see the module docstring for the pairing)."""

    unimplemented: ClassVar = {}
    model: str
    text_1: ListOrText = Field(json_schema_extra=_TEXTS)
    text_2: ListOrText = Field(json_schema_extra=_TEXTS)
    user: str | None = None
    priority: Int | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """The (text_1, text_2) pairs scored, in the response's order."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not first or not second:
            raise RequestError(f"{'text_1' if not first else 'text_2'} is empty", "text_1" if not first else "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(second) == 1:
            second = second * len(first)
        if len(first) != len(second):
            raise RequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text on either "
                               "side, or lists of equal length (scored pairwise)", "text_2")
        return list(zip(first, second, strict=True))

    def light(self) -> ScoreRequest:
        """Kept whole: the route maps scores back to its pairs (and a rerank answers with the documents)."""
        return self


class RerankRequest(_Body):
    """vLLM's (Jina's, Cohere's) ``/rerank`` body: ``query`` against each of ``documents``; ``top_n`` best kept
    (all without it), with their text unless ``return_documents`` is false."""

    unimplemented: ClassVar = {}
    model: str
    query: str = Field(json_schema_extra={"minLength": 1})
    documents: list[str] = Field(json_schema_extra={"minItems": 1, "items": {"type": "string", "minLength": 1}})
    top_n: Int | None = Field(None, json_schema_extra={"minimum": 1})
    return_documents: bool = True
    user: str | None = None
    priority: Int | None = None

    def pairs(self) -> list[tuple[str, str]]:
        if not self.documents:
            raise RequestError("documents is empty", "documents")
        if self.top_n is not None and self.top_n < 1:
            raise RequestError(f"top_n must be at least 1, got {self.top_n}", "top_n")
        return [(self.query, document) for document in self.documents]

    def light(self) -> RerankRequest:
        """Kept whole: the route maps scores back to its pairs (and a rerank answers with the documents)."""
        return self


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


def _usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}


def classification_response(model: str, probs: list[list[float]], class_labels: tuple[str, ...],
                            prompt_tokens: int) -> dict:
    """The ``ClassificationResponse`` body: per input its class probabilities and most probable label."""
    data = [{"index": i, "label": class_labels[max(range(len(p)), key=p.__getitem__)], "probs": p,
             "num_classes": len(p)} for i, p in enumerate(probs)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(prompt_tokens)}


def score_response(model: str, scores: list[float], prompt_tokens: int) -> dict:
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(prompt_tokens)}


def rerank_response(body: RerankRequest, scores: list[float], prompt_tokens: int) -> dict:
    """The ``RerankResponse`` body: documents by descending score (ties keep their order), ``top_n`` of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                "document": {"text": body.documents[i]} if body.return_documents else None} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model, "results": results,
            "usage": {"total_tokens": prompt_tokens}}


PoolingBody = EmbeddingRequest | ClassificationRequest | ScoreRequest | RerankRequest
POOLING_BODIES: dict[str, type[PoolingBody]] = {"embeddings": EmbeddingRequest, "classify": ClassificationRequest,
                                                "score": ScoreRequest, "rerank": RerankRequest}


def input_field(body: PoolingBody) -> str:
    """The body field an input's refusal names."""
    return {ScoreRequest: "text_2", RerankRequest: "documents"}.get(type(body), "input")


def score_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """The distinct texts of ``pairs`` in first-seen order: what an embedder embeds to score them."""
    return list(dict.fromkeys(text for pair in pairs for text in pair))


def pooled_inputs(body: PoolingBody, cross_encoder: bool) -> list[PairInput]:
    """What the engine pools for ``body``, in order: its inputs (embeddings, classify); for score and rerank the
    pairs themselves under a cross-encoder (a model with a classification head), else their distinct texts."""
    if isinstance(body, (EmbeddingRequest, ClassificationRequest)):
        return list(body.inputs())
    pairs = body.pairs()
    return list(pairs) if cross_encoder else list(score_texts(pairs))


def complete_scoring_schema(schemas: dict, base_name: str, vocab: int, heads: dict[str, int | None] | None) -> None:
    """The pooling bodies as the server answers: ``/classify``'s token ids below ``vocab``; its ``model`` an
    adapter with a classification head, ``/score`` and ``/rerank``'s the base model, an adapter without one or one
    with a one-label head. ``heads``: each served adapter's number of classes (None: no head); None when names
    must not be listed."""
    if "ClassificationRequest" in schemas:
        props = schemas["ClassificationRequest"]["properties"]
        token = {"minimum": 0, "maximum": vocab - 1, "description": "A token id below the vocabulary of the model "
                 "named, else 400."}
        props["input"]["items"] = {**props["input"]["items"], **token, "items": token}
        props["input"]["description"] = "Each input's tokens must fit the context, else 400."
    if heads is None:
        return
    classifiers = [name for name, n in heads.items() if n is not None]
    scorers = [base_name, *(name for name, n in heads.items() if n in (None, 1))]
    why = "Another model is a 400 (no classification head, or one with several labels) or a 404."
    if "ClassificationRequest" in schemas:
        schemas["ClassificationRequest"]["properties"]["model"] = (
            {"type": "string", "enum": classifiers, "description": why} if classifiers else
            {"type": "string", "description": "No served model has a classification head: any model is a 400."})
    for model in ("ScoreRequest", "RerankRequest"):
        if model in schemas:
            schemas[model]["properties"]["model"] = {"type": "string", "enum": scorers, "description": why}
