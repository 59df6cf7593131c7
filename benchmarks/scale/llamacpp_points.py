"""llama.cpp on the context and concurrency axes of ``benchmarks/scaling.py``: ``llama-server`` on the embedded
SmolLM2 Q4_1 GGUF (``benchmarks.peers.llamacpp.server_command``: 2 threads, prompt cache off), one server per
axis with enough slots and context for its largest point, driven by ``benchmarks.peers.loadgen`` (streamed
``/v1/completions``, the same random token-id prompts, greedy, EOS ignored, all requests sent at once;
``lora_ids={}``: the base model with ``cache_prompt: false``, so a warm-up's prompt is not served from the slot).
Per point: tok/s, TTFT p50, TPOT p50 as ``loadgen`` measures them; ``peak_rss_mib`` is the server's VmHWM
(peak resident set) read from ``/proc`` after the axis, one value for all its points.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from benchmarks.peers import llamacpp, loadgen
from benchmarks.peers.serving import start, stop

PORT = 8393


def _command(slots: int, ctx_per_slot: int) -> list[str]:
    cmd = llamacpp.server_command({}, PORT, slots=slots, threads=2)
    cmd[cmd.index("-c") + 1] = str(slots * ctx_per_slot)
    return cmd


def _peak_rss_mib(pid: int) -> float | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def _point(url: str, context: int, concurrency: int, new_tokens: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(context)] for _ in range(concurrency)]
    samples = asyncio.run(loadgen.run_load(url, prompts, ["llamacpp"] * concurrency, rate=1e9,
                                           max_tokens=new_tokens, seed=0, lora_ids={}))
    s = loadgen.summarize(samples, rate=1e9)
    return {"context": context, "concurrency": concurrency, "new_tokens": new_tokens, "tok_s": s["tok_s"],
            "ttft_p50": s["ttft"]["p50"], "tpot_p50": s["tpot"]["p50"], "errors": s["errors"],
            "error_examples": s["error_examples"]}


def run_axis(axis: str, points: list[tuple[int, int, int]], log: Path) -> list[dict]:
    """``points`` of (context, concurrency, new tokens) on one server sized for the largest; each warmed once."""
    slots = max(c for _, c, _ in points)
    ctx = max(x + n for x, _, n in points) + 64
    url = f"http://127.0.0.1:{PORT}"
    proc = start(_command(slots, ctx), {}, log, url)
    try:
        out = []
        for context, concurrency, new_tokens in points:
            _point(url, context, concurrency, 2)
            out.append({"axis": axis, "system": "llama.cpp Q4_1", **_point(url, context, concurrency, new_tokens)})
        peak = _peak_rss_mib(proc.pid)
    finally:
        stop(proc)
    for row in out:
        row["peak_rss_mib"] = peak
    return out
