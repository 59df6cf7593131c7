"""Per-step LoRA indices: a pure function of (batch mapping, slot-table version).

The mapping says which adapter *id* each token and each sequence asked for; the slot table says
where each id sits now. ``LoRABatch`` is derived from both and records the slot-table version it
was derived from, so a memo keyed on (mapping, version) can never serve indices for an old layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchMapping:
    """What one step asks for: per token and per sequence, an adapter id or None (base model)."""

    token_adapter_ids: tuple[int | None, ...]
    seq_adapter_ids: tuple[int | None, ...]

    @classmethod
    def from_sequences(cls, seqs: Sequence[tuple[int | None, int]]) -> BatchMapping:
        """``seqs[i] = (adapter_id, tokens_this_step)``, in batch order."""
        tokens: list[int | None] = []
        for adapter_id, n in seqs:
            tokens.extend([adapter_id] * n)
        return cls(tuple(tokens), tuple(a for a, _ in seqs))


@dataclass(frozen=True)
class LoRABatch:
    """Slot indices and slot groups for one step.

    ``order[group_offsets[g]:group_offsets[g+1]]`` are the token rows that read slot
    ``group_slots[g]``; tokens with slot -1 appear in no group.
    """

    token_slots: torch.Tensor  # [T] int64, -1 = base model only
    seq_slots: torch.Tensor  # [S] int64, -1 = base model only
    order: torch.Tensor  # [T_lora] int64 token rows sorted by slot (stable)
    group_slots: tuple[int, ...]  # [G] distinct slots, ascending
    group_offsets: tuple[int, ...]  # [G + 1]
    slot_version: int

    @property
    def has_lora(self) -> bool:
        return len(self.group_slots) > 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])


def build_lora_batch(mapping: BatchMapping, slot_of: Mapping[int, int], slot_version: int) -> LoRABatch:
    """Derive slot indices. ``slot_of[adapter_id]`` must hold every id in the mapping (KeyError if not:
    a request whose adapter is not resident must never be scheduled)."""
    token_slots = torch.tensor(
        [-1 if a is None else slot_of[a] for a in mapping.token_adapter_ids], dtype=torch.int64
    )
    seq_slots = torch.tensor([-1 if a is None else slot_of[a] for a in mapping.seq_adapter_ids],
                             dtype=torch.int64)
    adapted = torch.nonzero(token_slots >= 0).flatten()
    sorted_slots, perm = torch.sort(token_slots[adapted], stable=True)
    order = adapted[perm]
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    offsets = [0]
    for c in counts.tolist():
        offsets.append(offsets[-1] + c)
    return LoRABatch(
        token_slots=token_slots,
        seq_slots=seq_slots,
        order=order,
        group_slots=tuple(slots.tolist()),
        group_offsets=tuple(offsets),
        slot_version=slot_version,
    )
