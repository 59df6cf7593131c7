"""An open-loop HTTP load generator: Poisson arrivals, adapters drawn by popularity, streamed completions.

Each request is ``POST /v1/completions`` with ``model`` = an adapter name, ``prompt`` = token ids,
greedy, ``ignore_eos``, ``max_tokens`` new tokens, ``stream`` with a final usage chunk. Per request:
TTFT = first streamed token - send time; TPOT = (last token - first token) / (tokens - 1); an error
is a non-200 status, an error event, a transport failure, or a count of tokens other than asked.

For llama.cpp's ``llama-server`` (``lora_ids`` given: adapter name -> the server's LoRA id), a request's
adapter is its per-request ``lora`` list, ``[{"id": i, "scale": 1.0}]`` (``[]``: the base model, for a
name not in ``lora_ids``), with ``cache_prompt: false``; ``model`` then only names the server's alias.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import httpx


@dataclass
class Sample:
    adapter: str
    sent: float  # seconds since the run started
    ttft: float | None = None
    tpot: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None


def popularity(names: list[str], dist: str, n: int, rng: random.Random) -> list[str]:
    """``n`` draws from ``names``: ``uniform`` or ``zipf`` (P(rank k) ~ 1 / k, exponent 1.0)."""
    weights = [1.0] * len(names) if dist == "uniform" else [1.0 / (k + 1) for k in range(len(names))]
    return rng.choices(names, weights=weights, k=n)


def request_body(adapter: str, prompt: list[int], max_tokens: int, lora_ids: dict[str, int] | None) -> dict:
    """The streamed, greedy, EOS-ignoring completion request for ``adapter`` (see the module docstring)."""
    body = {"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if lora_ids is not None:
        lora = [{"id": lora_ids[adapter], "scale": 1.0}] if adapter in lora_ids else []
        body.update(model="llamacpp", lora=lora, cache_prompt=False)
    return body


async def one_request(client: httpx.AsyncClient, url: str, sample: Sample, prompt: list[int], max_tokens: int,
                      t0: float, lora_ids: dict[str, int] | None = None) -> None:
    body = request_body(sample.adapter, prompt, max_tokens, lora_ids)
    first = last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                sample.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    sample.error = str(event["error"])[:200]
                    return
                if event.get("usage"):
                    sample.tokens = event["usage"]["completion_tokens"]
                choice = (event.get("choices") or [{}])[0]
                if choice.get("text") or (choice.get("text") == "" and choice.get("finish_reason") is None):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    sample.end = time.perf_counter() - t0
    if first is None or sample.tokens != max_tokens:
        sample.error = f"got {sample.tokens} tokens in {chunks} chunks, asked {max_tokens}"
        return
    sample.ttft = first - t0 - sample.sent
    sample.tpot = (last - first) / (sample.tokens - 1)


async def run_load(base_url: str, prompts: list[list[int]], adapters: list[str], rate: float, max_tokens: int,
                   seed: int, lora_ids: dict[str, int] | None = None) -> list[Sample]:
    """Send ``len(adapters)`` requests (prompt i % len(prompts), adapter i) at Poisson ``rate`` req/s
    (``lora_ids``: llama-server's per-request ``lora`` field, see the module docstring)."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in adapters]
    limits = httpx.Limits(max_connections=len(adapters) + 8, max_keepalive_connections=len(adapters) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        tasks, at = [], 0.0
        for i, adapter in enumerate(adapters):
            at += gaps[i]
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            sample = Sample(adapter=adapter, sent=time.perf_counter() - t0)
            tasks.append((sample, asyncio.create_task(
                one_request(client, f"{base_url}/v1/completions", sample, prompts[i % len(prompts)], max_tokens, t0,
                             lora_ids))))
        await asyncio.gather(*(t for _, t in tasks))
    return [s for s, _ in tasks]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(samples: list[Sample], rate: float) -> dict:
    ok = [s for s in samples if s.error is None]
    span = max((s.end for s in ok), default=0.0) - min((s.sent for s in samples), default=0.0)
    out = {"rate": rate, "requests": len(samples), "errors": len(samples) - len(ok),
           "error_examples": sorted({s.error for s in samples if s.error})[:3],
           "req_s": len(ok) / span if span > 0 else 0.0,
           "tok_s": sum(s.tokens for s in ok) / span if span > 0 else 0.0}
    for key in ("ttft", "tpot"):
        vals = [getattr(s, key) for s in ok]
        out[key] = {f"p{q}": percentile(vals, q) for q in (50, 90, 99)}
    out["samples"] = [asdict(s) for s in samples]
    return out
