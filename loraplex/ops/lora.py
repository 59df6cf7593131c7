"""Batched LoRA delta over a ragged batch of tokens, one adapter slot per token.

Semantics (for every slot group g with slot s and packed rank R_s > 0):
    y[order[o_g:o_{g+1}]] += (x[order[o_g:o_{g+1}]] @ A[s, :R_s]^T) @ B[s, :, :R_s]^T
Tokens with slot -1 are untouched (never written; no weight is ever indexed with -1).
B already carries the adapter's scale (alpha/r or alpha/sqrt(r)).
Shapes: x [T, in], y [T, out] (changed in place), A [max_loras, R_max, in], B [max_loras, out, R_max],
slot_ranks [max_loras] (R_s; 0 = the slot holds nothing for this layer). Any float dtype, all alike.

A packed layer's B is block-diagonal (``LoRALinear``); ``slot_blocks[s]`` may list its blocks
``(out_lo, out_hi, rank_lo, rank_hi)``, one per projection, in output order, covering every output
(an untargeted projection has ``rank_lo == rank_hi``), so the expand can go block by block and skip
the zeros.

Three methods, all exact; ``batch.method`` picks one per step from the batch's shape (on CPU one op
dispatch costs about as much as a few token rows of LoRA arithmetic, so op counts matter at decode sizes):
- ``segments``: per run of consecutive tokens that read one slot (a prefill sequence): two GEMMs on row
  slices of x and y, no copies. 2 ops per run (1 + blocks when expanded block by block).
- ``grouped``: per slot group: gather its rows, two GEMMs, scatter-add. 4 ops per group (2 + 2 per
  block when expanded block by block).
- ``padded``: all groups at once: two batched GEMMs over a ``[G, M, in]`` grid of gathered rows
  (M = the largest group), one scatter-add. 4 ops whatever G (+1 to zero pad cells when groups are
  unequal, +2 when the groups' slots are not one contiguous range and their weights must be gathered).
  Padding: pad cells are computed, zeroed after the shrink, and add exact zeros to a real row; every
  group runs at the batch's largest rank for this layer, ``max_g R_{s_g}`` (never ``R_max`` unless an
  adapter has it): a smaller adapter's extra A rows and B columns are zeros in its slot buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.adapters.batch_indices import GROUPED, LORA_METHODS, PADDED, SEGMENTS, LoRABatch

Blocks = tuple[tuple[int, int, int, int], ...]  # (out_lo, out_hi, rank_lo, rank_hi) per projection
BLOCKWISE_MIN_ROWS = 16  # below this, one expand GEMM over the zero blocks beats one GEMM per block


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ranks: Sequence[int],
    batch: LoRABatch,
    *,
    slot_blocks: Sequence[Blocks] | None = None,
    method: str | None = None,
) -> None:
    """``y += LoRA(x)`` per slot group, each group at its own rank; see the module docstring.

    ``method`` forces one of ``LORA_METHODS`` (default: ``batch.method``).
    """
    # x: [T, in]; y: [T, out]; lora_a: [max_loras, R_max, in]; lora_b: [max_loras, out, R_max]
    if not batch.has_lora:
        return
    chosen = batch.method if method is None else method
    if chosen == SEGMENTS:
        for start, end, slot in batch.runs:
            if slot_ranks[slot]:
                _add_dense(y[start:end], x[start:end], lora_a, lora_b, slot, slot_ranks, slot_blocks)
    elif chosen == GROUPED:
        _add_grouped(y, x, lora_a, lora_b, slot_ranks, batch, slot_blocks)
    elif chosen == PADDED:
        _add_padded(y, x, lora_a, lora_b, slot_ranks, batch, slot_blocks)
    else:
        raise ValueError(f"unknown LoRA method {chosen!r}; expected one of {LORA_METHODS}")


def _add_dense(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int,
               slot_ranks: Sequence[int], slot_blocks: Sequence[Blocks] | None) -> None:
    """``y += (x @ A_s^T) @ B_s^T`` for rows that all read ``slot``; y and x: [n, *] (views are fine)."""
    rank = slot_ranks[slot]
    shrunk = x @ lora_a[slot, :rank].t()  # [n, R_s]
    for out_lo, out_hi, rank_lo, rank_hi in _expand_blocks(slot, rank, y.shape, slot_blocks):
        if rank_hi > rank_lo:
            y[:, out_lo:out_hi].addmm_(shrunk[:, rank_lo:rank_hi], lora_b[slot, out_lo:out_hi, rank_lo:rank_hi].t())


def _expand_blocks(slot: int, rank: int, shape: torch.Size, slot_blocks: Sequence[Blocks] | None) -> Blocks:
    """B's nonzero blocks when expanding them one by one pays (enough rows), else all of ``B_s[:, :R_s]``."""
    blocks = slot_blocks[slot] if slot_blocks is not None else ()
    if len(blocks) > 1 and shape[0] >= BLOCKWISE_MIN_ROWS:
        return blocks
    return ((0, shape[1], 0, rank),)


