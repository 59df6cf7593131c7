"""Fair share per tenant over real HTTP (engine/scheduler/fair_share.py). Two backlogged tenants, one sending 10x the
other's requests: the service they receive, measured from the outside (tokens as they stream back, weighted
as VTC weighs them: the prompt with the first token, then each token), differs by less than 2·N·R, the
docstring's bound N·R plus the requests in flight that the measurement trails. Under FCFS the same run
exceeds it many times over (the bound is not vacuous). A lone tenant gets the whole machine (N requests at
once), and the tenant travels to the engine process too (there the light tenant is served long before the
heavy one's backlog)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from loraplex.engine.scheduler.fair_share import FairShareWeights
from loraplex.server.tenancy.keys import ApiKey, KeyTable
from tests.server_harness import BASE, Server, tiny_server

N = 2  # max_num_seqs
PROMPT = "Tell me a story about a dragon"
MAX_TOKENS = 8
HEAVY, LIGHT = 100, 10  # requests per tenant: 10 to 1
KEYS = KeyTable([ApiKey(key=f"sk-{t}", tenant=t) for t in ("heavy", "light", "solo")])
W = FairShareWeights()
Arrival = tuple[float, str, int, float]  # (time, tenant, request index, service)
MakeServer = Callable[[str, str], AbstractContextManager[Server]]  # (mode, scheduling policy) -> a server
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def make_server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> MakeServer:
    def make(mode: str, policy: str) -> AbstractContextManager[Server]:
        return tiny_server(tiny_llama, tiny_llama_adapters, (), (), tmp_path_factory.mktemp("root"), mode=mode,
                           app_options={"api_keys": KEYS}, max_loras=2, max_cpu_loras=4, max_lora_rank=16,
                           kv_cache_blocks=256, max_num_seqs=N, enable_prefix_caching=False, scheduling_policy=policy)
    return make


def run(server: Server, plan: list[str], held: bool) -> tuple[list[Arrival], float]:
    """Stream one request per tenant in ``plan``, sent in plan order. With ``held`` (in-process engine) no step
    runs until the engine holds every request (its inbox, in plan order), so all start backlogged together.
    Returns every arrival in time order, and R (the most one request is charged)."""
    prompt_len = httpx.post(f"{server.url}/tokenize", json={"model": BASE, "prompt": PROMPT}).json()["count"]
    arrivals: list[Arrival] = []
    gate = threading.Event()
    if held:
        assert server.engine is not None
        step = server.engine.step
        server.engine.step = lambda: (gate.wait(), step())[1]

    async def one(client: httpx.AsyncClient, index: int, tenant: str) -> None:
        body = {"model": BASE, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer sk-{tenant}"}) as response:
            assert response.status_code == 200
            prompt = W.prefill * prompt_len
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens = len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                    arrivals.append((time.monotonic(), tenant, index, prompt + W.decode * tokens))
                    prompt = 0.0

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # every request at once
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            tasks = []
            for index, tenant in enumerate(plan):
                tasks.append(asyncio.ensure_future(one(client, index, tenant)))
                while held and server.engine._inbox.qsize() < index + 1:  # noqa: SLF001 - queued, in order
                    await asyncio.sleep(0.005)
            if held:
                server.engine.step = step
                gate.set()
            await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    finally:
        gate.set()
    return sorted(arrivals), W.prefill * prompt_len + W.decode * MAX_TOKENS


def gap_while_light_waits(arrivals: list[Arrival]) -> float:
    """The largest |service(heavy) - service(light)| until the light tenant's last token."""
    service = {"heavy": 0.0, "light": 0.0}
    last_light = max(t for t, tenant, _, _ in arrivals if tenant == "light")
    gap = 0.0
    for t, tenant, _, amount in arrivals:
        if t > last_light:
            break
        service[tenant] += amount
        gap = max(gap, abs(service["heavy"] - service["light"]))
    return gap


def ends(arrivals: list[Arrival], tenant: str) -> list[float]:
    """When each request of ``tenant`` got its last token, in order."""
    last: dict[int, float] = {}
    for t, who, index, _ in arrivals:
        if who == tenant:
            last[index] = t
    return sorted(last.values())


def test_two_backlogged_tenants_stay_within_the_bound(make_server: MakeServer) -> None:
    plan = ["heavy"] * HEAVY + ["light"] * LIGHT  # the light tenant's requests queue behind all of the heavy's
    gaps = {}
    for policy in ("fair", "fcfs"):
        with make_server("thread", policy) as server:
            arrivals, r = run(server, plan, held=True)
        gaps[policy] = gap_while_light_waits(arrivals)
    bound = 2 * N * r
    logger.info(f"service gap: fair {gaps['fair']:.0f}, fcfs {gaps['fcfs']:.0f}, bound 2·N·R = {bound:.0f}")
    assert gaps["fair"] <= bound, gaps
    assert gaps["fcfs"] > 10 * bound, gaps  # FCFS serves the heavy backlog first


def test_a_lone_tenant_gets_the_whole_machine(make_server: MakeServer) -> None:
    with make_server("thread", "fair") as server:
        arrivals, _ = run(server, ["solo"] * 12, held=True)
    spans: dict[int, list[float]] = {}
    for t, _, index, _ in arrivals:
        spans.setdefault(index, []).append(t)
    streaming = [sum(1 for s in spans.values() if s[0] <= t <= s[-1]) for t, _, _, _ in arrivals]
    assert max(streaming) == N and streaming.count(N) > len(arrivals) / 2  # a full batch most of the time
    assert [min(s) for _, s in sorted(spans.items())] == sorted(min(s) for s in spans.values())  # FCFS order


def test_the_tenant_reaches_the_engine_process(make_server: MakeServer) -> None:
    with make_server("process", "fair") as server:
        arrivals, _ = run(server, ["heavy"] * 40 + ["light"] * 4, held=False)
    light, heavy = ends(arrivals, "light"), ends(arrivals, "heavy")
    assert light[-1] < heavy[len(heavy) // 2], "the light tenant waited behind the heavy tenant's backlog"

