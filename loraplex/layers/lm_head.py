"""The lm_head's per-slot adapter parts (``VocabSlot``), applied after the base logits GEMM.

Semantics: given ``base = h W^T`` (``[S, V]``, one row per sequence), rows whose slot holds an
lm_head part become ``slots[s].project(h, base)`` (``[V_a]`` wide); every other row stays exactly
the base GEMM's. When some row's vocabulary is wider than V, the result is ``[S, max V_a]`` and
the extra columns of narrower rows are -inf (never sampled).
"""

from __future__ import annotations

import torch

from loraplex.layers.vocab_slot import VocabSlot
from loraplex.ops.lora_batch import LoRABatch


class LMHeadSlots:
    """``slots[max_loras]``: each slot's lm_head part or None (the base lm_head)."""

    def __init__(self, max_loras: int) -> None:
        self.slots: list[VocabSlot | None] = [None] * max_loras

    def set_slot(self, slot: int, part: VocabSlot | None) -> None:
        self.slots[slot] = part

    def clear_slot(self, slot: int) -> None:
        self.slots[slot] = None

    def apply(self, base: torch.Tensor, hidden: torch.Tensor, logits_rows: torch.Tensor,
              lora: LoRABatch | None) -> torch.Tensor:
        """``base [S, V]``, ``hidden [S, hidden]`` (the rows the logits come from), ``logits_rows [S]`` (their
        token rows in ``lora``) -> ``[S, V']``."""
        if lora is None or not any(self.slots[s] for s in lora.group_slots):
            return base
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(lora.token_slots.index_select(0, logits_rows.to(lora.token_slots.device)).tolist()):
            if slot >= 0 and self.slots[slot] is not None:
                groups.setdefault(slot, []).append(row)
        if not groups:
            return base
        width = max(base.shape[1], *(self.slots[s].vocab_size for s in groups))
        out = base if width == base.shape[1] else torch.cat(
            [base, base.new_full((base.shape[0], width - base.shape[1]), float("-inf"))], 1)
        for slot, rows in groups.items():
            idx = torch.tensor(rows, dtype=torch.int64, device=base.device)  # [n]
            z = self.slots[slot].project(hidden.index_select(0, idx), base.index_select(0, idx))  # [n, V_a]
            out[:, : z.shape[1]].index_copy_(0, idx, z)
            if z.shape[1] < width:
                out[:, z.shape[1] :].index_fill_(0, idx, float("-inf"))
        return out