def _add_grouped(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 slot_ranks: Sequence[int], batch: LoRABatch, slot_blocks: Sequence[Blocks] | None) -> None:
    for g, slot in enumerate(batch.group_slots):
        rank = slot_ranks[slot]
        if not rank:
            continue
        rows = batch.order[batch.group_offsets[g] : batch.group_offsets[g + 1]]  # [n_g]
        shrunk = x.index_select(0, rows) @ lora_a[slot, :rank].t()  # [n_g, R_s]
        blocks = _expand_blocks(slot, rank, torch.Size((rows.shape[0], y.shape[1])), slot_blocks)
        parts = [shrunk[:, r_lo:r_hi] @ lora_b[slot, o_lo:o_hi, r_lo:r_hi].t() for o_lo, o_hi, r_lo, r_hi in blocks]
        y.index_add_(0, rows, parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


def _add_padded(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                slot_ranks: Sequence[int], batch: LoRABatch, slot_blocks: Sequence[Blocks] | None) -> None:
    rank = max(slot_ranks[s] for s in batch.group_slots)  # the batch's largest rank in this layer
    if rank == 0:
        return
    layout = batch.padded
    span = batch.slot_span
    if span is not None:
        a = lora_a[span[0] : span[1], :rank]  # [G, R, in] (a view)
        b = lora_b[span[0] : span[1], :, :rank]  # [G, out, R] (a view)
    else:
        a = lora_a[:, :rank].index_select(0, batch.slots_tensor)  # [G, R, in]
        b = lora_b[:, :, :rank].index_select(0, batch.slots_tensor)  # [G, out, R]
    grid = x.index_select(0, layout.rows).view(len(batch.group_slots), layout.max_group_tokens, -1)
    shrunk = torch.bmm(grid, a.transpose(1, 2))  # [G, M, R]
    if layout.pad_mask is not None:
        shrunk.masked_fill_(layout.pad_mask, 0.0)
    blocks = _shared_blocks(batch.group_slots, slot_blocks)
    if len(blocks) > 1:  # every group has the same blocks: expand block by block, skipping B's zeros
        delta = torch.cat([torch.bmm(shrunk[:, :, r_lo:r_hi], b[:, o_lo:o_hi, r_lo:r_hi].transpose(1, 2))
                           for o_lo, o_hi, r_lo, r_hi in blocks], dim=2)  # [G, M, out]
    else:
        delta = torch.bmm(shrunk, b.transpose(1, 2))  # [G, M, out]
    y.index_add_(0, layout.rows, delta.view(-1, y.shape[1]))


def _shared_blocks(slots: Sequence[int], slot_blocks: Sequence[Blocks] | None) -> Blocks:
    """The B blocks common to every slot in ``slots`` (``()`` if they differ or are unknown)."""
    if slot_blocks is None:
        return ()
    first = slot_blocks[slots[0]]
    return first if all(slot_blocks[s] == first for s in slots) else ()
