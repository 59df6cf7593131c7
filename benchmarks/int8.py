"""Weight-only int8 base weights on SmolLM2-135M: quality and speed against float32, in one run.

- Perplexity of ``benchmarks/data/python_topics.txt`` (the first ~100 kB of the Python documentation's
  pydoc topics, stdlib ``pydoc_data``, sorted by topic; ~24k tokens) in non-overlapping windows of
  ``--window`` tokens, each one prefill through the engine's model with every position's logits.
  Target: int8 within 2 % of float32.
- Greedy agreement: ``--requests`` chat prompts x ``--tokens`` new tokens, EOS ignored, on both engines:
  requests whose outputs are identical, tokens equal position by position, mean common prefix.
- Decode throughput, batch 32 and batch 1 (the same chat prompts), interleaved ``--repeats`` rounds,
  median. Targets: batch 32 int8 >= 1.5x float32, batch 1 >= 2x. Tokens per CPU second are reported
  too: with ``--threads 1`` they are the comparison that holds on a shared, loaded host.

    python -m benchmarks.int8 [--window 1024] [--max-text-tokens N] [--repeats 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import chat_prompts, machine_line
from loraplex import LLM, SamplingParams
from loraplex.engine.runner import StepEntry, prepare_step

TEXT = Path(__file__).parent / "data" / "python_topics.txt"


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int], window: int) -> float:
    """exp(mean NLL) of every token after the first of each window, windows run as fresh prefills."""
    engine = llm.engine
    model, block_size = engine.model, engine.config.block_size
    blocks = tuple(range(-(-window // block_size)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        step = prepare_step([StepEntry(tuple(chunk), 0, blocks)], block_size, engine.model_config, engine.dtype,
                            engine.device)
        logits = model(step.input_ids, step.positions, step.attn, engine.kv_cache.kv, None,
                       torch.arange(len(chunk) - 1))  # [n - 1, vocab] predicting tokens 1..n-1
        nll += float(F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum"))
        count += len(chunk) - 1
    return math.exp(nll / count)


def decode_tok_s(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(tokens per wall-clock second, tokens per CPU second of this process). With ``--threads 1`` the
    second is the load-independent one on a shared host (wall clock there counts other jobs' time)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generated = sum(len(o.token_ids) for o in outs)
    return generated / (time.perf_counter() - start), generated / (time.process_time() - cpu_start)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    prefixes = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p))
                for p, q in zip(a, b, strict=True)]
    equal_tokens = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    return {"identical_requests": sum(p == q for p, q in zip(a, b, strict=True)), "requests": len(a),
            "token_agreement": equal_tokens / sum(len(p) for p in a),
            "mean_common_prefix": statistics.mean(prefixes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--max-text-tokens", type=int, default=None, help="cut the text (quick runs)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Prefix caching off: repeats reuse their prompts, and perplexity() writes the cache's blocks directly.
    engines = {"float32": LLM(max_loras=1, kv_cache_blocks=512, enable_prefix_caching=False),
               "int8": LLM(max_loras=1, kv_cache_blocks=512, quantization="int8", enable_prefix_caching=False)}
    ids = engines["float32"].tokenizer.encode(TEXT.read_text())[: args.max_text_tokens]
    results: dict = {"machine": machine_line(), "load_average_start": os.getloadavg()[0], "text_tokens": len(ids),
                     "window": args.window}
    results["perplexity"] = {name: perplexity(llm, ids, args.window) for name, llm in engines.items()}
    ppl = results["perplexity"]
    results["perplexity_ratio"] = ppl["int8"] / ppl["float32"]
    prompts = chat_prompts(engines["float32"].tokenizer, args.requests)
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    outs = {name: [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] for name, llm in engines.items()}
    results["greedy"] = agreement(outs["float32"], outs["int8"])
    runs: dict[str, list[float]] = {f"{name}_batch{b}": [] for b in (32, 1) for name in engines}
    cpu_runs: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for batch in (32, 1):
            for name, llm in engines.items():
                wall, cpu = decode_tok_s(llm, prompts[:batch], args.tokens)
                runs[f"{name}_batch{batch}"].append(wall)
                cpu_runs[f"{name}_batch{batch}"].append(cpu)
    results["tok_s"] = {key: statistics.median(v) for key, v in runs.items()}
    results["tok_s_runs"] = runs
    results["tok_per_cpu_s"] = {key: statistics.median(v) for key, v in cpu_runs.items()}
    tok, cpu_tok = results["tok_s"], results["tok_per_cpu_s"]
    results["speedup_batch32"] = tok["int8_batch32"] / tok["float32_batch32"]
    results["speedup_batch1"] = tok["int8_batch1"] / tok["float32_batch1"]
    results["cpu_speedup_batch32"] = cpu_tok["int8_batch32"] / cpu_tok["float32_batch32"]
    results["cpu_speedup_batch1"] = cpu_tok["int8_batch1"] / cpu_tok["float32_batch1"]
    results["load_average_end"] = os.getloadavg()[0]
    g = results["greedy"]
    print(f"\n{results['machine']}; load average {results['load_average_start']:.1f} -> "
          f"{results['load_average_end']:.1f}")
    print(f"perplexity over {len(ids)} tokens (windows of {args.window}): float32 {ppl['float32']:.3f}, "
          f"int8 {ppl['int8']:.3f}, ratio {results['perplexity_ratio']:.4f} (target <= 1.02)")
    print(f"greedy, {g['requests']} requests x {args.tokens} tokens: {g['identical_requests']} identical, "
          f"token agreement {g['token_agreement']:.3f}, mean common prefix {g['mean_common_prefix']:.1f}")
    for key, value in tok.items():
        print(f"  {key:16s} {value:7.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in runs[key])});  "
              f"{cpu_tok[key]:7.1f} tok per CPU s")
    print(f"int8 / float32: batch 32 {results['speedup_batch32']:.2f} (target >= 1.5), "
          f"batch 1 {results['speedup_batch1']:.2f} (target >= 2); per CPU second: batch 32 "
          f"{results['cpu_speedup_batch32']:.2f}, batch 1 {results['cpu_speedup_batch1']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
