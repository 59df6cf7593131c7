"""Ray Serve scale-out: start-up time of a 2-replica deployment, and the adapter-affinity hit rate
under a Zipf(1.0) workload over 8 adapters.

For each ``--max-adapters-per-replica`` K: deploy (timed: Serve start + every replica ready, Ray
already running), then send ``--requests`` completions, ``--concurrency`` at a time, each for adapter
k in 1..8 with probability proportional to 1/k (fixed seed). A *hit* is a request that landed on a
replica already holding its adapter (the ``x-loraplex-adapter-cache`` header). The reference in the
same table, ``random LRU (sim)``, is a simulation, not a measurement: the same request sequence
sent to uniformly random replicas that each keep an LRU set of K adapters.

    python benchmarks/ray_affinity.py [--out results.json] [--model PATH] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path

import httpx
import ray

from benchmarks.common import QUESTIONS, machine_line, write_random_adapter
from loraplex.config import EngineConfig, ModelConfig
from loraplex.integrations import ray_serve
from loraplex.integrations.ray_config import AFFINITY_HEADER, REPLICA_HEADER, RayServeConfig
from loraplex.models.embedded import embedded_checkpoint

NUM_ADAPTERS = 8


def zipf_sequence(n: int, num_adapters: int, s: float, seed: int) -> list[str]:
    weights = [1.0 / (k**s) for k in range(1, num_adapters + 1)]
    return random.Random(seed).choices([f"a{k}" for k in range(1, num_adapters + 1)], weights, k=n)


def simulated_random_lru(sequence: list[str], replicas: int, k: int, seed: int) -> float:
    """Hit rate of the same sequence routed to uniformly random replicas holding LRU sets of ``k``."""
    rng = random.Random(seed)
    held: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(replicas)]
    hits = 0
    for adapter in sequence:
        lru = held[rng.randrange(replicas)]
        hits += adapter in lru
        lru[adapter] = None
        lru.move_to_end(adapter)
        if len(lru) > k:
            lru.popitem(last=False)
    return hits / len(sequence)


async def workload(url: str, sequence: list[str], concurrency: int, max_tokens: int) -> list[dict]:
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(sequence):
        queue.put_nowait(item)
    records: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i, adapter = queue.get_nowait()
            start = time.perf_counter()
            r = await client.post("/v1/completions", json={
                "model": adapter, "prompt": QUESTIONS[i % len(QUESTIONS)], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            records.append({"i": i, "adapter": adapter, "replica": r.headers[REPLICA_HEADER],
                            "hit": r.headers[AFFINITY_HEADER] == "hit", "latency_s": time.perf_counter() - start})

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return sorted(records, key=lambda r: r["i"])


def run_one(args: argparse.Namespace, root: Path, k: int, sequence: list[str]) -> dict:
    config = RayServeConfig(
        engine=EngineConfig(model=args.model, max_loras=4, max_cpu_loras=8, max_lora_rank=8, kv_cache_blocks=512,
                            max_num_seqs=16),
        replicas=args.replicas, adapter_roots=(str(root),), max_adapters_per_replica=k,
        num_cpus_per_replica=1.0 / args.replicas, torch_threads=1, port=args.port,
    )
    start = time.perf_counter()
    url = ray_serve.deploy(config)
    startup = time.perf_counter() - start
    begin = time.perf_counter()
    records = asyncio.run(workload(url, sequence, args.concurrency, args.tokens))
    elapsed = time.perf_counter() - begin
    ray_serve.shutdown()
    warm = records[args.warmup:]
    share = Counter(r["replica"] for r in records)
    homes = {a: len({r["replica"] for r in records if r["adapter"] == a}) for a in sorted(set(sequence))}
    latencies = sorted(r["latency_s"] for r in records)
    return {
        "max_adapters_per_replica": k, "startup_s": startup, "requests": len(records),
        "hit_rate": sum(r["hit"] for r in records) / len(records),
        "hit_rate_after_warmup": sum(r["hit"] for r in warm) / max(len(warm), 1),
        "random_lru_sim_hit_rate": simulated_random_lru(sequence, args.replicas, k, args.seed),
        "replica_share": sorted((n / len(records) for n in share.values()), reverse=True),
        "replicas_per_adapter": homes, "requests_per_s": len(records) / elapsed,
        "p50_latency_s": statistics.median(latencies), "p95_latency_s": latencies[int(0.95 * (len(latencies) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-adapters-per-replica", default="2,4", help="comma-separated K values")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=40, help="first requests left out of the warm hit rate")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve()) if args.model else str(embedded_checkpoint())
    sequence = zipf_sequence(args.requests, NUM_ADAPTERS, args.zipf_s, args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_config = ModelConfig.from_hf(args.model)
        for k in range(1, NUM_ADAPTERS + 1):
            write_random_adapter(root / f"a{k}", model_config, rank=8, seed=k)
        start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray_init = time.perf_counter() - start
        try:
            rows = [run_one(args, root, int(k), sequence) for k in args.max_adapters_per_replica.split(",")]
        finally:
            ray.shutdown()

    print(f"# {machine_line()}; ray {ray.__version__}; model {Path(args.model).name}; {args.replicas} replicas")
    print(f"# {args.requests} requests x {args.tokens} tokens, concurrency {args.concurrency}, Zipf({args.zipf_s}) "
          f"over {NUM_ADAPTERS} adapters (share of a1: {sequence.count('a1') / len(sequence):.0%}); "
          f"ray.init {ray_init:.1f} s")
    print(f"{'K':>3} {'start-up s':>10} {'hit rate':>9} {'warm hit':>9} {'random LRU (sim)':>17} "
          f"{'replica share':>14} {'req/s':>6} {'p50 s':>6} {'p95 s':>6}")
    for r in rows:
        share = "/".join(f"{s:.0%}" for s in r["replica_share"])
        print(f"{r['max_adapters_per_replica']:>3} {r['startup_s']:>10.1f} {r['hit_rate']:>9.1%} "
              f"{r['hit_rate_after_warmup']:>9.1%} {r['random_lru_sim_hit_rate']:>17.1%} {share:>14} "
              f"{r['requests_per_s']:>6.1f} {r['p50_latency_s']:>6.2f} {r['p95_latency_s']:>6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_line(), "ray_init_s": ray_init,
                                              "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
