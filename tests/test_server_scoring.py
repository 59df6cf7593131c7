"""``POST /classify``, ``/score`` and ``/rerank`` over HTTP (vLLM's shapes, also under ``/v1``), in both engine
modes, against HF: classification probabilities are the softmax of ``AutoModelForSequenceClassification`` +
PEFT's logits on the tokenizer's ids; a cross-encoder's score is the sigmoid of its one-label head on
``tokenizer(text_1, text_2)``; an embedder's score is the cosine of HF ``AutoModel``'s embeddings. The routes
need a key as ``/v1`` does; bad bodies are 400s naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from loraplex.server.tenancy.keys import ApiKey, KeyTable
from tests.classifier_fixtures import hf_classifier_logits, write_classifier_adapter
from tests.reference import hf_embeddings
from tests.server_harness import BASE, MODES, Server, tiny_server

ADMIN, SCOPED = "sk-admin-1", "sk-relevance-only"
KEYS = KeyTable([ApiKey(key=ADMIN, tenant="ops"),
                 ApiKey(key=SCOPED, tenant="scoped", adapters=("relevance",), base_model=False, admin=False)])
LABELS = ("negative", "neutral", "positive")
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "cats sleep a lot", "the capital city of france is paris"]


@pytest.fixture(scope="module")
def classifiers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-classifiers")
    return {"sentiment": write_classifier_adapter(tiny_llama, root / "sentiment", 3, rank=8, seed=51,
                                                  class_labels=LABELS),
            "relevance": write_classifier_adapter(tiny_llama, root / "relevance", 1, rank=4, seed=52, head_std=2.0)}


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, classifiers: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, classifiers, tuple(classifiers), (), tmp_path_factory.mktemp("root"), request.param,
                     app_options={"api_keys": KEYS}, max_loras=2, max_lora_rank=16, kv_cache_blocks=128) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(tiny_llama)


def post(server: Server, path: str, body: dict, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_equals_hf(server: Server, tiny_llama: Path, classifiers: dict[str, Path], tokenizer,  # noqa: ANN001
                            path: str) -> None:
    """Texts and token ids, one result each in order: softmax of HF's logits, the most probable label by
    ``id2label``, ``num_classes``, usage counting the prompt tokens; the version header is the adapter's."""
    texts = ["a wonderful film", "dull, slow and far too long"]
    response = post(server, path, {"model": "sentiment", "input": texts})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "sentiment" and response.headers["x-loraplex-adapter-version"]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    refs = hf_classifier_logits(tiny_llama, classifiers["sentiment"], ids)
    assert [d["index"] for d in body["data"]] == [0, 1]
    for data, ref in zip(body["data"], refs, strict=True):
        probs = torch.softmax(ref.double(), 0)
        assert data["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert data["label"] == LABELS[int(probs.argmax())] and data["num_classes"] == 3
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                             "completion_tokens": 0}
    by_ids = post(server, path, {"model": "sentiment", "input": ids[0]}).json()
    assert by_ids["data"][0]["probs"] == pytest.approx(body["data"][0]["probs"], abs=1e-6)


def test_score_cross_encoder_equals_hf(server: Server, tiny_llama: Path, classifiers: dict[str, Path],
                                      tokenizer) -> None:  # noqa: ANN001
    """One ``text_1`` against a list, and two lists pairwise: sigmoid of the one-label head on HF's
    sentence-pair encoding."""
    for text_1, text_2 in ((QUERY, DOCUMENTS), ([QUERY, "cats"], DOCUMENTS[:2])):
        response = post(server, "/score", {"model": "relevance", "text_1": text_1, "text_2": text_2})
        assert response.status_code == 200, response.text
        firsts = [text_1] * len(text_2) if isinstance(text_1, str) else text_1
        ids = [tokenizer(a, b)["input_ids"] for a, b in zip(firsts, text_2, strict=True)]
        refs = hf_classifier_logits(tiny_llama, classifiers["relevance"], ids)
        data = response.json()["data"]
        assert [d["object"] for d in data] == ["score"] * len(ids)
        assert [d["score"] for d in data] == pytest.approx([sigmoid(float(r[0])) for r in refs], abs=1e-6)
    assert post(server, "/v1/score", {"model": "relevance", "text_1": QUERY, "text_2": "x"}).status_code == 200


def test_score_embedder_is_cosine_of_hf_embeddings(server: Server, tiny_llama: Path, tokenizer) -> None:  # noqa: ANN001
    """The base model has no head: it scores as an embedder, the cosine of the two texts' embeddings (the
    model's default pooling: last token, normalized)."""
    response = post(server, "/score", {"model": BASE, "text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    query = hf_embeddings(tiny_llama, None, [tokenizer(QUERY)["input_ids"]])[0]
    docs = hf_embeddings(tiny_llama, None, [tokenizer(d)["input_ids"] for d in DOCUMENTS])
    expected = [float(torch.dot(query.double(), d.double())) for d in docs]
    assert [d["score"] for d in response.json()["data"]] == pytest.approx(expected, abs=1e-5)


def test_rerank_orders_by_hf_scores(server: Server, tiny_llama: Path, classifiers: dict[str, Path],
                                   tokenizer) -> None:  # noqa: ANN001
    """Documents by descending relevance (HF's), ``top_n`` of them, with their text unless
    ``return_documents`` is false; ``usage.total_tokens`` counts every pair's tokens."""
    ids = [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]
    scores = [sigmoid(float(r[0])) for r in hf_classifier_logits(tiny_llama, classifiers["relevance"], ids)]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    response = post(server, "/rerank", {"model": "relevance", "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [r["index"] for r in body["results"]] == order[:2]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order[:2]], abs=1e-6)
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order[:2]]
    assert body["usage"]["total_tokens"] == sum(map(len, ids))
    bare = post(server, "/v1/rerank", {"model": "relevance", "query": QUERY, "documents": DOCUMENTS,
                                       "return_documents": False}).json()
    assert [r["index"] for r in bare["results"]] == order and all(r["document"] is None for r in bare["results"])


REFUSALS = [
    ("/classify", {"model": BASE, "input": "x"}, "model", "no classification head"),
    ("/classify", {"model": "sentiment", "input": []}, "input", "input"),
    ("/classify", {"model": "sentiment", "input": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens",
     "unknown field"),
    ("/score", {"model": "sentiment", "text_1": "a", "text_2": "b"}, "model", "has 3 labels"),
    ("/score", {"model": "relevance", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "equal length"),
    ("/rerank", {"model": "relevance", "query": "q", "documents": ["a"], "top_n": 0}, "top_n", "top_n"),
    ("/rerank", {"model": "relevance", "query": "q", "documents": ["word " * 5000]}, "documents", "context"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), REFUSALS)
def test_bad_bodies_are_400s_naming_the_field(server: Server, path: str, body: dict, param: str,
                                             message: str) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert server.stats().num_running == 0


def test_routes_need_a_key_and_respect_its_scope(server: Server) -> None:
    """Without a key: 401 (vLLM's paths outside /v1 run the model too); a key scoped to ``relevance`` may
    rerank with it but not classify with ``sentiment`` (404, as for any model it may not see)."""
    body = {"model": "relevance", "query": QUERY, "documents": DOCUMENTS}
    assert post(server, "/rerank", body, key=None).status_code == 401
    assert post(server, "/classify", {"model": "sentiment", "input": "x"}, key=None).status_code == 401
    assert post(server, "/rerank", body, key=SCOPED).status_code == 200
    assert post(server, "/classify", {"model": "sentiment", "input": "x"}, key=SCOPED).status_code == 404
