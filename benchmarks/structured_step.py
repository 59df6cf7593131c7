"""Structured-output overhead: a batch-32 SmolLM2 decode step (``ModelRunner.execute`` + grammar masks +
``sample`` + matcher updates) with k rows constrained by a JSON schema, against the same batch with none;
greedy and sampled (temperature 0.8). Steps are interleaved (k = 0, 8, 16, 32, 0, ...) in one run; each
constrained row is a different-looking long JSON document in progress (its grammar never completes within
the run). Also: grammar compile time per schema (the 32-schema test corpus), cold and cached.
Prints a table with the load average; ``--out PATH`` writes JSON.

    .venv/bin/python -m benchmarks.structured_step [--iters 12] [--threads 1 --clock thread]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer

from benchmarks.common import add_step_options, machine_line, step_clock, step_header, write_json
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.engine.sampling.logits_processors import ProcessorState
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.sampler import sample
from loraplex.engine.sampling.structured.compiler import GrammarCompilers
from loraplex.engine.sampling.structured.masks import GrammarState, accept_tokens, apply_grammar_masks
from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.loader import load_model
from tests.structured_schemas import SCHEMAS

# A long document: 40+ items, each with a free string, a bounded integer and optional enum tags.
ORDER = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "qty": {"type": "integer", "minimum": 0,
                                                                         "maximum": 100},
                                     "tags": {"type": "array", "items": {"enum": ["new", "used", "gift"]}}},
    "required": ["name", "qty"]}}}, "required": ["items"]}


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    processor_state: ProcessorState | None = None
    grammar: GrammarState | None = None


def compile_times(compilers: GrammarCompilers, tokenizer: object, vocab: int) -> dict[str, float]:
    """Milliseconds per schema: the tokenizer's first use, cold compiles (median, max), cached lookups."""
    start = time.perf_counter()
    compilers.submit(StructuredOutputsParams(regex="a"), tokenizer, vocab).result()  # builds TokenizerInfo
    first = time.perf_counter() - start
    cold, cached = [], []
    for schema in SCHEMAS:
        so = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        compilers.submit(so, tokenizer, vocab).result()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compilers.submit(so, tokenizer, vocab).result()
        cached.append(time.perf_counter() - start)
    return {"tokenizer_info_ms": first * 1e3, "cold_median_ms": statistics.median(cold) * 1e3,
            "cold_max_ms": max(cold) * 1e3, "cached_median_ms": statistics.median(cached) * 1e3,
            "schemas": len(SCHEMAS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_options(parser, iters=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    clock = step_clock(parser, args)
    folder = embedded_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_model(folder, None, 4, 16, torch.float32, "cpu")
    cfg, block_size = model.config, 16
    compilers = GrammarCompilers(cfg.eos_token_ids)
    compiled = compile_times(compilers, tokenizer, cfg.vocab_size)
    order = StructuredOutputsParams(json=ORDER)
    prompts = [tokenizer.encode(f"Order number {i}: list the items as JSON.") for i in range(args.batch)]
    blocks_per_seq = (max(map(len, prompts)) + 2 * (args.iters + 2) + 2 * block_size) // block_size
    kv = KVCache(cfg, 2 * 4 * args.batch * blocks_per_seq, block_size, torch.float32, "cpu")
    allocator = BlockManager(kv.num_blocks, kv.block_size, enable_caching=False)
    runner = ModelRunner(model, kv, block_size)
    ks = [0, 8, 16, 32] if args.batch == 32 else [0, args.batch // 2, args.batch]
    modes = {"greedy": 0.0, "sampled": 0.8}
    systems: dict[str, tuple[list[Row], list[tuple[int, ...]]]] = {}
    with torch.inference_mode():
        for mode, temperature in modes.items():
            for k in ks:
                shared = torch.Generator().manual_seed(1)
                rows = [Row(SamplingParams(temperature=temperature), shared, p,
                            grammar=GrammarState(compilers.submit(order, tokenizer, cfg.vocab_size)) if i < k else None)
                        for i, p in enumerate(prompts)]
                tables = [tuple(allocator.allocate(blocks_per_seq, None)) for _ in rows]
                logits = runner.execute([StepEntry(tuple(r.prompt_token_ids), 0, t) for r, t in zip(rows, tables,
                                                                                                   strict=True)], None)
                _draw(logits, rows)
                systems[f"{mode}/k={k}"] = (rows, tables)
        times: dict[str, list[float]] = {name: [] for name in systems}
        mask_times: dict[str, list[float]] = {name: [] for name in systems}
        for i in range(args.iters + 2):
            for name, (rows, tables) in systems.items():
                entries = [StepEntry((r.output_token_ids[-1],), len(r.prompt_token_ids) + len(r.output_token_ids) - 1,
                                     t) for r, t in zip(rows, tables, strict=True)]
                start = clock()
                logits = runner.execute(entries, None)
                mask = _draw(logits, rows, clock)
                if i >= 2:  # warm-up
                    times[name].append((clock() - start) * 1e3)
                    mask_times[name].append(mask * 1e3)
    report(args, systems, times, mask_times, ks, modes, compiled)


def _draw(logits: torch.Tensor, rows: list[Row], clock=time.perf_counter) -> float:  # noqa: ANN001
    """Mask, sample, advance the matchers; returns the seconds spent on masks and matchers."""
    start = clock()
    apply_grammar_masks(logits, rows)
    masked = clock() - start
    tokens = sample(logits, rows, ())
    start = clock()
    accept_tokens(rows, tokens)
    masked += clock() - start
    for r, token in zip(rows, tokens, strict=True):
        r.output_token_ids.append(token)
    return masked


def report(args: argparse.Namespace, systems: dict, times: dict, mask_times: dict, ks: list[int], modes: dict,
           compiled: dict) -> None:
    result = {"batch": args.batch, "iters": args.iters, "threads": args.threads, "clock": args.clock,
              "load_average": os.getloadavg(), "machine": machine_line(), "compile": compiled}
    print(step_header(args))
    print(f"{'mode':>8} {'k':>3} {'step_ms':>8} {'vs k=0':>7} {'paired':>7} {'mask+accept_ms':>14}")
    for mode in modes:
        free = times[f"{mode}/k=0"]
        for k in ks:
            name = f"{mode}/k={k}"
            row = {"step_ms": statistics.median(times[name]), "mask_ms": statistics.median(mask_times[name]),
                   "ratio": statistics.median(times[name]) / statistics.median(free),
                   "paired_ratio": statistics.median(a / b for a, b in zip(times[name], free, strict=True))}
            result[name] = row
            print(f"{mode:>8} {k:>3} {row['step_ms']:>8.1f} {row['ratio']:>7.3f} {row['paired_ratio']:>7.3f} "
                  f"{row['mask_ms']:>14.2f}")
    print(f"# grammar compile (SmolLM2 tokenizer, {compiled['schemas']} schemas): first use of the tokenizer "
          f"{compiled['tokenizer_info_ms']:.0f} ms; cold median {compiled['cold_median_ms']:.1f} ms, max "
          f"{compiled['cold_max_ms']:.1f} ms; cached {compiled['cached_median_ms']:.3f} ms")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
