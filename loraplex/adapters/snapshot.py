"""A JSON-serialisable picture of the adapter tiers at one instant: what ``GET /v1/slots`` returns.

``tier_snapshot`` is a pure function of the manager's parts; ``AdapterManager.snapshot()`` calls it
under the manager's lock, so the slots, pins, host tier, registry and counters it reports agree.
Shape (times are Unix seconds from ``time.time()``; ``version`` is the adapter id, fresh per load)::

    {"time": 1764500000.1,                       # when the snapshot was taken
     "slot_version": 12,                         # bumped by every slot write
     "max_loras": 4, "max_cpu_loras": 16,
     "slots": [{"slot": 0, "adapter": "shout", "version": 3, "rank": 8,
                "pins": 2,                        # running requests using it (+1 while pinned)
                "pinned": false,                  # pinned by an operator (POST /v1/adapters/{name}/pin)
                "last_used": 1764499999.8,        # its last acquire or release
                "unloaded": false},               # unloaded but still pinned: drains, then clears
               {"slot": 1, "adapter": null, "version": null, "rank": null, "pins": 0,
                "last_used": null, "unloaded": false}],
     "host": [{"adapter": "meow", "version": 4, "rank": 8}],   # host memory, least recently used first
     "adapters": [{"adapter": "shout", "version": 3, "rank": 8, "path": "...",
                   "slot": 0, "in_host": true,
                   "pinned": false}],             # every loaded adapter; slot null = not on the device
     "counters": {"loads": 3, "device_evictions": 1, "host_evictions": 0, "device_hits": 40,
                  "host_hits": 5, "disk_reads": 0}}
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence, Set
from typing import Any, Protocol

from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.slots import SlotTable


class _Info(Protocol):
    name: str
    path: str
    version_id: int
    max_rank: int


def tier_snapshot(slot_table: SlotTable, host: HostCache, infos: Mapping[int, _Info], live: Sequence[_Info],
                  counters: Mapping[str, int], pinned: Set[int] = frozenset()) -> dict[str, Any]:
    """The snapshot described above. ``infos``: every version a slot may hold (live or unloaded but
    pinned); ``live``: the loaded versions in load order; ``counters``: ``AdapterCounters`` as a dict;
    ``pinned``: the versions an operator's pin keeps."""
    live_ids = {info.version_id for info in live}

    def card(version_id: int) -> dict[str, Any]:
        info = infos[version_id]
        return {"adapter": info.name, "version": version_id, "rank": info.max_rank}

    slots = []
    for slot, version_id in enumerate(slot_table.slots):
        held = card(version_id) if version_id is not None else {"adapter": None, "version": None, "rank": None}
        slots.append({"slot": slot, **held, "pins": slot_table.pins(version_id) if version_id is not None else 0,
                      "pinned": version_id in pinned, "last_used": slot_table.last_used[slot],
                      "unloaded": version_id is not None and version_id not in live_ids})
    return {
        "time": time.time(),
        "slot_version": slot_table.version,
        "max_loras": slot_table.max_loras,
        "max_cpu_loras": host.capacity,
        "slots": slots,
        "host": [card(version_id) for version_id in host.ids()],
        "adapters": [{**card(info.version_id), "path": str(info.path),
                      "slot": slot_table.slot_of.get(info.version_id), "in_host": host.contains(info.version_id),
                      "pinned": info.version_id in pinned}
                     for info in live],
        "counters": dict(counters),
    }
