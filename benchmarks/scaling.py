"""How cost grows: loraplex along four axes, each point in its own process (``benchmarks/scale/point.py``),
and llama.cpp (the embedded SmolLM2's Q4_1 GGUF) on the context and concurrency axes where it is built.

Axes (SmolLM2-135M float32 unless the axis varies it; random token-id prompts, greedy, EOS ignored):
- ``model``: SmolLM2-135M (real weights) float32 and int8; random-weight SmolLM2-360M and Qwen3-0.6B float32;
  SmolLM2-1.7B and Qwen3-1.7B int8 (their float32 weights, 6.8 / 8.1 GB, do not fit beside the other
  agents on this 24 GiB host); one stream and 32 concurrent, 64-token prompts, with the decode step's bare
  matmuls (``gemm_floor_ms``) and the weight bytes each step reads (``read_gb_s``);
- ``context``: one stream, prompts of 256 .. 8,192 tokens: TTFT (prefill) and TPOT (decode at that length);
- ``concurrency``: 1 .. 64 simultaneous 64-token prompts;
- ``adapters``: 8 .. 1,000 registered rank-8/16 adapters, Zipf(1.0) over 128 requests, 32 running,
  ``max_loras`` 8 device slots, ``max_cpu_loras`` 64 host-cached (misses read the adapter's folder).
Metrics per point (see ``point.py``): tok/s, TTFT p50, TPOT p50, decode step ms, peak RSS. The table is
printed; JSON goes to ``benchmarks/results/scaling.json``; ``benchmarks/scale/plots.py`` draws the PNGs.

    .venv/bin/python -m benchmarks.scaling [--quick] [--axes model,context,concurrency,adapters] [--no-llamacpp]

``--quick`` runs the fewest points (about 3 minutes on an idle 2-core host); the default runs all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import machine_line
from benchmarks.peers import llamacpp
from benchmarks.peers.shared import REPO, RESULTS, print_table, write_json
from benchmarks.scale import llamacpp_points
from benchmarks.scale.point import Point

FULL = {"model": ["smollm2-135m", "smollm2-135m-int8", "smollm2-360m", "qwen3-0.6b", "smollm2-1.7b-int8",
                  "qwen3-1.7b-int8"],
        "context": [256, 512, 1024, 2048, 4096, 8192], "concurrency": [1, 2, 4, 8, 16, 32, 64],
        "adapters": [8, 32, 128, 1000]}
QUICK = {"model": ["smollm2-135m", "smollm2-135m-int8", "smollm2-360m"], "context": [256, 2048],
         "concurrency": [1, 32], "adapters": [8, 1000]}


def points(axis: str, values: list, quick: bool) -> list[Point]:
    """The loraplex points of one axis."""
    tokens = 16 if quick else 32
    if axis == "model":
        return [Point(axis, model=m, context=64, concurrency=c, requests=c, new_tokens=tokens, floor=True)
                for m in values for c in (1, 32)]
    if axis == "context":
        return [Point(axis, context=n, new_tokens=tokens) for n in values]
    if axis == "concurrency":
        return [Point(axis, context=64, concurrency=c, requests=c, new_tokens=2 * tokens) for c in values]
    requests = 64 if quick else 128
    return [Point(axis, context=64, concurrency=32, requests=requests, new_tokens=tokens, adapters=n)
            for n in values]


def run_point(point: Point) -> dict:
    """``point`` measured in a fresh process (its peak RSS its own); a failure is recorded, not raised."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.scale.point", json.dumps(asdict(point))],
                          capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if done.returncode != 0:
        return {**asdict(point), "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return {"system": "loraplex", **json.loads(done.stdout.strip().splitlines()[-1])}


def llamacpp_rows(axes: list[str], grid: dict, quick: bool) -> list[dict]:
    """llama.cpp on the context and concurrency axes (the same prompts' shapes as loraplex's points)."""
    tokens = 16 if quick else 32
    rows = []
    if "context" in axes:
        rows += llamacpp_points.run_axis("context", [(n, 1, tokens) for n in grid["context"]],
                                         RESULTS / "scaling_llamacpp_context.log")
    if "concurrency" in axes:
        rows += llamacpp_points.run_axis("concurrency", [(64, c, 2 * tokens) for c in grid["concurrency"]],
                                         RESULTS / "scaling_llamacpp_concurrency.log")
    return rows


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(rows: list[dict]) -> None:
    head = ["axis", "system", "model", "ctx", "conc", "adapters", "tok/s", "tok/cpu-s", "TTFT ms", "TPOT ms", "step ms",
            "floor ms", "GB/s", "peak MiB"]
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["axis"], "loraplex", r["model"], r["context"], r["concurrency"], r["adapters"],
                        "error: " + " ".join(r["error"])[:60], *["-"] * 7])
            continue
        out.append([r["axis"], r["system"], r.get("model", "smollm2-135m-q4_1"), r["context"], r["concurrency"],
                    r.get("adapters", 0), fmt(r["tok_s"]), fmt(r.get("tok_per_cpu_s")),
                    fmt(r["ttft_p50"], 1e3, 0), fmt(r["tpot_p50"], 1e3),
                    fmt(r.get("decode_step_ms")), fmt(r.get("gemm_floor_ms")), fmt(r.get("read_gb_s")),
                    fmt(r.get("peak_rss_mib"), digits=0)])
    print_table(out, head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the fewest points (a few minutes)")
    ap.add_argument("--axes", default="model,context,concurrency,adapters")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even where it is built")
    ap.add_argument("--label", default="", help="a note stored with the results (e.g. 'loaded host')")
    ap.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    ap.add_argument("--merge", action="store_true", help="keep --out's rows of the axes not run now")
    args = ap.parse_args()
    grid, axes = (QUICK if args.quick else FULL), args.axes.split(",")
    RESULTS.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()
    rows = [run_point(p) for axis in axes for p in points(axis, grid[axis], args.quick)]
    if not args.no_llamacpp and llamacpp.SERVER_BIN.is_file():
        rows += llamacpp_rows(axes, grid, args.quick)
    if args.merge and args.out.is_file():
        rows = [r for r in json.loads(args.out.read_text())["rows"] if r["axis"] not in axes] + rows
    result = {"machine": machine_line(), "label": args.label, "quick": args.quick, "load_avg_before": load_before,
              "load_avg_after": os.getloadavg(), "seconds": time.time() - started, "rows": rows}
    write_json(args.out, result)
    table(rows)
    print(f"machine: {result['machine']}; load {load_before} -> {result['load_avg_after']}; "
          f"{result['seconds']:.0f} s{'; ' + args.label if args.label else ''}")


if __name__ == "__main__":
    main()
