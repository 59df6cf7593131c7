"""Prometheus metrics, one ``CollectorRegistry`` per app (several apps can live in one process).

Request-level series are recorded by the HTTP layer as requests finish; step latency after every
step (a step observer); engine state (queue length, running requests, slots, KV blocks, adapter and
prefix-cache counters) is read from the engine's ``stats()`` at scrape time (through the engine client:
an RPC to the engine process in ``loraplex serve``), so it is never stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.client.output import RequestOutput
from loraplex.server.metric_labels import BASE_LABEL, AdapterLabels
from loraplex.server.tracing import RequestTracer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# engine.stats() field -> (metric name, help); gauges then monotonically growing counters.
_STAT_GAUGES = {
    "num_waiting": ("loraplex_requests_waiting", "Requests queued, not yet scheduled."),
    "num_running": ("loraplex_requests_running", "Requests scheduled and decoding."),
    "slots_in_use": ("loraplex_adapter_slots_in_use", "Device adapter slots holding an adapter."),
    "slots_pinned": ("loraplex_adapter_slots_pinned", "Device adapter slots pinned by running requests."),
    "max_loras": ("loraplex_adapter_slots_total", "Device adapter slots (max_loras)."),
    "kv_blocks_free": ("loraplex_kv_blocks_free", "Free KV-cache blocks."),
    "kv_blocks_total": ("loraplex_kv_blocks_total", "KV-cache blocks."),
    "prefix_cache_blocks": ("loraplex_prefix_cache_blocks", "KV blocks holding reusable (keyed) prefix K/V."),
    "adapters_pinned": ("loraplex_adapters_pinned", "Adapters pinned to a device slot by an operator."),
}
# AdapterCounters field -> (metric name, help); EngineStats.adapter_counters holds them.
_ADAPTER_COUNTERS = {
    "loads": ("loraplex_adapter_loads", "Adapter loads from disk into host memory."),
    "device_evictions": ("loraplex_adapter_device_evictions", "Adapters evicted from device slots."),
    "host_evictions": ("loraplex_adapter_host_evictions", "Adapters evicted from host memory."),
    "device_hits": ("loraplex_adapter_device_hits", "Acquisitions served by an adapter already in a slot."),
    "host_hits": ("loraplex_adapter_host_hits", "Acquisitions served from host memory."),
    "disk_reads": ("loraplex_adapter_disk_reads", "Background re-reads of adapters that had left host memory."),
}
_STAT_COUNTERS = {
    "prefix_cache_queried_tokens": ("loraplex_prefix_cache_queried_tokens",
                                    "Tokens of admitted requests looked up in the prefix cache."),
    "prefix_cache_hit_tokens": ("loraplex_prefix_cache_hit_tokens",
                                "Tokens of admitted requests whose K/V came from the prefix cache."),
    "prefix_cache_evictions": ("loraplex_prefix_cache_evictions", "Cached KV blocks evicted to make room."),
    "step_failures": ("loraplex_engine_step_failures", "Engine steps that raised (only their requests failed)."),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Speculative decoding: verifications of a draft."),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens."),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",
                                        "Speculative decoding: draft tokens accepted."),
}
# Per adapter (label values bounded by the loaded adapters): PrefixCounts field -> (metric name, help).
_PREFIX_BY_ADAPTER = {
    "queried_tokens": ("loraplex_adapter_prefix_cache_queried_tokens", "Prefix-cache lookups in tokens, by adapter."),
    "hit_tokens": ("loraplex_adapter_prefix_cache_hit_tokens", "Prefix-cache hits in tokens, by adapter."),
}


class EngineStatsCollector(Collector):
    """Turns the ``EngineStats`` of the scrape in progress (``stats``) into metrics."""

    def __init__(self) -> None:
        self.stats: Any = None

    def describe(self) -> list[Metric]:
        return []  # nothing to describe before the first scrape

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        for field, (name, doc) in _STAT_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
        occupancy = stats.slots_in_use / stats.max_loras if stats.max_loras else 0.0
        yield GaugeMetricFamily("loraplex_adapter_slot_occupancy", "slots_in_use / max_loras.", value=occupancy)
        yield from _router_gauges(stats)
        for field, (name, doc) in _STAT_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        for field, (name, doc) in _ADAPTER_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(stats.adapter_counters, field))
        for field, (name, doc) in _PREFIX_BY_ADAPTER.items():
            family = CounterMetricFamily(name, doc, labels=["adapter"])
            for adapter, counts in sorted(stats.prefix_cache_by_adapter.items(), key=lambda kv: kv[0] or ""):
                family.add_metric([adapter or BASE_LABEL], getattr(counts, field))
            yield family
        yield from _requests_by_adapter(stats)
        yield from _spec_decode_by_adapter(stats)


def _spec_decode_by_adapter(stats: Any) -> Iterator[Metric]:
    """Draft tokens, accepted draft tokens and their ratio (the acceptance rate) per loaded adapter."""
    drafted = CounterMetricFamily("loraplex_adapter_spec_decode_draft_tokens",
                                  "Speculative decoding: draft tokens, by adapter.", labels=["adapter"])
    accepted = CounterMetricFamily("loraplex_adapter_spec_decode_accepted_tokens",
                                   "Speculative decoding: draft tokens accepted, by adapter.", labels=["adapter"])
    rate = GaugeMetricFamily("loraplex_adapter_spec_decode_acceptance_rate",
                             "Speculative decoding: accepted / draft tokens since start, by adapter.",
                             labels=["adapter"])
    by_adapter = sorted(stats.spec_decode_by_adapter.items(), key=lambda kv: kv[0] or "")
    for adapter, (num_drafted, num_accepted) in by_adapter:
        label = [adapter or BASE_LABEL]
        drafted.add_metric(label, num_drafted)
        accepted.add_metric(label, num_accepted)
        rate.add_metric(label, num_accepted / num_drafted if num_drafted else 0.0)
    yield drafted
    yield accepted
    yield rate


def _router_gauges(stats: Any) -> Iterator[Metric]:
    """The gauges routers read under vLLM's names (the Gateway API inference extension's endpoint picker,
    llm-d's scorers), from the same ``stats`` as our own: ``loraplex_requests_running``,
    ``loraplex_requests_waiting`` and ``1 - kv_blocks_free / kv_blocks_total``."""
    yield GaugeMetricFamily("vllm:num_requests_running", "Requests scheduled and decoding (loraplex_requests_running).",
                            value=stats.num_running)
    yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued (loraplex_requests_waiting).",
                            value=stats.num_waiting)
    total = stats.kv_blocks_total
    usage = (total - stats.kv_blocks_free) / total if total else 0.0
    yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1: 1 - loraplex_kv_blocks_free / "
                            "loraplex_kv_blocks_total.", value=usage)


def _requests_by_adapter(stats: Any) -> Iterator[Metric]:
    """Running and waiting requests per loaded adapter, and vLLM's ``vllm:lora_requests_info``: one series whose
    labels name the adapters with running and with waiting requests (comma-separated) and ``max_lora``, valued
    at the scrape's Unix time (the Gateway API inference extension's LoRA-affinity routing reads the newest)."""
    running = GaugeMetricFamily("loraplex_adapter_requests_running", "Requests running, by adapter.",
                                labels=["adapter"])
    waiting = GaugeMetricFamily("loraplex_adapter_requests_waiting", "Requests waiting, by adapter.",
                                labels=["adapter"])
    by_adapter = sorted(stats.requests_by_adapter.items(), key=lambda kv: kv[0] or "")
    for adapter, (num_running, num_waiting) in by_adapter:
        running.add_metric([adapter or BASE_LABEL], num_running)
        waiting.add_metric([adapter or BASE_LABEL], num_waiting)
    yield running
    yield waiting
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(stats.max_loras), ",".join(a for a, (n, _) in by_adapter if a is not None and n),
                     ",".join(a for a, (_, n) in by_adapter if a is not None and n)], time.time())
    yield info


def _latency(name: str, doc: str, registry: CollectorRegistry) -> Histogram:
    """A latency histogram labelled by adapter (bounded: ``AdapterLabels``) and tenant ('none' without keys)."""
    return Histogram(name, doc + " By adapter and tenant.", ["adapter", "tenant"], buckets=_LATENCY_BUCKETS,
                     registry=registry)


class ServerMetrics:
    """``is_loaded(name)`` says whether an adapter name is loaded now: request series are labelled with
    loaded names only (``metric_labels.AdapterLabels``)."""

    def __init__(self, is_loaded: Callable[[str], bool] = lambda name: False,
                 tracer: RequestTracer | None = None) -> None:
        self.registry = CollectorRegistry()
        self.adapter_labels = AdapterLabels(is_loaded)
        self.tracer = tracer  # request traces (--otlp-traces-endpoint), off by default
        self._engine_stats = EngineStatsCollector()
        self._render_lock = threading.Lock()
        r = self.registry
        self.requests = Counter("loraplex_requests", "Finished requests by adapter and status.",
                                ["adapter", "status"], registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens processed.", ["adapter"],
                                     registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated.", ["adapter"],
                                         registry=r)
        self.ttft = _latency("loraplex_time_to_first_token_seconds", "Submission to first token.", r)
        self.tpot = _latency("loraplex_time_per_output_token_seconds",
                             "Mean time between output tokens after the first, per request.", r)
        self.e2e = _latency("loraplex_e2e_request_latency_seconds", "Submission to the request's last output.", r)
        self.queue_time = _latency("loraplex_request_queue_time_seconds",
                                   "Engine arrival to first admission (engine clock).", r)
        self.step_latency = Histogram("loraplex_step_latency_seconds", "Duration of one engine step.",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.tenant_requests = Counter("loraplex_tenant_requests", "Finished requests by tenant (the configured "
                                       "API keys' tenants; 'none' without keys) and status.", ["tenant", "status"],
                                       registry=r)
        self.tenant_tokens = Counter("loraplex_tenant_tokens", "Prompt and generated tokens by tenant.",
                                     ["tenant", "kind"], registry=r)
        self.runtime_loads = Counter("loraplex_runtime_adapter_loads", "Adapter loads through the API by result.",
                                     ["result"], registry=r)
        r.register(self._engine_stats)

    def _observe_latency(self, label: str, tenant: str, out: RequestOutput, ttft: float | None,
                         decode_seconds: float | None, e2e: float | None) -> None:
        child = self.adapter_labels.child
        if ttft is not None:
            child(self.ttft, label, tenant).observe(ttft)
        if decode_seconds is not None and len(out.token_ids) > 1:
            child(self.tpot, label, tenant).observe(decode_seconds / (len(out.token_ids) - 1))
        if e2e is not None:
            child(self.e2e, label, tenant).observe(e2e)
        times = out.times
        if times is not None and times.scheduled is not None:
            child(self.queue_time, label, tenant).observe(max(0.0, times.scheduled - times.arrival))

    def observe_step(self, seconds: float, outputs: list[RequestOutput]) -> None:
        self.step_latency.observe(seconds)

    def observe_request(self, adapter: str | None, status: str, out: RequestOutput | None,
                        ttft: float | None, decode_seconds: float | None, tenant: str | None = None,
                        e2e: float | None = None) -> None:
        """Record one request that ended (``out`` is None when it was rejected before running). ``tenant``
        is bounded by its caller: a configured key's tenant, or None. The latency histograms are labelled by
        adapter and tenant; queue time comes from the engine's instants (``out.times``)."""
        labels = self.adapter_labels
        label, tenant_label = labels.label(adapter), tenant or "none"
        labels.child(self.requests, label, status).inc()
        self.tenant_requests.labels(tenant_label, status).inc()
        if out is None:
            return
        labels.child(self.prompt_tokens, label).inc(len(out.prompt_token_ids))
        labels.child(self.generation_tokens, label).inc(len(out.token_ids))
        self.tenant_tokens.labels(tenant_label, "prompt").inc(len(out.prompt_token_ids))
        self.tenant_tokens.labels(tenant_label, "generated").inc(len(out.token_ids))
        self._observe_latency(label, tenant_label, out, ttft, decode_seconds, e2e)

    def render(self, stats: Any) -> bytes:
        """The Prometheus text, engine state from ``stats`` (the engine's ``EngineStats`` now)."""
        self.adapter_labels.prune()
        with self._render_lock:
            self._engine_stats.stats = stats
            return generate_latest(self.registry)
