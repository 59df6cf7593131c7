"""Per-step LoRA indices, the batched LoRA ops' input: a pure function of (batch mapping, slot-table version).

The mapping says which adapter *id* each token and each sequence asked for; the slot table says
where each id sits now. ``LoRABatch`` is derived from both and records the slot-table version it
was derived from, so a memo keyed on (mapping, version) can never serve indices for an old layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

# How the batched LoRA ops (``loraplex.ops.lora``) run a step; see ``LoRABatch.method``.
SEGMENTS = "segments"  # per run of consecutive same-slot tokens: two GEMMs on row slices, no copies
GROUPED = "grouped"  # per slot group: gather rows, two GEMMs, scatter-add
PADDED = "padded"  # all groups at once: two batched GEMMs over a [G, M] grid of rows
LORA_METHODS = (SEGMENTS, GROUPED, PADDED)

# Cost model for choosing the method, in units of one token row through a rank-r LoRA pair of GEMMs
# on a 576-wide layer (about 2 us here). One op dispatch costs ~5 us; a row that is gathered/scattered
# costs a little extra; a row in a batched GEMM of small groups costs a little more than in one GEMM.
_OP_COST = 2.5
_GATHER_ROW_COST = 0.15
_PADDED_ROW_COST = 1.2


@dataclass(frozen=True)
class BatchMapping:
    """What one step asks for: per token, an adapter id or None (base model)."""

    token_version_ids: tuple[int | None, ...]

    @classmethod
    def from_sequences(cls, seqs: Sequence[tuple[int | None, int]]) -> BatchMapping:
        """``seqs[i] = (version_id, tokens_this_step)``, in batch order."""
        tokens: list[int | None] = []
        for version_id, n in seqs:
            tokens.extend([version_id] * n)
        return cls(tuple(tokens))


@dataclass(frozen=True)
class PaddedLayout:
    """The slot groups laid out as a ``[G, M]`` grid of token rows, ``M`` = the largest group's size.

    ``rows[g * M + j]`` is the token row of the j-th token of group g. A group smaller than M fills
    its pad cells with its first row; ``pad_mask`` marks them (None when there are none) so the op
    can zero their results, which then add exactly nothing to that row.
    """

    rows: torch.Tensor  # [G * M] int64
    pad_mask: torch.Tensor | None  # [G, M, 1] bool, True = pad cell
    max_group_tokens: int  # M
    # (lo, hi) when the grid is exactly rows lo..hi-1 in order (groups of equal size, back to back: the
    # batch is sorted by slot), so the ops read x and write y through views, without gather or scatter
    contiguous: tuple[int, int] | None = None


@dataclass(frozen=True)
class LoRABatch:
    """Slot indices and slot groups for one step.

    ``order[group_offsets[g]:group_offsets[g+1]]`` are the token rows that read slot
    ``group_slots[g]``; tokens with slot -1 appear in no group.

    The lazily cached properties below depend only on the batch, so every LoRA layer of the step
    shares them (and a memoised batch shares them across steps).
    """

    token_slots: torch.Tensor  # [T] int64, -1 = base model only
    order: torch.Tensor  # [T_lora] int64 token rows sorted by slot (stable)
    group_slots: tuple[int, ...]  # [G] distinct slots, ascending
    group_offsets: tuple[int, ...]  # [G + 1]
    slot_version: int

    def to(self, device: torch.device) -> LoRABatch:
        """This batch with its index tensors on ``device`` (itself if they are there already: its cached
        plan stays). The ops index x, y and the slot weights with them, so they must share a device."""
        if self.token_slots.device == device:
            return self
        return replace(self, token_slots=self.token_slots.to(device), order=self.order.to(device))

    @property
    def has_lora(self) -> bool:
        return len(self.group_slots) > 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    @property
    def num_lora_tokens(self) -> int:
        return self.group_offsets[-1]

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """Maximal runs of consecutive tokens that read one slot: ``(start, end, slot)``, slot >= 0."""
        slots = self.token_slots
        if slots.numel() == 0:
            return ()
        change = torch.nonzero(slots[1:] != slots[:-1]).flatten() + 1
        bounds = [0, *change.tolist(), int(slots.shape[0])]
        run_slots = slots[bounds[:-1]].tolist()
        return tuple((bounds[i], bounds[i + 1], s) for i, s in enumerate(run_slots) if s >= 0)

    @cached_property
    def slot_rows(self) -> torch.Tensor:
        """``token_slots + 1`` ``[T]``: each token's row in a per-slot table whose row 0 belongs to the
        base model (so no table is ever indexed with -1)."""
        return self.token_slots + 1

    @cached_property
    def slots_tensor(self) -> torch.Tensor:
        """``group_slots`` as an int64 tensor ``[G]``, to gather the groups' slot weights."""
        return torch.tensor(self.group_slots, dtype=torch.int64, device=self.token_slots.device)

    @cached_property
    def offsets_tensor(self) -> torch.Tensor:
        """``group_offsets`` as an int64 CPU tensor ``[G + 1]`` (read by the CPU LoRA kernel)."""
        return torch.tensor(self.group_offsets, dtype=torch.int64)

    @cached_property
    def slot_span(self) -> tuple[int, int] | None:
        """``(lo, hi)`` when ``group_slots == range(lo, hi)`` (weights are then a view, not a gather)."""
        if not self.group_slots:
            return None
        lo, hi = self.group_slots[0], self.group_slots[-1] + 1
        return (lo, hi) if hi - lo == len(self.group_slots) else None

    @cached_property
    def padded(self) -> PaddedLayout:
        """The ``[G, M]`` grid layout used by the padded method."""
        counts = torch.tensor(self.group_offsets, dtype=torch.int64).diff()  # [G]
        num_groups = len(self.group_slots)
        m = int(counts.max()) if num_groups else 0
        group_of = torch.repeat_interleave(torch.arange(num_groups), counts)  # [T_lora]
        starts = torch.tensor(self.group_offsets[:-1], dtype=torch.int64)  # [G]
        cells = group_of * m + torch.arange(self.num_lora_tokens) - starts[group_of]  # [T_lora]
        order = self.order.cpu()  # [T_lora]
        rows = torch.repeat_interleave(order[starts], m)  # [G * M]
        rows[cells] = order
        device = self.order.device
        pad_mask = None
        if num_groups * m > self.num_lora_tokens:
            pad_mask = torch.ones(num_groups * m, dtype=torch.bool)
            pad_mask[cells] = False
            pad_mask = pad_mask.view(num_groups, m, 1).to(device)
        contiguous = None
        if pad_mask is None and bool((order.diff() == 1).all()):
            contiguous = (int(order[0]), int(order[-1]) + 1)
        return PaddedLayout(rows.to(device), pad_mask, m, contiguous)

    @cached_property
    def method(self) -> str:
        """The cheapest LoRA method for this batch's shape under a small cost model (ops vs rows)."""
        t = self.num_lora_tokens
        g = len(self.group_slots)
        m = max((self.group_offsets[i + 1] - self.group_offsets[i] for i in range(g)), default=0)
        gather = 0.0 if self.slot_span is not None else 2 * _OP_COST
        if self.padded.contiguous is not None:  # views of x and y: two batched GEMMs, no gather or scatter
            padded = 2 * _OP_COST + gather + t * _PADDED_ROW_COST
        else:
            padded = 5 * _OP_COST + gather + g * m * _PADDED_ROW_COST + t * _GATHER_ROW_COST
        costs = {
            SEGMENTS: 2 * _OP_COST * len(self.runs) + t,
            GROUPED: 5 * _OP_COST * g + t * (1 + _GATHER_ROW_COST),
            PADDED: padded,
        }
        return min(costs, key=costs.__getitem__)


def build_lora_batch(mapping: BatchMapping, slot_of: Mapping[int, int], slot_version: int) -> LoRABatch:
    """Derive slot indices. ``slot_of[version_id]`` must hold every id in the mapping (KeyError if not:
    a request whose adapter is not resident must never be scheduled)."""
    token_slots = torch.tensor(
        [-1 if a is None else slot_of[a] for a in mapping.token_version_ids], dtype=torch.int64
    )
    adapted = torch.nonzero(token_slots >= 0).flatten()
    sorted_slots, perm = torch.sort(token_slots[adapted], stable=True)
    order = adapted[perm]
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    offsets = [0]
    for c in counts.tolist():
        offsets.append(offsets[-1] + c)
    return LoRABatch(
        token_slots=token_slots,
        order=order,
        group_slots=tuple(slots.tolist()),
        group_offsets=tuple(offsets),
        slot_version=slot_version,
    )
