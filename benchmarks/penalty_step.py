"""Penalty overhead: a batch-32 SmolLM2 decode step (``ModelRunner.execute`` + ``sample``) where every row has
different presence/frequency/repetition penalties, a logit bias and ``min_tokens``, against the same step
with none of them; greedy and sampled (temperature 0.8, top-p 0.95). Steps are interleaved (plain,
penalised, plain, ...) in one run; each row's history grows by one token per step, as in decoding.
Prints a table with the load average; ``--out PATH`` writes JSON.

    .venv/bin/python -m benchmarks.penalty_step [--batch 32] [--context 100] [--iters 12]
    .venv/bin/python -m benchmarks.penalty_step --threads 1 --clock thread   # on a busy host
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from dataclasses import dataclass, field

import torch

from benchmarks.common import add_step_options, machine_line, step_clock, step_header, write_json
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.engine.sampling.logits_processors import ProcessorState
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.sampler import sample
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.loader import load_model


@dataclass
class Row:
    """What the sampler reads of a request."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    processor_state: ProcessorState | None = None


def penalised(rng: random.Random, vocab: int, base: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=base.temperature, top_p=base.top_p,
        presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.uniform(0.8, 1.5), min_tokens=rng.randrange(1, 400),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(4)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_options(parser, iters=12)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    clock = step_clock(parser, args)
    torch.manual_seed(0)
    rng = random.Random(0)
    model = load_model(embedded_checkpoint(), None, 4, 16, torch.float32, "cpu")
    cfg, block_size = model.config, 16
    blocks_per_seq = (args.context + args.iters * 4 + 20 + block_size) // block_size
    kv = KVCache(cfg, args.batch * blocks_per_seq, block_size, torch.float32, "cpu")
    allocator = BlockManager(kv.num_blocks, kv.block_size, enable_caching=False)
    runner = ModelRunner(model, kv, block_size)
    tables = [tuple(allocator.allocate(blocks_per_seq, None)) for _ in range(args.batch)]
    histories = [[rng.randrange(cfg.vocab_size) for _ in range(args.context + rng.randrange(-10, 10))]
                 for _ in range(args.batch)]
    modes = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.8, top_p=0.95)}
    systems = {}
    for mode, base in modes.items():
        shared = torch.Generator().manual_seed(1)
        # prompts are the first 60 tokens of each history; the rest are "generated" tokens
        systems[f"{mode}/plain"] = [Row(base, shared, h[:60], list(h[60:])) for h in histories]
        systems[f"{mode}/penalised"] = [Row(penalised(rng, cfg.vocab_size, base), shared, h[:60], list(h[60:]))
                                        for h in histories]
    times: dict[str, list[float]] = {name: [] for name in systems}
    sampler_times: dict[str, list[float]] = {name: [] for name in systems}
    with torch.inference_mode():
        for i in range(args.iters + 2):
            for name, rows in systems.items():
                entries = [StepEntry((r.output_token_ids[-1],), len(r.prompt_token_ids) + len(r.output_token_ids) - 1,
                                     t) for r, t in zip(rows, tables, strict=True)]
                start = clock()
                logits = runner.execute(entries, None)
                mid = clock()
                tokens = sample(logits, rows, cfg.eos_token_ids)
                end = clock()
                for r, tok in zip(rows, tokens, strict=True):
                    r.output_token_ids.append(tok)
                if i >= 2:  # warm-up
                    times[name].append((end - start) * 1e3)
                    sampler_times[name].append((end - mid) * 1e3)
    result = {"batch": args.batch, "context": args.context, "iters": args.iters, "threads": args.threads,
              "clock": args.clock,
              "load_average": os.getloadavg(), "machine": machine_line()}
    for name in systems:
        result[f"{name}_step_ms"] = statistics.median(times[name])
        result[f"{name}_sampler_ms"] = statistics.median(sampler_times[name])
    for mode in modes:
        result[f"{mode}_ratio"] = result[f"{mode}/penalised_step_ms"] / result[f"{mode}/plain_step_ms"]
        result[f"{mode}_paired_ratio"] = statistics.median(
            p / q for p, q in zip(times[f"{mode}/penalised"], times[f"{mode}/plain"], strict=True))
    print(step_header(args))
    print(f"{'mode':>8} {'plain_step_ms':>13} {'penalised_step_ms':>17} {'ratio':>6} {'paired':>6} "
          f"{'plain_sampler_ms':>16} {'penalised_sampler_ms':>20}")
    for mode in modes:
        r = {k.split("/")[-1]: v for k, v in result.items() if k.startswith(f"{mode}/")}
        print(f"{mode:>8} {r['plain_step_ms']:>13.1f} {r['penalised_step_ms']:>17.1f} {result[f'{mode}_ratio']:>6.3f} "
              f"{result[f'{mode}_paired_ratio']:>6.3f} {r['plain_sampler_ms']:>16.2f} "
              f"{r['penalised_sampler_ms']:>20.2f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
