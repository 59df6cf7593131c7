"""``POST /v1/embeddings`` in OpenAI's shape: the request body, its ``PoolingParams`` under the model's
pooling defaults (``models/pooling_config.py``), and the response body (float lists, or base64 of the
little-endian float32 bytes, as OpenAI's clients decode them)."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from loraplex.engine.pooling.params import PoolingParams
from loraplex.errors import RequestError
from loraplex.models.pooling_config import ModelPooling
from loraplex.server.openai.protocol import Int, _Body, prompt_list

EmbeddingInput = str | list[str] | list[Int] | list[list[Int]]


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body: ``input`` one text, texts, token ids or lists of them (one embedding each,
    in order); ``model`` the base model or an adapter; ``dimensions`` where the model allows truncation."""

    unimplemented: ClassVar = {}
    model: str
    input: EmbeddingInput = Field(json_schema_extra={"minLength": 1, "minItems": 1,
                                                     "items": {"minLength": 1, "minItems": 1}})
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Int | None = Field(None, json_schema_extra={"minimum": 1})
    user: str | None = None  # OpenAI's end-user id: accepted, it changes nothing in the answer
    priority: Int | None = None  # vLLM's: lower is admitted first, within the caller's tenant

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a text, or token ids."""
        return prompt_list(self.input, "input")

    def light(self) -> EmbeddingRequest:
        """This body with its inputs emptied (a process worker reads them again from the raw bytes)."""
        return self.model_copy(update={"input": ""})

    def pooling(self, model: ModelPooling) -> PoolingParams:
        """The body's ``PoolingParams`` under ``model``'s defaults; ``RequestError`` on ``dimensions`` where the
        model allows no truncation (or not that one), on ``model`` where its pooling is unsupported."""
        default = model_pooling_params(model)
        dims = self.dimensions
        if dims is not None:
            if not model.matryoshka:
                raise RequestError("dimensions: this model does not support truncated (Matryoshka) embeddings",
                                   "dimensions")
            if model.matryoshka_dimensions and dims not in model.matryoshka_dimensions:
                raise RequestError(f"dimensions must be one of {list(model.matryoshka_dimensions)} for this model, "
                                   f"got {dims}", "dimensions")
        params = PoolingParams(default.pooling_type, default.normalize, dims)
        params.validate(model.hidden_size)
        return params


def model_pooling_params(model: ModelPooling) -> PoolingParams:
    """The served model's pooling (type and normalization, no truncation); ``RequestError`` on ``model`` where
    its pooling is unsupported."""
    if model.pooling_type is None:
        raise RequestError(f"this model cannot serve embeddings: {model.unsupported} (the server may choose "
                           "one with --pooling last|mean|cls)", "model")
    return PoolingParams(model.pooling_type, model.normalize)


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def complete_embedding_schema(schema: dict, vocab: int, models: list[str], pooling: ModelPooling) -> None:
    """``EmbeddingRequest``'s schema as the served model answers: token ids below ``vocab``, the served names,
    and the ``dimensions`` the model allows (none, its Matryoshka list, or 1 to its hidden size)."""
    props = schema["properties"]
    props["model"]["examples"] = models
    token = {"minimum": 0, "maximum": vocab - 1, "description": "A token id below the vocabulary of the model "
             "named, else 400."}
    props["input"]["items"] = {**props["input"]["items"], **token, "items": token}
    props["input"]["description"] = "Each input's tokens must fit the context, else 400."
    if not pooling.matryoshka:
        props["dimensions"] = {"type": "null", "description": "This model does not allow truncated embeddings: "
                               "any other value is a 400."}
    elif pooling.matryoshka_dimensions:
        props["dimensions"] = {"anyOf": [{"enum": list(pooling.matryoshka_dimensions)}, {"type": "null"}]}
    elif pooling.hidden_size is not None:
        props["dimensions"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": pooling.hidden_size},
                                         {"type": "null"}]}


def encoded(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """``vector`` as the body carries it: a float list, or base64 of its float32 bytes (little-endian)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_response(model: str, vectors: list[list[float]], prompt_tokens: int,
                       encoding_format: str | None) -> dict:
    """The ``EmbeddingResponse`` body of ``vectors`` (one per input, in order)."""
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
