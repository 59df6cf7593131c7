"""``EngineStats``: the engine's counters at one instant (queue, slots, KV blocks, adapter tiers, prefix
cache), read by ``LLM.stats()``, the CLI and the Prometheus collector at scrape time.

``collect_stats`` may run on any thread while the step loop runs: every source it reads is either
locked (the adapter manager) or copied in one step (the block manager's counters), so a snapshot can
be a step old but never torn inside one counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from loraplex.adapters.info import AdapterCounters
from loraplex.adapters.manager import AdapterManager
from loraplex.config import EngineConfig
from loraplex.engine.scheduler.block_manager import BlockManager, PrefixCounts
from loraplex.engine.scheduler.scheduler import Scheduler
from loraplex.engine.speculative.speculator import DraftCounts


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    slots_in_use: int
    slots_pinned: int  # slots held by running requests' adapters
    max_loras: int
    kv_blocks_free: int
    kv_blocks_total: int
    adapter_counters: AdapterCounters  # loads, evictions and hits of the adapter tiers since start (one home)
    num_preemptions: int
    saved_rows_bytes: int = 0  # adapters' saved vocabulary rows held now
    saved_rows_budget_bytes: int = 0
    # Prefix cache: tokens of admitted requests looked up and found cached, blocks holding reusable K/V,
    # cached blocks evicted to make room; lookups per loaded adapter name (None = the base model).
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_blocks: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_by_adapter: Mapping[str | None, PrefixCounts] = field(default_factory=dict)
    # (running, waiting) requests per loaded adapter name with any in flight (None = the base model).
    requests_by_adapter: Mapping[str | None, tuple[int, int]] = field(default_factory=dict)
    step_failures: int = 0  # steps that raised: their requests failed, every other request kept running
    adapters_pinned: int = 0  # adapter names an operator pinned (each keeps a slot)
    # Speculative decoding (zero when off): verification steps that carried a draft, draft tokens proposed and
    # accepted, and (draft tokens, accepted tokens) per live adapter name (None = the base model).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_by_adapter: Mapping[str | None, tuple[int, int]] = field(default_factory=dict)


def collect_stats(config: EngineConfig, scheduler: Scheduler, blocks: BlockManager,
                  adapters: AdapterManager, step_failures: int = 0) -> EngineStats:
    """One ``EngineStats`` from the engine's parts. Per-adapter prefix-cache counters are reported under the
    name of each live version (a retired version's counters are gone; a reloaded name starts from zero);
    requests in flight per loaded adapter name (a request of an unloaded name is counted in the totals only)."""
    c = adapters.counters()
    names: dict[int | None, str | None] = {None: None}
    names.update((info.version_id, info.name) for info in adapters.list())
    by_version = blocks.counts_by_version()
    live = set(names.values())
    in_flight: dict[str | None, list[int]] = {}
    for column, queue in enumerate((scheduler.running, scheduler.waiting)):
        for request in list(queue):
            if request.adapter in live:
                in_flight.setdefault(request.adapter, [0, 0])[column] += 1
    spec = scheduler.speculator
    totals = spec.totals if spec is not None else DraftCounts()
    drafts = {names[v]: (c.draft_tokens, c.accepted_tokens)
              for v, c in (spec.counts() if spec is not None else {}).items() if v in names}
    return EngineStats(
        num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
        slots_in_use=c["slots_in_use"], slots_pinned=c["slots_pinned"], max_loras=config.max_loras,
        kv_blocks_free=blocks.num_free, kv_blocks_total=blocks.num_total,
        adapter_counters=AdapterCounters(**{f.name: c[f.name] for f in fields(AdapterCounters)}),
        num_preemptions=scheduler.num_preemptions,
        saved_rows_bytes=adapters.budget.used, saved_rows_budget_bytes=config.saved_rows_budget_bytes,
        prefix_cache_queried_tokens=blocks.totals.queried_tokens, prefix_cache_hit_tokens=blocks.totals.hit_tokens,
        prefix_cache_blocks=blocks.num_cached, prefix_cache_evictions=blocks.evictions,
        prefix_cache_by_adapter={names[v]: counts for v, counts in by_version.items() if v in names},
        requests_by_adapter={name: (running, waiting) for name, (running, waiting) in in_flight.items()},
        step_failures=step_failures, adapters_pinned=c["adapters_pinned"],
        spec_decode_num_drafts=totals.drafts, spec_decode_num_draft_tokens=totals.draft_tokens,
        spec_decode_num_accepted_tokens=totals.accepted_tokens, spec_decode_by_adapter=drafts)
