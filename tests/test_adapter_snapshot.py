"""``AdapterManager.snapshot()`` (what ``GET /v1/slots`` serves): slots with pins and last use, the host
tier in LRU order, the registry with each adapter's tier, and the counters, checked against values
worked out by hand from the operations, and JSON-serialisable."""

from __future__ import annotations

import json
import time
from pathlib import Path

from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.reading.peft_format import AdapterWeights
from loraplex.config import ModelConfig


class NullWriter:
    def prepare(self, weights: AdapterWeights) -> AdapterWeights:
        return weights  # plain LoRA: nothing to fold

    def set_slot(self, slot: int, weights: AdapterWeights) -> None:
        pass

    def clear_slot(self, slot: int) -> None:
        pass


EMPTY = {"adapter": None, "version": None, "rank": None, "pins": 0, "pinned": False, "last_used": None,
         "unloaded": False}


def test_snapshot_follows_loads_pins_evictions_and_unloads(tiny_llama: Path,
                                                           tiny_llama_adapters: dict[str, Path]) -> None:
    manager = AdapterManager(ModelConfig.from_hf(tiny_llama), 2, 2, 16, NullWriter())
    assert manager.snapshot()["slots"] == [{"slot": 0, **EMPTY}, {"slot": 1, **EMPTY}]
    a, b, c = (manager.load(n, tiny_llama_adapters[n]) for n in ("r8_all", "r4_attn", "r2_qv"))  # ranks 8, 4, 2
    assert (a.version_id, b.version_id, c.version_id) == (1, 2, 3)  # loading c pushed a out of host memory
    before = time.time()
    manager.acquire(2)  # slot 0 from host memory
    manager.acquire(2)  # a device hit: 2 pins
    manager.acquire(3)  # slot 1
    manager.release(3)
    after = time.time()

    snap = manager.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert snap["max_loras"] == 2 and snap["max_cpu_loras"] == 2 and snap["slot_version"] == 2
    assert before <= snap["slots"][0]["last_used"] <= snap["slots"][1]["last_used"] <= after <= snap["time"]
    assert [{k: v for k, v in s.items() if k != "last_used"} for s in snap["slots"]] == [
        {"slot": 0, "adapter": "r4_attn", "version": 2, "rank": 4, "pins": 2, "pinned": False, "unloaded": False},
        {"slot": 1, "adapter": "r2_qv", "version": 3, "rank": 2, "pins": 0, "pinned": False, "unloaded": False},
    ]
    assert snap["host"] == [{"adapter": "r4_attn", "version": 2, "rank": 4},
                            {"adapter": "r2_qv", "version": 3, "rank": 2}]  # least recently used first
    assert [(x["adapter"], x["version"], x["rank"], x["slot"], x["in_host"], x["path"]) for x in snap["adapters"]] == [
        ("r8_all", 1, 8, None, False, a.path), ("r4_attn", 2, 4, 0, True, b.path), ("r2_qv", 3, 2, 1, True, c.path)]
    assert snap["counters"] == {"loads": 3, "device_evictions": 0, "host_evictions": 1, "device_hits": 1,
                                "host_hits": 2, "disk_reads": 0}

    manager.unload("r4_attn")  # still pinned twice: its slot drains
    snap = manager.snapshot()
    assert snap["slots"][0]["adapter"] == "r4_attn" and snap["slots"][0]["pins"] == 2
    assert snap["slots"][0]["unloaded"] is True
    assert [x["adapter"] for x in snap["adapters"]] == ["r8_all", "r2_qv"]
    assert [h["adapter"] for h in snap["host"]] == ["r4_attn", "r2_qv"]  # kept while in use
    manager.release(2)
    manager.release(2)  # the last pin of an unloaded version drops it: slot and host memory
    snap = manager.snapshot()
    assert snap["slots"][0] == {"slot": 0, **EMPTY} and snap["slot_version"] == 3
    assert [h["adapter"] for h in snap["host"]] == ["r2_qv"]

    manager.wait_for_read(1)  # nothing is reading yet: a is on disk only until something needs it
    assert not manager.can_acquire(1)  # starts the background re-read
    manager.wait_for_read(1, timeout=30)
    slot = manager.acquire(1)  # into the free slot 0
    snap = manager.snapshot()
    assert slot == 0 and snap["slots"][0]["adapter"] == "r8_all" and snap["slots"][0]["pins"] == 1
    assert snap["counters"]["disk_reads"] == 1 and snap["counters"]["host_hits"] == 3
    manager.check_integrity()
    manager.close()
