"""LoRA cost on one SmolLM2-135M decoder layer's seven projections (packed as loraplex packs them).

Times, interleaved and after a warm-up, with a fixed seed, the median of repeats of:
- ``base``: the four packed base projections (qkv 576->960, o 576->576, gate_up 576->3072,
  down 1536->576), ``F.linear`` each;
- ``lora``: the same through ``LoRALinear.forward`` (base plus loraplex's batched LoRA delta);
- ``gather``: the base plus a per-token weight gather (``A[idx]``, ``B[idx]``, then two batched
  matmuls and a scatter-add), the way vLLM's CPU path computes the LoRA delta;
and the two LoRA parts alone (``lora_part``, ``gather_part``), whose ratio is the reported speedup.
Decode-sized batches are one token per sequence; prefill-sized ones are sequences of 64 tokens
(16 with 32 adapters). Sequence order is shuffled, so equal adapters are not adjacent. With one
layer (the default) its weights stay in the cache between repeats, base alone more than base plus
LoRA (whose slot weights compete for it); ``--layers 8`` makes both stream from memory, as in a model.
On a busy shared host, ``--threads 1 --clock cpu`` gives steadier numbers than wall-clock time.

    python benchmarks/lora_layer.py [--repeats N] [--tokens 32 512] [--threads 2] [--clock wall|cpu]
                                    [--layers 1] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from loraplex.layers.lora_linear import LoRALinear
from loraplex.ops.lora import add_lora
from loraplex.ops.lora_batch import BatchMapping, LoRABatch, build_lora_batch

HIDDEN, KV, INTER, RANK, MAX_LORAS = 576, 192, 1536, 16, 32
LAYERS = (  # in_features, out_features, names
    (HIDDEN, (HIDDEN, KV, KV), ("q_proj", "k_proj", "v_proj")),
    (HIDDEN, (HIDDEN,), ("o_proj",)),
    (HIDDEN, (INTER, INTER), ("gate_proj", "up_proj")),
    (INTER, (HIDDEN,), ("down_proj",)),
)
# (tokens, adapters, fraction of sequences that use the base model only)
CASES = [(t, n, f) for t in (32, 512) for n, f in ((1, 0.0), (8, 0.0), (32, 0.0), (8, 0.5))]


def make_layers(num_adapters: int, gen: torch.Generator) -> list[LoRALinear]:
    layers = []
    for in_f, outs, names in LAYERS:
        layer = LoRALinear(in_f, outs, names, MAX_LORAS, RANK)
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / in_f**0.5)
        for slot in range(num_adapters):
            layer.set_slot(slot, {n: (torch.randn(RANK, in_f, generator=gen) / in_f**0.5,
                                      torch.randn(o, RANK, generator=gen) * 0.09)
                                  for n, o in zip(names, outs, strict=True)})
        layers.append(layer)
    return layers


def make_batch(tokens: int, num_adapters: int, base_fraction: float, rng: random.Random) -> LoRABatch:
    seq_len = 1 if tokens <= 64 else (16 if num_adapters > 8 else 64)
    num_seqs = tokens // seq_len
    num_base = int(num_seqs * base_fraction)
    ids: list[int | None] = [i % num_adapters for i in range(num_seqs - num_base)] + [None] * num_base
    rng.shuffle(ids)
    mapping = BatchMapping.from_sequences([(a, seq_len) for a in ids])
    return build_lora_batch(mapping, {i: i for i in range(num_adapters)}, slot_version=0)


def gather_delta(y: torch.Tensor, x: torch.Tensor, layer: LoRALinear, batch: LoRABatch) -> None:
    """The per-token gather baseline: every LoRA token gets its own copy of its slot's A and B."""
    rows = batch.order  # [T_lora]
    idx = batch.token_slots[rows]  # [T_lora], never -1
    a = layer.lora_a[idx]  # [T_lora, R_max, in]
    b = layer.lora_b[idx]  # [T_lora, out, R_max]
    shrunk = torch.bmm(x[rows].unsqueeze(1), a.transpose(1, 2))  # [T_lora, 1, R_max]
    y.index_add_(0, rows, torch.bmm(shrunk, b.transpose(1, 2)).squeeze(1))


