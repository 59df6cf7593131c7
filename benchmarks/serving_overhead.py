"""Serving overhead: the HTTP server against the engine's own ``LLM.generate``, same requests, one run.

Requests (issue 22): chat prompts as token ids, adapters cycling base, shout, meow, pirate (the demo
adapters), 64 new tokens, greedy, EOS ignored, streamed. Systems, all up at once:

- ``offline``:   ``LLM.generate`` in this process with ``max_num_seqs = C``: a closed loop of C clients
                 with no think time is exactly continuous batching of C requests;
- ``process``:   ``loraplex serve``: the engine in its own process (what users run);
- ``inprocess``: ``loraplex serve --in-process-engine``: the step loop in a thread of the API process
                 (the architecture before issue 22), with the same OpenMP policy;
- ``today``:     the same with OpenMP's default (spinning) policy: the server as it shipped before
                 issue 22, for the single-stream check only.

For each concurrency C (8, 16, 32): C clients (asyncio in this process) send ``--rounds`` requests each,
back to back: tok/s = tokens / wall time; TPOT p50 over the requests. Offline: tok/s of the same
requests, and the decode step (median step with all C sequences decoding). Then one stream at a
time (``--single`` requests): TTFT and TPOT p50. Rounds interleave the systems (order rotated).

Breakdown per served run: the engine's step time while serving (``loraplex_step_latency_seconds``
sum / count), the step period (wall / steps), and the CPU seconds per step of the API process (with
its workers) and of the engine process. Offline: step time, and its model forward, sampling and the
rest (scheduling, detokenization, bookkeeping).

This process's OpenMP threads wait the way the engine process's do (``OMP_WAIT_POLICY``, set below
before torch loads), so the offline baseline is not handicapped on a loaded host.

    .venv/bin/python -m benchmarks.serving_overhead [--repeats 2] [--concurrency 8,16,32]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: the engine process's default

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import psutil  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.common import chat_prompts  # noqa: E402
from benchmarks.peers import loadgen, shared  # noqa: E402
from benchmarks.peers.serving import start, stop  # noqa: E402
from benchmarks.serving_breakdown import OfflineTimer, ServedCounters  # noqa: E402
from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.client.launcher import OMP_WAIT_POLICY  # noqa: E402
from loraplex.demo_adapters import DEMO_ADAPTERS  # noqa: E402
from loraplex.models.embedded import embedded_checkpoint  # noqa: E402

MODEL = shared.MODEL_NAME
ADAPTERS = (None, *DEMO_ADAPTERS)  # request i uses ADAPTERS[i % 4]
# name -> (command prefix, serve flags); "today" is the server as it shipped before issue 22: the step
# loop in the API process, OpenMP threads spinning (the default policy); it runs the single-stream check.
SERVERS = {"process": ([], []), "inprocess": ([], ["--in-process-engine"]),
           "today": (["env", "-u", "OMP_WAIT_POLICY"], ["--in-process-engine"])}
SINGLE_ONLY = {"today"}


def requests_for(prompts: list[list[int]], n: int) -> list[tuple[list[int], str | None]]:
    return [(prompts[i % len(prompts)], ADAPTERS[i % len(ADAPTERS)]) for i in range(n)]


def run_offline(llm: LLM, timer: OfflineTimer, reqs: list[tuple[list[int], str | None]], concurrency: int,
                tokens: int) -> dict:
    llm.engine.scheduler.config = dataclasses.replace(llm.engine.config, max_num_seqs=concurrency)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    timer.reset(concurrency)
    start_t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, adapters=[a for _, a in reqs], use_tqdm=False)
    elapsed = time.perf_counter() - start_t
    return {"tok_s": sum(len(o.token_ids) for o in outs) / elapsed, **timer.summary()}


async def closed_loop(url: str, reqs: list[tuple[list[int], str | None]], concurrency: int,
                      tokens: int) -> list[loadgen.Sample]:
    """``concurrency`` clients; client k sends requests k, k + C, k + 2C, ... one after the other."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    samples: list[loadgen.Sample] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def worker(k: int) -> None:
            for prompt, adapter in reqs[k::concurrency]:
                sample = loadgen.Sample(adapter=adapter or MODEL, sent=time.perf_counter() - t0)
                samples.append(sample)
                await loadgen.one_request(client, f"{url}/v1/completions", sample, prompt, tokens, t0)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return samples


