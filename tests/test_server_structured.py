"""Structured outputs over HTTP: the official client's ``chat.completions.parse(response_format=Model)``;
``response_format`` (json_object, json_schema) on chat and completions; vLLM's ``structured_outputs`` and
``guided_*``; streamed deltas; n choices; a free request's output unchanged by constrained neighbours; a
bad constraint is a 400 naming the field the client sent, before anything is queued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.server_harness import BASE, MODES, Server, tiny_server
from tests.structured_schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """In both engine modes: ``loraplex serve``'s (the engine process and a preparation worker) and in-process."""
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), (), tmp_path_factory.mktemp("root"),
                     mode=request.param, max_loras=2, max_lora_rank=16, kv_cache_blocks=256,
                     max_num_seqs=16) as srv:
        yield srv


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)


@pytest.mark.parametrize("model", [BASE, "r8_all"])
def test_official_client_parse_with_a_pydantic_model(server: Server, model: str) -> None:
    completion = server.client().chat.completions.parse(model=model, messages=MESSAGES, response_format=Person,
                                                        max_tokens=200, temperature=0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person) and Person.model_validate_json(message.content) == message.parsed


def test_response_format_json_schema_on_chat_and_completions(server: Server) -> None:
    schema = SCHEMAS[22]
    fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": schema, "strict": True}}
    chat = post(server, "chat/completions", {"model": "r8_all", "messages": MESSAGES, "response_format": fmt,
                                             "max_tokens": 200, "temperature": 0.7, "seed": 1, "n": 2}).json()
    text = post(server, "completions", {"model": BASE, "prompt": "Ticket:", "response_format": fmt,
                                        "max_tokens": 200, "temperature": 0}).json()
    outputs = [c["message"]["content"] for c in chat["choices"]] + [text["choices"][0]["text"]]
    for out in outputs:
        jsonschema.validate(json.loads(out), schema)


def test_json_object_and_vllm_fields(server: Server) -> None:
    body = {"model": BASE, "prompt": "x", "max_tokens": 8, "temperature": 0}
    first = post(server, "completions", {**body, "response_format": {"type": "json_object"}}).json()
    assert first["choices"][0]["text"].startswith(("{", "["))
    for fields, check in [
        ({"structured_outputs": {"regex": "[a-c]{2}-[0-9]"}}, lambda t: len(t) == 4 and t[2] == "-"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, lambda t: t[0] == "x" and t[1:].isdigit()),
        ({"structured_outputs": {"json": SCHEMAS[6], "disable_any_whitespace": True}},
         lambda t: json.loads(t)["color"] in ("red", "green", "blue")),
    ]:
        r = post(server, "completions", {**body, **fields, "max_tokens": 30}).json()
        assert check(r["choices"][0]["text"]), (fields, r)
        assert r["choices"][0]["finish_reason"] == "stop"


def test_streamed_deltas_join_to_the_constrained_output(server: Server) -> None:
    kw = dict(model="r8_all", messages=MESSAGES, max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"json": SCHEMAS[13], "disable_any_whitespace": True}})
    client = server.client()
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    jsonschema.validate(json.loads(full), SCHEMAS[13])


def test_free_request_unchanged_by_constrained_neighbours(server: Server) -> None:
    free = {"model": "r8_all", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    alone = post(server, "completions", free).json()["choices"][0]["text"]
    constrained = {"model": BASE, "prompt": "p", "max_tokens": 40, "temperature": 0,
                   "structured_outputs": {"json": SCHEMAS[1], "disable_any_whitespace": True}}
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, server, "completions", body) for body in [constrained] * 4 + [free] * 2]
        results = [f.result().json() for f in futures]
    assert [r["choices"][0]["text"] for r in results[4:]] == [alone, alone]
    for r in results[:4]:
        jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMAS[1])


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"backend": "outlines"}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_400_before_queueing(server: Server, fields: dict, param: str) -> None:
    for path, base in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "x"})):
        r = post(server, path, {"model": BASE, "max_tokens": 4, **base, **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    stats = server.stats()
    assert stats.num_running == stats.num_waiting == 0