def median_ms(fns: dict[str, Callable[[], object]], repeats: int, inner: int,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median over ``repeats`` rounds; each round times every function ``inner`` times, in a rotated order."""
    names = list(fns)
    for fn in fns.values():  # warm-up
        fn()
        fn()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            start = clock()
            for _ in range(inner):
                fns[n]()
            samples[n].append((clock() - start) * 1e3 / inner)
    return {n: statistics.median(v) for n, v in samples.items()}


def run_case(tokens: int, num_adapters: int, base_fraction: float, repeats: int, num_layers: int,
             clock: Callable[[], float]) -> dict[str, object]:
    gen = torch.Generator().manual_seed(1234 + tokens + num_adapters)
    layers = [lin for _ in range(num_layers) for lin in make_layers(num_adapters, gen)]
    batch = make_batch(tokens, num_adapters, base_fraction, random.Random(tokens * 100 + num_adapters))
    xs = [torch.randn(tokens, layer.in_features, generator=gen) for layer in layers]
    ys = [F.linear(x, layer.weight) for x, layer in zip(xs, layers, strict=True)]

    with torch.no_grad():
        for x, layer in zip(xs, layers, strict=True):  # both LoRA paths agree before they are timed
            ours, theirs = layer(x, batch), F.linear(x, layer.weight)
            gather_delta(theirs, x, layer, batch)
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

    pairs = list(zip(xs, layers, strict=True))
    triples = list(zip(ys, xs, layers, strict=True))
    fns: dict[str, Callable[[], object]] = {
        "base": lambda: [F.linear(x, layer.weight) for x, layer in pairs],
        "lora": lambda: [layer(x, batch) for x, layer in pairs],
        "gather": lambda: [gather_delta(F.linear(x, layer.weight), x, layer, batch) for x, layer in pairs],
        "lora_part": lambda: [add_lora(y, x, layer.lora_a, layer.lora_b, layer.slot_ranks, batch,
                                       slot_blocks=layer.slot_blocks, cache=layer.lora_cache)
                              for y, x, layer in triples],
        "gather_part": lambda: [gather_delta(y, x, layer, batch) for y, x, layer in triples],
    }
    inner = 10 if tokens <= 64 else 1
    with torch.no_grad():
        ms = {k: v / num_layers for k, v in median_ms(fns, repeats, inner, clock).items()}  # per decoder layer
    return {
        "tokens": tokens, "adapters": num_adapters, "base_fraction": base_fraction, "method": batch.method,
        "base_ms": ms["base"], "lora_ms": ms["lora"], "gather_ms": ms["gather"],
        "lora_part_ms": ms["lora_part"], "gather_part_ms": ms["gather_part"],
        "lora_over_base": ms["lora"] / ms["base"], "gather_over_base": ms["gather"] / ms["base"],
        "speedup_vs_gather": ms["gather_part"] / ms["lora_part"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="*", help="only the cases with these token counts")
    parser.add_argument("--layers", type=int, default=1,
                        help="cycle through this many decoder layers (times stay per layer): with several, the "
                             "weights stream from memory as in a whole model instead of staying in cache")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time (with --threads 1: steadier on a busy shared host)")
    parser.add_argument("--out", help="write the cases as JSON to this path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, float32, rank {RANK}, max_loras {MAX_LORAS}, {args.clock} clock, "
          f"{args.layers} decoder layer(s), "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'tokens':>6} {'adapters':>8} {'base%':>5} {'method':>8} {'base_ms':>8} {'lora_ms':>8} "
          f"{'gather_ms':>9} {'lora/base':>9} {'gath/base':>9} {'part_ms':>8} {'gpart_ms':>8} {'speedup':>7}")
    results = []
    for tokens, num_adapters, base_fraction in CASES:
        if args.tokens and tokens not in args.tokens:
            continue
        r = run_case(tokens, num_adapters, base_fraction, args.repeats, args.layers, clock)
        r.update(threads=torch.get_num_threads(), clock=args.clock, layers=args.layers)
        results.append(r)
        print(f"{tokens:>6} {num_adapters:>8} {base_fraction * 100:>5.0f} {r['method']:>8} {r['base_ms']:>8.3f} "
              f"{r['lora_ms']:>8.3f} {r['gather_ms']:>9.3f} {r['lora_over_base']:>9.3f} "
              f"{r['gather_over_base']:>9.3f} {r['lora_part_ms']:>8.3f} {r['gather_part_ms']:>8.3f} "
              f"{r['speedup_vs_gather']:>7.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
