"""Bounded memory under churn, over real HTTP, at CI size (issue 18; ``benchmarks/soak.py`` is the long run).

``loraplex serve``'s shape (engine process, preparation worker process) on the tiny model: four clients
stream requests over the base model, a stable adapter and a churned one, a third of them cut mid-stream,
while an adapter with saved ``embed_tokens`` and ``lm_head`` (25 MB of vocabulary rows per load: real-size
bytes for every tier and the saved-rows budget) is loaded and unloaded 240 times. Every size the API exposes
stays bounded (versions kept, host tier, /metrics series, cached blocks, saved-rows bytes: the robust
signal), the API process's anonymous RSS grows less than 2 % after warm-up (medians of the first and last
third of 17 samples), and the engine's less than 25 % (see the comment at the assertion)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from benchmarks.soak import soak_load
from tests.fixtures import ALL_PROJECTIONS
from tests.format_fixtures import write_format_adapter
from tests.server_harness import tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=2, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
CYCLES, WARMUP = 240, 80
PROMPTS = ["Once upon a time", "The weather today", "def fibonacci(n):", "Dear diary,"]


def test_memory_stays_flat_under_churn(tiny_llama: Path, tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    big = write_format_adapter(tiny_llama, tmp_path / "adapters" / "big", seed=3, r=16,
                               target_modules=list(ALL_PROJECTIONS), modules_to_save=["embed_tokens", "lm_head"])
    adapters = {**tiny_llama_adapters, "big": big}
    with tiny_server(tiny_llama, adapters, ("r8_all",), ("big",), tmp_path / "root", mode="process",
                     saved_rows_budget_bytes=128 * 2**20, **CONFIG) as srv:
        result = asyncio.run(soak_load(srv.url, srv.engine_client.info.pid, os.getpid(), str(srv.root / "big"),
                                       cycles=CYCLES, clients=4, max_tokens=4, prompts=PROMPTS, stable="r8_all",
                                       sample_every=10, period=0.02))
        wait_until_idle(srv.engine_client)
        stats = srv.stats()
    assert result.cycles == CYCLES
    assert set(result.outcomes) <= {"completed", "cut", "http 404"}, result.outcomes
    assert result.outcomes["completed"] + result.outcomes["cut"] >= 100, result.outcomes
    after = [s for s in result.samples if s.cycle >= WARMUP]
    curve = [(s.cycle, round(s.engine_rss_mib, 1), s.sizes) for s in result.samples]
    half = len(after) // 2  # /metrics: no series per cycle (the running/waiting gauges of 3 names come and go)
    series = [s.sizes["metrics_series"] for s in after]
    assert max(series[half:]) <= max(series[:half]) + 6, curve
    assert all(s.sizes["adapters"] <= 2 and s.sizes["host"] <= CONFIG["max_cpu_loras"]
               and s.sizes["prefix_cache_blocks"] <= CONFIG["kv_cache_blocks"] for s in after), curve
    assert after[-1].sizes["adapters"] == 1  # only the stable adapter is kept between cycles
    assert stats.saved_rows_bytes == 0  # every version's saved rows were released with it
    assert result.median_growth(WARMUP, "api_rss_mib") < 0.02, [(s.cycle, s.api_rss_mib) for s in result.samples]
    # The engine's RSS can step once by ~45 MiB (~12 %) at a random cycle as glibc's arenas settle, so at this
    # size only a leak of >= 250 KB per cycle is caught here; the 2 % bound is the long run's (benchmarks/soak.py)
    assert result.median_growth(WARMUP, "engine_rss_mib") < 0.25, curve