def served_point(url: str, counters: ServedCounters, reqs: list, concurrency: int, tokens: int) -> dict:
    counters.begin()
    start_t = time.perf_counter()
    samples = asyncio.run(closed_loop(url, reqs, concurrency, tokens))
    elapsed = time.perf_counter() - start_t
    ok = [s for s in samples if s.error is None]
    return {"tok_s": sum(s.tokens for s in ok) / elapsed, "errors": len(samples) - len(ok),
            "error_examples": sorted({s.error for s in samples if s.error})[:2],
            "ttft_ms": 1e3 * (loadgen.percentile([s.ttft for s in ok], 50) or 0),
            "tpot_ms": 1e3 * (loadgen.percentile([s.tpot for s in ok], 50) or 0), **counters.end(elapsed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=shared.RESULTS / "serving_overhead.json")
    parser.add_argument("--concurrency", default="8,16,32")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--single", type=int, default=6, help="requests for single-stream TTFT/TPOT")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--systems", default="offline,process,inprocess,today")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    systems = args.systems.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = chat_prompts(AutoTokenizer.from_pretrained(embedded_checkpoint()), 64, seed=shared.SEED)
    if os.environ["OMP_WAIT_POLICY"] != OMP_WAIT_POLICY:
        logging.warning("OMP_WAIT_POLICY=%s here; the engine process defaults to %s", os.environ["OMP_WAIT_POLICY"],
                        OMP_WAIT_POLICY)
    results: dict = {**shared.header(), "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "levels": levels,
                     "rounds": args.rounds, "tokens": args.tokens, "runs": [], "servers": {}}
    llm = timer = None
    if "offline" in systems:
        llm = LLM(model=MODEL, max_num_seqs=max(levels), enable_prefix_caching=False)  # rounds repeat prompts
        for name, path in DEMO_ADAPTERS.items():
            llm.load_adapter(name, path)
        timer = OfflineTimer(llm)
    procs, urls, counters = {}, {}, {}
    try:
        for i, (name, (prefix, flags)) in enumerate((n, f) for n, f in SERVERS.items() if n in systems):
            urls[name] = f"http://127.0.0.1:{18201 + i}"
            cmd = [*prefix, str(shared.LORAPLEX_BIN), "serve", "--port", str(18201 + i), "--log-level", "WARNING",
                   "--no-prefix-caching", *flags]
            started = time.time()
            procs[name] = start(cmd, {}, args.out.with_suffix(f".{name}.log"), urls[name])
            results["servers"][name] = {"startup_s": time.time() - started, "cmd": cmd}
            counters[name] = ServedCounters(urls[name], psutil.Process(procs[name].pid))
        warm = requests_for(prompts, 8)  # every adapter, every code path, once
        if llm is not None:
            run_offline(llm, timer, warm, 8, 4)
        for name in procs:
            asyncio.run(closed_loop(urls[name], warm, 8, 4))
        for repeat in range(args.repeats):
            for level in levels:
                reqs = requests_for(prompts, level * args.rounds)
                order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
                for name in (n for n in order if n not in SINGLE_ONLY):
                    if name == "offline":
                        point = run_offline(llm, timer, reqs, level, args.tokens)
                    else:
                        point = served_point(urls[name], counters[name], reqs, level, args.tokens)
                    results["runs"].append({"system": name, "concurrency": level, "repeat": repeat,
                                            "load_avg": os.getloadavg()[0], **point})
                    logging.info("%s C=%d: %.1f tok/s %s", name, level, point["tok_s"],
                                 {k: round(v, 1) for k, v in point.items() if k.endswith("_ms") and v is not None})
                    shared.write_json(args.out, results)
            for name in procs:
                single = requests_for(prompts, args.single)
                results["runs"].append({"system": name, "concurrency": 1, "repeat": repeat,
                                        "load_avg": os.getloadavg()[0],
                                        **served_point(urls[name], counters[name], single, 1, args.tokens)})
            shared.write_json(args.out, results)
    finally:
        for proc in procs.values():
            stop(proc)
    results["load_avg_end"] = os.getloadavg()
    shared.write_json(args.out, results)
    print_summary(results)


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def print_summary(results: dict) -> None:
    print(f"\n{results['machine']}  ({results['date']}, load avg {results['load_avg'][0]:.1f} -> "
          f"{results['load_avg_end'][0]:.1f}, OMP_WAIT_POLICY={results['omp_wait_policy']})\n")
    rows, runs = [], results["runs"]
    for level in [*results["levels"], 1]:
        offline = [r for r in runs if r["system"] == "offline" and r["concurrency"] == level]
        base = _median(offline, "tok_s")
        for system in ("offline", *SERVERS):
            mine = [r for r in runs if r["system"] == system and r["concurrency"] == level]
            if not mine:
                continue
            tok_s = _median(mine, "tok_s")
            rows.append([str(level), system, f"{tok_s:.1f}", f"{tok_s / base:.2f}" if base else "",
                         *(_fmt(_median(mine, k)) for k in ("ttft_ms", "tpot_ms", "step_ms", "period_ms",
                                                           "api_cpu_ms", "engine_cpu_ms", "forward_ms",
                                                           "sample_ms", "rest_ms")),
                         f"{min(r['load_avg'] for r in mine):.1f}-{max(r['load_avg'] for r in mine):.1f}"])
    shared.print_table(rows, ["C", "system", "tok/s", "/offline", "TTFT p50 ms", "TPOT p50 ms", "step ms", "period ms",
                              "API CPU ms/step", "engine CPU ms/step", "forward ms", "sample ms", "rest ms",
                              "load"])


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
