"""Embedding clients against ``loraplex serve``: the ``openai`` SDK's ``embeddings.create`` (base64 by default,
and float), LangChain's ``OpenAIEmbeddings`` (``check_embedding_ctx_length=False``: by default it tokenizes with
tiktoken, OpenAI's vocabulary, and sends token ids this model does not have) and litellm's ``embedding()``; each
equals HF ``AutoModel`` (+ PEFT) last-token embeddings, normalized."""

from __future__ import annotations

import os

import openai
import pytest
import torch
from langchain_openai import OpenAIEmbeddings
from transformers import AutoTokenizer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price map: no fetch from GitHub
import litellm  # noqa: E402  (reads the variable at import)

from tests.clients.conftest import ADAPTER, Served  # noqa: E402
from tests.reference import hf_embeddings  # noqa: E402

TEXTS = ["retrieval needs embeddings", "of the same adapters"]


def expected(served: Served, adapter: bool) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(served.model)
    return hf_embeddings(served.model, served.adapter if adapter else None, [tokenizer.encode(t) for t in TEXTS])


def assert_close(ours: list[list[float]], refs: list[torch.Tensor]) -> None:
    assert len(ours) == len(refs)
    for got, ref in zip(ours, refs, strict=True):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), ref, rtol=0.0,
                                   atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("encoding_format", [openai.NOT_GIVEN, "float"])
def test_openai_sdk_embeddings_create(served: Served, encoding_format: object) -> None:
    client = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)
    for model, adapter in ((served.base, False), (ADAPTER, True)):
        response = client.embeddings.create(model=model, input=TEXTS, encoding_format=encoding_format)
        assert response.model == model and response.usage.prompt_tokens > 0
        assert_close([d.embedding for d in response.data], expected(served, adapter))


def test_langchain_openai_embeddings(served: Served) -> None:
    embedder = OpenAIEmbeddings(model=ADAPTER, base_url=served.v1, api_key="unused", check_embedding_ctx_length=False,
                                max_retries=0, timeout=60)
    refs = expected(served, adapter=True)
    assert_close(embedder.embed_documents(TEXTS), refs)
    assert_close([embedder.embed_query(TEXTS[0])], refs[:1])


def test_litellm_embedding(served: Served) -> None:
    response = litellm.embedding(model=f"openai/{served.base}", input=TEXTS, api_base=served.v1, api_key="unused",
                                 num_retries=0, timeout=60)
    assert_close([d["embedding"] for d in response.data], expected(served, adapter=False))
