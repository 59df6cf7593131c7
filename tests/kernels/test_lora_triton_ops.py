"""The Triton LoRA kernels against the float64 per-token loop of ``tests/test_lora_ops.py``.

Same oracle, same NaN-poisoned unused slots (slot 12 = what slot -1 would read), ranks 1..64 mixed in
one batch, every popularity pattern, 1..512 tokens, float32 and bfloat16, on the tight grid and (some
cases) on the fixed graph grid over the buffers' whole capacity; each checks that only ``y`` changed:
rows with slot -1 bit for bit, x and the weights untouched. Sized for the interpreter.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from loraplex.ops.lora_batch import BatchMapping, LoRABatch, build_lora_batch
from loraplex.ops.lora_step_buffers import LoRAStepBuffers, slot_tables
from loraplex.ops.lora_triton import add_lora_triton
from tests.test_lora_ops import POPULARITY, TOLERANCE, make_mapping, packed_case, reference, same, stacked_weights

# (dtype, tokens, popularity): every pattern at 1, 7 and 64 tokens in float32 and at 64 in bfloat16, and
# 512 tokens in each dtype (the interpreter runs a 512-token case in seconds, so only two)
CASES = ([(torch.float32, t, p) for t in (1, 7, 64) for p in POPULARITY]
         + [(torch.bfloat16, 64, p) for p in POPULARITY]
         + [(torch.float32, 512, "zipf"), (torch.bfloat16, 512, "uniform")])
FIXED_GRID_TOKENS = 7  # these cases also run on the graph grid (capacity past the step)

def run_kernels(y0: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int],
                batch: LoRABatch, expected: torch.Tensor, *, slot_blocks=None, block_width: int | None = None,
                fixed_grid: bool = False, capacity: int | None = None) -> None:
    """Run ``add_lora_triton`` on copies of the inputs and check it against ``expected`` (float64)."""
    device = x.device
    buffers = LoRAStepBuffers(capacity or max(batch.num_tokens, 1), a.shape[0], device)
    buffers.fill(batch)
    num_blocks = max((len(bl) for bl in slot_blocks), default=1) if slot_blocks is not None else 1
    ranks_t, blocks_t = slot_tables(ranks, y0.shape[1], slot_blocks, num_blocks, device)
    y = torch.zeros(y0.shape[0], y0.shape[1] + 2, dtype=y0.dtype, device=device)[:, 2:]  # a strided y
    y.copy_(y0)
    x_before, a_before, b_before = x.clone(), a.clone(), b.clone()
    add_lora_triton(y, x, a, b, ranks_t, blocks_t, buffers, block_width=block_width, fixed_grid=fixed_grid)
    base_rows = (batch.token_slots < 0).to(device)
    assert torch.equal(y[base_rows], y0[base_rows]), "a base-only row changed"
    assert same(x, x_before) and same(a, a_before) and same(b, b_before)
    # relative to the delta's scale, plus one unit in the last place of y's dtype: the kernels add the
    # float32 delta to y and round once, and a bfloat16 y of 4.0 already rounds by up to 0.016
    scale = (expected - y0.double().cpu()).abs().max().item() + 1e-3
    err = (y.double().cpu() - expected).abs()
    allowed = TOLERANCE[y.dtype] * scale + torch.finfo(y.dtype).eps * expected.abs()
    assert bool((err <= allowed).all()), f"fixed_grid={fixed_grid}: max error {err.max()} vs delta scale {scale}"


@pytest.mark.parametrize(("dtype", "num_tokens", "popularity"), CASES)
def test_kernels_match_float64_loop(dtype: torch.dtype, num_tokens: int, popularity: str,
                                    kernel_device: torch.device) -> None:
    seed = zlib.crc32(f"triton-{dtype}-{popularity}-{num_tokens}".encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    max_loras, r_max, in_f, out_f = 13, 64, 48, 40  # slot 12 (= slot -1 read wrongly) stays unused
    mapping = make_mapping(popularity, num_tokens, 9, rng)
    batch = build_lora_batch(mapping, {i: (i * 5 + 1) % max_loras for i in range(9)}, slot_version=1)
    ranks = [r_max] * max_loras  # unused slots: full rank of NaN, so reading one cannot go unnoticed
    for s in batch.group_slots:
        ranks[s] = rng.randint(1, r_max)
    if batch.group_slots:  # the extremes occur: full capacity and rank 1
        ranks[batch.group_slots[0]], ranks[batch.group_slots[-1]] = r_max, 1
    a, b = stacked_weights(max_loras, set(batch.group_slots), ranks, r_max, in_f, out_f, dtype, gen)
    x = torch.randn(num_tokens, in_f, generator=gen).to(dtype)
    y0 = torch.randn(num_tokens, out_f, generator=gen).to(dtype)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    a, b, x, y0 = (t.to(kernel_device) for t in (a, b, x, y0))
    run_kernels(y0, x, a, b, ranks, batch, expected)
    if num_tokens == FIXED_GRID_TOKENS:  # the graph grid: most programs find no work and exit at once
        run_kernels(y0, x, a, b, ranks, batch, expected, fixed_grid=True, capacity=num_tokens + 5)


@pytest.mark.parametrize("block_ranks", [
    [(3, 5, 2), (3, 5, 2), (3, 5, 2)],  # every slot alike
    [(3, 5, 2), (8, 0, 4), (1, 1, 1)],  # different blocks, a projection left out
    [(0, 6, 0), (0, 6, 0), (0, 6, 0)],  # alike, with empty blocks
    [(0, 0, 0), (2, 3, 17), (0, 0, 0)],  # slots whose adapter skips this layer (rank 0), a rank past one tile
])
@pytest.mark.parametrize("seq_len", [1, 40])
def test_packed_projections_through_block_offsets(block_ranks: list[tuple[int, ...]], seq_len: int,
                                                  kernel_device: torch.device) -> None:
    """q/k/v-like outputs of different widths: each block expanded at its own offsets, B's zeros skipped;
    x is a strided view."""
    seqs = [(0, seq_len), (None, 2), (2, seq_len), (1, seq_len), (0, 3), (2, 1)]
    outs = (16, 8, 24)
    y0, x, a, b, ranks, slot_blocks, batch = packed_case(block_ranks, outs, seqs, seed=seq_len)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    x_dev = torch.zeros(x.shape[0], x.shape[1] + 3, device=kernel_device)[:, 1:-2]
    x_dev.copy_(x)
    for fixed_grid in (False, True):
        run_kernels(y0.to(kernel_device), x_dev, a.to(kernel_device), b.to(kernel_device), ranks, batch,
                    expected, slot_blocks=slot_blocks, block_width=max(outs), fixed_grid=fixed_grid)


def test_b_stored_rank_major(kernel_device: torch.device) -> None:
    """``LoRALinear`` stores B as ``[max_loras, R_max, out]`` and passes its transpose: strides differ."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(3, 8, 20, generator=gen)
    b = torch.randn(3, 8, 12, generator=gen).transpose(1, 2)  # [3, 12, 8], rank-major in memory
    ranks = [8, 5, 8]
    a[1, 5:] = 0
    b[1, :, 5:] = 0
    batch = build_lora_batch(BatchMapping.from_sequences([(0, 3), (1, 2), (None, 1), (2, 4)]),
                             {0: 0, 1: 1, 2: 2}, 0)
    x = torch.randn(batch.num_tokens, 20, generator=gen)
    y0 = torch.randn(batch.num_tokens, 12, generator=gen)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    run_kernels(y0.to(kernel_device), x.to(kernel_device), a.to(kernel_device), b.to(kernel_device), ranks,
                batch, expected)
