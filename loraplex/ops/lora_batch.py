"""Per-step LoRA indices, the batched LoRA ops' input: a pure function of (batch mapping, slot-table version).

The mapping says which adapter *id* each token and each sequence asked for; the slot table says
where each id sits now. ``LoRABatch`` is derived from both and records the slot-table version it
was derived from, so a memo keyed on (mapping, version) can never serve indices for an old layout.

The step's LoRA plan is a list of entries (token row, slot, scale): a row may read 0..K deltas, each
at its own scale (a per-request ``lora_scale``, an adapter mix). Entries of scale 0 are dropped (the
row then gets exactly the base's output). The plan is laid out as K *passes*, pass k holding every
row's k-th entry, so each pass has at most one entry per row and every LoRA kernel runs it unchanged;
``LoRABatch`` is pass 0 and ``LoRABatch.more`` the passes after it.
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


Entries = tuple[tuple[int, float], ...]  # one token's LoRA plan: (adapter version id, scale) per delta


@dataclass(frozen=True)
class BatchMapping:
    """What one step asks for: per token, an adapter id or None (base model); where ``token_entries`` is
    given (non-empty), its entry for a token, when not None, is that token's whole plan instead
    (``token_version_ids[t]`` is then None)."""

    token_version_ids: tuple[int | None, ...]
    token_entries: tuple[Entries | None, ...] = ()

    @classmethod
    def from_sequences(cls, seqs: Sequence[tuple[int | None, int]],
                       entries: Sequence[Entries | None] | None = None) -> BatchMapping:
        """``seqs[i] = (version_id, tokens_this_step)``, in batch order; ``entries[i]`` (optional) sequence
        i's plan, overriding its version id (None: its version id at scale 1)."""
        tokens: list[int | None] = []
        plans: list[Entries | None] = []
        for i, (version_id, n) in enumerate(seqs):
            plan = None if entries is None else entries[i]
            tokens.extend([None if plan is not None else version_id] * n)
            plans.extend([plan] * n)
        return cls(tuple(tokens), tuple(plans) if any(p is not None for p in plans) else ())

    def plans(self) -> list[Entries]:
        """Every token's plan, scale-0 entries included: ``((id, 1.0),)`` for an adapter id, ``()`` for None."""
        if self.token_entries:
            return [e if e is not None else (() if a is None else ((a, 1.0),))
                    for a, e in zip(self.token_version_ids, self.token_entries, strict=True)]
        return [() if a is None else ((a, 1.0),) for a in self.token_version_ids]

    def version_ids(self) -> frozenset[int]:
        """Every adapter id the step reads (its pins must be held)."""
        ids = {a for a in self.token_version_ids if a is not None}
        ids.update(v for e in self.token_entries if e is not None for v, _ in e)
        return frozenset(ids)


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
    # each cell's entry scale (0 at pad cells) when the batch has scales, else None
    scales: torch.Tensor | None = None  # [G, M, 1] float32


@dataclass(frozen=True)
class LoRABatch:
    """Slot indices and slot groups for one step.

    ``order[group_offsets[g]:group_offsets[g+1]]`` are the token rows that read slot
    ``group_slots[g]``; tokens with slot -1 appear in no group. ``token_scales[t]`` scales row t's delta
    (None: all 1, the plain LoRA step); ``more`` are the plan's further passes (see the module docstring).
    The row-wise paths that are not ``LoRALinear`` (embeddings, lm_head, vocabulary rows, DoRA, experts)
    read pass 0's ``token_slots`` unscaled, so adapters with such modules are never scaled or mixed.

    The lazily cached properties below depend only on the batch, so every LoRA layer of the step
    shares them (and a memoised batch shares them across steps).
    """

    token_slots: torch.Tensor  # [T] int64, -1 = base model only
    order: torch.Tensor  # [T_lora] int64 token rows sorted by slot (stable)
    group_slots: tuple[int, ...]  # [G] distinct slots, ascending
    group_offsets: tuple[int, ...]  # [G + 1]
    slot_version: int
    token_scales: torch.Tensor | None = None  # [T] float32; 0 at rows of no group
    more: tuple[LoRABatch, ...] = ()

    def to(self, device: torch.device) -> LoRABatch:
        """This batch with its index tensors on ``device`` (itself if they are there already: its cached
        plan stays). The ops index x, y and the slot weights with them, so they must share a device."""
        if self.token_slots.device == device:
            return self
        scales = None if self.token_scales is None else self.token_scales.to(device)
        return replace(self, token_slots=self.token_slots.to(device), order=self.order.to(device),
                       token_scales=scales, more=tuple(p.to(device) for p in self.more))

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
        """Maximal runs of consecutive tokens that read one slot at one scale: ``(start, end, slot)``, slot >= 0
        (each run's scale: ``run_scales``)."""
        return tuple(run for run, _ in self._scaled_runs)

    @cached_property
    def run_scales(self) -> tuple[float, ...]:
        """The scale of each of ``runs`` (1.0 everywhere when the batch has no scales)."""
        return tuple(scale for _, scale in self._scaled_runs)

    @cached_property
    def _scaled_runs(self) -> tuple[tuple[tuple[int, int, int], float], ...]:
        slots = self.token_slots
        if slots.numel() == 0:
            return ()
        change = slots[1:] != slots[:-1]
        if self.token_scales is not None:
            change |= self.token_scales[1:] != self.token_scales[:-1]
        bounds = [0, *(torch.nonzero(change).flatten() + 1).tolist(), int(slots.shape[0])]
        run_slots = slots[bounds[:-1]].tolist()
        scales = [1.0] * len(run_slots) if self.token_scales is None else self.token_scales[bounds[:-1]].tolist()
        return tuple(((bounds[i], bounds[i + 1], s), scales[i]) for i, s in enumerate(run_slots) if s >= 0)

    @cached_property
    def entry_scales(self) -> torch.Tensor | None:
        """``token_scales[order]`` ``[T_lora]`` float32 (each entry's scale in group order), None without scales."""
        return None if self.token_scales is None else self.token_scales.index_select(0, self.order).contiguous()

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
        scales = None
        if self.entry_scales is not None:
            scales = torch.zeros(num_groups * m, dtype=torch.float32)
            scales[cells] = self.entry_scales.cpu()
            scales = scales.view(num_groups, m, 1).to(device)
        return PaddedLayout(rows.to(device), pad_mask, m, contiguous, scales)

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
    """Derive slot indices: pass 0 and its ``more`` passes. ``slot_of[version_id]`` must hold every id in the
    mapping (KeyError if not: a request whose adapter is not resident must never be scheduled)."""
    plans = [[(slot_of[v], float(s)) for v, s in plan if s != 0.0] for plan in mapping.plans()]
    depth = max(map(len, plans), default=0)
    passes = [_build_pass([p[k] if len(p) > k else None for p in plans], slot_version) for k in range(max(depth, 1))]
    return replace(passes[0], more=tuple(passes[1:]))


def _build_pass(entries: Sequence[tuple[int, float] | None], slot_version: int) -> LoRABatch:
    """One pass: ``entries[t] = (slot, scale)`` or None (row t reads nothing in this pass)."""
    token_slots = torch.tensor([-1 if e is None else e[0] for e in entries], dtype=torch.int64)
    token_scales = None
    if any(e is not None and e[1] != 1.0 for e in entries):
        token_scales = torch.tensor([0.0 if e is None else e[1] for e in entries], dtype=torch.float32)
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
        token_scales=token_scales,
    )
