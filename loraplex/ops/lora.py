"""Batched LoRA delta over a ragged batch of tokens, one adapter slot per token.

Semantics (for every slot group g with slot s and packed rank R_s > 0):
    y[order[o_g:o_{g+1}]] += (x[order[o_g:o_{g+1}]] @ A[s, :R_s]^T) @ B[s, :, :R_s]^T
Tokens with slot -1 are untouched. B already carries the adapter's scale (alpha/r or alpha/sqrt(r)).
Shapes: x [T, in], y [T, out] (changed in place), A [max_loras, R_max, in], B [max_loras, out, R_max].
"""

from __future__ import annotations

import torch

from loraplex.adapters.batch_indices import LoRABatch


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ranks: list[int],
    batch: LoRABatch,
) -> None:
    """``y += LoRA(x)`` per slot group, each group at its own rank; see the module docstring."""
    # x: [T, in]; y: [T, out]; lora_a: [max_loras, R_max, in]; lora_b: [max_loras, out, R_max]
    for g, slot in enumerate(batch.group_slots):
        rank = slot_ranks[slot]
        if rank == 0:
            continue
        rows = batch.order[batch.group_offsets[g] : batch.group_offsets[g + 1]]
        shrunk = x.index_select(0, rows) @ lora_a[slot, :rank].t()  # [n_g, R_s]
        y.index_add_(0, rows, shrunk @ lora_b[slot, :, :rank].t())
