"""The host-memory tier: an LRU of validated adapter weights, bounded by ``max_cpu_loras``.

Not thread-safe on its own: ``AdapterManager`` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict

from loraplex.adapters.peft_format import AdapterWeights


class HostCache:
    """``adapter_id -> AdapterWeights``, least recently used first; ``put`` evicts beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"HostCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, AdapterWeights] = OrderedDict()

    def get(self, adapter_id: int) -> AdapterWeights | None:
        """The weights (marked most recently used), or None."""
        weights = self._entries.get(adapter_id)
        if weights is not None:
            self._entries.move_to_end(adapter_id)
        return weights

    def put(self, adapter_id: int, weights: AdapterWeights) -> list[int]:
        """Insert (or refresh) as most recently used; return the ids evicted to stay within capacity."""
        self._entries[adapter_id] = weights
        self._entries.move_to_end(adapter_id)
        evicted = []
        while len(self._entries) > self.capacity:
            old_id, _ = self._entries.popitem(last=False)
            evicted.append(old_id)
        return evicted

    def pop(self, adapter_id: int) -> AdapterWeights | None:
        """Remove and return the weights, or None if absent."""
        return self._entries.pop(adapter_id, None)

    def contains(self, adapter_id: int) -> bool:
        """Presence test that does not touch the LRU order."""
        return adapter_id in self._entries

    __contains__ = contains

    def ids(self) -> list[int]:
        """Resident ids, least recently used first."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._entries.values())
