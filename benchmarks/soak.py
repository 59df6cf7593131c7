"""Soak: does memory stay flat under adapter churn, requests and disconnects? (issue 18)

``loraplex serve``'s shape (the engine in its own process, requests prepared in a worker process) over
real HTTP: ``--clients`` clients stream completions over the base model, a stable adapter and a churned
one, a third of them cut mid-stream, while one real-size adapter (SmolLM2-135M, rank 16 on all seven
projections: 19 MB) is loaded and unloaded ``--cycles`` times. Every ``--sample-every`` cycles the
anonymous RSS (``RssAnon``) of the engine process and of the API process are read, with the sizes of every
registry the run can see (registered versions, host tier, /metrics series, cached KV blocks). Growth is
measured from the sample after ``--warmup`` cycles to the end.

    python benchmarks/soak.py                       # >= 2,000 cycles, thousands of requests
    python benchmarks/soak.py --cycles 50 --quick   # a smoke run

Prints a table, writes ``benchmarks/results/soak.json`` and the RSS curve ``soak_rss.png``.
``soak_load`` is the driver; ``tests/test_soak.py`` runs it at CI size on the tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).parent / "results"


def rss_mib(pid: int) -> float:
    """Anonymous resident memory of process ``pid`` in MiB (``RssAnon`` in /proc): its own heap and tensors.
    File-backed pages (shared libraries, mapped weights) are left out: under memory pressure the kernel
    reclaims them, which moved the whole RSS of both processes by ~150 MiB in one run here."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no RssAnon for process {pid}")


@dataclass
class Sample:
    cycle: int
    seconds: float
    engine_rss_mib: float
    api_rss_mib: float
    sizes: dict[str, int]


