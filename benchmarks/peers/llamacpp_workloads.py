"""The adapter, long-prompt and serving workloads of ``llamacpp_bench``, run on one server already up.

Each server holds the same 8 PEFT adapters (``shared.adapter_set(8)``, rank 8/16 alternating; llama.cpp
gets them converted by its own ``convert_lora_to_gguf.py``) and is driven by ``loadgen`` (streamed
``/v1/completions``, greedy, EOS ignored; llama.cpp's requests name their adapter in the per-request
``lora`` list, see ``loadgen``). Workloads, each after one short warm-up of the same shape:
- ``conc8`` / ``conc32``: 8 / 32 requests sent at once on the base model;
- ``mixed8`` / ``mixed32``: 8 / 32 requests at once, request i on adapter ``a{i % 8}``;
- ``ttft512``: one request with a 512-token prompt (random token ids), 4 new tokens: its TTFT;
- ``sweep``: Poisson arrivals at each of ``rates`` (req/s), ``rate x duration`` requests (8 to 60),
  adapters Zipf(1.0) over the 8; a rate is *sustained* as ``serving.sustains`` decides.
"""

from __future__ import annotations

import asyncio
import random

from benchmarks.peers import loadgen, shared
from benchmarks.peers.serving import sustains

ADAPTERS = [f"a{i}" for i in range(8)]


def burst(url: str, prompts: list[list[int]], models: list[str], tokens: int, lora_ids: dict[str, int] | None,
          rate: float = 1e9, seed: int = shared.SEED) -> dict:
    """``len(models)`` requests (request i on ``models[i]``) at ``rate`` (default: all at once), summarized."""
    samples = asyncio.run(loadgen.run_load(url, prompts, models, rate=rate, max_tokens=tokens, seed=seed,
                                           lora_ids=lora_ids))
    out = loadgen.summarize(samples, rate)
    return {k: out[k] for k in ("tok_s", "req_s", "ttft", "tpot", "errors", "error_examples")} | (
        {"sustained": sustains(out)} if rate < 1e9 else {})


def closed_loops(url: str, base: str, prompts: list[list[int]], tokens: int,
                 lora_ids: dict[str, int] | None) -> dict:
    """``conc8``, ``conc32``, ``mixed8``, ``mixed32`` (see the module docstring), each warmed first."""
    out = {}
    for key, n, mixed in (("conc8", 8, False), ("conc32", 32, False), ("mixed8", 8, True), ("mixed32", 32, True)):
        models = [ADAPTERS[i % 8] if mixed else base for i in range(n)]
        burst(url, prompts[:n], models, 2, lora_ids)
        out[key] = burst(url, prompts[:n], models, tokens, lora_ids)
    return out


def ttft_long(url: str, base: str, lora_ids: dict[str, int] | None, length: int = 512) -> dict:
    """TTFT of one request with a ``length``-token prompt (warmed once with another such prompt)."""
    rng = random.Random(shared.SEED)
    warm, prompt = ([rng.randrange(1000, 20000) for _ in range(length)] for _ in range(2))
    burst(url, [warm], [base], 2, lora_ids)
    return burst(url, [prompt], [base], 4, lora_ids)


def sweep(url: str, prompts: list[list[int]], tokens: int, rates: list[float], duration: float,
          lora_ids: dict[str, int] | None) -> list[dict]:
    """The Poisson sweep: one point per rate, stopping after the first rate not sustained."""
    points = []
    for ri, rate in enumerate(rates):
        n = max(8, min(60, round(rate * duration)))
        draws = loadgen.popularity(ADAPTERS, "zipf", n, random.Random(100 + ri))
        point = {"rate": rate, **burst(url, prompts, draws, tokens, lora_ids, rate=rate, seed=shared.SEED + ri)}
        points.append(point)
        if not point["sustained"]:
            break
    return points
