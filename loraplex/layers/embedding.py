"""The token embedding with per-slot adapter parts (``VocabSlot``: replaced/added rows, LoRA, DoRA).

Semantics: ``out[t] = W[ids[t]]`` for tokens without an adapter part, else
``slots[s].embed(ids[t], W[ids[t]])`` with s the token's slot. Shapes: ids ``[T]`` int64 ->
``[T, hidden]``. A token's id may reach its slot's ``vocab_size`` (added tokens) only when that slot
adds them; the engine checks every request's ids against its adapter's vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.layers.vocab_slot import VocabSlot
from loraplex.ops.lora_batch import LoRABatch


class VocabEmbedding(nn.Module):
    """``weight [V, hidden]`` (the checkpoint's ``embed_tokens.weight``) plus ``slots[max_loras]``."""

    def __init__(self, vocab_size: int, hidden_size: int, max_loras: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)  # [V, hidden]
        self.slots: list[VocabSlot | None] = [None] * max_loras

    def set_slot(self, slot: int, part: VocabSlot | None) -> None:
        self.slots[slot] = part

    def clear_slot(self, slot: int) -> None:
        self.slots[slot] = None

    def forward(self, input_ids: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        active = [] if lora is None else [(g, s) for g, s in enumerate(lora.group_slots) if self.slots[s]]
        if not active:
            return F.embedding(input_ids, self.weight)
        v = self.weight.shape[0]
        wide = any(self.slots[s].vocab_size > v for _, s in active)  # added ids have no base row
        hidden = F.embedding(input_ids.clamp(max=v - 1) if wide else input_ids, self.weight)
        for g, s in active:
            rows = lora.order[lora.group_offsets[g] : lora.group_offsets[g + 1]]  # [n_g]
            part = self.slots[s].embed(input_ids.index_select(0, rows), hidden.index_select(0, rows))
            hidden.index_copy_(0, rows, part)
        return hidden
