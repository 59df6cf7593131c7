"""Chunked prefill: what a step's token budget (``max_num_batched_tokens``) costs running streams and gives a
long prompt (issue 30 item 5).

Two streams decode (one with a rank-16 adapter on all seven projections, one on the base model); a long prompt
(random token ids, ``--prompt-tokens``) arrives. Per budget: the streams' time per output token before it came
(decode-only steps) and while it prefilled (p50 and max: their largest inter-token gap), and the long prompt's
time to its first token. Every step gives both streams a token (the decodes come out of the budget first), so
a stream's inter-token gap is the step's time. One engine, SmolLM2 float32 by default; the budget is switched
between rounds on the scheduler's config and every round's long prompt is fresh (no prefix-cache hits).

    .venv/bin/python -m benchmarks.chunked_prefill [--prompt-tokens 1024] [--budgets 64,128,256,512,2048]
        [--threads 1 --clock thread] [--json benchmarks/results/chunked_prefill.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import machine_line, write_json, write_random_adapter
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import SamplingParams

WARM_STEPS = 8  # decode-only steps measured before the long prompt arrives


def run_budget(engine: Engine, budget: int, prompt: list[int], clock: Callable[[], float]) -> dict:
    """One round at ``budget``: decode-only steps, then steps until the long prompt has its first token."""
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    victims = [engine.add_request(None, [1, 2, 3, 4, 5, 6, 7, 8], dataclasses.replace(params, max_tokens=2000),
                                  version_id=version) for version in (engine.adapters.resolve("a"), None)]
    started: set[str] = set()
    while len(started) < len(victims):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    decode = [_timed_step(engine, clock)[0] for _ in range(WARM_STEPS)]
    long_id = engine.add_request(None, prompt, dataclasses.replace(params, max_tokens=1))
    prefill, missed = [], 0
    while True:
        seconds, outputs = _timed_step(engine, clock)
        prefill.append(seconds)
        got = {o.request_id for o in outputs if o.new_token_ids}
        missed += sum(v not in got for v in victims)
        if long_id in got:
            break
    for rid in victims:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"budget": budget, "decode_tpot_ms": 1e3 * statistics.median(decode),
            "prefill_tpot_p50_ms": 1e3 * statistics.median(prefill), "prefill_tpot_max_ms": 1e3 * max(prefill),
            "long_ttft_s": sum(prefill), "prefill_steps": len(prefill), "victim_steps_without_token": missed}


def run_wave(engine: Engine, budget: int, prompts: list[list[int]], clock: Callable[[], float]) -> dict:
    """One round at ``budget``: ``prompts`` arrive together beside two decoding streams; the time until each
    has its first token (mean and last) and the streams' largest gap meanwhile: what a smaller budget costs
    admission, in time rather than in steps."""
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    victims = [engine.add_request(None, [1, 2, 3, 4, 5, 6, 7, 8], params, version_id=version)
               for version in (engine.adapters.resolve("a"), None)]
    started: set[str] = set()
    while len(started) < len(victims):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    wave = {engine.add_request(None, p, dataclasses.replace(params, max_tokens=1)) for p in prompts}
    elapsed, ttfts, gaps = 0.0, [], []
    while wave:
        seconds, outputs = _timed_step(engine, clock)
        elapsed += seconds
        gaps.append(seconds)
        got = {o.request_id for o in outputs if o.new_token_ids}
        ttfts += [elapsed] * len(wave & got)
        wave -= got
    for rid in victims:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"budget": budget, "wave": len(prompts), "wave_ttft_mean_s": statistics.mean(ttfts),
            "wave_ttft_last_s": max(ttfts), "wave_steps": len(gaps), "wave_stream_gap_max_ms": 1e3 * max(gaps)}


def _timed_step(engine: Engine, clock: Callable[[], float]) -> tuple[float, list]:
    start = clock()
    outputs = engine.step()
    return clock() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EngineConfig().model)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--budgets", default="64,128,256,512,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "thread"), default="thread",
                        help="thread: this thread's CPU time (needs --threads 1), which a busy host inflates less")
    parser.add_argument("--wave", type=int, default=16, help="short prompts arriving together (0: no wave rounds)")
    parser.add_argument("--wave-tokens", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread needs --threads 1")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    budgets = [int(b) for b in args.budgets.split(",")]
    engine = Engine(EngineConfig(model=args.model, max_loras=2, max_cpu_loras=2, max_num_seqs=args.wave + 4,
                                 max_num_batched_tokens=max(budgets), kv_cache_bytes=256 << 20))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        engine.load_adapter("a", write_random_adapter(Path(tmp) / "a", engine.model_config, 16, seed=1))
        run_budget(engine, budgets[0], torch.randint(0, vocab, (64,), generator=gen).tolist(), clock)  # warm-up
        rows = [run_budget(engine, b, torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist(), clock)
                for b in budgets]
        waves = [run_wave(engine, b, [torch.randint(0, vocab, (args.wave_tokens,), generator=gen).tolist()
                                      for _ in range(args.wave)], clock) for b in budgets if args.wave]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {machine_line()} (load {load}); {engine.model_name}, 2 streams, a {args.prompt_tokens}-token prompt "
          f"arrives; {args.clock} clock")
    print("| budget | decode-only TPOT ms | TPOT while it prefills p50 / max ms | max / decode-only | "
          "its TTFT s | prefill steps | stream steps without a token |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['budget']} | {r['decode_tpot_ms']:.0f} | {r['prefill_tpot_p50_ms']:.0f} / "
              f"{r['prefill_tpot_max_ms']:.0f} | {r['prefill_tpot_max_ms'] / r['decode_tpot_ms']:.1f}x | "
              f"{r['long_ttft_s']:.2f} | {r['prefill_steps']} | {r['victim_steps_without_token']} |")
    if waves:
        print(f"\n{args.wave} prompts of {args.wave_tokens} tokens arrive together beside the 2 streams:")
        print("| budget | wave TTFT mean / last s | steps | streams' largest gap ms |")
        print("|---:|---:|---:|---:|")
        for w in waves:
            print(f"| {w['budget']} | {w['wave_ttft_mean_s']:.2f} / {w['wave_ttft_last_s']:.2f} | {w['wave_steps']} | "
                  f"{w['wave_stream_gap_max_ms']:.0f} |")
    write_json(args.json, {"machine": machine_line(), "load": os.getloadavg(), "model": engine.model_name,
                           "prompt_tokens": args.prompt_tokens, "clock": args.clock, "rows": rows,
                           "waves": waves})


if __name__ == "__main__":
    main()
