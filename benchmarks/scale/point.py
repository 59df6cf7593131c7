"""One point of ``benchmarks/scaling.py``, measured in its own process (so its peak RSS is its own):
``python -m benchmarks.scale.point '<Point as JSON>'`` prints one JSON line.

A point builds ``LLM(model, quantization, max_num_seqs=concurrency, max_loras, max_cpu_loras)`` with prefix
caching off and a KV cache sized to the point, warms it up (the same requests, 2 tokens each: kernels at this
shape, adapters into the caches as far as they fit), then sends ``requests``
prompts of ``context`` random token ids each (ids in [1000, 20000): valid for every model of the axis),
``new_tokens`` greedy tokens with EOS ignored, adapters drawn Zipf(1.0) over ``adapters`` registered ones
(0: the base model). Per point:
- ``tok_s``: generated tokens / wall seconds of the whole ``generate``; ``tok_per_cpu_s``: the same per second
  of this process's CPU time (every thread), which a busy shared host inflates far less than wall time;
- ``ttft_p50``: median over requests of (first token - arrival), from the engine's own instants;
- ``tpot_p50``: median over requests of (end of ``generate`` - first token) / (new_tokens - 1) (all requests
  of a closed batch end on the same step when ``requests == concurrency``);
- ``decode_step_ms``: median wall time of the engine steps that were pure decode of the full batch;
- ``peak_rss_mib``: this process's peak resident memory;
- ``weight_bytes``: bytes of base weights one decode step reads (parameters x bytes per weight), and with it
  ``read_gb_s`` = weight_bytes / decode step: the effective read bandwidth (a bandwidth-bound step holds it
  constant across model sizes);
- ``gemm_floor_ms`` (float32 only, when ``floor`` is set): one decode step's bare matmuls at this batch with
  loraplex's packed kernels; decode step - floor is what attention, sampling and Python add.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import matmul_floors, peak_rss_mib, time_decode_steps
from benchmarks.scale import adapters as adapter_files
from benchmarks.scale.models import MODELS, checkpoint, parameter_count
from loraplex import LLM, SamplingParams
from loraplex.config import ModelConfig


@dataclass(frozen=True)
class Point:
    axis: str
    model: str = "smollm2-135m"
    context: int = 64
    concurrency: int = 1
    requests: int = 1
    new_tokens: int = 32
    adapters: int = 0
    max_loras: int = 8
    max_cpu_loras: int = 64
    floor: bool = False
    threads: int = 2


def kv_bytes(config: ModelConfig, point: Point) -> int:
    """KV cache for every running sequence at full length, float32, plus 25 % and 64 blocks of slack."""
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    tokens = point.concurrency * (point.context + point.new_tokens + 32)
    return int(per_token * (tokens * 1.25 + 64 * 16))


def gemm_floor(llm: LLM, batch: int, repeats: int = 5) -> float:
    """Median ms of one decode step's matmuls alone (loraplex's packed kernels) at ``batch`` tokens."""
    loop = matmul_floors(llm.engine.model, batch)["packed_gemm_floor"]
    runs = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            loop()
            runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs[1:])


def measure(point: Point) -> dict:
    torch.set_num_threads(point.threads)
    spec = MODELS[point.model]
    folder = checkpoint(spec)
    config = ModelConfig.from_hf(folder)
    llm = LLM(model=folder, quantization=spec.quantization, max_num_seqs=point.concurrency,
              max_loras=point.max_loras, max_cpu_loras=point.max_cpu_loras, enable_prefix_caching=False,
              kv_cache_bytes=kv_bytes(config, point))
    names = adapter_files.register(llm, config, point.adapters)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(point.context)] for _ in range(point.requests)]
    drawn = adapter_files.zipf(names, point.requests, rng) if names else [None] * point.requests
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, warm, adapters=drawn, use_tqdm=False)  # kernels at this shape; adapters into the cache
    steps, _ = time_decode_steps(llm.engine, point.concurrency)
    params = SamplingParams(max_tokens=point.new_tokens, temperature=0.0, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, adapters=drawn, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    end = time.time()
    ttft = [o.times.first_token - o.times.arrival for o in outs]
    tpot = [(end - o.times.first_token) / (point.new_tokens - 1) for o in outs]
    step_ms = statistics.median(steps) if steps else None
    weight_bytes = parameter_count(spec) * (1 if spec.quantization == "int8" else 4)
    generated = sum(len(o.token_ids) for o in outs)
    out = {**asdict(point), "tok_s": generated / elapsed, "seconds": elapsed, "tok_per_cpu_s": generated / cpu,
           "ttft_p50": statistics.median(ttft), "tpot_p50": statistics.median(tpot), "decode_step_ms": step_ms,
           "weight_bytes": weight_bytes, "read_gb_s": weight_bytes / step_ms / 1e6 if step_ms else None,
           "distinct_adapters_used": len(set(drawn) - {None})}
    if point.floor and spec.quantization is None:
        out["gemm_floor_ms"] = gemm_floor(llm, point.concurrency)
    out["peak_rss_mib"] = peak_rss_mib()
    return out


if __name__ == "__main__":
    print(json.dumps(measure(Point(**json.loads(sys.argv[1])))))
