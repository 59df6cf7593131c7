"""DoRA's step cost: the same SmolLM2 batch through ``ModelRunner.execute`` with LoRA adapters and with
DoRA adapters of the same ranks (same A and B, plus magnitudes), and with no adapter, interleaved.

DoRA folds ``g = m / ||W + B A||`` once per adapter version at load (``CausalLM.prepare``, timed here
for one adapter as ``fold_ms``), so a step adds one per-row scale per adapted projection. Target: DoRA
step <= 1.05x the LoRA step. Decode: ``--batch`` one-token entries over ``--adapters`` rank-``--rank``
adapters on all seven projections; prefill: one 32-token chunk per adapter. Prints a table; writes JSON (``--out``).

    .venv/bin/python -m benchmarks.dora_step [--batch 32] [--adapters 8] [--rank 16] [--iters 10]
    .venv/bin/python -m benchmarks.dora_step --threads 1 --clock thread   # on a busy host
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import torch

from benchmarks.common import add_step_options, machine_line, step_clock, step_header, write_json, write_random_adapter
from loraplex.adapters.reading.peft_format import read_peft_adapter
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.loader import load_model
from loraplex.ops.lora_batch import BatchMapping, build_lora_batch


def dora_version(weights, seed: int):  # noqa: ANN001, ANN201 - AdapterWeights
    """``weights`` as a folded DoRA adapter with scales g ~ U(0.9, 1.1) (a trained adapter's are near 1;
    the step's cost does not depend on their values, so the fold itself is timed once, separately)."""
    gen = torch.Generator().manual_seed(seed)
    scales = {key: 0.9 + 0.2 * torch.rand(b.shape[0], generator=gen) for key, (_, b) in weights.modules.items()}
    return replace(weights, magnitudes=MappingProxyType(scales), dora_scales=MappingProxyType(scales))


def lora_batch(slots: list[int], counts: list[int]):  # noqa: ANN201 - a LoRABatch
    """Sequence i reads slot ``slots[i]`` for its ``counts[i]`` tokens (ids are slots here)."""
    mapping = BatchMapping.from_sequences(list(zip(slots, counts, strict=True)))
    return build_lora_batch(mapping, {s: s for s in set(slots)}, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_options(parser, iters=10)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/dora_step.json")
    args = parser.parse_args()
    clock = step_clock(parser, args)
    torch.manual_seed(0)
    n = args.adapters
    model = load_model(embedded_checkpoint(), None, 2 * n, args.rank, torch.float32, "cpu")
    model.pack_dense()
    cfg, block_size = model.config, 16
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            folder = write_random_adapter(Path(tmp) / f"a{i}", cfg, args.rank, seed=i)
            weights = read_peft_adapter(folder, cfg, args.rank)
            model.set_slot(i, weights)  # slots [0, n): LoRA
            model.set_slot(n + i, dora_version(weights, seed=i))  # slots [n, 2n): the same adapters as DoRA
    magnitudes = MappingProxyType({key: torch.ones(b.shape[0]) for key, (_, b) in weights.modules.items()})
    start = time.perf_counter()
    model.prepare(replace(weights, magnitudes=magnitudes))  # the fold a DoRA load runs, once per version
    fold_ms = (time.perf_counter() - start) * 1e3
    per_seq = (args.context + 80 + block_size) // block_size
    kv = KVCache(cfg, (args.batch + n) * per_seq, block_size, torch.float32, "cpu")
    allocator = BlockManager(kv.num_blocks, kv.block_size, enable_caching=False)
    runner = ModelRunner(model, kv, block_size)
    decode = [StepEntry((int(t),), args.context, tuple(allocator.allocate(per_seq, None)))
              for t in torch.randint(0, cfg.vocab_size, (args.batch,))]
    prefill = [StepEntry(tuple(torch.randint(0, cfg.vocab_size, (32,)).tolist()), 0,
                         tuple(allocator.allocate(per_seq, None))) for _ in range(n)]
    shapes = {"decode": (decode, [i % n for i in range(args.batch)]), "prefill": (prefill, list(range(n)))}
    results: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for shape, (entries, slots) in shapes.items():
            counts = [len(e.token_ids) for e in entries]
            batches = {"lora": lora_batch(slots, counts), "dora": lora_batch([s + n for s in slots], counts),
                       "base": None}
            times: dict[str, list[float]] = {name: [] for name in batches}
            for it in range(args.iters + 2):
                for name, lora in batches.items():
                    start = clock()
                    runner.execute(entries, lora)
                    if it >= 2:
                        times[name].append((clock() - start) * 1e3)
            ratios = [d / lo for d, lo in zip(times["dora"], times["lora"], strict=True)]
            results[shape] = {**{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                              **{f"{k}_min_ms": min(v) for k, v in times.items()},
                              "dora_over_lora": statistics.median(ratios), "ratio_min": min(ratios),
                              "ratio_max": max(ratios),
                              "min_dora_over_min_lora": min(times["dora"]) / min(times["lora"])}
    print(step_header(args))
    print(f"# SmolLM2-135M fp32, {n} rank-{args.rank} adapters on all 7 projections; "
          f"DoRA fold at load: {fold_ms:.0f} ms per adapter version")
    print("# median ms (min ms); DoRA/LoRA: median of the per-round ratios (range), and min over min")
    print(f"{'shape':>8} {'tokens':>6} {'base':>15} {'LoRA':>15} {'DoRA':>15} {'DoRA/LoRA':>9} {'range':>13} "
          f"{'min/min':>7}")
    for shape, r in results.items():
        tokens = sum(len(e.token_ids) for e in shapes[shape][0])
        cells = " ".join(f"{r[f'{k}_ms']:>7.1f} ({r[f'{k}_min_ms']:>5.1f})" for k in ("base", "lora", "dora"))
        print(f"{shape:>8} {tokens:>6} {cells} {r['dora_over_lora']:>9.3f} {r['ratio_min']:>6.3f}-{r['ratio_max']:.3f} "
              f"{r['min_dora_over_min_lora']:>7.3f}")
    write_json(args.out, {"config": vars(args), "load_average": os.getloadavg(), "fold_ms": fold_ms,
                          "machine": machine_line(), **results})


if __name__ == "__main__":
    main()
