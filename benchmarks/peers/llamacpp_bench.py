"""loraplex vs llama.cpp on SmolLM2-135M-Instruct, base model only, over HTTP, in one run.

Three servers, one at a time on 127.0.0.1 (each started, warmed with one request, measured, stopped):
``loraplex-f32`` (``loraplex serve``, its float32 default), ``loraplex-q4_1`` (``loraplex serve --model
<the Q4_1 GGUF>``, served natively) and ``llama.cpp`` (``llama-server -m <the same GGUF>``, 2 threads,
32 slots, prompt cache off). All get 32 running sequences, no prefix caching, both cores (OpenMP
threads bound by ``run_all.sh``'s ``GOMP_CPU_AFFINITY``; llama.cpp with ``-t 2``).

Per system, ``--repeats`` times each, with ``loadgen`` (streamed ``/v1/completions``, token-id chat
prompts, greedy, EOS ignored):
- one stream: a single request of ``--stream-tokens`` new tokens; TTFT and decode tok/s = 1 / TPOT;
- 32 concurrent: 32 requests sent at once (``--burst-tokens`` new tokens each); aggregate tok/s
  (all new tokens / first send to last completion) and TTFT p50.
Then, once per system, the workloads of ``llamacpp_workloads`` with the same 8 adapters loaded in every
server (``--workloads``; ``none`` skips them): 8 / 32 concurrent on the base model and over the 8 adapters,
the 512-token TTFT, and a Poisson sweep (``--rates``, ``--duration``) up to the first rate a system does
not sustain. The tables show medians and each system's ratio to llama.cpp; JSON (with the load average
before and after) goes to ``benchmarks/results/llamacpp.json``.

    .venv/bin/python -m benchmarks.peers.llamacpp_bench [--repeats 3] [--workloads loops,ttft512,sweep]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from benchmarks.peers import llamacpp, llamacpp_workloads, loadgen, shared
from benchmarks.peers.serving import start, stop

PORT = 8391
LORAPLEX_FLAGS = ["--max-num-seqs", "32", "--no-prefix-caching", "--log-level", "WARNING", "--port", str(PORT)]
ADAPTER_FLAGS = ["--max-loras", "8", "--max-cpu-loras", "8", "--max-lora-rank", "16"]


def commands(adapters: dict[str, Path] | None = None) -> dict[str, tuple[list[str], str]]:
    """System -> (server command line, the ``model`` field its base-model requests carry), every server
    with ``adapters`` loaded (None: none)."""
    gguf = str(llamacpp.model_gguf())
    lp = [str(shared.LORAPLEX_BIN), "serve", *LORAPLEX_FLAGS]
    if adapters:
        lp += [*ADAPTER_FLAGS, *(f for n, p in adapters.items() for f in ("--adapter", f"{n}={p}"))]
    return {"loraplex-f32": ([*lp, "--model", shared.MODEL_NAME, "--dtype", "float32"], shared.MODEL_NAME),
            "loraplex-q4_1": ([*lp, "--model", gguf], gguf),
            "llama.cpp": (llamacpp.server_command(adapters or {}, PORT, slots=32, threads=2), "llamacpp")}


def lora_ids(name: str, url: str, adapters: dict[str, Path]) -> dict[str, int] | None:
    """llama.cpp's adapter name -> LoRA id (``loadgen``'s ``lora_ids``); None for the loraplex servers."""
    if name != "llama.cpp":
        return None
    listed = httpx.get(f"{url}/lora-adapters", timeout=10).json()
    by_path = {str(llamacpp.convert_adapter(n, p)): n for n, p in adapters.items()}
    return {by_path[e["path"]]: e["id"] for e in listed if e["path"] in by_path}


def measure(url: str, model: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Warm-up, then ``repeats`` x (one stream, 32 concurrent) on a running server."""
    def load(n: int, tokens: int) -> dict:
        # llama.cpp: cache_prompt false (via lora_ids), or the measured prompt is the warm-up's, cached in its slot
        ids = {} if model == "llamacpp" else None
        samples = asyncio.run(loadgen.run_load(url, prompts[:n], [model] * n, rate=1e9, max_tokens=tokens,
                                               seed=shared.SEED, lora_ids=ids))
        return loadgen.summarize(samples, rate=1e9)

    load(1, 8)
    stream, burst = [], []
    for _ in range(args.repeats):
        one = load(1, args.stream_tokens)
        stream.append({"errors": one["errors"], "ttft": one["ttft"]["p50"],
                       "decode_tok_s": 1 / one["tpot"]["p50"] if one["tpot"]["p50"] else None})
        many = load(32, args.burst_tokens)
        burst.append({"errors": many["errors"], "tok_s": many["tok_s"], "ttft_p50": many["ttft"]["p50"],
                      "error_examples": many["error_examples"]})
    return {"stream": stream, "burst": burst,
            "ttft": shared.summarize([s["ttft"] or float("nan") for s in stream]),
            "decode_tok_s": shared.summarize([s["decode_tok_s"] or 0.0 for s in stream]),
            "burst_tok_s": shared.summarize([b["tok_s"] for b in burst]),
            "burst_ttft_p50": shared.summarize([b["ttft_p50"] or float("nan") for b in burst]),
            "errors": sum(s["errors"] for s in stream) + sum(b["errors"] for b in burst)}


