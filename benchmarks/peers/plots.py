"""PNG plots of the peer benchmarks (matplotlib; runs in ``.venv-vllm``, reads only the JSON results).

- ``offline_throughput.png``: tokens/s per workload and system (bar = median, whisker = min..max of
  the repeats; a system that failed is marked "failed").
- ``serving_latency.png``: TTFT and TPOT p50/p90/p99 vs Poisson request rate, one column per scenario.

    .venv-vllm/bin/python benchmarks/peers/plots.py [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"loraplex": "#1f77b4", "vllm": "#d62728", "peft": "#2ca02c", "hf": "#7f7f7f"}
LABELS = {"loraplex": "loraplex", "vllm": "vLLM-CPU", "peft": "PEFT mixed batch", "hf": "HF generate"}


def offline_plot(data: dict, path: Path) -> None:
    workloads = list(data["workloads"].values())
    systems = [s for s in COLORS if any(s in w["peers"] for w in workloads)]
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, system in enumerate(systems):
        for i, w in enumerate(workloads):
            peer = w["peers"].get(system)
            if peer is None:
                continue
            x = i + (j - (len(systems) - 1) / 2) * width
            if "tok_s" not in peer:
                ax.text(x, 2, "failed", rotation=90, ha="center", va="bottom", fontsize=8, color=COLORS[system])
                continue
            t = peer["tok_s"]
            ax.bar(x, t["median"], width, color=COLORS[system], label=LABELS[system],
                   yerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]], capsize=3)
            ax.text(x, t["max"] * 1.01, f"{t['median']:.0f}", ha="center", va="bottom", fontsize=7)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xticks(range(len(workloads)), [w["label"] for w in workloads], fontsize=8)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Offline throughput, SmolLM2-135M fp32, {workloads[0]['requests']} requests x "
                 f"{data['new_tokens']} tokens, greedy; whiskers: min..max of the repeats\n"
                 f"{data['machine']}, {data['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def serving_plot(data: dict, path: Path) -> None:
    scenarios = list(dict.fromkeys(p["scenario"] for p in data["points"]))
    fig, axes = plt.subplots(3, len(scenarios), figsize=(3.2 * len(scenarios), 8.5), squeeze=False, sharex=True)
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    for col, scenario in enumerate(scenarios):
        throughput = axes[2][col]
        for system in COLORS:
            pts = sorted((p for p in data["points"] if p["scenario"] == scenario and p["system"] == system),
                         key=lambda p: p["rate"])
            if pts:
                throughput.plot([p["rate"] for p in pts], [p["tok_s"] for p in pts], "-o", ms=3, color=COLORS[system])
        throughput.grid(alpha=0.3)
        throughput.set_xlabel("request rate (req/s, Poisson)")
        if col == 0:
            throughput.set_ylabel("achieved tokens / s")
        for row, metric in enumerate(("ttft", "tpot")):
            ax = axes[row][col]
            for system in COLORS:
                pts = sorted((p for p in data["points"] if p["scenario"] == scenario and p["system"] == system),
                             key=lambda p: p["rate"])
                if not pts:
                    continue
                for q, style in styles.items():
                    xs = [p["rate"] for p in pts if p[metric][q] is not None]
                    ys = [p[metric][q] * 1e3 for p in pts if p[metric][q] is not None]
                    ax.plot(xs, ys, style, marker="o", ms=3, color=COLORS[system],
                            label=f"{LABELS[system]} {q}" if col == 0 and row == 0 else None)
                for p in pts:
                    if not p["sustained"] and p[metric]["p50"] is not None:
                        ax.plot(p["rate"], p[metric]["p50"] * 1e3, "x", color=COLORS[system], ms=8)
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            if row == 0:
                ax.set_title(scenario, fontsize=9)
            if col == 0:
                ax.set_ylabel(f"{metric.upper()} (ms)")
    fig.legend(loc="lower center", ncol=3, fontsize=7)
    fig.suptitle(f"Serving: {data['new_tokens']} tokens per request, streamed; x = rate not sustained\n"
                 f"{data['machine']}, {data['date'][:10]}", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    for name, plot in (("offline", offline_plot), ("serving", serving_plot)):
        source = args.results / f"{name}.json"
        if source.exists():
            target = args.results / ("offline_throughput.png" if name == "offline" else "serving_latency.png")
            plot(json.loads(source.read_text()), target)
            print(f"wrote {target}")


if __name__ == "__main__":
    main()
