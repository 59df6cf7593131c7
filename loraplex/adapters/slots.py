"""Device slots: which adapter id sits in which of the ``max_loras`` slots, LRU order, pins, version.

Contract (pin before use, unpin after, evict only unpinned):
- ``acquire(id)`` pins ``id``. If it is resident it only pins and marks it most recently used;
  otherwise it takes the lowest free slot, else the least recently used *unpinned* slot, and the
  caller must write the adapter's weights into that slot before any forward pass reads it.
- A pinned slot is never evicted, overwritten or cleared. When every slot is pinned by other ids,
  ``can_acquire`` is False and ``acquire`` raises: the caller waits for a ``release``.
- ``version`` is bumped by every slot write (assign or clear) and by nothing else, so state derived
  from the layout (per-step indices) can key on it.
- ``last_used[slot]`` is the wall-clock time (``time.time()``) of the last ``acquire`` or ``release``
  of the slot's adapter, for display only; None for an empty slot.

Not thread-safe on its own: ``AdapterManager`` calls it under its lock. ``SlotWriter`` is what copies
weights into a slot (the model implements it); the manager calls it after an ``acquire`` that needs a write.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple, Protocol

from loraplex.adapters.reading.weights import AdapterWeights


class SlotWriter(Protocol):
    """What the model implements: fold a version against the base once (at load, off the step loop),
    copy one adapter into a device slot, or empty a slot."""

    def prepare(self, weights: AdapterWeights) -> AdapterWeights: ...

    def set_slot(self, slot: int, weights: AdapterWeights) -> None: ...

    def clear_slot(self, slot: int) -> None: ...


class Acquisition(NamedTuple):
    slot: int
    evicted: int | None  # the id that occupied the slot before, if any


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.slots: list[int | None] = [None] * max_loras  # slot -> adapter id
        self.last_used: list[float | None] = [None] * max_loras  # slot -> time of its last acquire/release
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._pins: dict[int, int] = {}  # resident adapter id -> pin count (> 0 only)
        self._lru: OrderedDict[int, None] = OrderedDict()  # occupied slots, least recently used first
        self.version = 0

    @property
    def max_loras(self) -> int:
        return len(self.slots)

    @property
    def slot_of(self) -> Mapping[int, int]:
        """Read-only live view ``adapter id -> slot`` of the resident adapters."""
        return MappingProxyType(self._slot_of)

    def pins(self, version_id: int) -> int:
        return self._pins.get(version_id, 0)

    def in_use(self) -> int:
        """Number of occupied slots."""
        return len(self._slot_of)

    def pinned(self) -> int:
        """Number of pinned slots."""
        return len(self._pins)

    def can_acquire(self, version_id: int) -> bool:
        """True if ``acquire(version_id)`` would succeed now (resident, a free slot, or an unpinned one)."""
        return version_id in self._slot_of or self._victim() is not None

    def acquire(self, version_id: int) -> Acquisition:
        """Pin ``version_id`` into a slot; see the module docstring. Raises RuntimeError if it must wait."""
        slot = self._slot_of.get(version_id)
        if slot is not None:
            self._pins[version_id] = self._pins.get(version_id, 0) + 1
            self._lru.move_to_end(slot)
            self.last_used[slot] = time.time()
            return Acquisition(slot, evicted=None)
        slot = self._victim()
        if slot is None:
            raise RuntimeError(f"cannot acquire adapter {version_id}: all {self.max_loras} slots are pinned")
        evicted = self.slots[slot]
        if evicted is not None:
            del self._slot_of[evicted]
        self.slots[slot] = version_id
        self._slot_of[version_id] = slot
        self._pins[version_id] = 1
        self._lru[slot] = None
        self._lru.move_to_end(slot)
        self.last_used[slot] = time.time()
        self.version += 1
        return Acquisition(slot, evicted=evicted)

    def release(self, version_id: int) -> int:
        """Drop one pin; return the pins left. Raises RuntimeError if ``version_id`` is not pinned."""
        count = self._pins.get(version_id, 0)
        if count == 0:
            raise RuntimeError(f"release of adapter {version_id}, which holds no pin")
        if count == 1:
            del self._pins[version_id]
        else:
            self._pins[version_id] = count - 1
        self.last_used[self._slot_of[version_id]] = time.time()
        return count - 1

    def clear(self, slot: int) -> int | None:
        """Empty an unpinned slot (a slot write: bumps the version); return the id it held."""
        version_id = self.slots[slot]
        if version_id is not None and version_id in self._pins:
            raise RuntimeError(f"cannot clear slot {slot}: adapter {version_id} is pinned")
        if version_id is not None:
            del self._slot_of[version_id]
            del self._lru[slot]
        self.slots[slot] = None
        self.last_used[slot] = None
        self.version += 1
        return version_id

    def _victim(self) -> int | None:
        """The lowest free slot, else the least recently used unpinned slot, else None."""
        for slot, version_id in enumerate(self.slots):
            if version_id is None:
                return slot
        for slot in self._lru:
            if self.slots[slot] not in self._pins:
                return slot
        return None

    def check_integrity(self) -> None:
        """Raise AssertionError if the table, the reverse map, the LRU order and the pins disagree."""
        occupied = {s: a for s, a in enumerate(self.slots) if a is not None}
        if len(set(occupied.values())) != len(occupied):
            raise AssertionError(f"an adapter sits in two slots: {self.slots}")
        if {a: s for s, a in occupied.items()} != self._slot_of:
            raise AssertionError(f"reverse map {self._slot_of} disagrees with slots {self.slots}")
        if set(self._lru) != set(occupied):
            raise AssertionError(f"LRU order {list(self._lru)} disagrees with occupied slots {occupied}")
        for version_id, count in self._pins.items():
            if count < 1 or version_id not in self._slot_of:
                raise AssertionError(f"adapter {version_id} has {count} pins but is not resident")
