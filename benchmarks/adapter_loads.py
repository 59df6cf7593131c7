"""Adapter loads on SmolLM2-135M (float32): one cold load, and a 1,000-adapter churn workload.

- ``cold load``: wall time of ``LLM.load_adapter`` (read the PEFT folder, validate it against the model,
  fold the scale into B, put it in the host tier) for distinct rank-16 adapters on all seven projections
  (19 MB each), median and range; and of the first ``acquire`` (host tier -> a device slot). The files
  sit in the OS page cache (the host is shared: the cache is not dropped); the issue's target is <= 20 ms.
  CPU time (``thread_time``) is reported next to wall time: it does not move with the host's load.
- ``churn``: ``--adapters`` registered adapters (rank 16, all seven projections; ``--distinct`` different
  weight files, hard-linked under the other names to spare the disk), ``--requests`` requests whose
  adapters are drawn Zipf(1.0) over them, 64 tokens each, greedy, EOS ignored; ``max_loras`` 8,
  ``max_cpu_loras`` 64, ``max_num_seqs`` 32, against ``resident``: the same requests on an engine where
  every adapter they use was loaded into host memory before the run (no disk read while it runs). Both
  engines stay up; ``--repeats`` interleaved rounds (median). Target: churn / resident >= 0.80 (tokens/s);
  also printed: the same ratio in process CPU seconds (the background reader's included) and disk reads.

    python -m benchmarks.adapter_loads [--adapters 1000] [--distinct 64] [--requests 128] [--repeats 2]
                                       [--out benchmarks/results/adapter_loads.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import chat_prompts, machine_line, write_random_adapter
from loraplex import LLM, SamplingParams
from loraplex.config import ModelConfig
from loraplex.models.embedded import embedded_checkpoint

RANK = 16


def adapter_folders(root: Path, model_config: ModelConfig, count: int, distinct: int) -> list[Path]:
    """``count`` adapter folders; folder i holds weights file ``i % distinct`` (hard links past the first)."""
    folders = []
    for i in range(count):
        folder = root / f"a{i}"
        if i < distinct:
            write_random_adapter(folder, model_config, rank=RANK, seed=i)
        else:
            source = root / f"a{i % distinct}"
            folder.mkdir()
            shutil.copy(source / "adapter_config.json", folder / "adapter_config.json")
            os.link(source / "adapter_model.safetensors", folder / "adapter_model.safetensors")
        folders.append(folder)
    return folders


def cold_loads(llm: LLM, folders: list[Path]) -> dict:
    """Time ``load_adapter`` and then the first ``acquire`` of each folder (distinct weight files)."""
    loads, cpu, acquires = [], [], []
    manager = llm.engine.adapters
    for i, folder in enumerate(folders):
        start, start_cpu = time.perf_counter(), time.thread_time()
        info = llm.load_adapter(f"cold{i}", folder)
        loads.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.thread_time() - start_cpu) * 1e3)
        start = time.perf_counter()
        manager.acquire(info.version_id)
        acquires.append((time.perf_counter() - start) * 1e3)
        manager.release(info.version_id)
        llm.unload_adapter(f"cold{i}")
    return {"load_ms": statistics.median(loads), "load_ms_min": min(loads), "load_ms_max": max(loads),
            "load_cpu_ms": statistics.median(cpu),
            "acquire_ms": statistics.median(acquires), "loads": len(loads)}


def zipf_names(count: int, requests: int, seed: int = 0) -> list[str]:
    """Per request an adapter name, P(adapter k) proportional to 1 / (k + 1)."""
    weights = [1.0 / (k + 1) for k in range(count)]
    return [f"a{k}" for k in random.Random(seed).choices(range(count), weights=weights, k=requests)]


def timed(llm: LLM, prompts: list[list[int]], names: list[str], tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = llm.engine.adapters.counters()
    start, start_cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, adapters=names, use_tqdm=False)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    after = llm.engine.adapters.counters()
    return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "seconds": seconds, "cpu_s": cpu_s,
            "disk_reads": after["disk_reads"] - before["disk_reads"],
            "slot_writes": after["host_hits"] - before["host_hits"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--distinct", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cold", type=int, default=20, help="distinct adapters timed for the cold load")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_config = ModelConfig.from_hf(embedded_checkpoint())
    root = Path(tempfile.mkdtemp(prefix="loraplex-loads-"))
    try:
        folders = adapter_folders(root, model_config, args.adapters, max(args.distinct, args.cold))
        results: dict = {"machine": machine_line(), "load_average_start": os.getloadavg()[0],
                         "adapters": args.adapters, "distinct_files": max(args.distinct, args.cold),
                         "requests": args.requests, "tokens": args.tokens, "repeats": args.repeats}
        names = zipf_names(args.adapters, args.requests)
        used = sorted(set(names), key=lambda n: int(n[1:]))
        # Prefix caching off: repeated runs reuse their prompts; this measures adapter loads, not cache hits.
        churn = LLM(max_loras=8, max_cpu_loras=64, max_num_seqs=32, max_lora_rank=RANK, enable_prefix_caching=False)
        results["cold"] = cold_loads(churn, folders[: args.cold])
        start = time.perf_counter()
        for i, folder in enumerate(folders):
            churn.load_adapter(f"a{i}", folder)
        results["register_all_s"] = time.perf_counter() - start
        resident = LLM(max_loras=8, max_cpu_loras=len(used), max_num_seqs=32, max_lora_rank=RANK,
                       enable_prefix_caching=False)
        for name in used:
            resident.load_adapter(name, folders[int(name[1:])])
        prompts = chat_prompts(churn.tokenizer, args.requests)
        runs: dict[str, list[dict]] = {"churn": [], "resident": []}
        for llm in (churn, resident):  # warm-up
            llm.generate(prompts[:4], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        for _ in range(args.repeats):
            runs["churn"].append(timed(churn, prompts, names, args.tokens))
            runs["resident"].append(timed(resident, prompts, names, args.tokens))
        for key, r in runs.items():
            results[key] = {"tok_s": statistics.median(x["tok_s"] for x in r), "runs": r}
        results["distinct_used"] = len(used)
        results["ratio"] = results["churn"]["tok_s"] / results["resident"]["tok_s"]
        # the same ratio in process CPU time (every thread, the background reader's too): steadier on a shared host
        results["cpu_ratio"] = (statistics.median(x["cpu_s"] for x in runs["resident"])
                                / statistics.median(x["cpu_s"] for x in runs["churn"]))
        results["load_average_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cold = results["cold"]
    print(f"\n{results['machine']}; load average {results['load_average_start']:.1f} -> "
          f"{results['load_average_end']:.1f}")
    print(f"cold load (read, validate, fold, host tier), rank {RANK}, 7 projections: median {cold['load_ms']:.1f} ms "
          f"(range {cold['load_ms_min']:.1f}-{cold['load_ms_max']:.1f}, {cold['loads']} adapters; target <= 20; "
          f"CPU time {cold['load_cpu_ms']:.1f} ms); "
          f"first acquire (slot write) {cold['acquire_ms']:.1f} ms")
    print(f"registering {args.adapters} adapters took {results['register_all_s']:.1f} s")
    print(f"churn: {args.requests} requests, Zipf(1.0) over {args.adapters} adapters ({len(used)} used), "
          f"8 slots, host tier 64")
    for key in ("churn", "resident"):
        r = results[key]
        reads = [x["disk_reads"] for x in r["runs"]]
        each = ", ".join(f"{x['tok_s']:.1f}" for x in r["runs"])
        cpu = ", ".join(f"{x['cpu_s']:.1f}" for x in r["runs"])
        print(f"  {key:9s} {r['tok_s']:7.1f} tok/s  (runs {each}; process CPU s {cpu}; disk reads {reads})")
    print(f"  churn / resident = {results['ratio']:.2f}  (target >= 0.80); "
          f"in CPU time resident / churn = {results['cpu_ratio']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
