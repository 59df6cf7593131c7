"""Offline throughput of loraplex on SmolLM2-135M (float32, 2 threads, greedy, EOS ignored, 64 tokens).

Workloads, all in one run after a warm-up: (a) 32 requests on the base model; (b) 32 requests over 8
rank-16 adapters on all seven projections, max_loras=8; (c) 32 requests over 32 adapters,
max_loras=32; (d) 128 requests over 32 adapters (4 each, shuffled), max_loras=8, max_num_seqs=32, and
(d0) the same 128 requests on the base model; (e) HF transformers ``generate`` at batch 32 on (a);
(f) one request alone. Also the bare matmuls of one batch-32 decode step against loraplex's whole
decode step (``decode_step_ms``): ``gemm_floor_ms`` with ``F.linear`` (what HF runs) and
``packed_gemm_floor_ms`` with loraplex's oneDNN-packed weights.

Every engine is built first and stays up; then ``--repeats`` rounds run every workload in turn
(interleaved, so host drift hits all alike) and the table reports the median and the range. All six
engines and the HF model take ~12 GiB at once; ``--workloads base mixed8 mixed32`` keeps only some
(the base model always runs: the ratios are to it) where memory is short. ``--lora-dtype bfloat16`` stores
every engine's adapters in bfloat16 (``EngineConfig.lora_dtype``).

    python -m benchmarks.throughput [--out results.json] [--tokens 64] [--repeats 3] [--workloads KEY ...]
        [--lora-dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import (
    chat_prompts,
    machine_line,
    matmul_floors,
    peak_rss_mib,
    time_decode_steps,
    write_random_adapter,
)
from loraplex import LLM, SamplingParams
from loraplex.config import ModelConfig
from loraplex.models.embedded import embedded_checkpoint


def timed_generate(llm: LLM, prompts: list[list[int]], adapters: list[str | None], tokens: int) -> dict:
    """Run the workload; record per-step wall time for full-batch decode-only steps."""
    decode_steps, restore = time_decode_steps(llm.engine, 32)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    elapsed = time.perf_counter() - start
    restore()
    generated = sum(len(o.token_ids) for o in outs)
    return {"tok_s": generated / elapsed, "seconds": elapsed, "generated": generated,
            "decode_step_ms": statistics.median(decode_steps) if decode_steps else None}


def make_llm(**kwargs) -> LLM:  # noqa: ANN003
    llm = LLM(enable_prefix_caching=False, **kwargs)  # rounds repeat their prompts: measure compute, not hits
    warm = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm


def gemm_floor_ms(model: torch.nn.Module, batch: int = 32, repeats: int = 5) -> dict[str, float]:
    """One decode step's matmuls alone, ``F.linear`` on plain weights and loraplex's packed kernels."""
    loops = matmul_floors(model, batch)
    times: dict[str, list[float]] = {name: [] for name in loops}
    with torch.inference_mode():
        for i in range(repeats + 1):
            for name, loop in loops.items():
                start = time.perf_counter()
                loop()
                if i:
                    times[name].append((time.perf_counter() - start) * 1e3)
    return {f"{name}_ms": statistics.median(t) for name, t in times.items()}


def hf_generate_tok_s(prompts: list[list[int]], tokens: int, pad_id: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(embedded_checkpoint(), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False,
                       pad_token_id=pad_id)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=pad_id)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


@dataclass
class Workload:
    key: str
    label: str
    adapters: list[str | None]  # one per request; None = base model
    config: dict
    llm: LLM | None = None
    runs: list[dict] = field(default_factory=list)


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


WORKLOAD_KEYS = ["base", "mixed8", "mixed32", "churn", "churn_base", "batch1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds over all workloads (median)")
    parser.add_argument("--workloads", nargs="*", choices=WORKLOAD_KEYS, default=WORKLOAD_KEYS,
                        help="run only these (base always runs)")
    parser.add_argument("--lora-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="adapter weight storage of every engine (EngineConfig.lora_dtype)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    base = embedded_checkpoint()
    model_config = ModelConfig.from_hf(base)
    root = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    adapters = {f"a{i}": write_random_adapter(root / f"a{i}", model_config, rank=16, seed=i) for i in range(32)}
    shuffled = [f"a{i % 32}" for i in range(128)]
    random.Random(0).shuffle(shuffled)
    workloads = [
        Workload("base", "(a) 32 req, base", [None] * 32, {"max_loras": 8}),
        Workload("mixed8", "(b) 32 req / 8 adapters, 8 slots", [f"a{i % 8}" for i in range(32)], {"max_loras": 8}),
        Workload("mixed32", "(c) 32 req / 32 adapters, 32 slots", [f"a{i}" for i in range(32)],
                 {"max_loras": 32, "max_cpu_loras": 32}),
        Workload("churn", "(d) 128 req / 32 adapters, 8 slots", shuffled,
                 {"max_loras": 8, "max_cpu_loras": 32, "max_num_seqs": 32}),
        Workload("churn_base", "(d0) 128 req, base", [None] * 128, {"max_loras": 8, "max_num_seqs": 32}),
        Workload("batch1", "(f) 1 request alone", [None], {"max_loras": 1}),
    ]
    workloads = [w for w in workloads if w.key == "base" or w.key in args.workloads]
    for w in workloads:  # every engine stays up, so the rounds below interleave the workloads
        w.llm = make_llm(**w.config, lora_dtype=args.lora_dtype)
        for name in sorted({a for a in w.adapters if a}):
            w.llm.load_adapter(name, adapters[name])
    tokenizer = workloads[0].llm.tokenizer
    results: dict = {"machine": machine_line(), "repeats": args.repeats, "lora_dtype": args.lora_dtype,
                     **gemm_floor_ms(workloads[0].llm.engine.model)}
    hf_runs = []
    for _ in range(args.repeats):
        for w in workloads:
            w.runs.append(timed_generate(w.llm, chat_prompts(tokenizer, len(w.adapters)), w.adapters, args.tokens))
        hf_runs.append(hf_generate_tok_s(chat_prompts(tokenizer, 32), args.tokens, pad_id=2))
        gc.collect()
    rows = []
    for w in workloads:
        results[f"{w.key}_tok_s"] = median_of(w.runs, "tok_s")
        results[f"{w.key}_tok_s_runs"] = [r["tok_s"] for r in w.runs]
        rows.append((w.label, results[f"{w.key}_tok_s"], min(results[f"{w.key}_tok_s_runs"]),
                     max(results[f"{w.key}_tok_s_runs"]), median_of(w.runs, "decode_step_ms")))
    results["decode_step_ms"] = median_of(workloads[0].runs, "decode_step_ms")
    results["hf_tok_s"], results["hf_tok_s_runs"] = statistics.median(hf_runs), hf_runs
    rows.insert(min(5, len(rows)), ("(e) HF generate, batch 32, base", results["hf_tok_s"], min(hf_runs),
                                    max(hf_runs), None))
    results["peak_rss_mib"] = peak_rss_mib()

    print(f"\n{results['machine']}, median of {args.repeats} interleaved rounds, {args.lora_dtype} adapters\n")
    print(f"{'workload':40s} {'tok/s':>9s} {'range':>13s} {'decode step ms':>15s}")
    for label, tok_s, lo, hi, step_ms in rows:
        print(f"{label:40s} {tok_s:9.1f} {f'{lo:.0f}-{hi:.0f}':>13s} {'' if step_ms is None else f'{step_ms:.1f}':>15}")
    b = results["base_tok_s"]
    print()
    if "mixed8_tok_s" in results:
        print(f"(b)/(a) {results['mixed8_tok_s'] / b:.2f}  (target >= 0.90)")
    if "mixed32_tok_s" in results:
        print(f"(c)/(a) {results['mixed32_tok_s'] / b:.2f}  (target >= 0.85)")
    if "churn_tok_s" in results and "churn_base_tok_s" in results:
        print(f"(d)/(d0) {results['churn_tok_s'] / results['churn_base_tok_s']:.2f}  (target >= 0.75)")
    print(f"(a)/(e) {b / results['hf_tok_s']:.2f}  (target >= 1.0)")
    print(f"decode_step_ms / gemm_floor_ms = {results['decode_step_ms']:.1f} / {results['gemm_floor_ms']:.1f} "
          f"= {results['decode_step_ms'] / results['gemm_floor_ms']:.2f}  (target <= 1.15; F.linear floor)")
    print(f"decode_step_ms / packed_gemm_floor_ms = {results['decode_step_ms']:.1f} / "
          f"{results['packed_gemm_floor_ms']:.1f} = {results['decode_step_ms'] / results['packed_gemm_floor_ms']:.2f}"
          "  (loraplex's own oneDNN matmuls)")
    print(f"peak RSS {results['peak_rss_mib']:.0f} MiB (all engines and the HF model in one process)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
