"""``/metrics`` stays bounded over real HTTP: request series are labelled with loaded adapters, ``base`` and
``unknown`` only, so 2,000 requests naming random models leave it the same size; an unloaded adapter's
series go away; the per-adapter running/waiting gauges and vLLM's ``vllm:lora_requests_info`` (read by the
Gateway API inference extension's LoRA-affinity routing) name the adapters with requests in flight."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.metric_labels import AdapterLabels
from loraplex.server.metrics import ServerMetrics
from tests.server_harness import MODES, Server, streaming, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
# Random names per mode: the label logic is the same in both; the engine process's client answers "is it
# loaded" from its own mirror, checked with fewer names to keep the file's time down (~4 ms per 404 here)
RANDOM_NAMES = {"thread": 2_000, "process": 1_000}


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), ("r4_attn",), tmp_path_factory.mktemp("root"),
                     mode=request.param, **CONFIG) as srv:
        yield srv


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def adapter_labels(url: str) -> set[str]:
    return {dict(labels)["adapter"] for _, labels in samples(url) if "adapter" in dict(labels)}


def series_names(url: str) -> set[tuple[str, frozenset]]:
    """Every series but the one valued at the scrape time (its labels name what runs now)."""
    return {key for key in samples(url) if key[0] != "vllm:lora_requests_info"}


def test_random_model_names_leave_metrics_the_same_size(server: Server) -> None:
    """Thousands of requests for random model names (RANDOM_NAMES): each a 404, all counted under ``unknown``."""
    count = RANDOM_NAMES["thread" if server.engine is not None else "process"]
    client = server.client()
    client.completions.create(model="r8_all", prompt="Hello", max_tokens=2)
    with httpx.Client() as http:  # one request for a random name first, so ``unknown`` exists
        assert http.post(f"{server.url}/v1/completions", json={"model": "warm", "prompt": "x"}).status_code == 404
    before, size = series_names(server.url), len(httpx.get(f"{server.url}/metrics").text)

    async def flood() -> int:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            names = iter(uuid.uuid4().hex for _ in range(count))

            async def worker() -> int:
                return sum([(await http.post("/v1/completions", json={"model": name, "prompt": "x"})).status_code
                            == 404 for name in names])

            return sum(await asyncio.gather(*(worker() for _ in range(16))))

    assert asyncio.run(flood()) == count
    assert series_names(server.url) == before
    after = httpx.get(f"{server.url}/metrics").text
    assert abs(len(after) - size) < 200  # only values changed (digits), no new series
    counts = samples(server.url)
    assert counts[("loraplex_requests_total", frozenset({("adapter", "unknown"), ("status", "rejected")}))] >= count + 1
    assert adapter_labels(server.url) <= {"r8_all", "base", "unknown"}


def test_unloaded_adapter_series_are_removed(server: Server) -> None:
    client = server.client()
    httpx.post(f"{server.url}/v1/load_lora_adapter",
               json={"lora_name": "short-lived", "lora_path": str(server.root / "r4_attn")}).raise_for_status()
    client.completions.create(model="short-lived", prompt="Hello", max_tokens=2)
    assert "short-lived" in adapter_labels(server.url)
    httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "short-lived"}).raise_for_status()
    assert "short-lived" not in adapter_labels(server.url)
    assert not [key for key in samples(server.url) if "short-lived" in str(key)]


def test_running_and_waiting_gauges_name_the_adapters_in_flight(server: Server) -> None:
    """While a stream of ``r8_all`` decodes, ``vllm:lora_requests_info`` lists it as running, valued at the
    scrape's Unix time, with ``max_lora``; per-adapter gauges count it. Idle, the lists are empty."""
    wait_until_idle(server.engine_client)
    with streaming(server.url, "r8_all"):
        deadline = time.monotonic() + 30
        while samples(server.url).get(
                ("loraplex_adapter_requests_running", frozenset({("adapter", "r8_all")}))) != 1:
            assert time.monotonic() < deadline, "the stream never showed as running"
            time.sleep(0.05)
        info = [(dict(labels), value) for (name, labels), value in samples(server.url).items()
                if name == "vllm:lora_requests_info"]
        assert len(info) == 1
        labels, value = info[0]
        assert labels == {"max_lora": "2", "running_lora_adapters": "r8_all", "waiting_lora_adapters": ""}
        assert abs(value - time.time()) < 60
    wait_until_idle(server.engine_client)
    info = [dict(labels) for (name, labels), _ in samples(server.url).items() if name == "vllm:lora_requests_info"]
    assert info == [{"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}]
    assert not [key for key in samples(server.url) if key[0] == "loraplex_adapter_requests_running"]


def test_labels_follow_what_is_loaded() -> None:
    """``AdapterLabels`` alone: names map to themselves only while loaded; pruning removes every series of a
    name that left, in each metric it labelled."""
    loaded = {"a", "b"}
    metrics = ServerMetrics(lambda name: name in loaded)
    labels: AdapterLabels = metrics.adapter_labels
    assert [labels.label(n) for n in ("a", None, "zzz", "base", "unknown")] == ["a", "base", "unknown", "unknown",
                                                                              "unknown"]
    for adapter in ("a", "b", None, "zzz"):
        metrics.observe_request(adapter, "rejected", None, None, None)
    assert labels.names() == {"a", "b", "base", "unknown"}
    loaded.discard("a")
    metrics.observe_request("b", "rejected", None, None, None)  # nothing new: nothing pruned yet
    loaded.add("c")
    metrics.observe_request("c", "rejected", None, None, None)  # a new name prunes the ones that left
    assert labels.names() == {"b", "c", "base", "unknown"}
    text = metrics.registry.get_sample_value
    assert text("loraplex_requests_total", {"adapter": "a", "status": "rejected"}) is None
    assert text("loraplex_requests_total", {"adapter": "b", "status": "rejected"}) == 2
