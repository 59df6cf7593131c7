"""Every user error gets OpenAI's error body with the right status, type and param, never a 500;
after them the server still serves. Auth on and off; runtime loading off; adapter-root escapes."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loraplex.server.app import create_app
from tests.fixtures import write_peft_adapter
from tests.server_harness import BASE, MODES, Server, running_server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=64, max_num_seqs=4)
LONG_PROMPT = list(range(100, 700))  # 600 token ids: longer than the tiny model's 512 positions


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """In both engine modes: ``loraplex serve``'s (the engine process and a preparation worker) and in-process."""
    base = tmp_path_factory.mktemp("errors")
    root = base / "root"
    root.mkdir()
    shutil.copytree(tiny_llama_adapters["r2_qv"], base / "outside")  # a valid adapter beside the root
    (root / "escape").symlink_to(base / "outside", target_is_directory=True)
    write_peft_adapter(tiny_llama, root / "rank32", rank=32, target_modules=("q_proj",))
    (root / "not-an-adapter").mkdir()
    (root / "bad-config").mkdir()
    (root / "bad-config" / "adapter_config.json").write_text("{ not json")
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), ("r4_attn",), root, mode=request.param,
                     **CONFIG) as srv:
        yield srv


def assert_error(response: httpx.Response, status: int, error_type: str, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == (error_type, param), error
    assert error["message"]
    return error


COMPLETION = {"model": BASE, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

# (path, body, status, error type, param)
BAD_REQUESTS = [
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 600}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {**COMPLETION, "temperature": 2.5}, 400, "invalid_request_error", "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": -0.1}, 400, "invalid_request_error", "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "invalid_request_error", "top_p"),
    ("/v1/completions", {**COMPLETION, "top_p": 1.5}, 400, "invalid_request_error", "top_p"),
    ("/v1/completions", {**COMPLETION, "top_k": -3}, 400, "invalid_request_error", "top_k"),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "invalid_request_error", "n"),
    ("/v1/completions", {**COMPLETION, "n": 129}, 400, "invalid_request_error", "n"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, 400, "invalid_request_error", "logprobs"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 2.5}, 400, "invalid_request_error", "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 0}, 400, "invalid_request_error", "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, 400, "invalid_request_error", "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"49152": 1}}, 400, "invalid_request_error", "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "invalid_request_error", "logit_bias"),
    ("/v1/completions", {**COMPLETION, "min_tokens": -5}, 400, "invalid_request_error", "min_tokens"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [49152]}, 400, "invalid_request_error", "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, 400, "invalid_request_error", "best_of"),
    ("/v1/completions", {**COMPLETION, "suffix": "x"}, 400, "invalid_request_error", "suffix"),
    ("/v1/completions", {**COMPLETION, "frobnicate": 1}, 400, "invalid_request_error", "frobnicate"),
    ("/v1/completions", {**COMPLETION, "include_stop_str_in_output": True}, 400, "invalid_request_error",
     "include_stop_str_in_output"),
    ("/v1/completions", {**COMPLETION, "seed": 1.5}, 400, "invalid_request_error", "seed"),
    ("/v1/completions", {**COMPLETION, "seed": "7"}, 400, "invalid_request_error", "seed"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, 400, "invalid_request_error", "stop"),
    ("/v1/completions", {**COMPLETION, "prompt": LONG_PROMPT}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": "word " * 600}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [10**9]}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", ""]}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "word " * 600]}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {"model": BASE}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {"prompt": "Hello"}, 400, "invalid_request_error", "model"),
    ("/v1/completions", {**COMPLETION, "model": "nope"}, 404, "not_found_error", "model"),
    ("/v1/completions", {**COMPLETION, "stream": True, "model": "nope"}, 404, "not_found_error", "model"),
    ("/v1/completions", {**COMPLETION, "stream": True, "top_p": 7}, 400, "invalid_request_error", "top_p"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "invalid_request_error", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "invalid_request_error", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "invalid_request_error", "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "invalid_request_error", "temperature"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "not_found_error", "model"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "invalid_request_error", "n"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "invalid_request_error", "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "invalid_request_error",
     "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, 400, "invalid_request_error",
     "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, 400, "invalid_request_error", "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "invalid_request_error", "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, 400, "invalid_request_error", "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, 400, "invalid_request_error", "echo"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]}, 400,
     "invalid_request_error", "messages"),
    ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "not_found_error", None),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "invalid_request_error", "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "r4_attn"}, 400, "invalid_request_error",
     "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "r8_all", "lora_path": "r4_attn"}, 409, "conflict_error", None),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"}, 404, "not_found_error", None),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "not-an-adapter"}, 404, "not_found_error", None),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "bad-config"}, 400, "invalid_request_error", None),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "rank32"}, 400, "invalid_request_error", None),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "escape"}, 403, "permission_error", "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "escape/../../outside"}, 403, "permission_error",
     "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../outside"}, 403, "permission_error", "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nul\x00byte"}, 404, "not_found_error", "lora_path"),
]


