"""The embedded SmolLM2-135M served from its own Q4_1 GGUF file (weights kept in blocks) against the float32
checkpoint (that file dequantized: today's default) and weight-only int8, in one run (issue 33).

- Greedy agreement of the GGUF engine with float32 (the same weights: only float rounding may differ).
- Decode throughput at batch 1 and batch 32 (chat prompts, ``--tokens`` new tokens, EOS ignored) and the
  TTFT of one ~40-token prompt (one prefill + the first token), interleaved over ``--repeats`` rounds, medians.
- Resident weight bytes of each engine's base projections and lm_head, and the peak RSS of a process that
  builds that engine alone and decodes a batch of 32 (one subprocess per engine: ``--peak-rss-of NAME``).

    python -m benchmarks.gguf [--tokens 32] [--repeats 3] [--out benchmarks/results/gguf.json]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import chat_prompts, machine_line, write_json
from loraplex import LLM, SamplingParams
from loraplex.layers.lora_linear import LoRALinear
from loraplex.models.embedded import _gguf_path


def decode_tok_s(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def ttft_ms(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


ENGINES = ("float32", "int8", "gguf_q4_1")
_COMMON = dict(max_loras=1, kv_cache_blocks=512, enable_prefix_caching=False)


def make_engine(name: str) -> LLM:
    """One of ``ENGINES``: the embedded default as float32, weight-only int8, or served from its Q4_1 file."""
    if name == "gguf_q4_1":
        return LLM(model=str(_gguf_path()), **_COMMON)
    return LLM(quantization="int8", **_COMMON) if name == "int8" else LLM(**_COMMON)


def peak_rss_mib(name: str, tokens: int) -> float:
    """Peak RSS (MiB) of a fresh process that builds engine ``name`` and decodes 32 prompts."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.gguf", "--peak-rss-of", name, "--tokens", str(tokens)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def report_own_peak_rss(name: str, tokens: int) -> None:
    llm = make_engine(name)
    llm.generate(chat_prompts(llm.tokenizer, 32), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: KiB


def weight_mib(llm: LLM) -> float:
    """Bytes of the base projections' and the lm_head's weights as the engine holds them."""
    model = llm.engine.model

    def size(w: object) -> int:
        if hasattr(w, "nbytes"):
            return int(w.nbytes)  # BlockWeight
        if hasattr(w, "data") and hasattr(w, "scale"):
            return w.data.numel() + w.scale.numel() * 4  # Int8Weight
        return 0

    total = 0
    for m in model.modules():
        if isinstance(m, LoRALinear):
            total += size(m.int8_weight) if m.int8_weight is not None else m.dense_weight().numel() * 4
    total += size(model.lm_head_int8) if model.lm_head_int8 is not None else model.lm_head_weight.numel() * 4
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--peak-rss-of", choices=ENGINES, default=None, help="internal: print this engine's peak RSS")
    args = parser.parse_args()
    if args.peak_rss_of:
        return report_own_peak_rss(args.peak_rss_of, args.tokens)
    peak_rss = {name: peak_rss_mib(name, args.tokens) for name in ENGINES}
    engines = {name: make_engine(name) for name in ENGINES}
    prompts = chat_prompts(engines["float32"].tokenizer, 32)
    long_prompt = max(prompts, key=len)
    results: dict = {"machine": machine_line(), "load_average_start": os.getloadavg()[0], "tokens": args.tokens,
                     "weight_mib": {name: weight_mib(llm) for name, llm in engines.items()}, "peak_rss_mib": peak_rss}
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    outs = {name: [o.token_ids for o in engines[name].generate(prompts[:8], greedy, use_tqdm=False)]
            for name in ("float32", "gguf_q4_1")}
    results["gguf_identical_to_float32"] = sum(a == b for a, b in zip(*outs.values(), strict=True))
    print(f"gguf greedy == float32 greedy on {results['gguf_identical_to_float32']} of 8 requests", flush=True)
    runs: dict[str, list[float]] = {f"{n}_{k}": [] for n in engines for k in ("b1_tok_s", "b32_tok_s", "ttft_ms")}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            runs[f"{name}_b1_tok_s"].append(decode_tok_s(llm, prompts[:1], args.tokens))
            runs[f"{name}_b32_tok_s"].append(decode_tok_s(llm, prompts, args.tokens))
            runs[f"{name}_ttft_ms"].append(ttft_ms(llm, long_prompt))
            print(f"  {name}: " + ", ".join(f"{k.removeprefix(name + '_')} {v[-1]:.1f}" for k, v in runs.items()
                                           if k.startswith(name)), flush=True)
    med = {key: statistics.median(v) for key, v in runs.items()}
    results.update(median=med, runs=runs, load_average_end=os.getloadavg()[0])
    results["ratios_vs_float32"] = {f"{n}_{k}": med[f"{n}_{k}"] / med[f"float32_{k}"]
                                    for n in engines for k in ("b1_tok_s", "b32_tok_s", "ttft_ms")}
    print(f"\n{results['machine']}; load average {results['load_average_start']:.1f} -> "
          f"{results['load_average_end']:.1f}; {args.repeats} rounds, {args.tokens} tokens, "
          f"TTFT prompt {len(long_prompt)} tokens")
    print(f"{'engine':10s} {'weights MiB':>11s} {'peak RSS MiB':>12s} {'b1 tok/s':>9s} {'b32 tok/s':>10s} "
          f"{'TTFT ms':>8s}")
    for name in engines:
        print(f"{name:10s} {results['weight_mib'][name]:11.0f} {peak_rss[name]:12.0f} {med[f'{name}_b1_tok_s']:9.1f} "
              f"{med[f'{name}_b32_tok_s']:10.1f} {med[f'{name}_ttft_ms']:8.0f}")
    ratios = results["ratios_vs_float32"]
    ratios.update({f"{n}_peak_rss": peak_rss[n] / peak_rss["float32"] for n in engines})
    print("vs float32: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if not k.startswith("float32")))
    write_json(str(args.out) if args.out else None, results)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
