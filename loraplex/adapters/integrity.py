"""The adapter tiers' consistency check behind ``AdapterManager.check_integrity`` (debug checks, tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.info import AdapterInfo
from loraplex.adapters.slots import SlotTable


def check_tiers(slot_table: SlotTable, host: HostCache, infos: Mapping[int, AdapterInfo],
                written: Sequence[str | None], held: Set[int], checked_version: int, memo_version: int | None) -> int:
    """Raise AssertionError unless every slot holds a registered version whose content the writer got, a
    version no request holds and no one acquires keeps no slot while unpinned, and host memory holds only
    acquirable versions, within its capacity. ``infos``: versions not dropped; ``written``: the content
    hash handed to the writer per slot; ``held``: the acquirable version ids (held, in use by requests, or
    pinned): exactly those kept.
    The slot table's version never goes back (from ``checked_version``) and memoised indices
    (``memo_version``) are never newer; returns the version checked."""
    slot_table.check_integrity()
    if set(infos) != set(held):
        raise AssertionError(f"versions kept {sorted(infos)} are not those held, in use or pinned {sorted(held)}")
    version = slot_table.version
    if version < checked_version:
        raise AssertionError(f"slot version went back from {checked_version} to {version}")
    if memo_version is not None and memo_version > version:
        raise AssertionError("memoised indices are newer than the slot table")
    for slot, version_id in enumerate(slot_table.slots):
        info = infos.get(version_id) if version_id is not None else None
        if version_id is not None and info is None:
            raise AssertionError(f"slot {slot} holds adapter {version_id}, which is not registered")
        if written[slot] != (info.content_hash if info else None):
            raise AssertionError(f"slot {slot}: writer got {written[slot]}, table says {info}")
        if info and version_id not in held and slot_table.pins(version_id) == 0:
            raise AssertionError(f"slot {slot} keeps unloaded, unpinned adapter {version_id}")
    if not set(host.ids()) <= held or host.evictable() > host.capacity:
        raise AssertionError(f"host tier {host.ids()} holds ids outside {set(held)} or is over capacity")
    return version