@pytest.mark.parametrize(("path", "body", "status", "error_type", "param"), BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, *_) in enumerate(BAD_REQUESTS)])
def test_bad_request(server: Server, path: str, body: dict, status: int, error_type: str,
                     param: str | None) -> None:
    if "lora_path" in body:  # relative names are folders in (or, with ../, beside) the adapter root
        body = {**body, "lora_path": os.path.join(server.root, body["lora_path"])}
    error = assert_error(httpx.post(server.url + path, json=body, timeout=30), status, error_type, param)
    if body.get("lora_path", "").endswith("rank32"):
        assert "rank" in error["message"] and "32" in error["message"]


def test_escapes_reach_a_valid_adapter(server: Server) -> None:
    """The folder both 403 cases reach is a valid adapter: only the root policy refuses it."""
    outside = server.root.parent / "outside"
    assert (server.root / "escape").resolve() == (server.root / ".." / "outside").resolve() == outside.resolve()
    app = create_app(server.engine_client, served_model_name=BASE, allow_runtime_adapters=True)  # no roots
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "outside", "lora_path": str(outside)})
        assert r.status_code == 200, r.text
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "outside"}).status_code == 200


@pytest.mark.parametrize(("path", "content", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/load_lora_adapter", b"\xff\xfe", 400, None),
])
def test_malformed_body(server: Server, path: str, content: bytes, status: int, param: str | None) -> None:
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert_error(r, status, "invalid_request_error", param)


def test_unknown_route_and_method(server: Server) -> None:
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404, "not_found_error", None)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405, "invalid_request_error", None)
    # one path served by a route per method: the 405 names every method served there
    wrong_method = httpx.put(f"{server.url}/v1/responses/resp_x")
    assert_error(wrong_method, 405, "invalid_request_error", None)
    assert wrong_method.headers["allow"] == "DELETE, GET"


def test_operation_ids_are_unique(server: Server) -> None:
    spec = httpx.get(f"{server.url}/openapi.json").json()
    ids = [op["operationId"] for path in spec["paths"].values() for op in path.values() if "operationId" in op]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_still_serving_after_errors(server: Server) -> None:
    for path, body, *_ in BAD_REQUESTS[:5]:
        httpx.post(server.url + path, json=body, timeout=30)
    out = server.client().completions.create(model="r8_all", prompt="Hello", max_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    chat = server.client().chat.completions.create(model=BASE, messages=CHAT["messages"], max_tokens=2,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 2


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"top_k": 10**12},
                                     {"seed": -1}, {"seed": 2**64 - 1}, {"seed": 2**70}, {"seed": -(2**90)},
                                     {"stop": ["x" * 10_000] * 50}])
def test_extreme_valid_values_are_served(server: Server, extreme: dict) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={**COMPLETION, "max_tokens": 3, "ignore_eos": True, **extreme})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_openai_client_sees_typed_errors(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="x", temperature=9)
    assert info.value.body["param"] == "temperature"


def test_auth(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a key (argument or $LORAPLEX_API_KEY) every /v1 call needs it; /health stays open."""
    monkeypatch.setenv("LORAPLEX_API_KEY", "env-key")
    for key, app in (("secret", create_app(server.engine_client, served_model_name=BASE, api_key="secret")),
                     ("env-key", create_app(server.engine_client, served_model_name=BASE))):
        with running_server(app) as url:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401, "authentication_error", None)
                r = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=headers)
                assert_error(r, 401, "authentication_error", None)
            assert httpx.get(f"{url}/health").status_code == 200
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            assert client.completions.create(model=BASE, prompt="Hi", max_tokens=2).usage.completion_tokens <= 2
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    # Auth off: the module's server takes calls without any header.
    assert httpx.get(f"{server.url}/v1/models").status_code == 200


def test_runtime_loading_disabled(server: Server) -> None:
    app = create_app(server.engine_client, served_model_name=BASE, allow_runtime_adapters=False)
    with running_server(app) as url:
        body = {"lora_name": "x", "lora_path": str(server.root / "r4_attn")}
        assert_error(httpx.post(f"{url}/v1/load_lora_adapter", json=body), 403, "permission_error", None)
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "r8_all"})
        assert_error(r, 403, "permission_error", None)
        assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} == {BASE, "r8_all"}


def test_error_event_format() -> None:
    """A failure after the stream started ends it with an OpenAI error event and [DONE]."""
    from loraplex.errors import AdapterContentChanged
    from loraplex.server.openai.errors import loraplex_error_event

    event = loraplex_error_event(AdapterContentChanged("adapter 'a' changed on disk"))
    assert json.loads(json.dumps(event)) == {"error": {"message": "adapter 'a' changed on disk",
                                                       "type": "conflict_error", "param": None, "code": 409}}
