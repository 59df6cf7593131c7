"""Random multi-entry LoRA plans (token row, slot, scale) and their float64 per-entry reference, shared by the
op tests of the torch ops, the C++ kernel and the Triton kernels (``tests/test_lora_plans.py``,
``tests/kernels/test_lora_triton_plans.py``)."""

from __future__ import annotations

import random

import torch

from loraplex.ops.lora_batch import BatchMapping, Entries, LoRABatch, build_lora_batch

SCALES = (0.0, 0.5, 1.0, 2.0, 0.7, 1.3)
KINDS = ("scales", "mixes", "mixed_with_plain", "scale_zero_only")


def random_plans(kind: str, num_tokens: int, num_adapters: int, rng: random.Random) -> BatchMapping:
    """Sequences of random lengths; each a base row, a plain adapter, a scaled adapter or a mix of 2-3."""
    lengths: list[int] = []
    while sum(lengths) < num_tokens:
        lengths.append(min(rng.choice([1, 1, 2, rng.randint(1, 40)]), num_tokens - sum(lengths)))
    seqs: list[tuple[int | None, int]] = []
    plans: list[Entries | None] = []
    for n in lengths:
        ids = rng.sample(range(num_adapters), 3)
        if kind == "scales":
            plan: Entries | None = ((ids[0], rng.choice(SCALES)),)
        elif kind == "mixes":
            plan = tuple((i, rng.choice(SCALES)) for i in ids[: rng.choice([2, 3])])
        elif kind == "scale_zero_only":
            plan = ((ids[0], 0.0),)
        else:
            plan = rng.choice([None, ((ids[0], rng.choice(SCALES)),), ((ids[0], 0.5), (ids[1], 1.0))])
        plain = kind == "mixed_with_plain" and plan is None
        seqs.append((rng.choice([None, ids[2]]) if plain else None, n))
        plans.append(plan)
    return BatchMapping.from_sequences(seqs, plans)


def plan_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int],
                   mapping: BatchMapping, slot_of: dict[int, int]) -> torch.Tensor:
    """Float64, one entry at a time: ``y[t] += c * B[s, :, :R_s] @ (A[s, :R_s] @ x[t])`` per entry (s, c) of t."""
    out = y.double().clone()
    for t, plan in enumerate(mapping.plans()):
        for version_id, scale in plan:
            s, r = slot_of[version_id], ranks[slot_of[version_id]]
            if scale != 0.0:
                out[t] += scale * (b[s, :, :r].double() @ (a[s, :r].double() @ x[t].double()))
    return out


def untouched_rows(batch: LoRABatch) -> torch.Tensor:
    """Rows no pass reads (base rows and rows whose every entry has scale 0): they must stay bit for bit."""
    return batch.token_slots < 0


def plan_case(kind: str, num_tokens: int, seed: int, dtype: torch.dtype = torch.float32):
    """One random case: weights as ``LoRALinear`` keeps them (NaN in unused slots), x, y0, batch, expected."""
    from tests.test_lora_ops import stacked_weights

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    max_loras, r_max, in_f, out_f = 13, 32, 40, 36  # slot 12 (what -1 would read) stays unused
    mapping = random_plans(kind, num_tokens, 9, rng)
    slot_of = {i: (i * 5 + 1) % max_loras for i in range(9)}
    batch = build_lora_batch(mapping, slot_of, slot_version=1)
    used = {slot_of[v] for v in mapping.version_ids()}
    ranks = [r_max] * max_loras
    for s in used:
        ranks[s] = rng.randint(1, r_max)
    a, b = stacked_weights(max_loras, used, ranks, r_max, in_f, out_f, dtype, gen)
    x = torch.randn(num_tokens, in_f, generator=gen).to(dtype)
    y0 = torch.randn(num_tokens, out_f, generator=gen).to(dtype)
    return y0, x, a, b, ranks, batch, plan_reference(y0, x, a, b, ranks, mapping, slot_of)
