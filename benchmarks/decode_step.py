"""Decode-step overhead: one batch-32 decode step through ``ModelRunner.execute`` vs its bare matmuls.

The floor is a loop of ``F.linear`` over the model's weights (q/k/v and gate/up packed, as the model
runs them) for the same 32 tokens, plus the lm_head; ``packed_gemm_floor_ms`` is the same loop with
loraplex's oneDNN-packed weights (``loraplex.ops.dense``). Everything else the step does (embedding,
norms, rotary, KV writes and gathers, attention, metadata) is overhead. All are timed interleaved in
one run (this host drifts 20-50 % between runs). Prints a table; ``--out PATH`` writes JSON
(``decode_step_ms``, ``gemm_floor_ms``, ``packed_gemm_floor_ms``).

    .venv/bin/python benchmarks/decode_step.py [--batch 32] [--context 100] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from benchmarks.common import matmul_floors
from loraplex.engine.kv_cache import BlockManager, KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(embedded_checkpoint(), None, 4, 16, torch.float32, "cpu")
    cfg, block_size = model.config, 16
    blocks_per_seq = (args.context + 10 + block_size) // block_size
    kv = KVCache(cfg, args.batch * blocks_per_seq, block_size, torch.float32, "cpu")
    for t in kv.kv:
        t.normal_()  # timing only: the cache content does not matter
    allocator = BlockManager(kv.num_blocks, block_size, enable_caching=False)
    tables = [tuple(allocator.allocate(blocks_per_seq, None)) for _ in range(args.batch)]
    starts = torch.randint(args.context - 10, args.context + 10, (args.batch,)).tolist()
    tokens = torch.randint(0, cfg.vocab_size, (args.batch,)).tolist()
    entries = [StepEntry((tok,), s, t) for tok, s, t in zip(tokens, starts, tables, strict=True)]
    runner = ModelRunner(model, kv, block_size)
    loops = {"decode_step": lambda: runner.execute(entries, None), **matmul_floors(model, args.batch)}
    times: dict[str, list[float]] = {name: [] for name in loops}
    with torch.inference_mode():
        for i in range(args.iters + 2):
            for name, loop in loops.items():
                start = time.perf_counter()
                loop()
                if i >= 2:  # warm-up
                    times[name].append((time.perf_counter() - start) * 1e3)
    result = {"batch": args.batch, "context": args.context, "threads": args.threads,
              "load_average": os.getloadavg()[0]}
    result.update({f"{name}_ms": statistics.median(t) for name, t in times.items()})
    result["ratio"] = result["decode_step_ms"] / result["gemm_floor_ms"]
    result["ratio_to_packed"] = result["decode_step_ms"] / result["packed_gemm_floor_ms"]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus (load {load}), "
          f"torch {torch.__version__}, {args.threads} threads")
    print(f"{'batch':>5} {'context':>7} {'decode_step_ms':>14} {'gemm_floor_ms':>13} {'ratio':>6} "
          f"{'packed_floor_ms':>15} {'ratio':>6}")
    print(f"{args.batch:>5} {args.context:>7} {result['decode_step_ms']:>14.1f} {result['gemm_floor_ms']:>13.1f} "
          f"{result['ratio']:>6.3f} {result['packed_gemm_floor_ms']:>15.1f} {result['ratio_to_packed']:>6.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
