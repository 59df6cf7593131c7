"""Accepted means served, over real HTTP (issue 18): 24 concurrent streaming clients over the base model and
two adapters, a third of the streams cut mid-way, while one adapter is unloaded and reloaded every ~0.4 s.
With ``max_num_seqs=4`` most requests wait in the queue, so unloads hit queued requests as well as
running ones. Every request is either refused cleanly before it starts (404: the name was not loaded at
that instant) or served to the end: no error event, no 5xx, and every completed text equals HF transformers +
PEFT's greedy text of that request. Afterwards no KV block, pin or version is left over: the unloaded versions were
dropped with their last request."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.hf_text import hf_complete
from tests.server_harness import BASE, MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=4)
PROMPTS = ["Once upon a time", "The weather today", "def fibonacci(n):", "Dear diary,", "Roses are red"]
MODELS = (BASE, "r8_all", "churn")
CLIENTS, PER_CLIENT, MAX_TOKENS, CHURN_S = 24, 6, 12, 0.4


@pytest.fixture(scope="module")
def references(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> dict[tuple[str, str], str]:
    """HF + PEFT's greedy text of each (served name, prompt); ``churn`` is ``r16_mlp``'s folder."""
    folders = {BASE: None, "r8_all": tiny_llama_adapters["r8_all"], "churn": tiny_llama_adapters["r16_mlp"]}
    return {(model, prompt): hf_complete(tiny_llama, folders[model], prompt, MAX_TOKENS, ignore_eos=True).text
            for model in MODELS for prompt in PROMPTS}


async def churn(srv: Server, stop: asyncio.Event) -> int:
    """Unload and reload ``churn`` (same folder, so the same weights) until ``stop``; returns the cycles."""
    cycles = 0
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
        while not stop.is_set():
            await asyncio.sleep(CHURN_S / 2)
            (await http.post("/v1/unload_lora_adapter", json={"lora_name": "churn"})).raise_for_status()
            await asyncio.sleep(CHURN_S / 2)
            (await http.post("/v1/load_lora_adapter", json={"lora_name": "churn",
                                                           "lora_path": str(srv.root / "r16_mlp")})).raise_for_status()
            cycles += 1
    return cycles


async def client(srv: Server, seed: int, outcomes: Counter, texts: list[tuple[str, str, str]]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
        for _ in range(PER_CLIENT):
            model, prompt = rng.choice(MODELS), rng.choice(PROMPTS)
            cut_after = rng.randrange(1, MAX_TOKENS) if rng.random() < 1 / 3 else None
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    outcomes[f"http {response.status_code}"] += 1
                    continue
                text, chunks, done = "", 0, False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        outcomes["error event"] += 1
                        texts.append((model, prompt, f"error: {event['error']}"))
                        break
                    text += event["choices"][0]["text"]
                    chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        break  # the client goes away mid-stream
                outcomes["cut" if cut_after is not None and not done else "completed" if done else "ended early"] += 1
                if done:
                    texts.append((model, prompt, text))


@pytest.mark.parametrize("mode", MODES)
def test_churn_loses_no_accepted_request(mode: str, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                         references: dict[tuple[str, str], str], tmp_path: Path) -> None:
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), ("r16_mlp",), tmp_path, mode=mode,
                     **CONFIG) as srv:
        httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "churn", "lora_path": str(
            srv.root / "r16_mlp")}).raise_for_status()

        async def run() -> tuple[Counter, list[tuple[str, str, str]], int]:
            outcomes: Counter = Counter()
            texts: list[tuple[str, str, str]] = []
            stop = asyncio.Event()
            churner = asyncio.ensure_future(churn(srv, stop))
            await asyncio.gather(*(client(srv, seed, outcomes, texts) for seed in range(CLIENTS)))
            stop.set()
            return outcomes, texts, await churner

        outcomes, texts, cycles = asyncio.run(run())
        wait_until_idle(srv.engine_client)
        srv.check_integrity()
        if srv.engine is not None:  # in-process: nothing of the unloaded versions is left
            adapters = srv.engine.adapters
            assert adapters.versions.in_flight == {} and sorted(adapters._infos) == sorted(
                i.version_id for i in adapters.list())
            assert adapters._failures == {} and adapters.drain_dropped() == []
    assert cycles >= 3, f"only {cycles} unload/reload cycles ran"
    assert set(outcomes) <= {"completed", "cut", "http 404"}, outcomes
    assert outcomes["completed"] >= CLIENTS * PER_CLIENT // 3, outcomes
    assert [(m, p) for m, p, text in texts if text != references[(m, p)]] == []
    assert sum(1 for m, _, _ in texts if m == "churn") >= 5, "too few churned-adapter requests were served"
