"""Throughput of fair share per tenant against FCFS on the churn workload (SmolLM2-135M, float32, greedy, EOS
ignored): does ordering admissions by tenant cost throughput?

Workload: ``--adapters`` registered adapters (rank 16, all seven projections; ``--distinct`` weight files,
hard-linked under the other names), ``--requests`` requests whose adapters are drawn Zipf(1.0) over them,
``--tokens`` tokens each; ``max_loras`` 8, ``max_cpu_loras`` 64, ``max_num_seqs`` 32, prefix caching off. The
requests belong to ``--tenants`` tenants, the first sending 10x the requests of each other one (the
backlogged heavy tenant of the fairness test). Two engines stay up, ``scheduling_policy="fair"`` and
``"fcfs"``; every request is queued at once; ``--repeats`` interleaved rounds, median. Target: fair / fcfs
>= 0.95 in tokens per second. The engine steps and adapter slot writes of each run are printed too: they do
not depend on the host's load, so they show whether the policy itself costs batching or adapter swaps.

    python -m benchmarks.fairness [--adapters 128] [--requests 96] [--tokens 32] [--repeats 2]
                                  [--out benchmarks/results/fairness.json]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.adapter_loads import RANK, adapter_folders, zipf_names
from benchmarks.common import chat_prompts, machine_line, write_json
from loraplex import LLM, SamplingParams
from loraplex.config import ModelConfig
from loraplex.models.embedded import embedded_checkpoint


def tenant_plan(requests: int, tenants: int, seed: int = 0) -> list[str]:
    """Per request a tenant: ``t0`` has weight 10, the others 1 each, shuffled."""
    weights = [10] + [1] * (tenants - 1)
    return random.Random(seed).choices([f"t{i}" for i in range(tenants)], weights=weights, k=requests)


def timed(llm: LLM, prompts: list[list[int]], names: list[str], tenants: list[str], tokens: int, tag: str) -> dict:
    """Queue every request at once (each with its tenant), step until all finish; tokens per second."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = engine.adapters.counters()
    start = time.perf_counter()
    for i, (prompt, name, tenant) in enumerate(zip(prompts, names, tenants, strict=True)):
        engine.add_requests([(f"{tag}-{i}", prompt, params, name)], tenant=tenant)
    generated, steps = 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        generated += sum(len(out.token_ids) for out in engine.step() if out.finished)
    seconds = time.perf_counter() - start
    after = engine.adapters.counters()
    return {"tok_s": generated / seconds, "seconds": seconds, "steps": steps,
            "slot_writes": after["host_hits"] - before["host_hits"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=128)
    parser.add_argument("--distinct", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/fairness.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_config = ModelConfig.from_hf(embedded_checkpoint())
    root = Path(tempfile.mkdtemp(prefix="loraplex-fairness-"))
    try:
        folders = adapter_folders(root, model_config, args.adapters, args.distinct)
        names = zipf_names(args.adapters, args.requests)
        tenants = tenant_plan(args.requests, args.tenants)
        engines = {policy: LLM(max_loras=8, max_cpu_loras=64, max_num_seqs=32, max_lora_rank=RANK,
                               enable_prefix_caching=False, scheduling_policy=policy) for policy in ("fair", "fcfs")}
        for llm in engines.values():
            for i, folder in enumerate(folders):
                llm.load_adapter(f"a{i}", folder)
        prompts = chat_prompts(engines["fair"].tokenizer, args.requests)
        results: dict = {"machine": machine_line(), "load_average_start": os.getloadavg()[0], **vars(args)}
        for policy, llm in engines.items():  # warm-up
            timed(llm, prompts[:4], names[:4], tenants[:4], 2, f"warm-{policy}")
        runs: dict[str, list[dict]] = {policy: [] for policy in engines}
        for round_ in range(args.repeats):
            for policy, llm in engines.items():
                runs[policy].append(timed(llm, prompts, names, tenants, args.tokens, f"{policy}-{round_}"))
        for policy, r in runs.items():
            results[policy] = {"tok_s": statistics.median(x["tok_s"] for x in r), "runs": r}
        results["ratio"] = results["fair"]["tok_s"] / results["fcfs"]["tok_s"]
        results["load_average_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{results['machine']}; load average {results['load_average_start']:.1f} -> "
          f"{results['load_average_end']:.1f}")
    print(f"{'policy':<8}{'tok/s (median)':>16}  {'runs':<26}{'steps':<16}{'slot writes'}")
    for policy in ("fair", "fcfs"):
        r = results[policy]
        speeds = ", ".join(f"{x['tok_s']:.1f}" for x in r["runs"])
        steps = ", ".join(str(x["steps"]) for x in r["runs"])
        writes = ", ".join(str(x["slot_writes"]) for x in r["runs"])
        print(f"{policy:<8}{r['tok_s']:>16.1f}  {speeds:<26}{steps:<16}{writes}")
    print(f"fair / fcfs = {results['ratio']:.3f} (target >= 0.95)")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
