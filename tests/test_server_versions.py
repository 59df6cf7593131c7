"""Adapter versions as an API over real HTTP, in both engine modes: GET /v1/adapters, promotion with
"version": "new" (a request in flight finishes on the old version), rollback, weighted splits and their
errors, and every response naming the version that answered (system_fingerprint, x-loraplex-adapter-version),
each answer's text equal to that version's HF transformers + PEFT greedy text (``tests/hf_text.py``)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.models.fingerprint import checkpoint_fingerprint
from tests.hf_text import hf_complete
from tests.server_harness import BASE, MODES, Server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
PROMPT = "The capital of France is"
LONG = 400  # tokens of the mid-stream promotion's stream: it must still be running when the promotion lands
HEADER = "x-loraplex-adapter-version"


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, (), ("r4_attn", "r2_qv"), tmp_path_factory.mktemp("root"),
                     mode=request.param, **CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> dict[str | None, str]:
    """HF + PEFT's greedy text of PROMPT per adapter (None: the base); "long": LONG tokens of r4_attn."""
    out = {name: hf_complete(tiny_llama, tiny_llama_adapters.get(name), PROMPT, 24, ignore_eos=True).text
           for name in (None, "r4_attn", "r2_qv")}
    out["long"] = hf_complete(tiny_llama, tiny_llama_adapters["r4_attn"], PROMPT, LONG, ignore_eos=True).text
    return out


def post(server: Server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def complete(server: Server, model: str, **extra: object) -> httpx.Response:
    response = post(server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response


def text(response: httpx.Response) -> str:
    return response.json()["choices"][0]["text"]


def entry(server: Server, name: str) -> dict:
    listing = httpx.get(f"{server.url}/v1/adapters").json()
    assert listing["object"] == "list"
    return next(e for e in listing["data"] if e["name"] == name)


def test_versions_promote_roll_back_and_split(server: Server, reference: dict[str | None, str]) -> None:
    root = server.root
    first = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "r4_attn")})
    assert first.status_code == 200
    v1 = entry(server, "x")["current"]
    answer = complete(server, "x")
    assert answer.headers[HEADER] == v1 and text(answer) == reference["r4_attn"]
    assert answer.json()["system_fingerprint"] == entry(server, "x")["versions"][0]["content_hash"]

    again = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "r2_qv")})
    assert again.status_code == 409  # without "version": "new", as before
    with httpx.stream("POST", f"{server.url}/v1/completions", json={
            "model": "x", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True},
            timeout=60) as stream:
        assert stream.headers[HEADER] == v1
        events = stream.iter_lines()
        first = next(line for line in events if line.startswith("data: {"))  # the request is decoding
        promoted = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "x", "lora_path": str(root / "r2_qv"), "version": "new"})  # mid-stream
        running = server.stats().num_running
        chunks = [json.loads(line[6:]) for line in [first, *events] if line.startswith("data: {")]
    assert promoted.status_code == 200
    assert running == 1, "the promotion must land while the stream is still running"
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == reference["long"]  # in flight: finished on the old version
    listing = entry(server, "x")
    v2 = listing["current"]
    hashes = {v["id"]: v["content_hash"] for v in listing["versions"]}
    assert v2 != v1 and list(hashes) == [v1, v2] and hashes[v1] != hashes[v2]
    assert {c["system_fingerprint"] for c in chunks} == {hashes[v1]}
    answer = complete(server, "x")
    assert (answer.headers[HEADER], text(answer)) == (v2, reference["r2_qv"])
    assert answer.json()["system_fingerprint"] == hashes[v2]

    rolled = post(server, "/v1/adapters/x/rollback", None)
    assert rolled.status_code == 200 and rolled.json()["current"] == v1
    assert (complete(server, "x").headers[HEADER], text(complete(server, "x"))) == (v1, reference["r4_attn"])
    conflict = post(server, "/v1/adapters/x/rollback", None)
    assert conflict.status_code == 409 and "no version older" in conflict.json()["error"]["message"]

    split = post(server, "/v1/adapters/x/split", {v1: 3, v2: 1})  # weights are normalised to shares
    assert split.status_code == 200 and split.json()["split"] == {v1: 0.75, v2: 0.25}
    answers = [complete(server, "x") for _ in range(8)]
    assert Counter(a.headers[HEADER] for a in answers) == {v1: 6, v2: 2}  # smooth weighted round-robin
    for a in answers:
        version = a.headers[HEADER]
        assert text(a) == reference["r4_attn" if version == v1 else "r2_qv"]
        assert a.json()["system_fingerprint"] == hashes[version]
    served = {v["id"]: v["requests_served"] for v in entry(server, "x")["versions"]}
    assert served[v2] >= 3 and served[v1] >= 9
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200


def test_split_errors_are_precise(server: Server) -> None:
    root = server.root
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(root / "r2_qv")})
    assert loaded.status_code == 200
    current = entry(server, "y")["current"]
    cases = [({current: 1, "v999999": 1}, 404, "v999999"), ({"seven": 1}, 400, "seven"), ({current: 0}, 400, current),
             ({current: "a"}, 400, current), ({}, 400, "split"), ([current], 400, "split")]
    for body, status, param in cases:
        response = post(server, "/v1/adapters/y/split", body)
        assert response.status_code == status, (body, response.text)
        if status == 400:
            assert response.json()["error"]["param"] == param
        else:
            assert param in response.json()["error"]["message"]
    unknown = post(server, "/v1/adapters/nope/split", {current: 1})
    assert unknown.status_code == 404 and "no adapter named 'nope'" in unknown.json()["error"]["message"]
    assert post(server, "/v1/adapters/nope/rollback", None).status_code == 404
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "y"}).status_code == 200


def test_base_model_answers_with_the_checkpoint_fingerprint(server: Server, tiny_llama: Path,
                                                            reference: dict[str | None, str]) -> None:
    answer = complete(server, BASE)
    assert answer.headers[HEADER] == "base" and text(answer) == reference[None]
    assert answer.json()["system_fingerprint"] == checkpoint_fingerprint(tiny_llama)
    chat = post(server, "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 2})
    assert chat.headers[HEADER] == "base" and chat.json()["system_fingerprint"] == checkpoint_fingerprint(tiny_llama)


def test_versions_need_runtime_management(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                          tmp_path: Path) -> None:
    from loraplex.client.inproc import AsyncEngine
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine
    from loraplex.server.app import create_app
    from tests.server_harness import running_server

    engine = Engine(EngineConfig(model=str(tiny_llama), **CONFIG))
    engine.load_adapter("z", tiny_llama_adapters["r2_qv"])
    shutil.copytree(tiny_llama_adapters["r2_qv"], tmp_path / "r2_qv")
    with running_server(create_app(AsyncEngine(engine), served_model_name=BASE)) as url:
        assert httpx.post(f"{url}/v1/adapters/z/rollback").status_code == 403
        assert httpx.get(f"{url}/v1/adapters").json()["data"][0]["name"] == "z"
