"""The host-memory tier: an LRU of validated adapter weights, bounded by ``max_cpu_loras``.

Entries put with ``keep=True`` (adapters with saved vocabulary rows, bounded by their own memory budget
instead) are never evicted and do not count against the capacity; ``pop`` removes them.
Not thread-safe on its own: ``AdapterManager`` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict

from loraplex.adapters.reading.weights import AdapterWeights


class HostCache:
    """``version_id -> AdapterWeights``, least recently used first; ``put`` evicts beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"HostCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, AdapterWeights] = OrderedDict()
        self._kept: set[int] = set()

    def get(self, version_id: int) -> AdapterWeights | None:
        """The weights (marked most recently used), or None."""
        weights = self._entries.get(version_id)
        if weights is not None:
            self._entries.move_to_end(version_id)
        return weights

    def put(self, version_id: int, weights: AdapterWeights, keep: bool = False) -> list[int]:
        """Insert (or refresh) as most recently used; return the ids evicted to stay within capacity."""
        self._entries[version_id] = weights
        self._entries.move_to_end(version_id)
        if keep:
            self._kept.add(version_id)
        evicted = []
        lru = (i for i in list(self._entries) if i not in self._kept)
        while self.evictable() > self.capacity:
            old_id = next(lru)
            del self._entries[old_id]
            evicted.append(old_id)
        return evicted

    def set_kept(self, version_id: int, keep: bool) -> list[int]:
        """Mark a resident entry kept or not (a pinned adapter's host copy); returns the ids evicted to stay
        within capacity once it counts again."""
        if version_id not in self._entries:
            return []
        if keep:
            self._kept.add(version_id)
            return []
        self._kept.discard(version_id)
        return self.put(version_id, self._entries[version_id])

    def pop(self, version_id: int) -> AdapterWeights | None:
        """Remove and return the weights, or None if absent."""
        self._kept.discard(version_id)
        return self._entries.pop(version_id, None)

    def evictable(self) -> int:
        """Entries that count against ``capacity`` (all but the kept ones)."""
        return len(self._entries) - len(self._kept)

    def contains(self, version_id: int) -> bool:
        """Presence test that does not touch the LRU order."""
        return version_id in self._entries

    __contains__ = contains

    def ids(self) -> list[int]:
        """Resident ids, least recently used first."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._entries.values())
