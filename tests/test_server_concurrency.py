"""Concurrency over real HTTP with two device slots: the seed scenario (an adapter loaded through
the API while two other adapters' streams decode) and 16 concurrent clients over 6 adapters.
Every output must equal the output of the same request run alone, offline."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex import LLM, SamplingParams
from tests.fixtures import write_peft_adapter
from tests.server_harness import BASE, MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=512, max_num_seqs=16)
PROMPTS = ["Once upon a time", "The weather today", "def fibonacci(n):", "Dear diary,", "In 1492 Columbus",
           "Roses are red", "SELECT * FROM", "The mitochondria is"]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Six adapters: the four shared ones and two more."""
    folder = tmp_path_factory.mktemp("more-adapters")
    extra = {f"extra{i}": write_peft_adapter(tiny_llama, folder / f"extra{i}", rank=4 * i, alpha=8.0, seed=10 + i)
             for i in (1, 2)}
    return {**tiny_llama_adapters, **extra}


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, adapters: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), **CONFIG)
    for name, folder in adapters.items():
        llm.load_adapter(name, folder)
    return llm


def solo(llm: LLM, prompt: str, model: str | None, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params, adapters=[model], use_tqdm=False)[0].text


@pytest.fixture
def seed_server(request: pytest.FixtureRequest, tiny_llama: Path, adapters: dict[str, Path],
                tmp_path: Path) -> Iterator[Server]:
    """A server in "thread" mode, or in the mode a test passes indirectly."""
    mode = getattr(request, "param", "thread")
    with tiny_server(tiny_llama, adapters, ("r8_all", "r4_attn"), ("r16_mlp",), tmp_path, mode=mode,
                     **CONFIG) as srv:
        yield srv


@pytest.mark.parametrize("seed_server", MODES, indirect=True)
def test_seed_scenario_over_http(seed_server: Server, offline: LLM) -> None:
    """Streams with A and B fill both slots; C is loaded through the API and requested (with A again)
    mid-decode. C must wait for a free slot, never evict a pinned one, and every text is its solo text."""
    srv, long_tokens, short_tokens = seed_server, 160, 8
    a, b, c = "r8_all", "r4_attn", "r16_mlp"

    async def scenario() -> tuple[list[str], list[str], int]:
        client = srv.async_client()
        streams = [await client.completions.create(model=m, prompt=p, max_tokens=long_tokens, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                   for m, p in ((a, PROMPTS[0]), (b, PROMPTS[1]))]
        iters = [s.__aiter__() for s in streams]
        texts = [(await it.__anext__()).choices[0].text for it in iters]  # both decoding, both pinned
        async with httpx.AsyncClient(base_url=srv.url) as http:
            r = await http.post("/v1/load_lora_adapter",
                                json={"lora_name": c, "lora_path": str(srv.root / c)})
        assert r.status_code == 200, r.text
        running_at_load = (await srv.engine_client.stats()).num_running
        late = [asyncio.ensure_future(client.completions.create(
            model=m, prompt=p, max_tokens=short_tokens, temperature=0, extra_body={"ignore_eos": True}))
            for m, p in ((c, PROMPTS[2]), (c, PROMPTS[3]), (a, PROMPTS[4]))]
        for i, it in enumerate(iters):
            texts[i] += "".join([chunk.choices[0].text async for chunk in it])
        return texts, [(await t).choices[0].text for t in late], running_at_load

    texts, late, running_at_load = asyncio.run(scenario())
    assert running_at_load == 2, "the load must happen while A and B decode"
    assert texts == [solo(offline, PROMPTS[0], a, long_tokens), solo(offline, PROMPTS[1], b, long_tokens)]
    assert late == [solo(offline, PROMPTS[2], c, short_tokens), solo(offline, PROMPTS[3], c, short_tokens),
                    solo(offline, PROMPTS[4], a, short_tokens)]
    assert srv.stats().adapter_counters.device_evictions >= 1  # C really displaced A or B once they finished
    wait_until_idle(srv.engine_client)
    srv.check_integrity()


def test_sixteen_clients_over_six_adapters(tiny_llama: Path, adapters: dict[str, Path], offline: LLM,
                                           tmp_path: Path) -> None:
    names = [*adapters, None]
    jobs = [(names[i % len(names)], PROMPTS[i % len(PROMPTS)], 6 + i % 5, i % 2 == 0) for i in range(16)]
    with tiny_server(tiny_llama, adapters, tuple(adapters), (), tmp_path, **CONFIG) as srv:

        async def one(model: str | None, prompt: str, max_tokens: int, stream: bool) -> str:
            client = srv.async_client()
            kw = dict(model=model or BASE, prompt=prompt, max_tokens=max_tokens, temperature=0,
                      extra_body={"ignore_eos": True})
            if not stream:
                return (await client.completions.create(**kw)).choices[0].text
            return "".join([c.choices[0].text async for c in await client.completions.create(stream=True, **kw)])

        async def all_jobs() -> list[str]:
            return list(await asyncio.gather(*(one(*job) for job in jobs)))

        texts = asyncio.run(all_jobs())
        wait_until_idle(srv.engine_client)
        srv.check_integrity()
    assert texts == [solo(offline, prompt, model, n) for model, prompt, n, _ in jobs]


def test_unload_lets_running_requests_finish(seed_server: Server, offline: LLM) -> None:
    """Unloading an adapter mid-stream: the stream finishes with the version it started with; new
    requests for the name get 404. 400 tokens: long enough that the unload and the stats call land
    mid-stream on a busy host (64 tokens of the tiny model were over before them at load 5)."""
    srv, n = seed_server, 400

    async def scenario() -> tuple[str, int, int]:
        client = srv.async_client()
        stream = await client.completions.create(model="r4_attn", prompt=PROMPTS[5], max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        it = stream.__aiter__()
        text = (await it.__anext__()).choices[0].text
        async with httpx.AsyncClient(base_url=srv.url) as http:
            unloaded = (await http.post("/v1/unload_lora_adapter", json={"lora_name": "r4_attn"})).status_code
            running = (await srv.engine_client.stats()).num_running
            text += "".join([chunk.choices[0].text async for chunk in it])
            late = await http.post("/v1/completions", json={"model": "r4_attn", "prompt": "x", "max_tokens": 2})
        assert running == 1, "the unload must happen mid-stream"
        return text, unloaded, late.status_code

    text, unloaded, late = asyncio.run(scenario())
    assert (unloaded, late) == (200, 404)
    assert text == solo(offline, PROMPTS[5], "r4_attn", n)
    wait_until_idle(srv.engine_client)
