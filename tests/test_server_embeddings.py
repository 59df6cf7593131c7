"""``POST /v1/embeddings`` over HTTP, in both engine modes: OpenAI's shape (every input form, float and base64,
usage), the base model or an adapter routed once, embeddings equal to HF ``AutoModel`` + PEFT's; the model's
sentence-transformers pooling config, ``dimensions`` where it allows truncation, ``--pooling``; 400s naming
the field."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from loraplex.models.pooling_config import model_pooling
from tests.fixtures import write_embedding_adapter
from tests.reference import assert_embedding_close, hf_embeddings
from tests.server_harness import BASE, MODES, tiny_server


@pytest.fixture(scope="module")
def embedders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-embedders")
    return {name: write_embedding_adapter(tiny_llama, root / name, rank=rank, seed=seed)
            for name, rank, seed in (("emb_a", 8, 21), ("emb_b", 4, 22))}


@pytest.fixture(scope="module")
def st_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_llama`` as a sentence-transformers folder: mean pooling, then Normalize; Matryoshka truncation."""
    folder = tmp_path_factory.mktemp("st") / "tiny-st"
    shutil.copytree(tiny_llama, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return folder


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, embedders: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    with tiny_server(tiny_llama, embedders, tuple(embedders), (), tmp_path_factory.mktemp("root"), request.param,
                     max_loras=2, kv_cache_blocks=128) as server:
        yield server


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)


def test_every_input_form_equals_hf_peft(server, tiny_llama: Path, embedders: dict[str, Path]) -> None:  # noqa: ANN001
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = ["a short text", "another, somewhat longer text about adapters"]
    ids = [tokenizer.encode(t) for t in texts]
    for model, adapter in ((BASE, None), ("emb_a", embedders["emb_a"]), ("emb_b", embedders["emb_b"])):
        refs = hf_embeddings(tiny_llama, adapter, ids, "last")
        for given, expected in ((texts[0], refs[:1]), (texts, refs), (ids[1], refs[1:]), (ids, refs)):
            r = post(server.url, {"model": model, "input": given})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == model
            assert [d["index"] for d in body["data"]] == list(range(len(expected)))
            for data, ref in zip(body["data"], expected, strict=True):
                assert data["object"] == "embedding"
                assert_embedding_close(data["embedding"], ref)
            tokens = sum(len(ids[i]) for i in ([0] if given == texts[0] else [1] if given == ids[1] else [0, 1]))
            assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        assert r.headers["x-loraplex-adapter-version"].startswith("v" if adapter else "base")


def test_base64_is_little_endian_float32(server) -> None:  # noqa: ANN001
    floats = post(server.url, {"model": "emb_a", "input": "same text"}).json()["data"][0]["embedding"]
    b64 = post(server.url, {"model": "emb_a", "input": "same text", "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == [struct.unpack("<f", struct.pack("<f", x))[0]
                                                              for x in floats]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": BASE, "input": "x", "dimensions": 8}, 400, "dimensions"),  # a causal LM: no truncation
    ({"model": BASE, "input": "x", "truncate_prompt_tokens": 5}, 400, "truncate_prompt_tokens"),
    ({"model": BASE, "input": []}, 400, "input"),
    ({"model": BASE, "input": ""}, 400, "input"),
    ({"model": BASE, "input": [[5, 6], [49152]]}, 400, "input"),
    ({"model": "nope", "input": "x"}, 404, "model"),
])
def test_refusals_name_the_field(server, body: dict, status: int, param: str) -> None:  # noqa: ANN001
    r = post(server.url, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_sentence_transformers_config_and_matryoshka(st_model: Path, embedders: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """Mean pooling and Normalize from modules.json; ``dimensions`` truncates (then normalizes), up to hidden."""
    pooling = model_pooling(st_model)
    assert (pooling.pooling_type, pooling.normalize, pooling.matryoshka) == ("mean", True, True)
    ids = [5, 6, 7, 8, 9, 10]
    with tiny_server(st_model, embedders, ("emb_a",), (), tmp_path, max_loras=2, kv_cache_blocks=64) as server:
        r = post(server.url, {"model": "emb_a", "input": ids, "dimensions": 16})
        assert r.status_code == 200, r.text
        ref = hf_embeddings(st_model, embedders["emb_a"], [ids], "mean", dimensions=16)[0]
        assert_embedding_close(r.json()["data"][0]["embedding"], ref)
        r = post(server.url, {"model": BASE, "input": ids, "dimensions": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_pooling_flag_overrides_the_model(tiny_llama: Path, embedders: dict[str, Path], tmp_path: Path) -> None:
    ids = [11, 12, 13, 14]
    with tiny_server(tiny_llama, embedders, (), (), tmp_path, app_options={"pooling": "cls"},
                     kv_cache_blocks=64) as server:
        r = post(server.url, {"model": BASE, "input": ids})
        assert_embedding_close(r.json()["data"][0]["embedding"], hf_embeddings(tiny_llama, None, [ids], "cls")[0])


def test_unsupported_sentence_transformers_modules(st_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "dense"
    shutil.copytree(st_model, folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = model_pooling(folder)
    assert pooling.pooling_type is None and "Dense" in pooling.unsupported
    assert pooling.overridden("last").pooling_type == "last"


def test_keys_scope_and_limits_apply(tiny_llama: Path, embedders: dict[str, Path], tmp_path: Path) -> None:
    """As generation: a key sees only its adapters (others are 404, as unknown), its inputs are engine seats
    (``max_running_requests``) and its prompt tokens count against ``tokens_per_minute`` (429)."""
    from loraplex.server.tenancy.keys import ApiKey, KeyTable

    keys = KeyTable([ApiKey("sk-emb-0123456789", "alpha", adapters=("emb_a",), base_model=False,
                            max_running_requests=2, tokens_per_minute=20)])
    with tiny_server(tiny_llama, embedders, tuple(embedders), (), tmp_path, app_options={"api_keys": keys},
                     max_loras=2, kv_cache_blocks=64) as server:
        def call(body: dict) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60,
                              headers={"Authorization": "Bearer sk-emb-0123456789"})

        assert call({"model": "emb_b", "input": [5, 6]}).status_code == 404
        assert call({"model": BASE, "input": [5, 6]}).status_code == 404
        assert call({"model": "emb_a", "input": [[5, 6], [7, 8], [9, 10]]}).status_code == 429  # 3 seats > 2
        assert call({"model": "emb_a", "input": list(range(5, 17))}).status_code == 200  # 12 tokens
        assert call({"model": "emb_a", "input": list(range(5, 17))}).status_code == 429  # 24 > 20 a minute
