"""Per-layer LoRA on a Llama-shaped block: the float64 correctness gate and base / torch / Triton timings.

Layers are ``LoRALinear`` packed as loraplex packs them (qkv, o, gate_up, down), their slots written with
``set_slot`` (so the slot buffers, ranks and blocks are exactly what the engine reads). Token order is
shuffled, so equal adapters are not adjacent (decode); prefill cases are sequences of equal length.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.layers.lora_linear import LoRALinear
from loraplex.ops.lora import add_lora
from loraplex.ops.lora_batch import BatchMapping, LoRABatch, build_lora_batch
from loraplex.ops.lora_step_buffers import LoRAStepBuffers


@dataclass(frozen=True)
class Shapes:
    hidden: int
    kv: int  # K/V projection width (kv heads x head_dim)
    intermediate: int
    rank: int
    max_loras: int

    def layers(self) -> dict[str, tuple[int, tuple[int, ...], tuple[str, ...]]]:
        h, kv, i = self.hidden, self.kv, self.intermediate
        return {"qkv": (h, (h, kv, kv), ("q_proj", "k_proj", "v_proj")), "o": (h, (h,), ("o_proj",)),
                "gate_up": (h, (i, i), ("gate_proj", "up_proj")), "down": (i, (h,), ("down_proj",))}


def make_layer(in_f: int, outs: tuple[int, ...], names: tuple[str, ...], shapes: Shapes, adapters: int,
               dtype: torch.dtype, device: torch.device, gen: torch.Generator, ranks: list[int] | None = None,
               skip_every: int = 0) -> LoRALinear:
    """A layer with random base weights and ``adapters`` slots written (rank ``ranks[s]`` or the default;
    with ``skip_every`` k, every k-th adapter leaves the layer's last projection out)."""
    layer = LoRALinear(in_f, outs, names, shapes.max_loras, shapes.rank, dtype=dtype, device=device)
    layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / in_f**0.5)
    for s in range(adapters):
        r = ranks[s] if ranks else shapes.rank
        chosen = names[:-1] if skip_every and len(names) > 1 and s % skip_every == 0 else names
        layer.set_slot(s, {n: ((torch.randn(r, in_f, generator=gen) / in_f**0.5).to(device),
                               (torch.randn(o, r, generator=gen) * 0.05).to(device))
                           for n, o in zip(names, outs, strict=True) if n in chosen})
    return layer


def decode_batch(tokens: int, adapters: int, base_fraction: float, seed: int) -> LoRABatch:
    """``tokens`` one-token sequences over ``adapters`` slots (round robin, then shuffled)."""
    rng = random.Random(seed)
    ids: list[int | None] = [i % adapters for i in range(tokens)]
    for i in rng.sample(range(tokens), int(tokens * base_fraction)):
        ids[i] = None
    rng.shuffle(ids)
    return build_lora_batch(BatchMapping.from_sequences([(a, 1) for a in ids]), {i: i for i in range(adapters)}, 0)


