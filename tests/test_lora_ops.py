"""Batched LoRA ops against a float64 per-token loop.

Parametrized over dtype x adapter popularity x token count, with ranks 1..64 mixed in one batch; each
case runs every method forced and the automatic choice, and checks that only ``y`` changed: rows with
slot -1 bitwise, x and the weights untouched. Unused slots hold NaN, so reading one (or slot -1,
which would read the last slot) poisons the result.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from loraplex.ops.lora import BLOCKWISE_MIN_ROWS, add_lora
from loraplex.ops.lora_batch import LORA_METHODS, PADDED, SEGMENTS, BatchMapping, build_lora_batch

METHODS = (None, *LORA_METHODS)  # None = the batch's automatic choice
POPULARITY = ("distinct", "uniform", "zipf", "identical", "all_none", "mixed_none")
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}  # relative to the delta's scale


def pick_adapters(popularity: str, num_seqs: int, num_adapters: int, rng: random.Random) -> list[int | None]:
    if popularity == "distinct":
        return [i % num_adapters for i in range(num_seqs)]
    if popularity == "uniform":
        return [rng.randrange(num_adapters) for _ in range(num_seqs)]
    if popularity == "zipf":
        weights = [1.0 / (k + 1) ** 1.5 for k in range(num_adapters)]
        return rng.choices(range(num_adapters), weights, k=num_seqs)
    if popularity == "identical":
        return [3] * num_seqs
    if popularity == "all_none":
        return [None] * num_seqs
    return [rng.choice([None, rng.randrange(num_adapters)]) for _ in range(num_seqs)]


def make_mapping(popularity: str, num_tokens: int, num_adapters: int, rng: random.Random) -> BatchMapping:
    """Sequences of 1 token (decode) or of random lengths (prefill), shuffled adapters."""
    lengths: list[int] = []
    while sum(lengths) < num_tokens:
        lengths.append(min(rng.choice([1, 1, 2, rng.randint(1, 80)]), num_tokens - sum(lengths)))
    ids = pick_adapters(popularity, len(lengths), num_adapters, rng)
    return BatchMapping.from_sequences(list(zip(ids, lengths, strict=True)))


def stacked_weights(max_loras: int, used: set[int], ranks: list[int], r_max: int, in_f: int, out_f: int,
                    dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot buffers as ``LoRALinear`` keeps them: zeros past each rank; unused slots all NaN."""
    a = torch.full((max_loras, r_max, in_f), float("nan"))
    b = torch.full((max_loras, out_f, r_max), float("nan"))
    for s in used:
        a[s].zero_()
        b[s].zero_()
        a[s, : ranks[s]] = torch.randn(ranks[s], in_f, generator=gen) / in_f**0.5
        b[s, :, : ranks[s]] = torch.randn(out_f, ranks[s], generator=gen) / max(ranks[s], 1) ** 0.5
    return a.to(dtype), b.to(dtype)


def reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int],
              token_slots: torch.Tensor) -> torch.Tensor:
    """Float64, one token at a time: ``y[t] += B[s, :, :R_s] @ (A[s, :R_s] @ x[t])``, s = slot of t."""
    out = y.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            r = ranks[s]
            out[t] += b[s, :, :r].double() @ (a[s, :r].double() @ x[t].double())
    return out


def same(t: torch.Tensor, u: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    return torch.equal(t.isnan(), u.isnan()) and torch.equal(t.nan_to_num(), u.nan_to_num())


def check_op(y0: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int],
             batch, expected: torch.Tensor, method: str | None, slot_blocks=None, strided_y: bool = False) -> None:
    y = y0.clone()
    if strided_y:  # y as a column slice of a wider buffer
        y = torch.zeros(y0.shape[0], y0.shape[1] + 2, dtype=y0.dtype)[:, 2:]
        y.copy_(y0)
    ptr = y.data_ptr()
    x_before, a_before, b_before = x.clone(), a.clone(), b.clone()
    add_lora(y, x, a, b, ranks, batch, slot_blocks=slot_blocks, method=method)
    assert y.data_ptr() == ptr and y.shape == y0.shape and y.dtype == y0.dtype
    base_rows = batch.token_slots < 0
    assert torch.equal(y[base_rows], y0[base_rows]), "a base-only row changed"
    assert same(x, x_before) and same(a, a_before) and same(b, b_before)
    scale = (expected - y0.double()).abs().max().item() + 1e-3
    err = (y.double() - expected).abs().max().item()
    assert err <= TOLERANCE[y.dtype] * scale, f"method {method}: max error {err} vs delta scale {scale}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
