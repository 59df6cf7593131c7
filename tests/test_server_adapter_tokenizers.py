"""Adapters that ship their own tokenizer (added tokens, a resized vocabulary, their own chat template)
served over HTTP, with the engine in this process and in its own process: the server tokenizes and
renders chat with the version's tokenizer (in a worker process in "process" mode) and decodes its
outputs with it (in the API process), so every answer equals ``LLM.generate`` with that adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex import LLM, SamplingParams
from tests.format_fixtures import ADDED_TOKENS, write_added_tokens_adapter
from tests.server_harness import BASE, MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, kv_cache_blocks=128, max_num_seqs=4)
TEMPLATE = "{% for m in messages %}<|think|>{{ m['content'] }}\n{% endfor %}"
TEXT = f"Call {ADDED_TOKENS[0]} then"
MESSAGES = [{"role": "user", "content": f"use {ADDED_TOKENS[1]} now"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"saved" is loaded at start-up, "lora" through the API; both force an added token first."""
    root = tmp_path_factory.mktemp("tokenizer-adapters")
    prompt = LLM(model=str(tiny_llama), kv_cache_blocks=16).tokenize(TEXT)
    return {layout: write_added_tokens_adapter(tiny_llama, root / layout, layout, prompt, seed=i,
                                               chat_template=TEMPLATE)
            for i, layout in enumerate(("saved", "lora"))}


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, folders: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), **CONFIG)
    for name, folder in folders.items():
        llm.load_adapter(name, folder)
    return llm


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, folders: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, folders, ("saved",), ("lora",), tmp_path_factory.mktemp("root"),
                     mode=request.param, **CONFIG) as srv:
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter",
                       json={"lora_name": "lora", "lora_path": str(srv.root / "lora")})
        assert r.status_code == 200, r.text
        yield srv


def completion(server: Server, model: str, **fields: object) -> dict:
    body = {"model": model, "prompt": TEXT, "max_tokens": GREEDY.max_tokens, "temperature": 0,
            "ignore_eos": True, **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["saved", "lora"])
def test_completion_uses_the_adapters_tokenizer(server: Server, offline: LLM, model: str) -> None:
    want = offline.generate([TEXT], GREEDY, adapters=[model], use_tqdm=False)[0]
    ids = offline.tokenize(TEXT, model)
    assert ids != offline.tokenize(TEXT), "the adapter's tokenizer encodes the added token"
    assert ADDED_TOKENS[0] in want.text, "the adapter emits an added token (decoded by its tokenizer)"
    full = completion(server, model)
    assert full["choices"][0]["text"] == want.text
    assert full["usage"]["prompt_tokens"] == len(ids) and full["usage"]["completion_tokens"] == GREEDY.max_tokens
    chunks = server.client().completions.create(model=model, prompt=TEXT, max_tokens=GREEDY.max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == want.text
    base = completion(server, BASE)
    assert base["usage"]["prompt_tokens"] == len(offline.tokenize(TEXT))
    assert base["choices"][0]["text"] == offline.generate([TEXT], GREEDY, use_tqdm=False)[0].text
    wait_until_idle(server.engine_client)


def test_chat_uses_the_adapters_template_and_tokenizer(server: Server, offline: LLM) -> None:
    tokenizer = offline.current_version("lora").tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == f"<|think|>use {ADDED_TOKENS[1]} now\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = offline.generate([ids], GREEDY, adapters=["lora"], use_tqdm=False)[0]
    full = server.client().chat.completions.create(model="lora", messages=MESSAGES, max_tokens=GREEDY.max_tokens,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens == len(ids)
    assert full.choices[0].message.content == want.text


def test_an_unloaded_version_is_gone_and_a_reload_serves_again(server: Server, offline: LLM) -> None:
    url = f"{server.url}/v1"
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "lora"}).status_code == 200
    r = httpx.post(f"{url}/completions", json={"model": "lora", "prompt": TEXT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "lora", "lora_path": str(server.root / "lora")})
    assert r.status_code == 200, r.text
    want = offline.generate([TEXT], GREEDY, adapters=["lora"], use_tqdm=False)[0]
    assert completion(server, "lora")["choices"][0]["text"] == want.text
