"""Observability over real HTTP, both engine modes: the gauges routers read under vLLM's names equal our own at
the same scrape; TTFT, TPOT, end-to-end and queue-time histograms are labelled by adapter and tenant, a slow
adapter shows a larger TTFT than a fast one, and their label set stays bounded under random model names."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import BASE, MODES, Server, streaming, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
KEYS = """
[[keys]]
key = "sk-ops-0123456789"
tenant = "ops"
adapters = ["*"]
admin = true

[[keys]]
key = "sk-alpha-0123456789"
tenant = "alpha"
adapters = ["*"]
"""
OPS, ALPHA = "sk-ops-0123456789", "sk-alpha-0123456789"
LATENCY = ("loraplex_time_to_first_token_seconds", "loraplex_time_per_output_token_seconds",
           "loraplex_e2e_request_latency_seconds", "loraplex_request_queue_time_seconds")
Samples = dict[tuple[str, frozenset], float]
DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "loraplex.json"
METRIC_NAME = re.compile(r"\b(?:loraplex_|vllm:)[A-Za-z0-9_:]*")


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), ("r4_attn",),
                     tmp_path_factory.mktemp("root"), mode=request.param, app_options={"api_keys": str(keys)},
                     **CONFIG) as srv:
        yield srv


def samples(server: Server) -> Samples:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {OPS}"}).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scrape: Samples, name: str, **labels: str) -> float:
    return scrape[(name, frozenset(labels.items()))]


def complete(server: Server, key: str, model: str, stream: bool, max_tokens: int = 4) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, response.read()
        response.read()


def test_vllm_gauges_equal_ours_at_the_same_scrape(server: Server) -> None:
    """While a stream decodes: ``vllm:num_requests_running`` / ``_waiting`` are ours, ``vllm:kv_cache_usage_perc``
    is ``1 - free / total`` of our KV-block gauges (and above 0: the stream holds blocks); idle, all are 0."""
    wait_until_idle(server.engine_client)
    with streaming(server.url, "r8_all", {"Authorization": f"Bearer {OPS}"}):
        deadline = time.monotonic() + 30
        while (scrape := samples(server)).get(("loraplex_requests_running", frozenset())) != 1:
            assert time.monotonic() < deadline, "the stream never showed as running"
            time.sleep(0.02)
        busy = scrape
    wait_until_idle(server.engine_client)
    idle = samples(server)
    for scrape, running in ((busy, 1), (idle, 0)):
        assert value(scrape, "vllm:num_requests_running") == value(scrape, "loraplex_requests_running") == running
        assert value(scrape, "vllm:num_requests_waiting") == value(scrape, "loraplex_requests_waiting") == 0
        free, total = value(scrape, "loraplex_kv_blocks_free"), value(scrape, "loraplex_kv_blocks_total")
        assert value(scrape, "vllm:kv_cache_usage_perc") == pytest.approx(1 - free / total, abs=1e-12)
    assert 0 < value(busy, "vllm:kv_cache_usage_perc") < 1
    assert value(idle, "vllm:kv_cache_usage_perc") == 0


def latency_labels(scrape: Samples) -> set[tuple[str, str]]:
    return {(dict(labels)["adapter"], dict(labels)["tenant"]) for name, labels in scrape
            if name.startswith(LATENCY)}


def test_latency_histograms_by_adapter_and_tenant(server: Server) -> None:
    """Each finished request adds one observation to each histogram of its (adapter, tenant): streamed or not;
    its queue time and TTFT are within its end-to-end latency."""
    before = samples(server)
    runs = [(ALPHA, "r8_all", True), (ALPHA, "r8_all", False), (OPS, "r4_attn", True), (OPS, BASE, False),
            (OPS, BASE, True)]
    for key, model, stream in runs:
        complete(server, key, model, stream)
    after = samples(server)
    expected = {("r8_all", "alpha"): 2, ("r4_attn", "ops"): 1, ("base", "ops"): 2}
    assert latency_labels(after) == set(expected)
    for (adapter, tenant), count in expected.items():
        def delta(name: str, adapter: str = adapter, tenant: str = tenant) -> float:
            key = (name, frozenset({("adapter", adapter), ("tenant", tenant)}))
            return after[key] - before.get(key, 0.0)

        for name in LATENCY:
            assert delta(f"{name}_count") == count, name
        e2e = delta("loraplex_e2e_request_latency_seconds_sum")
        assert 0 < delta("loraplex_time_to_first_token_seconds_sum") <= e2e
        assert 0 <= delta("loraplex_request_queue_time_seconds_sum") <= e2e


def test_latency_labels_stay_bounded(server: Server) -> None:
    """Random model names (404s, labelled ``unknown`` where counted) add no latency series; an unloaded
    adapter's latency series go away."""
    complete(server, OPS, "r8_all", False)
    before = latency_labels(samples(server))
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {OPS}"}) as http:
        for _ in range(200):
            assert http.post("/v1/completions", json={"model": uuid.uuid4().hex, "prompt": "x"}).status_code == 404
    assert latency_labels(samples(server)) == before
    assert {adapter for adapter, _ in before} <= {"r8_all", "r4_attn", "base", "unknown"}
    httpx.post(f"{server.url}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {OPS}"},
               json={"lora_name": "short-lived", "lora_path": str(server.root / "r4_attn")}).raise_for_status()
    complete(server, OPS, "short-lived", True)
    assert ("short-lived", "ops") in latency_labels(samples(server))
    httpx.post(f"{server.url}/v1/unload_lora_adapter", headers={"Authorization": f"Bearer {OPS}"},
               json={"lora_name": "short-lived"}).raise_for_status()
    assert "short-lived" not in {adapter for adapter, _ in latency_labels(samples(server))}


