"""The endpoints agent frameworks probe beside generation: ``GET /v1/models/{id}`` (the base and every loaded
adapter; OpenAI's 404 otherwise), vLLM's ``GET /tokenizer_info`` (compared with the HF tokenizer's own
config), OpenAI endpoints loraplex does not serve (404, OpenAI's body, a string ``code``), and a chat
stream's first chunk, sent only once the first token exists (as vLLM's server)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server_harness import BASE, Server, tiny_server


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), (), tmp_path_factory.mktemp("root"),
                     max_loras=2, max_lora_rank=16, kv_cache_blocks=64, max_num_seqs=4) as srv:
        yield srv


def test_retrieve_model_gives_the_listed_card(server: Server, tiny_llama: Path) -> None:
    client = server.client()
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {BASE, "r8_all"}
    for name in (BASE, "r8_all"):
        assert client.models.retrieve(name) == listed[name]
    assert client.models.retrieve(str(tiny_llama)).id == BASE  # the base model's other name
    r = httpx.get(f"{server.url}/v1/models/no-such-adapter")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _reference_config(tokenizer: object) -> dict:
    """What vLLM's TokenizerInfo gives for an HF tokenizer: its init kwargs, added tokens as their text."""
    def plain(value: object) -> object:
        if hasattr(value, "content"):
            return value.content
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value
    config = {k: plain(v) for k, v in tokenizer.init_kwargs.items() if k not in ("vocab_file", "merges_file")}
    return json.loads(json.dumps(config, default=str))


def test_tokenizer_info_is_the_tokenizers_config(server: Server, tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    r = httpx.get(f"{server.url}/tokenizer_info")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.pop("tokenizer_class") == type(tokenizer).__name__
    assert body.pop("chat_template") == tokenizer.chat_template
    reference = _reference_config(tokenizer)
    reference.pop("chat_template", None)
    assert body == reference
    assert body["eos_token"] == tokenizer.eos_token  # what lm-eval's remote tokenizer reads
    assert httpx.get(f"{server.url}/tokenizer_info", params={"model": "r8_all"}).status_code == 200
    missing = httpx.get(f"{server.url}/tokenizer_info", params={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/moderations"), ("POST", "/v1/images/generations"),
                                              ("GET", "/v1/files"), ("POST", "/v1/audio/speech")])
def test_unimplemented_endpoints_are_openai_404s(server: Server, method: str, path: str) -> None:
    r = httpx.request(method, f"{server.url}{path}", json={"model": BASE, "input": "x"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str) and error["code"]
    assert "not implemented by loraplex" in error["message"] and path in error["message"]


def test_chat_stream_sends_its_role_chunk_with_the_first_token(server: Server) -> None:
    """The engine's first step is held until the client has read a first event, or for at most 2 s (the
    time a role chunk sent before prefill takes to arrive): that event must come after the step that
    produced the first token (the role chunk came at once, before prefill, and TTFT read as ~0)."""
    engine = server.engine
    assert engine is not None
    real_step, steps_done, got_first = engine.step, [0], threading.Event()

    def held_step() -> list:
        got_first.wait(2)
        out = real_step()
        steps_done[0] += 1
        return out

    engine.step = held_step
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                "temperature": 0, "stream": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            at_first = steps_done[0]
            got_first.set()
            rest = [line for line in lines if line]
    finally:
        got_first.set()
        del engine.step
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
    assert at_first >= 1
    assert rest[-1] == "data: [DONE]"