def test_add_lora_matches_float64_loop(dtype: torch.dtype, popularity: str, num_tokens: int) -> None:
    seed = zlib.crc32(f"{dtype}-{popularity}-{num_tokens}".encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    max_loras, r_max, in_f, out_f = 13, 64, 48, 40  # slot 12 (= slot -1 read wrongly) stays unused
    mapping = make_mapping(popularity, num_tokens, 9, rng)
    slot_of = {i: (i * 5 + 1) % max_loras for i in range(9)}  # scattered over slots 0..11
    batch = build_lora_batch(mapping, slot_of, slot_version=1)
    ranks = [r_max] * max_loras  # unused slots: full rank of NaN, so reading one cannot go unnoticed
    for s in batch.group_slots:
        ranks[s] = rng.randint(1, r_max)
    ranks[batch.group_slots[0] if batch.group_slots else 0] = r_max  # the full capacity occurs too
    a, b = stacked_weights(max_loras, set(batch.group_slots), ranks, r_max, in_f, out_f, dtype, gen)
    x = torch.randn(num_tokens, in_f, generator=gen).to(dtype)
    y0 = torch.randn(num_tokens, out_f, generator=gen).to(dtype)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    for method in METHODS:
        check_op(y0, x, a, b, ranks, batch, expected, method)


def packed_case(block_ranks: list[tuple[int, ...]], outs: tuple[int, ...], seqs: list[tuple[int | None, int]],
                seed: int):
    """Packed slot buffers (one block per projection, ranks may be 0) and their blocks, as LoRALinear packs."""
    gen = torch.Generator().manual_seed(seed)
    max_loras, in_f = len(block_ranks), 24
    r_max = max(sum(r) for r in block_ranks)
    out_offsets = [sum(outs[:i]) for i in range(len(outs) + 1)]
    a = torch.zeros(max_loras, r_max, in_f)
    b = torch.zeros(max_loras, out_offsets[-1], r_max)
    slot_blocks = []
    for s, proj_ranks in enumerate(block_ranks):
        blocks, k = [], 0
        for p, r in enumerate(proj_ranks):
            a[s, k : k + r] = torch.randn(r, in_f, generator=gen)
            b[s, out_offsets[p] : out_offsets[p + 1], k : k + r] = torch.randn(outs[p], r, generator=gen)
            blocks.append((out_offsets[p], out_offsets[p + 1], k, k + r))
            k += r
        slot_blocks.append(tuple(blocks))
    ranks = [sum(r) for r in block_ranks]
    batch = build_lora_batch(BatchMapping.from_sequences(seqs), {i: i for i in range(max_loras)}, 0)
    x = torch.randn(batch.num_tokens, in_f + 3, generator=gen)[:, 1:-2]  # a strided view works too
    y0 = torch.randn(batch.num_tokens, out_offsets[-1], generator=gen)
    return y0, x, a, b, ranks, slot_blocks, batch


@pytest.mark.parametrize("block_ranks", [
    [(3, 5, 2), (3, 5, 2), (3, 5, 2)],  # every slot alike: the padded method expands block by block
    [(3, 5, 2), (8, 0, 4), (1, 1, 1)],  # different blocks, a projection left out
    [(0, 6, 0), (0, 6, 0), (0, 6, 0)],  # alike, with empty blocks
])
@pytest.mark.parametrize("seq_len", [1, BLOCKWISE_MIN_ROWS - 1, BLOCKWISE_MIN_ROWS, 40])
def test_packed_blocks_match_full_expand(block_ranks: list[tuple[int, ...]], seq_len: int) -> None:
    seqs = [(0, seq_len), (None, 2), (2, seq_len), (1, seq_len), (0, 3), (2, 1)]
    y0, x, a, b, ranks, slot_blocks, batch = packed_case(block_ranks, (16, 8, 8), seqs, seed=seq_len)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    for method in METHODS:
        check_op(y0, x, a, b, ranks, batch, expected, method, slot_blocks=slot_blocks, strided_y=True)


@pytest.mark.parametrize("slots", [(0, 1, 2), (0, 2)])
@pytest.mark.parametrize("per_slot", [1, 4])
def test_rows_sorted_by_slot_run_through_views(slots: tuple[int, ...], per_slot: int) -> None:
    """A decode batch sorted by slot with equal groups (what the engine builds): the padded method reads x
    and writes y through views (no gather or scatter), block by block into column slices of a strided y."""
    seqs = [(None, 1), *[(s, 1) for s in slots for _ in range(per_slot)], (None, 1)]
    y0, x, a, b, ranks, slot_blocks, batch = packed_case([(3, 5, 2)] * 3, (16, 8, 8), seqs, seed=per_slot)
    assert batch.padded.contiguous == (1, 1 + len(slots) * per_slot)
    assert (batch.slot_span is None) == (slots == (0, 2))
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    for method in METHODS:
        for blocks in (slot_blocks, None):
            check_op(y0, x, a, b, ranks, batch, expected, method, slot_blocks=blocks, strided_y=True)


def test_rank_zero_slots_add_nothing() -> None:
    """An adapter that does not target this layer sits in a slot with rank 0: its tokens keep y."""
    y0, x, a, b, ranks, slot_blocks, batch = packed_case([(0, 0), (2, 3), (0, 0)], (8, 8),
                                                       [(0, 4), (1, 2), (2, 3), (0, 1)], seed=5)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    for method in METHODS:
        check_op(y0, x, a, b, ranks, batch, expected, method, slot_blocks=slot_blocks)
        y = y0.clone()
        add_lora(y, x, a, b, ranks, batch, slot_blocks=slot_blocks, method=method)
        untouched = (batch.token_slots == 0) | (batch.token_slots == 2)
        assert torch.equal(y[untouched], y0[untouched])


def test_batch_plan_fields() -> None:
    # tokens: slot 2 x3, base x2, slot 0 x1, slot 2 x1, slot 0 x2
    mapping = BatchMapping((7, 7, 7, None, None, 5, 7, 5, 5))
    batch = build_lora_batch(mapping, {5: 0, 7: 2}, slot_version=3)
    assert batch.runs == ((0, 3, 2), (5, 6, 0), (6, 7, 2), (7, 9, 0))
    assert batch.group_slots == (0, 2) and batch.order.tolist() == [5, 7, 8, 0, 1, 2, 6]
    assert batch.slot_span is None and batch.slots_tensor.tolist() == [0, 2]
    layout = batch.padded  # groups of 3 and 4 tokens -> a [2, 4] grid, one pad cell repeating row 5
    assert layout.max_group_tokens == 4 and layout.rows.tolist() == [5, 7, 8, 5, 0, 1, 2, 6]
    assert layout.pad_mask.flatten().tolist() == [False, False, False, True] + [False] * 4
    assert layout.contiguous is None  # pad cells, and rows out of order
    assert batch.method in LORA_METHODS
    assert build_lora_batch(mapping, {5: 3, 7: 4}, 0).slot_span == (3, 5)


def test_method_choice_follows_batch_shape() -> None:
    prefill = build_lora_batch(BatchMapping.from_sequences([(1, 256), (2, 256)]), {1: 0, 2: 1}, 0)
    assert prefill.method == SEGMENTS  # two long runs: 4 GEMMs, no copies
    decode = build_lora_batch(BatchMapping.from_sequences([(i % 8, 1) for i in range(32)]),
                              {i: i for i in range(8)}, 0)
    assert decode.method == PADDED  # 32 one-token runs over 8 slots: constant op count


def test_unknown_method_is_rejected() -> None:
    y0, x, a, b, ranks, _, batch = packed_case([(2,)], (4,), [(0, 3)], seed=1)
    with pytest.raises(ValueError, match="unknown LoRA method 'sgmv'"):
        add_lora(y0, x, a, b, ranks, batch, method="sgmv")
