"""Adapters loaded on first use (``--adapter-root DIR --load-on-demand``) over real HTTP, in both engine modes:
32 concurrent first-use requests load the adapter exactly once and all answer with HF + PEFT's greedy
text for the adapter; a missing folder is the unknown model's 404, an invalid one the load's 400, a symlink out of the
root 403, and a name outside the caller's scope never triggers a load."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.server.tenancy.keys import ApiKey, KeyTable
from tests.hf_text import hf_complete
from tests.server_harness import MODES, Server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=16)
PROMPT = "The capital of France is"
KEYS = KeyTable([ApiKey(key="sk-all", tenant="ops"), ApiKey(key="sk-few", tenant="few", adapters=("fresh*",),
                                                            admin=False)])


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(tiny_llama_adapters["r8_all"], root / "fresh")
    shutil.copytree(tiny_llama_adapters["r4_attn"], root / "secret")
    broken = root / "fresh-broken"
    shutil.copytree(tiny_llama_adapters["r2_qv"], broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))  # over --max-lora-rank
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(tiny_llama_adapters["r2_qv"], outside / "elsewhere")
    (root / "fresh-link").symlink_to(outside / "elsewhere")
    with tiny_server(tiny_llama, tiny_llama_adapters, (), (), root, mode=request.param,
                     app_options={"load_on_demand": True, "api_keys": KEYS}, **CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> str:
    """HF + PEFT's greedy text of PROMPT with ``r8_all``."""
    return hf_complete(tiny_llama, tiny_llama_adapters["r8_all"], PROMPT, 12, ignore_eos=True).text


def post(server: Server, model: str, key: str = "sk-all") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})


def test_32_concurrent_first_uses_load_once_and_all_answer(server: Server, reference: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    loads_before = server.stats().adapter_counters.loads
    calls: list[str] = []  # engine loads the server asks for (the engine would refuse a second one: 409)
    load = server.engine_client.load_adapter

    async def counted(name: str, *args: object, **kwargs: object) -> object:
        calls.append(name)
        await asyncio.sleep(1.0)  # a slow disk: every request arrives while the load runs
        return await load(name, *args, **kwargs)

    monkeypatch.setattr(server.engine_client, "load_adapter", counted)

    async def race() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": "Bearer sk-all"}) as client:
            body = {"model": "fresh", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(32)))

    responses = asyncio.run(race())
    assert [r.status_code for r in responses] == [200] * 32, [r.text for r in responses if r.status_code != 200]
    assert {r.json()["choices"][0]["text"] for r in responses} == {reference}
    assert server.stats().adapter_counters.loads == loads_before + 1 and calls == ["fresh"]
    listing = httpx.get(f"{server.url}/v1/adapters", headers={"Authorization": "Bearer sk-all"}).json()["data"]
    fresh = next(e for e in listing if e["name"] == "fresh")
    assert len(fresh["versions"]) == 1 and fresh["versions"][0]["requests_served"] == 32
    assert {r.headers["x-loraplex-adapter-version"] for r in responses} == {fresh["current"]}


def test_missing_invalid_and_escaping_folders(server: Server) -> None:
    missing, unknown = post(server, "no-such-folder"), post(server, "no-such-other")
    assert missing.status_code == unknown.status_code == 404
    assert missing.text.replace("no-such-folder", "X") == unknown.text.replace("no-such-other", "X")
    invalid = post(server, "fresh-broken")
    assert invalid.status_code == 400 and "rank" in invalid.json()["error"]["message"]
    assert post(server, "fresh-link").status_code == 403  # resolves outside the root
    assert post(server, "../fresh").status_code == 404  # a path, not a name: never looked up
    loads = server.stats().adapter_counters.loads
    hidden, unknown = post(server, "secret", key="sk-few"), post(server, "nothing", key="sk-few")
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.text.replace("secret", "X") == unknown.text.replace("nothing", "X")
    assert server.stats().adapter_counters.loads == loads  # out of scope: not loaded