def prefill_batch(tokens: int, adapters: int) -> LoRABatch:
    seqs = [(i, tokens // adapters) for i in range(adapters)]
    return build_lora_batch(BatchMapping.from_sequences(seqs), {i: i for i in range(adapters)}, 0)


def float64_delta(layer: LoRALinear, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """``(x_g @ A_s^T) @ B_s^T`` per slot group in float64 from the layer's buffers (full B, no blocks)."""
    delta = torch.zeros(x.shape[0], layer.lora_b.shape[1], dtype=torch.float64, device=x.device)
    for g, slot in enumerate(batch.group_slots):
        rows = batch.order[batch.group_offsets[g] : batch.group_offsets[g + 1]]
        r = layer.slot_ranks[slot]
        a, b = layer.lora_a[slot, :r].double(), layer.lora_b[slot, :, :r].double()
        delta[rows] = (x[rows].double() @ a.T) @ b.T
    return delta


def triton_add(layer: LoRALinear, buffers: LoRAStepBuffers) -> Callable[[torch.Tensor, torch.Tensor, LoRABatch], None]:
    from loraplex.ops.lora_triton import add_lora_triton  # after run.py chose JIT or interpreter

    def run(y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        buffers.prepare(batch)
        add_lora_triton(y, x, layer.lora_a, layer.lora_b, layer.slot_ranks_dev, layer.slot_blocks_dev, buffers,
                        block_width=max(layer.out_features))
    return run


def torch_add(layer: LoRALinear) -> Callable[[torch.Tensor, torch.Tensor, LoRABatch], None]:
    def run(y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        add_lora(y, x, layer.lora_a, layer.lora_b, layer.slot_ranks, batch, slot_blocks=layer.slot_blocks,
                 cache=layer.lora_cache)
    return run


def gate(shapes: Shapes, device: torch.device, cases: list[tuple[str, int, int]]) -> list[dict]:
    """Both LoRA paths against float64 on packed layers, ranks mixed 1..rank, some projections left out."""
    rows = []
    for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 3e-2)):
        for name in ("qkv", "gate_up"):
            in_f, outs, names = shapes.layers()[name]
            gen = torch.Generator().manual_seed(len(rows))
            adapters = max(a for _, _, a in cases)
            ranks = [1 + (s * 7) % shapes.rank for s in range(adapters)]
            layer = make_layer(in_f, outs, names, shapes, adapters, dtype, device, gen, ranks, skip_every=3)
            buffers = LoRAStepBuffers(max(t for _, t, _ in cases), shapes.max_loras, device)
            for kind, tokens, n in cases:
                batch = (decode_batch(tokens, n, 0.25, tokens) if kind == "decode"
                         else prefill_batch(tokens, n)).to(device)
                x = torch.randn(tokens, in_f, generator=gen).to(device, dtype)
                y0 = torch.randn(tokens, sum(outs), generator=gen).to(device, dtype)
                want = y0.double() + float64_delta(layer, x, batch)
                scale = (want - y0.double()).abs().max().item() + 1e-3
                for path, add in (("torch", torch_add(layer)), ("triton", triton_add(layer, buffers))):
                    y = y0.clone()
                    add(y, x, batch)
                    err = (y.double() - want).abs()
                    ok = bool((err <= tol * scale + torch.finfo(dtype).eps * want.abs()).all())
                    base = batch.token_slots < 0
                    base_ok = torch.equal(y[base], y0[base])
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "layer": name, "case": kind,
                                 "tokens": tokens, "adapters": n, "path": path, "max_err_rel": err.max().item() / scale,
                                 "base_rows_untouched": base_ok, "pass": ok and base_ok})
    return rows


def lora_bytes(layer: LoRALinear, batch: LoRABatch, elem: int) -> int:
    """Bytes the LoRA delta must move: each group's A and B blocks, its x rows, its y rows read and written."""
    total = 0
    for g, slot in enumerate(batch.group_slots):
        n = batch.group_offsets[g + 1] - batch.group_offsets[g]
        b_elems = sum((o_hi - o_lo) * (r_hi - r_lo) for o_lo, o_hi, r_lo, r_hi in layer.slot_blocks[slot])
        total += (layer.slot_ranks[slot] * layer.in_features + b_elems + n * (layer.in_features + 2 * sum(
            layer.out_features))) * elem
    return total


def variants(layer: LoRALinear, buffers: LoRAStepBuffers, x: torch.Tensor, y: torch.Tensor,
             batch: LoRABatch) -> dict[str, Callable[[], None]]:
    """The three things timed per layer: the base GEMM, and each path's LoRA delta alone."""
    tri, tor = triton_add(layer, buffers), torch_add(layer)
    return {"base": lambda: F.linear(x, layer.weight), "torch_lora": lambda: tor(y, x, batch),
            "triton_lora": lambda: tri(y, x, batch)}


def timings(shapes: Shapes, device: torch.device, cases: list[tuple[str, int, int]], reps: int,
            timer: Callable[[dict[str, Callable[[], None]], int], dict[str, float]]) -> list[dict]:
    """Median µs and GB/s per layer and case, bf16: base GEMM, torch LoRA delta, Triton LoRA delta."""
    rows, dtype, elem = [], torch.bfloat16, 2
    gen = torch.Generator().manual_seed(1)
    max_adapters = max(n for _, _, n in cases)
    for name, (in_f, outs, names) in shapes.layers().items():
        layer = make_layer(in_f, outs, names, shapes, max_adapters, dtype, device, gen)
        buffers = LoRAStepBuffers(max(t for _, t, _ in cases), shapes.max_loras, device)
        for kind, tokens, n in cases:
            batch = (decode_batch(tokens, n, 0.0, tokens) if kind == "decode" else prefill_batch(tokens, n)).to(device)
            x = torch.randn(tokens, in_f, generator=gen).to(device, dtype)
            y = torch.zeros(tokens, sum(outs), dtype=dtype, device=device)
            us = timer(variants(layer, buffers, x, y, batch), reps)
            base_bytes = (layer.weight.numel() + tokens * (in_f + sum(outs))) * elem
            delta_bytes = lora_bytes(layer, batch, elem)
            rows.append({"layer": name, "case": kind, "tokens": tokens, "adapters": n, **{f"{k}_us": v for k, v in
                         us.items()}, "base_GBps": base_bytes / us["base"] / 1e3,
                         "torch_lora_GBps": delta_bytes / us["torch_lora"] / 1e3,
                         "triton_lora_GBps": delta_bytes / us["triton_lora"] / 1e3})
    return rows