def print_table(results: dict) -> None:
    ref = results["systems"].get("llama.cpp")
    rows = []
    for name, r in results["systems"].items():
        ratio = f"{r['burst_tok_s']['median'] / ref['burst_tok_s']['median']:.2f}x" if ref else "-"
        rows.append([name, f"{r['ttft']['median'] * 1000:.0f}", f"{r['decode_tok_s']['median']:.1f}",
                     f"{r['burst_tok_s']['median']:.1f}", ratio, f"{r['burst_ttft_p50']['median'] * 1000:.0f}",
                     str(r["errors"])])
    shared.print_table(rows, ["system", "1-stream TTFT ms", "1-stream tok/s", "32-conc tok/s", "32-conc vs llama.cpp",
                              "32-conc TTFT p50 ms", "errors"])
    print(f"machine: {results['machine']}; load avg before {results['load_avg']}, after {results['load_avg_after']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--burst-tokens", type=int, default=shared.NEW_TOKENS)
    ap.add_argument("--systems", default="loraplex-f32,loraplex-q4_1,llama.cpp")
    ap.add_argument("--workloads", default="loops,ttft512,sweep", help="of loops, ttft512, sweep; 'none' to skip")
    ap.add_argument("--rates", default="0.25,0.5,1,2,4", help="the sweep's Poisson rates, req/s")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per sweep point")
    ap.add_argument("--out", type=Path, default=shared.RESULTS / "llamacpp.json")
    args = ap.parse_args()
    prompts = shared.prompts(AutoTokenizer.from_pretrained(shared.model_folder()), 32)
    results = {**shared.header(), "repeats": args.repeats, "stream_tokens": args.stream_tokens,
               "burst_tokens": args.burst_tokens, "model_gguf": str(llamacpp.model_gguf()), "systems": {}}
    url = f"http://127.0.0.1:{PORT}"
    shared.RESULTS.mkdir(parents=True, exist_ok=True)
    for name in args.systems.split(","):
        cmd, model = commands()[name]
        proc = start(cmd, {}, shared.RESULTS / f"llamacpp_{name}.log", url)
        try:
            results["systems"][name] = {"command": cmd, **measure(url, model, prompts, args)}
        finally:
            stop(proc)
    workloads = [w for w in args.workloads.split(",") if w != "none"]
    if workloads:
        results["workloads"] = run_workloads(args, prompts, url, workloads)
    results["load_avg_after"] = os.getloadavg()
    shared.write_json(args.out, results)
    print_table(results)
    if workloads:
        print_workloads(results["workloads"])


def run_workloads(args: argparse.Namespace, prompts: list[list[int]], url: str, workloads: list[str]) -> dict:
    """Every system restarted with the 8 adapters; ``llamacpp_workloads`` on each in turn."""
    adapters = shared.adapter_set(8)
    out = {}
    for name in args.systems.split(","):
        cmd, model = commands(adapters)[name]
        proc = start(cmd, {}, shared.RESULTS / f"llamacpp_{name}_adapters.log", url)
        try:
            ids = lora_ids(name, url, adapters)
            row: dict = {"command": cmd}
            if "loops" in workloads:
                row.update(llamacpp_workloads.closed_loops(url, model, prompts, args.burst_tokens, ids))
            if "ttft512" in workloads:
                row["ttft512"] = llamacpp_workloads.ttft_long(url, model, ids)
            if "sweep" in workloads:
                rates = [float(r) for r in args.rates.split(",")]
                row["sweep"] = llamacpp_workloads.sweep(url, prompts, args.burst_tokens, rates, args.duration, ids)
            out[name] = row
        finally:
            stop(proc)
    return out


def print_workloads(results: dict) -> None:
    """One row per system: closed-loop tok/s, 512-token TTFT, highest sustained Poisson rate."""
    def tok_s(r: dict, key: str) -> str:
        return f"{r[key]['tok_s']:.1f}" if key in r else "-"

    rows = []
    for name, r in results.items():
        ttft = r.get("ttft512", {}).get("ttft", {}).get("p50")
        sustained = [p["rate"] for p in r.get("sweep", []) if p["sustained"]]
        errors = sum(r[k]["errors"] for k in ("conc8", "conc32", "mixed8", "mixed32", "ttft512") if k in r)
        rows.append([name, tok_s(r, "conc8"), tok_s(r, "conc32"), tok_s(r, "mixed8"), tok_s(r, "mixed32"),
                     "-" if ttft is None else f"{ttft * 1e3:.0f}", f"{max(sustained):.2f}" if sustained else "none",
                     str(errors)])
    shared.print_table(rows, ["system", "8-conc base tok/s", "32-conc base tok/s", "8-conc 8-adapter tok/s",
                              "32-conc 8-adapter tok/s", "512-tok TTFT ms", "highest sustained req/s", "errors"])


if __name__ == "__main__":
    main()
