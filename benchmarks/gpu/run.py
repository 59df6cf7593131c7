"""The GPU check, one command (under 5 minutes on one H200): run it when a GPU machine is lent.

1. versions (Python, torch, CUDA, Triton, the GPU);
2. the correctness gate: torch LoRA ops and Triton kernels against float64 on packed Llama-8B-shaped
   layers (float32 and bfloat16, decode and prefill, ranks 1..16 mixed, projections left out);
3. per layer (qkv, o, gate_up, down of Llama-3-8B, rank 16, bf16): median µs and achieved GB/s of the
   base GEMM, the torch LoRA delta and the Triton LoRA delta, decode batches over 1..128 adapters and a
   2048-token prefill;
4. a whole decode step of a Llama-3-8B-shaped model (random weights, bf16, 128 sequences at 512 tokens
   of context) with 0 / 8 / 32 / 128 adapters in the batch, torch ops vs Triton kernels;
5. ``tests/kernels`` on CUDA: the kernels' float64 oracle, the graph-state simulation and the engine's
   HF + PEFT reference tests with ``lora_kernels="triton"``.

``--dry-run`` runs every section end to end on CPU at tiny shapes with Triton's interpreter (its timings
are the interpreter's, not a GPU's). Exits 1 if the gate or the tests fail. Writes JSON to ``--out``
(default ``benchmarks/results/gpu.json``; none in a dry run unless given).

    .venv/bin/python -m benchmarks.gpu.run [--dry-run] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu.decode import decode_steps, llama_config
from benchmarks.gpu.layers import Shapes, gate, timings

ROOT = Path(__file__).resolve().parents[2]
FULL = {"shapes": Shapes(hidden=4096, kv=1024, intermediate=14336, rank=16, max_loras=128),
        "gate_cases": [("decode", 64, 8), ("prefill", 512, 4)],
        "layer_cases": [("decode", 32, 1), ("decode", 32, 8), ("decode", 128, 32), ("decode", 128, 128),
                        ("prefill", 2048, 4)],
        "layer_reps": 50, "model": llama_config(4096, 14336, 32, 32, 8, 128256), "adapter_counts": [0, 8, 32, 128],
        "batch": 128, "context": 512, "decode_reps": 10, "tests": ["tests/kernels"]}
DRY = {"shapes": Shapes(hidden=64, kv=16, intermediate=128, rank=8, max_loras=8),
       "gate_cases": [("decode", 8, 3), ("prefill", 24, 2)], "layer_cases": [("decode", 8, 4), ("prefill", 32, 2)],
       "layer_reps": 1, "model": llama_config(64, 128, 2, 4, 2, 512), "adapter_counts": [0, 2, 4, 8],
       "batch": 8, "context": 20, "decode_reps": 1, "tests": ["tests/kernels/test_engine_triton.py"]}


def make_timer(device: torch.device) -> Callable[[dict[str, Callable[[], None]], int], dict[str, float]]:
    """Median µs of each variant over ``reps`` interleaved rounds, after one warm-up call each."""
    def once(fn: Callable[[], None]) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def timer(variants: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
        for fn in variants.values():
            fn()  # compiles the kernels, fills the memos
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(reps):
            for name, fn in variants.items():
                samples[name].append(once(fn))
        return {name: statistics.median(s) for name, s in samples.items()}
    return timer


def versions(device: torch.device) -> dict:
    import triton

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "triton_interpreter": bool(triton.knobs.runtime.interpret),
            "device": str(device), "host": platform.node(), "load_average": os.getloadavg()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    info["commit"] = commit.stdout.strip() or None
    return info


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    if not rows:
        return
    cols = list(rows[0])
    cells = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU in Triton's interpreter")
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/results/gpu.json)")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before loraplex.ops.lora_triton defines its kernels
    elif not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run for the CPU rehearsal")
    plan, device = (DRY, torch.device("cpu")) if args.dry_run else (FULL, torch.device("cuda"))
    started = time.perf_counter()
    timer = make_timer(device)
    result = {"dry_run": args.dry_run, "versions": versions(device)}
    print(f"# loraplex GPU check{' (DRY RUN: CPU, Triton interpreter; timings are not GPU numbers)' * args.dry_run}")
    print(json.dumps(result["versions"]))
    result["gate"] = gate(plan["shapes"], device, plan["gate_cases"])
    print_table("correctness gate vs float64", result["gate"])
    result["layers"] = timings(plan["shapes"], device, plan["layer_cases"], plan["layer_reps"], timer)
    print_table("per layer, bf16, rank 16 (µs, GB/s)", result["layers"])
    result["decode"] = decode_steps(plan["model"], plan["adapter_counts"], plan["batch"], plan["context"],
                                    plan["shapes"].rank, torch.bfloat16, device, plan["decode_reps"], timer)
    print_table("decode step, Llama-shaped model, bf16 (ms, tokens/s)", result["decode"])
    print("\n## tests on the kernels' device:", " ".join(plan["tests"]), flush=True)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plan["tests"]],
                           cwd=ROOT, env=dict(os.environ), capture_output=True, text=True)
    print(tests.stdout[-4000:], tests.stderr[-2000:])
    result["tests_passed"] = tests.returncode == 0
    result["gate_passed"] = all(r["pass"] for r in result["gate"])
    result["seconds"] = time.perf_counter() - started
    verdict = {True: "PASS", False: "FAIL"}
    print(f"\ngate {verdict[result['gate_passed']]}, tests {verdict[result['tests_passed']]}, "
          f"{result['seconds']:.0f} s")
    out = args.out or (None if args.dry_run else "benchmarks/results/gpu.json")
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return 0 if result["gate_passed"] and result["tests_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
