"""The memory budget for adapters' saved vocabulary rows (``modules_to_save`` matrices, trainable token
rows, added tokens): reserved per adapter version when it is loaded, released when it is forgotten.

Those rows stay in host memory for as long as their version is loaded (the host tier never evicts
them, so no 100 MB matrix is silently re-read from disk); the slot that serves the version references
them without a copy on CPU. A load that would pass the budget fails with
``AdapterMemoryBudgetExceeded`` instead of swapping anything out.
"""

from __future__ import annotations

from loraplex.errors import AdapterMemoryBudgetExceeded

MIB = 2**20


class SavedRowsBudget:
    """``reserve(id, nbytes)`` / ``release(id)`` against ``capacity`` bytes (None = unlimited)."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"saved-rows budget must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._held: dict[int, int] = {}

    @property
    def used(self) -> int:
        return sum(self._held.values())

    def reserve(self, version_id: int, nbytes: int, who: str) -> None:
        """Count ``nbytes`` for ``version_id``; raise (changing nothing) if that would pass the budget."""
        if nbytes == 0:
            return
        if self.capacity is not None and self.used + nbytes > self.capacity:
            raise AdapterMemoryBudgetExceeded(
                f"{who}: its saved embed_tokens/lm_head rows take {nbytes / MIB:.1f} MiB, but only "
                f"{(self.capacity - self.used) / MIB:.1f} MiB of the {self.capacity / MIB:.0f} MiB budget for saved "
                "vocabulary rows is free (EngineConfig.saved_rows_budget_bytes / --saved-rows-budget-mib); "
                "unload an adapter that saves them, or raise the budget")
        self._held[version_id] = nbytes

    def release(self, version_id: int) -> None:
        self._held.pop(version_id, None)

    def holds(self, version_id: int) -> bool:
        return version_id in self._held

    def describe(self, matrix_bytes: int, row_bytes: int) -> str:
        """One line for the start-up log: the budget, how many whole ``[V, hidden]`` matrices fit, where."""
        if self.capacity is None:
            return "saved vocabulary rows: no budget (unlimited)"
        fit = self.capacity // max(matrix_bytes, 1)
        return (f"saved vocabulary rows (modules_to_save embed_tokens/lm_head, trainable tokens, added tokens): "
                f"budget {self.capacity / MIB:.0f} MiB of host memory, held while their adapter version is loaded "
                f"and referenced (not copied) by its slot; a whole embed_tokens or lm_head is "
                f"{matrix_bytes / MIB:.1f} MiB ({matrix_bytes / 1e6:.1f} MB), so {fit} fit "
                f"(a token row: {row_bytes} B)")
