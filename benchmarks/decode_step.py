"""Decode-step overhead: one batch-32 decode step through ``ModelRunner.execute`` vs its bare matmuls.

The floor is a loop of ``F.linear`` over the model's weights (q/k/v and gate/up packed, as the model
runs them) for the same 32 tokens, plus the lm_head; ``packed_gemm_floor_ms`` is the same loop with
loraplex's oneDNN-packed weights (``loraplex.ops.dense``). Everything else the step does (embedding,
norms, rotary, KV writes, attention, metadata) is overhead. All are timed interleaved in one run (this
host drifts 20-50 % between runs). ``--adapters N`` adds the same step with N rank-16 adapters on all
seven projections (token i reads adapter i % N; ``--sorted``: tokens grouped by slot), its LoRA part
(``lora_ms`` = that step - the base step, with the LoRA kernels ``auto`` picks here;
``decode_step_lora_torch_ms`` / ``lora_torch_ms``: the same through the torch LoRA ops, interleaved; with
``--sgmv-avx2`` each sgmv LoRA step also runs on the kernel's AVX2 build, ``..._avx2_ms``) and the
LoRA part's byte floor: the adapters' bytes over the
read bandwidth of this machine measured in the same run (a sum over 256 MB). ``--lora-dtype bfloat16`` runs
the adapter steps on the same adapters rounded to bfloat16 slots (``EngineConfig.lora_dtype``), ``both``
interleaves the two (``decode_step_lora_bf16_ms``, ``lora_bf16_ms``, its byte floor at half the bytes; the
torch-ops LoRA step then runs on float32 slots only). ``--clock cpu`` times with
``time.process_time`` (steady on a busy host; use it with ``--threads 1``); ``--breakdown`` prints where
each step's CPU time goes (``benchmarks/step_breakdown.py``). ``decode_step_torch_ops`` is the base step
with the CPU step kernels off (``loraplex.ops.cpu_kernels``: the gather path and the torch pointwise
ops), ``decode_step_unfused`` the base step with only the fused ones off (rotary + K/V write + attention
in one kernel, each residual add fused with the next norm), in the same interleaved loop. Prints tables;
``--out PATH`` writes JSON.

    python -m benchmarks.decode_step [--batch 32] [--context 100] [--iters 10] [--threads 2]
        [--clock wall|cpu] [--adapters N [--sorted] [--lora-dtype float32|bfloat16|both] [--sgmv-avx2]] [--breakdown]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from types import SimpleNamespace

import torch

from benchmarks.common import matmul_floors
from benchmarks.step_breakdown import step_breakdown
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.layers import self_attention
from loraplex.layers.lora_linear import LoRALinear, use_lora_kernels
from loraplex.layers.norms import RMSNorm
from loraplex.models.base import CausalLM
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.loader import load_model
from loraplex.ops import cpu_kernels, lora_sgmv
from loraplex.ops.lora import resolve_lora_kernels
from loraplex.ops.lora_batch import BatchMapping, LoRABatch, build_lora_batch

RANK = 16


def write_adapters(model: CausalLM, count: int) -> int:
    """Random rank-16 adapters on every projection into slots ``0..count-1``; returns one adapter's bytes."""
    gen = torch.Generator().manual_seed(0)
    nbytes = 0
    for slot in range(count):
        modules = {(layer, name): (torch.randn(RANK, p.in_features, generator=gen) / p.in_features**0.5,
                                   torch.randn(p.out_features, RANK, generator=gen) * 0.09)
                   for layer in range(model.config.num_layers) for name, p in model.config.projections().items()}
        model.set_slot(slot, SimpleNamespace(modules=modules))
        nbytes = sum(a.nbytes + b.nbytes for a, b in modules.values())
    return nbytes


