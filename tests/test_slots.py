"""SlotTable (device slots: LRU, pins, version) and HostCache (host LRU tier) on their own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex.adapters import slots as slots_module
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.slots import Acquisition, SlotTable


def activate(table: SlotTable, version_id: int) -> Acquisition:
    """What an out-of-band activation does: acquire, then release at once (no lasting pin)."""
    result = table.acquire(version_id)
    table.release(version_id)
    table.check_integrity()
    return result


def test_fill_free_slots_then_hit_without_write() -> None:
    table = SlotTable(3)
    assert table.slots == [None, None, None] and table.version == 0
    assert table.acquire(7) == Acquisition(0, evicted=None)
    assert table.acquire(9) == Acquisition(1, evicted=None)
    assert table.version == 2
    assert table.acquire(7) == Acquisition(0, evicted=None)
    assert table.version == 2  # a hit writes nothing
    assert table.pins(7) == 2 and table.pins(9) == 1 and table.pins(5) == 0
    assert dict(table.slot_of) == {7: 0, 9: 1}
    assert table.in_use() == 2 and table.pinned() == 2
    table.check_integrity()


def test_seed_rotation_at_table_level() -> None:
    """seed.md: slots [1, 2]; activating 3, 1, 2 evicts the LRU each time and ends at [2, 1]."""
    table = SlotTable(2)
    activate(table, 1)
    activate(table, 2)
    assert table.slots == [1, 2]
    assert activate(table, 3) == Acquisition(0, 1)
    assert activate(table, 1) == Acquisition(1, 2)
    assert activate(table, 2) == Acquisition(0, 3)
    assert table.slots == [2, 1]
    assert table.version == 5


def test_lru_order_follows_use_not_insertion() -> None:
    table = SlotTable(2)
    activate(table, 1)
    activate(table, 2)
    activate(table, 1)  # 1 is now the most recently used
    assert activate(table, 3) == Acquisition(1, 2)
    assert table.slots == [1, 3]


def test_pinned_slots_are_never_evicted_or_cleared() -> None:
    table = SlotTable(2)
    table.acquire(1)
    table.acquire(2)
    version = table.version
    assert not table.can_acquire(3)
    with pytest.raises(RuntimeError, match="all 2 slots are pinned"):
        table.acquire(3)
    with pytest.raises(RuntimeError, match="adapter 1 is pinned"):
        table.clear(0)
    assert table.slots == [1, 2] and table.version == version
    assert table.can_acquire(1)  # resident ids can always take another pin
    table.release(2)
    assert table.can_acquire(3)
    assert table.acquire(3) == Acquisition(1, 2)
    assert table.slots == [1, 3] and table.version == version + 1
    table.check_integrity()


def test_least_recent_unpinned_is_chosen_over_pinned_older() -> None:
    table = SlotTable(3)
    table.acquire(1)  # pinned, the oldest
    activate(table, 2)
    activate(table, 3)
    assert activate(table, 4) == Acquisition(1, 2)
    assert table.slots == [1, 4, 3]


def test_release_and_clear() -> None:
    table = SlotTable(2)
    with pytest.raises(RuntimeError, match="holds no pin"):
        table.release(1)
    table.acquire(1)
    table.acquire(1)
    assert table.release(1) == 1
    assert table.release(1) == 0
    with pytest.raises(RuntimeError, match="holds no pin"):
        table.release(1)
    assert table.clear(0) == 1
    assert table.slots == [None, None] and table.version == 2  # the clear is a slot write
    assert table.clear(1) is None and table.version == 3
    table.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    table = SlotTable(2)
    table.acquire(1)
    table.slots[1] = 1  # the same adapter in two slots
    with pytest.raises(AssertionError, match="two slots"):
        table.check_integrity()
    table.slots[1] = None
    table._pins[5] = 1  # a pin on an adapter that is not resident
    with pytest.raises(AssertionError, match="not resident"):
        table.check_integrity()


def test_last_used_follows_acquire_and_release(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 11.0, 12.0, 13.0, 14.0])
    monkeypatch.setattr(slots_module, "time", SimpleNamespace(time=lambda: next(clock)))
    table = SlotTable(2)
    assert table.last_used == [None, None]
    table.acquire(7)  # 10.0, slot 0
    table.acquire(9)  # 11.0, slot 1
    table.acquire(7)  # 12.0: a hit is a use too
    assert table.last_used == [12.0, 11.0]
    table.release(9)  # 13.0
    assert table.last_used == [12.0, 13.0]
    table.clear(1)
    assert table.last_used == [12.0, None]
    table.acquire(5)  # 14.0, into the cleared slot
    assert table.last_used == [12.0, 14.0]


def test_max_loras_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SlotTable(0)


def test_host_cache_lru() -> None:
    cache = HostCache(2)
    a, b, c = object(), object(), object()  # the cache stores weights opaquely
    assert cache.put(1, a) == [] and cache.put(2, b) == []
    assert cache.get(1) is a  # 1 becomes the most recently used
    assert cache.put(3, c) == [2]
    assert cache.ids() == [1, 3] and len(cache) == 2
    assert cache.get(2) is None
    assert cache.contains(1) and 3 in cache and not cache.contains(2)
    assert cache.ids() == [1, 3]  # contains() does not touch the order
    assert cache.pop(1) is a and cache.pop(1) is None
    assert cache.ids() == [3]
    with pytest.raises(ValueError):
        HostCache(0)
