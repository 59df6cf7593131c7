"""PNG plots of ``benchmarks/results/scaling.json`` into ``docs/`` (matplotlib, the dev extra):
``scaling_context.png`` / ``scaling_concurrency.png`` (loraplex and llama.cpp: tok/s, TTFT, TPOT, peak RSS
against the axis), ``scaling_adapters.png`` and ``scaling_model.png`` (loraplex: tok/s and TPOT, the model
axis against the parameter bytes each decode step reads). Titles carry the machine line and the label.

    .venv/bin/python -m benchmarks.scale.plots [--results benchmarks/results/scaling.json] [--out docs]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = (("tok_s", "tokens/s", 1.0), ("ttft_p50", "TTFT p50 (ms)", 1e3), ("tpot_p50", "TPOT p50 (ms)", 1e3),
           ("peak_rss_mib", "peak RSS (MiB)", 1.0))
X = {"context": "prompt tokens", "concurrency": "concurrent requests", "adapters": "registered adapters (Zipf)"}


def axis_plot(rows: list[dict], axis: str, title: str, path: Path) -> None:
    """One panel per metric; one line per system, log-scaled x."""
    fig, panels = plt.subplots(1, len(METRICS), figsize=(16, 3.8))
    key = "adapters" if axis == "adapters" else axis
    for system in sorted({r["system"] for r in rows}):
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r[key])
        for ax, (metric, label, scale) in zip(panels, METRICS, strict=True):
            pts = [(r[key], r[metric] * scale) for r in mine if r.get(metric) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=system)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(X[axis])
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    panels[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_plot(rows: list[dict], title: str, path: Path) -> None:
    """Decode step ms and its bare-matmul floor against the weight bytes a step reads, batch 1 and 32."""
    fig, panels = plt.subplots(1, 2, figsize=(11, 4))
    for ax, conc in zip(panels, (1, 32), strict=True):
        mine = sorted((r for r in rows if r["concurrency"] == conc and r.get("decode_step_ms")),
                      key=lambda r: r["weight_bytes"])
        xs = [r["weight_bytes"] / 1e9 for r in mine]
        ax.plot(xs, [r["decode_step_ms"] for r in mine], marker="o", label="decode step")
        floor = [(r["weight_bytes"] / 1e9, r["gemm_floor_ms"]) for r in mine if r.get("gemm_floor_ms")]
        if floor:
            ax.plot(*zip(*floor, strict=True), marker="x", linestyle="--", label="bare matmuls (float32)")
        for x, r in zip(xs, mine, strict=True):
            ax.annotate(r["model"], (x, r["decode_step_ms"]), fontsize=7)
        ax.set_xlabel("weight bytes read per step (GB)")
        ax.set_ylabel("ms")
        ax.set_title(f"batch {conc}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/scaling.json"))
    ap.add_argument("--out", type=Path, default=Path("docs"))
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    title = f"{data['machine']}{' - ' + data['label'] if data.get('label') else ''}"
    rows = [r for r in data["rows"] if "error" not in r]
    for axis in ("context", "concurrency", "adapters"):
        mine = [r for r in rows if r["axis"] == axis]
        if mine:
            axis_plot(mine, axis, title, args.out / f"scaling_{axis}.png")
    model_rows = [r for r in rows if r["axis"] == "model"]
    if model_rows:
        model_plot(model_rows, title, args.out / "scaling_model.png")


if __name__ == "__main__":
    main()
