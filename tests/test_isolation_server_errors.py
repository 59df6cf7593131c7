"""Every bad input is a 4xx with OpenAI's error body (issue 30, item 7), over real HTTP in both engine modes:
``/tokenize`` with a lone surrogate (a 500 on main), adapter configs with an invalid regex, a bad
``rank_pattern`` key, a non-numeric ``alpha_pattern``, ``layers_to_transform: ["x"]`` or 100k-deep JSON, a
rollback racing an unload (404), ``image_url`` / ``input_audio`` content parts (400 saying only text parts
are supported); and every 503 (engine stopped, server draining, ``/health``) has the same body shape, one
``type`` and a ``Retry-After``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.client.inproc import AsyncEngine
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.errors import EngineUnavailable
from loraplex.server.app import create_app
from tests.server_harness import BASE, MODES, Server, running_server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=128, max_num_seqs=4)
BAD_CONFIGS = {  # folder -> (config changes, what the message names)
    "regex": ({"target_modules": "q_proj("}, "target_modules regex is not a valid RE2 regex"),
    "rank-key": ({"rank_pattern": {"q_proj(": 2}}, "rank_pattern key 'q_proj(' is not a valid RE2 regex"),
    "alpha-text": ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern['q_proj'] must be a finite number"),
    "layers-text": ({"layers_to_transform": ["x"]}, "layers_to_transform must be a layer index or a list"),
}
DEEP = 100_000
ERROR_KEYS = ["code", "message", "param", "type"]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("root")
    for name, (changes, _) in BAD_CONFIGS.items():
        shutil.copytree(tiny_llama_adapters["r4_attn"], root / name)
        config = json.loads((root / name / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    shutil.copytree(tiny_llama_adapters["r4_attn"], root / "deep")
    (root / "deep" / "adapter_config.json").write_text("[" * DEEP + "]" * DEEP)
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), ("r2_qv",), root, mode=request.param,
                     **CONFIG) as srv:
        yield srv


def post(url: str, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert sorted(error) == ERROR_KEYS and error["code"] == status
    return error


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/tokenize", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages"),
    ("/tokenize", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
])
def test_a_lone_surrogate_is_a_400(server: Server, path: str, body: str, param: str) -> None:
    error = error_of(post(server.url, path, body), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert "lone surrogate" in error["message"]
    assert post(server.url, "/tokenize", {"model": BASE, "prompt": "ab"}).status_code == 200


@pytest.mark.parametrize("name", [*BAD_CONFIGS, "deep"])
def test_bad_adapter_configs_are_400s(server: Server, name: str) -> None:
    response = post(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(server.root / name)})
    error = error_of(response, 400)
    expected = f"nests {DEEP} levels deep, over the limit" if name == "deep" else BAD_CONFIGS[name][1]
    assert error["type"] == "invalid_request_error" and expected in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_non_text_content_parts_say_only_text_is_supported(server: Server, part: dict) -> None:
    body = {"model": BASE, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, part]}]}
    error = error_of(post(server.url, "/v1/chat/completions", body), 400)
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert f"content part 1 has type {part['type']!r}: only text content parts are supported" in error["message"]


def test_a_rollback_racing_an_unload_is_a_404(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unload lands right after the engine's rollback, before the route answers."""
    path = str(server.root / "r2_qv")
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "racy", "lora_path": path}).status_code == 200
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "racy", "lora_path": path,
                                                      "version": "new"}).status_code == 200
    client, rollback = server.engine_client, server.engine_client.rollback_adapter

    async def rollback_then_unload(name: str):  # noqa: ANN202
        info = await rollback(name)
        await client.unload_adapter(name)
        return info

    monkeypatch.setattr(client, "rollback_adapter", rollback_then_unload)
    error = error_of(post(server.url, "/v1/adapters/racy/rollback", {}), 404)
    assert error["type"] == "not_found_error" and "racy" in error["message"]
    monkeypatch.undo()
    assert "racy" not in [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    assert error_of(post(server.url, "/v1/adapters/racy/rollback", {}), 404)["type"] == "not_found_error"


def test_every_503_has_one_shape_and_retry_after(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's death (``EngineUnavailable`` from every call, as a dead engine process answers), the
    server's drain and ``/health`` of a stopped engine."""
    client = AsyncEngine(Engine(EngineConfig(model=str(tiny_llama), **CONFIG)))
    app = create_app(client, served_model_name=BASE)
    completion = {"model": BASE, "prompt": "Hi", "max_tokens": 1}

    async def dead(*args: object, **kwargs: object) -> None:
        raise EngineUnavailable("the engine is dead: the engine process exited")

    answers = []
    try:
        with running_server(app) as url:
            assert post(url, "/v1/completions", completion).status_code == 200
            monkeypatch.setattr(client, "submit_many", dead)
            monkeypatch.setattr(client, "stats", dead)
            answers.append(post(url, "/v1/completions", completion))
            answers.append(post(url, "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user",
                                                                                         "content": "Hi"}]}))
            answers.append(httpx.get(f"{url}/metrics", timeout=30))
            client.shutdown()
            health = httpx.get(f"{url}/health", timeout=30)
            app.state.lifecycle.begin_drain(5.0)
            answers.append(post(url, "/v1/completions", completion))
            drained_health = httpx.get(f"{url}/health", timeout=30)
    finally:
        client.shutdown()
    for response in answers:
        error = error_of(response, 503)
        assert error["type"] == "service_unavailable", (response.request.url, error)
        assert response.headers["retry-after"] == "1"
    for response in (health, drained_health):
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert sorted(response.json()) == ["detail", "status"]