@dataclass
class SoakResult:
    cycles: int = 0
    outcomes: Counter = field(default_factory=Counter)  # completed / cut / http <status> / error event
    samples: list[Sample] = field(default_factory=list)

    def growth(self, warmup: int, key: str) -> float:
        """Relative RSS growth (``key``: engine_rss_mib or api_rss_mib) from the first sample at or after
        ``warmup`` cycles to the last sample."""
        after = [s for s in self.samples if s.cycle >= warmup]
        return getattr(after[-1], key) / getattr(after[0], key) - 1

    def median_growth(self, warmup: int, key: str) -> float:
        """Like ``growth``, between the medians of the first and the last third of the samples after warm-up:
        robust to what happens to be in host memory at one sampling instant (an adapter is ~20 MiB)."""
        after = [getattr(s, key) for s in self.samples if s.cycle >= warmup]
        third = max(1, len(after) // 3)
        return statistics.median(after[-third:]) / statistics.median(after[:third]) - 1


async def sizes(http: httpx.AsyncClient) -> dict[str, int]:
    """The registries the API exposes: versions the engine keeps, host tier, /metrics series, cached blocks."""
    slots = (await http.get("/v1/slots")).json()
    metrics = (await http.get("/metrics")).text
    series = [line for line in metrics.splitlines() if line and not line.startswith("#")]
    blocks = next((float(line.split()[-1]) for line in series if line.startswith("loraplex_prefix_cache_blocks ")), 0)
    return {"adapters": len(slots["adapters"]), "host": len(slots["host"]), "metrics_series": len(series),
            "prefix_cache_blocks": int(blocks)}


async def _client(http: httpx.AsyncClient, models: list[str], prompts: list, max_tokens: int, seed: int,
                  stop: asyncio.Event, result: SoakResult) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        cut_after = rng.randrange(1, max_tokens) if max_tokens > 1 and rng.random() < 1 / 3 else None
        body = {"model": rng.choice(models), "prompt": rng.choice(prompts), "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.outcomes[f"http {response.status_code}"] += 1
                continue
            chunks, outcome = 0, "ended early"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    outcome = "completed"
                    break
                if line.startswith("data: ") and '"error"' in line[:20]:
                    outcome = "error event"
                    break
                chunks += line.startswith("data: ")
                if cut_after is not None and chunks >= cut_after:
                    outcome = "cut"  # the client goes away mid-stream
                    break
            result.outcomes[outcome] += 1


async def soak_load(url: str, engine_pid: int, api_pid: int, adapter_path: str, *, cycles: int, clients: int,
                    max_tokens: int, prompts: list, stable: str | None, sample_every: int, period: float,
                    churned: str = "soak") -> SoakResult:
    """Load and unload ``adapter_path`` as ``churned`` ``cycles`` times, one cycle per ``period`` seconds at
    most (loaded for half of it), while ``clients`` stream requests (base model, ``stable`` if given, and
    ``churned``) and samples are taken every ``sample_every`` cycles."""
    result = SoakResult()
    start = time.perf_counter()
    models = ["base", churned, *([stable] if stable else [])]
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        base = (await http.get("/v1/models")).json()["data"][0]["id"]
        models[0] = base
        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(_client(http, models, prompts, max_tokens, seed, stop, result))
                 for seed in range(clients)]
        try:
            for cycle in range(cycles + 1):
                if cycle % sample_every == 0 or cycle == cycles:
                    result.samples.append(Sample(cycle, time.perf_counter() - start, rss_mib(engine_pid),
                                                 rss_mib(api_pid), await sizes(http)))
                if cycle == cycles:
                    break
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": churned, "lora_path": adapter_path})
                r.raise_for_status()
                await asyncio.sleep(period / 2)  # requests resolve to it
                (await http.post("/v1/unload_lora_adapter", json={"lora_name": churned})).raise_for_status()
                await asyncio.sleep(period / 2)
                result.cycles += 1
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    return result


@contextmanager
def serving(config: Any, startup: dict[str, Path], root: Path) -> Iterator[tuple[str, Any]]:
    """``loraplex serve``'s shape on 127.0.0.1: the engine in its own process, one preparation worker process,
    runtime adapters from ``root``; yields (base URL, the engine client)."""
    import socket
    import threading

    import uvicorn

    from loraplex.client.process import EngineProcess
    from loraplex.server.app import create_app

    client = EngineProcess(config, [(name, str(path)) for name, path in startup.items()])
    client.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(client, served_model_name="base", allow_runtime_adapters=True,
                                                      adapter_roots=[root], prepare_processes=1), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", client
    finally:
        server.should_exit = True
        thread.join(30)
        client.shutdown()


def _plot(result: SoakResult, warmup: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    cycles = [s.cycle for s in result.samples]
    for key, label in (("engine_rss_mib", "engine process"), ("api_rss_mib", "API process")):
        ax.plot(cycles, [getattr(s, key) for s in result.samples], marker=".", label=label)
    ax.axvline(warmup, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("load/unload cycles")
    ax.set_ylabel("anonymous RSS (MiB)")
    ax.set_title(f"loraplex soak: {result.cycles} cycles, {sum(result.outcomes.values())} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=200, help="cycles before growth is measured")
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--period", type=float, default=0.2, help="seconds per load/unload cycle (at least)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "soak_rss.png")
    parser.add_argument("--quick", action="store_true", help="warm-up and samples scaled to a short run")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.sample_every = args.cycles // 5, max(1, args.cycles // 10)
    import os
    import tempfile

    from benchmarks.common import chat_prompts, machine_line, write_random_adapter
    from loraplex.config import EngineConfig, ModelConfig
    from loraplex.models.embedded import resolve_model

    folder = resolve_model(args.model)
    config = EngineConfig(model=str(folder), max_loras=2, max_cpu_loras=2, max_lora_rank=args.rank, max_num_seqs=8,
                          kv_cache_bytes=256 * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {name: write_random_adapter(Path(tmp) / name, ModelConfig.from_hf(folder), args.rank, seed)
                    for seed, name in enumerate(("stable", "soak"))}
        size_mb = sum(f.stat().st_size for f in adapters["soak"].iterdir()) / 1e6
        with serving(config, {"stable": adapters["stable"]}, Path(tmp)) as (url, client):
            from transformers import AutoTokenizer

            prompts = chat_prompts(AutoTokenizer.from_pretrained(folder), 16)
            result = asyncio.run(soak_load(url, client.info.pid, os.getpid(), str(adapters["soak"]),
                                           cycles=args.cycles, clients=args.clients, max_tokens=args.max_tokens,
                                           prompts=prompts, stable="stable", sample_every=args.sample_every,
                                           period=args.period))
    print(f"{'cycle':>6} {'s':>7} {'engine MiB':>11} {'API MiB':>8}  sizes")
    for s in result.samples:
        print(f"{s.cycle:>6} {s.seconds:>7.0f} {s.engine_rss_mib:>11.1f} {s.api_rss_mib:>8.1f}  {s.sizes}")
    keys = ("engine_rss_mib", "api_rss_mib")
    growth = {key: result.growth(args.warmup, key) for key in keys}
    median = {key: result.median_growth(args.warmup, key) for key in keys}
    print(f"cycles {result.cycles}, requests {dict(result.outcomes)}; RSS growth after {args.warmup} cycles, "
          "last/first sample and median of the last/first third: "
          + ", ".join(f"{k} {growth[k] * 100:+.2f}% / {median[k] * 100:+.2f}%" for k in keys))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine_line(), "load_average": os.getloadavg(), "cycles": result.cycles,
        "adapter_rank": args.rank, "adapter_mb": size_mb, "period_s": args.period, "clients": args.clients,
        "requests": dict(result.outcomes),
        "warmup_cycles": args.warmup, "rss_growth_after_warmup": growth, "rss_median_growth_after_warmup": median,
        "samples": [asdict(s) for s in result.samples]}, indent=1))
    _plot(result, args.warmup, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