SLOW_PREFILL_SECONDS = 0.3


@pytest.fixture(scope="module")
def held_server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An in-process engine whose steps holding the prefill of an ``r4_attn`` request take
    ``SLOW_PREFILL_SECONDS`` longer (a hook on the scheduler): ``r4_attn`` is the slow adapter, deterministically."""
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), (), tmp_path_factory.mktemp("root"),
                     **CONFIG) as srv:
        assert srv.engine is not None
        scheduler = srv.engine.scheduler
        schedule = scheduler.schedule

        def held() -> list:
            scheduled = schedule()
            if any(s.request.adapter == "r4_attn" and not s.request.output_token_ids for s in scheduled):
                time.sleep(SLOW_PREFILL_SECONDS)
            return scheduled

        scheduler.schedule = held
        yield srv


def test_a_slow_adapter_shows_a_larger_ttft(held_server: Server) -> None:
    """Interleaved requests, the same prompt and load: every ``r4_attn`` TTFT lands above the held time (no
    observation in the buckets up to it), and the mean ``r8_all`` TTFT stays below it."""
    for _ in range(3):
        for model in ("r8_all", "r4_attn"):
            complete(held_server, "unused", model, stream=True)
    scrape = samples(held_server)

    def ttft(adapter: str, suffix: str, **labels: str) -> float:
        return value(scrape, f"loraplex_time_to_first_token_seconds_{suffix}", adapter=adapter, tenant="none",
                     **labels)

    assert ttft("r4_attn", "count") == ttft("r8_all", "count") == 3
    assert ttft("r4_attn", "bucket", le="0.25") == 0
    fast, slow = ttft("r8_all", "sum") / 3, ttft("r4_attn", "sum") / 3
    assert fast < SLOW_PREFILL_SECONDS <= slow


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    return queries + [var["definition"] for var in board["templating"]["list"] if var["type"] == "query"]


def test_every_dashboard_query_names_exported_metrics(server: Server) -> None:
    """After streamed and whole requests: each query of ``docs/grafana/loraplex.json`` names at least one metric
    and every metric it names is in the scrape (histograms by their ``_bucket`` series)."""
    for stream in (True, False):
        complete(server, OPS, "r8_all", stream)
    exported = {name for name, _ in samples(server)}
    queries = dashboard_queries()
    assert len(queries) >= 14
    for query in queries:
        names = set(METRIC_NAME.findall(query))
        assert names, query
        assert names <= exported, (query, names - exported)
