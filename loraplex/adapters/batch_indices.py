"""``BatchIndices``: a step's LoRA slot indices, memoised on (batch mapping, slot-table version).

The memo holds one entry (consecutive decode steps usually repeat the previous mapping); any slot write
bumps the slot table's version, so indices derived for an older layout are never served again.
Not thread-safe on its own: ``AdapterManager.lora_batch`` calls it under the manager's lock.
"""

from __future__ import annotations

from loraplex.adapters.slots import SlotTable
from loraplex.ops.lora_batch import BatchMapping, LoRABatch, build_lora_batch


class BatchIndices:
    def __init__(self) -> None:
        self._memo: tuple[BatchMapping, int, LoRABatch, frozenset[int]] | None = None

    @property
    def version(self) -> int | None:
        """The slot-table version of the memoised indices (None before the first)."""
        return self._memo[1] if self._memo else None

    def derive(self, mapping: BatchMapping, slot_table: SlotTable) -> LoRABatch | None:
        """Slot indices for ``mapping`` (None if no token uses an adapter, plans' members included). Raises
        RuntimeError if a mapped id holds no pin (its slot could be overwritten while the step reads it)."""
        version = slot_table.version
        memo = self._memo
        hit = memo is not None and memo[1] == version and (memo[0] is mapping or memo[0] == mapping)
        batch, ids = (memo[2], memo[3]) if hit and memo is not None else (None, mapping.version_ids())
        for version_id in ids:
            if slot_table.pins(version_id) == 0:
                raise RuntimeError(f"adapter {version_id} is in the batch mapping but holds no pin")
        if batch is None:
            if not ids:
                return None
            batch = build_lora_batch(mapping, slot_table.slot_of, version)
            self._memo = (mapping, version, batch, ids)
        return batch
