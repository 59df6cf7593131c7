"""Per-request adapter blends (issue 31 item 3): a batch in which every request has its own random mix of 2
adapters (``AdapterMix``, random scales) against the same batch with one adapter per request, in one engine.

The embedded SmolLM2, ``--adapters`` random rank-16 adapters on all seven projections, all resident
(``max_loras`` = their number); ``--batch`` chat prompts, ``--tokens`` new tokens each, greedy, EOS ignored;
rounds interleave the two workloads (the same prompts; fresh request ids, prefix caching off so both prefill
alike). Goal: blends >= 0.8x the single-adapter tokens/s. Prints a table and writes JSON (``--out``).

    .venv/bin/python -m benchmarks.adapter_mix [--batch 16] [--tokens 32] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import (
    add_clock_options,
    chat_prompts,
    machine_line,
    step_clock,
    write_json,
    write_random_adapter,
)
from loraplex import LLM, AdapterMix, SamplingParams


def run(llm: LLM, prompts: list[list[int]], adapters: list, tokens: int,
        clock: Callable[[], float] = time.perf_counter) -> float:
    """Generated tokens per second (of ``clock``) of one ``generate`` over ``prompts``."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = clock()
    outs = llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (clock() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    add_clock_options(parser)
    parser.add_argument("--out", default="benchmarks/results/adapter_mix.json")
    args = parser.parse_args()
    clock = step_clock(parser, args)
    llm = LLM(max_loras=args.adapters, max_cpu_loras=args.adapters, max_lora_rank=16, max_num_seqs=args.batch,
              enable_prefix_caching=False)
    model_config = llm.engine.model_config
    names = [f"a{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            llm.load_adapter(name, write_random_adapter(Path(tmp) / name, model_config, 16, seed=i))
    rng = random.Random(0)
    prompts = chat_prompts(llm.tokenizer, args.batch)
    single = [names[i % len(names)] for i in range(args.batch)]
    mixes = [AdapterMix([(a, round(rng.uniform(0.3, 1.5), 2)), (b, round(rng.uniform(0.3, 1.5), 2))])
             for a, b in (rng.sample(names, 2) for _ in range(args.batch))]
    run(llm, prompts[:4], single[:4], 4)  # warm-up
    run(llm, prompts[:4], mixes[:4], 4)
    rows: dict[str, list[float]] = {"one adapter per request": [], "random 2-adapter mix per request": []}
    for _ in range(args.rounds):
        rows["one adapter per request"].append(run(llm, prompts, single, args.tokens, clock))
        rows["random 2-adapter mix per request"].append(run(llm, prompts, mixes, args.tokens, clock))
    ratios = [m / s for s, m in zip(*rows.values(), strict=True)]
    result = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d %H:%M"), "batch": args.batch,
              "tokens": args.tokens, "adapters": args.adapters, "clock": args.clock, "tok_s": rows,
              "ratio_per_round": ratios,
              "ratio_median": statistics.median(ratios), "goal": ">= 0.8"}
    write_json(args.out, result)
    print(f"# {result['machine']}; batch {args.batch}, {args.tokens} new tokens, {args.adapters} rank-16 adapters, "
          f"{args.clock} clock")
    print(f"{'workload':36} {'tok/s (median of ' + str(args.rounds) + ')':>24}")
    for name, values in rows.items():
        print(f"{name:36} {statistics.median(values):24.1f}")
    print(f"mix / single per round {[round(r, 3) for r in ratios]}, median {result['ratio_median']:.3f} (goal >= 0.8)")


if __name__ == "__main__":
    main()
