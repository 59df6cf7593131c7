"""The peer benchmarks' verdict: ratios against the issue's targets, as a table and ``summary.json``.

Reads ``offline.json``, ``prefill.json``, ``serving.json`` and ``crosscheck.json`` (whichever exist) and writes the
small, committed ``benchmarks/results/summary.json`` and ``summary.md`` (the README's tables).
Standard library only (runs in either venv).

    python benchmarks/peers/summary.py [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TIE = 1e-2  # |logit margin| below this, at the first differing position, is a float tie


def median(w: dict, system: str) -> float | None:
    return w["peers"].get(system, {}).get("tok_s", {}).get("median")


def offline_rows(data: dict) -> tuple[dict, list[dict]]:
    table, targets = {}, []
    for key, w in data["workloads"].items():
        table[key] = {s: ({"median": round(p["tok_s"]["median"], 2), "min": round(p["tok_s"]["min"], 2),
                           "max": round(p["tok_s"]["max"], 2), **({"max_loras": p["config"]["max_loras"]}
                                                                     if "max_loras" in p.get("config", {}) else {})}
                          if "tok_s" in p else {"error": p.get("error", "no result")})
                      for s, p in w["peers"].items()}
    goals = [("mixed8", "vllm", 4.0), ("mixed8", "peft", 1.6), ("base", "vllm", 1.25), ("base", "hf", 1.0)]
    for key, peer, goal in goals:
        w = data["workloads"].get(key)
        if w is None:
            continue
        lp, other = median(w, "loraplex"), median(w, peer)
        ratio = lp / other if lp and other else None
        targets.append({"target": f"{key}: loraplex / {peer} tok/s", "goal": f">= {goal}",
                        "value": None if ratio is None else round(ratio, 2),
                        "met": ratio is not None and ratio >= goal})
    return table, targets


def prefill_rows(data: dict) -> tuple[dict, list[dict]]:
    """TTFT of one long prompt per system; target: loraplex <= 0.8x vLLM-CPU."""
    table = {s: ({k: round(p["ttft_ms"][k], 1) for k in ("median", "min", "max")} if "ttft_ms" in p
                 else {"error": p.get("error", "no result")}) for s, p in data["peers"].items()}
    lp, vllm = (table.get(s, {}).get("median") for s in ("loraplex", "vllm"))
    ratio = lp / vllm if lp and vllm else None
    return table, [{"target": f"prefill: TTFT of one {data['prompt_tokens']}-token prompt, loraplex / vllm",
                    "goal": "<= 0.8", "value": None if ratio is None else round(ratio, 2),
                    "met": ratio is not None and ratio <= 0.8}]


def _target(target: str, goal: str, value: float | None, met: bool) -> dict:
    return {"target": target, "goal": goal, "value": None if value is None else round(value, 3), "met": met}


def adapter_loads_rows(data: dict) -> tuple[dict, list[dict]]:
    """``benchmarks/adapter_loads.py``: cold load ms, churn / all-resident throughput."""
    cold, ratio = data["cold"]["load_ms"], data["ratio"]
    table = {"cold_load_ms": round(cold, 1), "churn_tok_s": round(data["churn"]["tok_s"], 1),
             "resident_tok_s": round(data["resident"]["tok_s"], 1), "distinct_used": data["distinct_used"]}
    return table, [_target("cold load of a rank-16 adapter on all 7 projections, ms", "<= 20", cold, cold <= 20),
                   _target(f"churn, Zipf over {data['adapters']} adapters: tok/s vs all resident", ">= 0.80", ratio,
                           ratio >= 0.8)]


def int8_rows(data: dict) -> tuple[dict, list[dict]]:
    """``benchmarks/int8.py``: perplexity ratio, greedy agreement, speedups at batch 32 and 1."""
    ppl, b32, b1 = data["perplexity_ratio"], data["speedup_batch32"], data["speedup_batch1"]
    table = {"perplexity": data["perplexity"], "greedy": data["greedy"], "tok_s": data["tok_s"]}
    return table, [_target(f"int8 perplexity / float32 ({data['text_tokens']} tokens)", "<= 1.02", ppl, ppl <= 1.02),
                   _target("int8 / float32 tok/s, batch 32", ">= 1.5", b32, b32 >= 1.5),
                   _target("int8 / float32 tok/s, batch 1", ">= 2", b1, b1 >= 2)]


def serving_rows(data: dict) -> tuple[dict, list[dict]]:
    by = {}
    for p in data["points"]:
        by.setdefault(p["scenario"], {}).setdefault(p["system"], {})[p["rate"]] = p
    table, targets = {}, []
    for scenario, systems in by.items():
        vllm, lp = systems.get("vllm", {}), systems.get("loraplex", {})
        table[scenario] = {s: {str(r): {"arrivals_req_s": round(_arrival_rate(p), 3),
                                        "req_s": round(p["req_s"], 3), "errors": p["errors"],
                                        "sustained": p["sustained"],
                                        "ttft_p50_ms": _ms(p["ttft"]["p50"]), "tpot_p50_ms": _ms(p["tpot"]["p50"])}
                               for r, p in sorted(pts.items())} for s, pts in systems.items()}
        sustained = [r for r, p in vllm.items() if p["sustained"]]
        # the highest rate vLLM sustains; where it sustains none, the lowest rate tested
        rate = max(sustained) if sustained else min(vllm, default=None)
        if rate is None or rate not in lp:
            continue
        where = f"@ {rate} req/s" + ("" if sustained else " (vLLM sustains none; lowest rate)")
        for metric in ("tpot", "ttft"):
            a, b = lp[rate][metric]["p50"], vllm[rate][metric]["p50"]
            ratio = a / b if a is not None and b else None
            targets.append({"target": f"serving {scenario} {where}: loraplex / vLLM p50 {metric.upper()}",
                            "goal": "<= 0.8, no errors", "value": None if ratio is None else round(ratio, 2),
                            "met": ratio is not None and ratio <= 0.8 and lp[rate]["errors"] == 0})
        targets += sustained_targets(data, scenario, lp, vllm)
    return table, targets


def sustained_targets(data: dict, scenario: str, lp: dict, vllm: dict) -> list[dict]:
    """Issue 22: loraplex's highest sustained rate >= 0.8x the engine's offline request rate for the
    mix (the better OpenMP policy) and >= 3x vLLM's; where vLLM sustains none of the rates, its rate
    is taken as the lowest one tested (an upper bound, so the verdict errs against loraplex). Where
    loraplex sustained the highest rate run, its ratio is only a lower bound: a shortfall is then reported
    as not measured (verdict None), not as a miss."""
    best = max((r for r, p in lp.items() if p["sustained"]), default=None)
    capped = best is not None and best == max(lp)
    offline = [r["req_s"][scenario] for r in data.get("offline_rate", {}).values() if scenario in r["req_s"]]
    out = []
    if offline:
        ratio = None if best is None else best / max(offline)
        out.append(_sustained(f"serving {scenario}: loraplex highest sustained rate / offline request rate "
                              f"({max(offline):.2f} req/s)", 0.8, ratio, capped))
    if vllm:
        theirs = max((r for r, p in vllm.items() if p["sustained"]), default=min(vllm))
        ratio = None if best is None else best / theirs
        out.append(_sustained(f"serving {scenario}: loraplex / vLLM highest sustained rate", 3.0, ratio, capped))
    return out


def _sustained(target: str, goal: float, ratio: float | None, capped: bool) -> dict:
    met = ratio is not None and ratio >= goal
    if capped and not met:
        return {"target": target, "goal": f">= {goal}", "value": f">= {ratio:.2f} (every rate run sustained)",
                "met": None}
    return {"target": target, "goal": f">= {goal}", "value": None if ratio is None else round(ratio, 2), "met": met}


def _arrival_rate(point: dict) -> float:
    """The realised Poisson rate: on 2 shared cores a busy server can delay the client's own sends."""
    sent = sorted(s["sent"] for s in point["samples"])
    return (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else 0.0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def crosscheck_rows(data: dict) -> tuple[dict, list[dict]]:
    misses = data["mismatches"]
    ties = [m for m in misses if abs(m.get("margin", float("inf"))) < TIE]
    table = {"pairs": data["pairs"], "mismatches": len(misses), "float_ties": len(ties),
             "largest_margin": max((abs(m["margin"]) for m in misses if "margin" in m), default=None)}
    met = len(misses) == len(ties)
    return table, [{"target": "greedy token ids equal (or each mismatch a float tie)",
                    "goal": f"|margin| < {TIE}", "value": f"{len(misses)} mismatches, {len(ties)} ties",
                    "met": met}]


SYSTEMS = {"loraplex": "loraplex", "vllm": "vLLM-CPU", "peft": "PEFT mixed batch", "hf": "HF generate"}


def markdown(summary: dict, labels: dict[str, str]) -> str:
    """The README's tables: offline tok/s (median, min-max), serving p50s per scenario, the verdicts."""
    lines = [f"Machine: {summary.get('machine', '?')}."]
    for name in ("offline", "prefill", "serving", "crosscheck"):
        run = summary.get(f"{name}_run")
        if run:
            lines.append(f"{name} run {run['date']}, load average at start {run['load_avg_start'][0]:.1f}.")
    for name in ("adapter_loads", "int8"):
        run = summary.get(f"{name}_run")
        if run:
            lines.append(f"{name} run: load average {run['load_avg_start']:.1f} at start, "
                         f"{run['load_avg_end']:.1f} at the end.")
    if "offline" in summary:
        systems = [s for s in SYSTEMS if any(s in w for w in summary["offline"].values())]
        lines += ["", "| workload | " + " | ".join(SYSTEMS[s] for s in systems) + " |",
                  "|---|" + "---|" * len(systems)]
        for key, w in summary["offline"].items():
            cells = []
            for s in systems:
                v = w.get(s)
                cells.append("" if v is None else f"failed: {v['error'][:60]}" if "error" in v
                             else f"{v['median']:.1f} ({v['min']:.0f}-{v['max']:.0f})")
            lines.append(f"| {labels.get(key, key)} | " + " | ".join(cells) + " |")
    if "prefill" in summary:
        lines += ["", "| one long prompt, base model | TTFT ms, median (min-max) |", "|---|---|"]
        for s, v in summary["prefill"].items():
            cell = (f"failed: {v['error'][:60]}" if "error" in v
                    else f"{v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f})")
            lines.append(f"| {SYSTEMS.get(s, s)} | {cell} |")
    if "serving" in summary:
        lines += ["", "| scenario | rate req/s | system | arrivals req/s | done req/s | TTFT p50 ms | TPOT p50 ms "
                      "| errors | sustained |", "|---|---|---|---|---|---|---|---|---|"]
        for scenario, systems in summary["serving"].items():
            for system, rates in systems.items():
                for rate, p in rates.items():
                    lines.append(f"| {scenario} | {rate} | {SYSTEMS.get(system, system)} | "
                                 f"{p['arrivals_req_s']:.2f} | {p['req_s']:.2f} | "
                                 f"{p['ttft_p50_ms']} | {p['tpot_p50_ms']} | {p['errors']} | "
                                 f"{'yes' if p['sustained'] else 'no'} |")
    if "crosscheck" in summary:
        c = summary["crosscheck"]
        pairs = ", ".join(f"{k} {v['equal']}/{v['total']}" for k, v in c["pairs"].items())
        lines += ["", f"Greedy token ids equal, request by request: {pairs}; "
                      f"{c['mismatches']} mismatches, {c['float_ties']} of them float ties."]
    lines += ["", "| target | goal | value | verdict |", "|---|---|---|---|"]
    for t in summary["targets"]:
        verdict = {True: "met", False: "**missed**", None: "-"}[t["met"]]
        cells = (str(c).replace("|", "\\|") for c in (t["target"], t["goal"], t["value"]))
        lines.append("| " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    summary: dict = {"targets": []}
    for name, rows in (("offline", offline_rows), ("prefill", prefill_rows), ("serving", serving_rows),
                       ("crosscheck", crosscheck_rows)):
        path = args.results / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        summary.setdefault("machine", data["machine"])
        summary[f"{name}_run"] = {"date": data["date"], "load_avg_start": data["load_avg"],
                                  "load_avg_end": data.get("load_avg_end")}
        summary[name], targets = rows(data)
        summary["targets"] += targets
    for name, rows in (("adapter_loads", adapter_loads_rows), ("int8", int8_rows)):  # loraplex alone
        path = args.results / f"{name}.json"
        if path.exists():
            data = json.loads(path.read_text())
            summary[name], targets = rows(data)
            summary[f"{name}_run"] = {"load_avg_start": data["load_average_start"],
                                      "load_avg_end": data["load_average_end"]}
            summary["targets"] += targets
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1))
    labels = {}
    offline = args.results / "offline.json"
    if offline.exists():
        labels = {k: w["label"] for k, w in json.loads(offline.read_text())["workloads"].items()}
    (args.results / "summary.md").write_text(markdown(summary, labels))
    print(f"\n{summary.get('machine', '')}\n")
    width = max((len(t["target"]) for t in summary["targets"]), default=10)
    for t in summary["targets"]:
        verdict = {True: "met", False: "MISSED", None: "-"}[t["met"]]
        print(f"{t['target']:{width}s}  {t['goal']:>18s}  {t['value']!s:>24s}  {verdict}")


if __name__ == "__main__":
    main()
