"""Adapter versions (adapters/versions.py through AdapterManager): promotion, rollback, weighted splits,
the held-version bound, and that a version in use keeps serving after the name moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.client.directory import AdapterDirectory
from loraplex.config import ModelConfig
from loraplex.errors import AdapterAlreadyLoaded, AdapterVersionConflict, RequestError, UnknownAdapter
from tests.test_manager import make_manager


@pytest.fixture()
def model_config(tiny_llama: Path) -> ModelConfig:
    return ModelConfig.from_hf(tiny_llama)


def test_promote_then_roll_back_moves_the_name_and_keeps_pins(model_config: ModelConfig,
                                                              tiny_llama_adapters: dict[str, Path]) -> None:
    manager = make_manager(model_config, max_loras=2, max_cpu_loras=4)
    v1 = manager.load("x", tiny_llama_adapters["r4_attn"])
    with pytest.raises(AdapterAlreadyLoaded, match="as a new version"):
        manager.load("x", tiny_llama_adapters["r2_qv"])
    manager.acquire(v1.version_id)  # a request running on v1
    v2 = manager.load("x", tiny_llama_adapters["r2_qv"], new_version=True)
    assert manager.resolve("x") == v2.version_id and manager.list() == [v2]
    assert manager.failure(v1.version_id) is None and manager.can_acquire(v1.version_id)  # still held
    assert manager.drain_dropped() == []
    assert manager.with_versions(lambda v: v.rollback("x")) == v1
    assert manager.resolve("x") == v1.version_id
    with pytest.raises(AdapterVersionConflict, match="no version older than v"):
        manager.with_versions(lambda v: v.rollback("x"))
    listing = manager.with_versions(lambda v: v.listing())
    assert listing == [{"name": "x", "current": f"v{v1.version_id}", "split": None, "pinned": False, "versions": [
        {"id": f"v{i.version_id}", "content_hash": i.content_hash, "path": str(i.path), "loaded_at": i.loaded_at,
         "requests_served": 0} for i in (v1, v2)]}]
    assert v1.content_hash != v2.content_hash and v2.loaded_at >= v1.loaded_at > 0
    manager.release(v1.version_id)
    manager.unload("x")  # retires every version
    assert sorted(manager.drain_dropped()) == [v1.version_id, v2.version_id]
    assert manager.slot_table.slots == [None, None]
    manager.check_integrity()
    manager.close()


def test_split_routes_by_smooth_weighted_round_robin(model_config: ModelConfig,
                                                     tiny_llama_adapters: dict[str, Path]) -> None:
    manager = make_manager(model_config, max_loras=2, max_cpu_loras=4)
    v1 = manager.load("x", tiny_llama_adapters["r4_attn"]).version_id
    v2 = manager.load("x", tiny_llama_adapters["r2_qv"], new_version=True).version_id
    manager.with_versions(lambda v: v.set_split("x", {v1: 0.9, v2: 0.1}))
    directory = AdapterDirectory(None, model_config.vocab_size, lambda held: None)  # a frontend's copy
    directory.update(manager.version_view())
    picks = [directory.route("x").version_id for _ in range(20)]
    assert picks.count(v1) == 18 and picks.count(v2) == 2  # exact per window of 10
    assert all(picks[i:i + 10].count(v2) == 1 for i in (0, 10))
    assert directory.current("x").version_id == v2  # the current version is not a route
    directory.update(manager.version_view())  # the same table again: the picks go on where they were
    assert [directory.route("x").version_id for _ in range(10)].count(v2) == 1
    for bad, error in (({v1: 0.5, v2: 0.4}, RequestError), ({v1: 1.5, v2: -0.5}, RequestError),
                       ({v1: 0.5, 999: 0.5}, UnknownAdapter), ({}, UnknownAdapter)):
        with pytest.raises(error):
            manager.with_versions(lambda v, bad=bad: v.set_split("x", bad))
    manager.with_versions(lambda v: v.set_split("x", {v1: 1.0}))  # one version: promote it, no split
    assert manager.resolve("x") == v1 and manager.with_versions(lambda v: v.split("x")) == {}
    manager.close()


def test_promotions_past_the_bound_retire_the_oldest(model_config: ModelConfig,
                                                     tiny_llama_adapters: dict[str, Path]) -> None:
    manager = make_manager(model_config, max_loras=2, max_cpu_loras=8)
    held_max = manager.versions.max_held
    ids = [manager.load("x", tiny_llama_adapters["r4_attn"], new_version=True).version_id
           for _ in range(held_max + 1)]
    assert manager.drain_dropped() == [ids[0]]
    assert isinstance(manager.failure(ids[0]), UnknownAdapter)
    assert [v["id"] for v in manager.with_versions(lambda v: v.listing())[0]["versions"]] == [
        f"v{i}" for i in ids[1:]]
    with pytest.raises(UnknownAdapter):
        manager.hold(ids[0])
    manager.check_integrity()
    manager.close()