def lora_batch(batch: int, adapters: int, grouped: bool) -> LoRABatch:
    """Token i reads adapter i % adapters (i * adapters // batch when ``grouped``: sorted by slot)."""
    ids = [i * adapters // batch if grouped else i % adapters for i in range(batch)]
    return build_lora_batch(BatchMapping(tuple(ids)), {a: a for a in range(adapters)}, 0)


def read_bandwidth_loop() -> tuple[int, callable]:
    """A read of 256 MB (a sum: memory-bound), to turn bytes into a floor in ms on this machine now."""
    buffer = torch.ones(64 * 2**20)
    return buffer.nbytes, lambda: buffer.sum()


def torch_ops(runner: ModelRunner, entries: list[StepEntry]) -> None:
    """One base step with the CPU step kernels off (every caller takes its torch path)."""
    for_tensors = cpu_kernels.for_tensors
    cpu_kernels.for_tensors = lambda *tensors: None
    try:
        runner.execute(entries, None)
    finally:
        cpu_kernels.for_tensors = for_tensors


def unfused(runner: ModelRunner, entries: list[StepEntry]) -> None:
    """One base step with the fused kernels off: rotary, the K/V write + attention, each residual add and
    each norm as separate calls (the kernels' step before ``decode_attention_qkv`` / ``add_rms_norm``)."""
    fused_attention, add_and_norm = self_attention.fused_decode_attention, RMSNorm.add_and_norm

    def separate(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = residual + x
        return hidden, norm(hidden)

    self_attention.fused_decode_attention = lambda *args, **kwargs: None
    RMSNorm.add_and_norm = separate
    try:
        runner.execute(entries, None)
    finally:
        self_attention.fused_decode_attention, RMSNorm.add_and_norm = fused_attention, add_and_norm


def with_lora_kernels(linears: list[LoRALinear], kernels: str, step: callable) -> None:
    """``step()`` with the layers' LoRA delta on CPU ``kernels`` ("torch" or "sgmv"), then back."""
    saved = linears[0].lora_kernels
    for linear in linears:
        linear.lora_kernels = kernels
    try:
        step()
    finally:
        for linear in linears:
            linear.lora_kernels = saved


def with_sgmv_build(isa: str, step: callable) -> None:
    """``step()`` on the sgmv kernel's ``isa`` build (a key of ``lora_sgmv.ISA_FLAGS``), then back."""
    saved, module = lora_sgmv.kernel, lora_sgmv.kernel_build(isa)
    lora_sgmv.kernel = lambda: module
    try:
        step()
    finally:
        lora_sgmv.kernel = saved


def bfloat16_slots(linears: list[LoRALinear]) -> dict[LoRALinear, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's A and B slot buffers rounded to bfloat16 (B stays rank-major: ``.to`` keeps strides)."""
    return {linear: (linear.lora_a.bfloat16(), linear.lora_b.bfloat16()) for linear in linears}


def with_slots(slots: dict[LoRALinear, tuple[torch.Tensor, torch.Tensor]], step: callable) -> None:
    """``step()`` with each layer's A and B buffers swapped for ``slots``' (same adapters), then back."""
    saved = {linear: (linear.lora_a, linear.lora_b) for linear in slots}
    for linear, (a, b) in slots.items():
        linear.lora_a, linear.lora_b = a, b
        linear.lora_cache.clear()
    try:
        step()
    finally:
        for linear, (a, b) in saved.items():
            linear.lora_a, linear.lora_b = a, b
            linear.lora_cache.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--sorted", action="store_true", help="tokens grouped by slot (with --adapters)")
    parser.add_argument("--lora-dtype", choices=("float32", "bfloat16", "both"), default="float32",
                        help="adapter slot dtype of the --adapters steps (both: interleaved)")
    parser.add_argument("--sgmv-avx2", action="store_true",
                        help="also each sgmv LoRA step on the kernel's AVX2 build (A/B against the AVX-512 one)")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    model = load_model(embedded_checkpoint(), None, max(4, args.adapters), RANK, torch.float32, "cpu")
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
    lora_kernels = resolve_lora_kernels("auto", torch.device("cpu"))
    use_lora_kernels(model, lora_kernels, 0)
    steps = {"decode_step": lambda: runner.execute(entries, None),
             "decode_step_unfused": lambda: unfused(runner, entries),
             "decode_step_torch_ops": lambda: torch_ops(runner, entries)}
    if args.adapters:
        adapter_bytes = write_adapters(model, args.adapters)
        mixed = lora_batch(args.batch, args.adapters, args.sorted)
        linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
        bf16 = bfloat16_slots(linears) if args.lora_dtype != "float32" else {}
        if args.lora_dtype != "bfloat16":
            steps["decode_step_lora"] = lambda: runner.execute(entries, mixed)
        if bf16:
            steps["decode_step_lora_bf16"] = lambda: with_slots(bf16, lambda: runner.execute(entries, mixed))
        if lora_kernels != "torch" and args.lora_dtype != "bfloat16":
            steps["decode_step_lora_torch"] = lambda: with_lora_kernels(
                linears, "torch", lambda: runner.execute(entries, mixed))
        if args.sgmv_avx2 and lora_kernels == "sgmv":
            for name in ("decode_step_lora", "decode_step_lora_bf16"):
                if name in steps:
                    steps[f"{name}_avx2"] = lambda step=steps[name]: with_sgmv_build("avx2", step)
    read_bytes, read_loop = read_bandwidth_loop()
    loops = {**steps, **matmul_floors(model, args.batch), "read_256MB": read_loop}
    times: dict[str, list[float]] = {name: [] for name in loops}
    with torch.inference_mode():
        for i in range(args.iters + 2):
            for name, loop in loops.items():
                start = clock()
                loop()
                if i >= 2:  # warm-up
                    times[name].append((clock() - start) * 1e3)
        breakdowns = {name: step_breakdown(step, args.iters) for name, step in steps.items()} if args.breakdown else {}
    result = {"batch": args.batch, "context": args.context, "threads": args.threads, "clock": args.clock,
              "load_average": os.getloadavg()[0], "lora_dtype": args.lora_dtype}
    result.update({f"{name}_ms": statistics.median(t) for name, t in times.items()})
    result["read_gb_s"] = read_bytes / result["read_256MB_ms"] / 1e6
    result["ratio"] = result["decode_step_ms"] / result["gemm_floor_ms"]
    result["ratio_to_packed"] = result["decode_step_ms"] / result["packed_gemm_floor_ms"]
    result["torch_ops_ratio_to_packed"] = result["decode_step_torch_ops_ms"] / result["packed_gemm_floor_ms"]
    result["unfused_ratio_to_packed"] = result["decode_step_unfused_ms"] / result["packed_gemm_floor_ms"]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus (load {load}), "
          f"torch {torch.__version__}, {args.threads} threads, {args.clock} clock")
    print(f"{'batch':>5} {'context':>7} {'decode_step_ms':>14} {'gemm_floor_ms':>13} {'ratio':>6} "
          f"{'packed_floor_ms':>15} {'ratio':>6}")
    print(f"{args.batch:>5} {args.context:>7} {result['decode_step_ms']:>14.1f} {result['gemm_floor_ms']:>13.1f} "
          f"{result['ratio']:>6.3f} {result['packed_gemm_floor_ms']:>15.1f} {result['ratio_to_packed']:>6.3f}")
    print(f"fused kernels off (separate rotary, attention, adds, norms): {result['decode_step_unfused_ms']:.1f} ms, "
          f"{result['unfused_ratio_to_packed']:.3f}x the packed floor")
    print(f"kernels off (torch ops): {result['decode_step_torch_ops_ms']:.1f} ms, "
          f"{result['torch_ops_ratio_to_packed']:.3f}x the packed floor")
    if "decode_step_lora_bf16_ms" in result:
        result.update(lora_bf16_ms=result["decode_step_lora_bf16_ms"] - result["decode_step_ms"],
                      lora_byte_floor_bf16_ms=args.adapters * adapter_bytes / 2e6 / result["read_gb_s"],
                      mixed_over_base_bf16=result["decode_step_ms"] / result["decode_step_lora_bf16_ms"])
        print(f"\n{args.adapters} adapters in bfloat16 slots: step {result['decode_step_lora_bf16_ms']:.1f} ms, LoRA "
              f"part {result['lora_bf16_ms']:.1f} ms, byte floor {result['lora_byte_floor_bf16_ms']:.1f} ms "
              f"({args.adapters} x {adapter_bytes / 2e6:.1f} MB), base / mixed {result['mixed_over_base_bf16']:.3f}")
    if "decode_step_lora_ms" in result:
        result.update(adapters=args.adapters, sorted=args.sorted, adapter_mb=adapter_bytes / 1e6,
                      lora_ms=result["decode_step_lora_ms"] - result["decode_step_ms"],
                      lora_byte_floor_ms=args.adapters * adapter_bytes / 1e6 / result["read_gb_s"],
                      lora_kernels=lora_kernels, lora_method=mixed.method)
        result["mixed_over_base"] = result["decode_step_ms"] / result["decode_step_lora_ms"]
        print(f"\n{args.adapters} adapters ({'sorted by slot' if args.sorted else 'interleaved'}, LoRA kernels "
              f"{lora_kernels}): step {result['decode_step_lora_ms']:.1f} ms, LoRA part {result['lora_ms']:.1f} ms, "
              f"byte floor {result['lora_byte_floor_ms']:.1f} ms ({args.adapters} x {adapter_bytes / 1e6:.1f} MB "
              f"at {result['read_gb_s']:.1f} GB/s), base / mixed step time {result['mixed_over_base']:.3f}")
        if "decode_step_lora_torch_ms" in result:
            result["lora_torch_ms"] = result["decode_step_lora_torch_ms"] - result["decode_step_ms"]
            result["mixed_over_base_torch"] = result["decode_step_ms"] / result["decode_step_lora_torch_ms"]
            print(f"torch LoRA ops (method {mixed.method}), same run: step {result['decode_step_lora_torch_ms']:.1f} "
                  f"ms, LoRA part {result['lora_torch_ms']:.1f} ms, base / mixed {result['mixed_over_base_torch']:.3f}")
    for name in ("decode_step_lora_avx2", "decode_step_lora_bf16_avx2"):
        if f"{name}_ms" in result:
            lora_part = result[f"{name}_ms"] - result["decode_step_ms"]
            result[name.replace("decode_step_", "") + "_ms"] = lora_part
            print(f"{name.replace('decode_step_', '')}: LoRA part {lora_part:.1f} ms on the sgmv AVX2 build, base / "
                  f"mixed {result['decode_step_ms'] / result[f'{name}_ms']:.3f}")
    for name, parts in breakdowns.items():
        result[f"{name}_breakdown_ms"] = parts
        print(f"\n{name}: CPU ms per step ({args.threads} thread(s))")
        for part, ms in parts.items():
            print(f"  {part:28s} {ms:7.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
