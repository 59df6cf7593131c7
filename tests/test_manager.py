"""AdapterManager: the seed scenario, pins, versions, the host tier, and a stateful test against a
plain reference model of what every slot must hold (design.md section 2, invariants 1-3)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters import manager as manager_module
from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.reading.peft_format import AdapterWeights, read_peft_adapter
from loraplex.config import ModelConfig
from loraplex.errors import AdapterAlreadyLoaded, AdapterContentChanged, UnknownAdapter
from loraplex.layers.lora_linear import LoRALinear
from loraplex.ops.lora_batch import BatchMapping, LoRABatch


class RecordingWriter:
    """Records what each slot was last given, and every write in order; ``prepare`` folds through
    ``fold`` (a real model's ``prepare``) when given, else passes plain LoRA through."""

    def __init__(self, max_loras: int, fold: Callable[[AdapterWeights], AdapterWeights] | None = None) -> None:
        self.slots: list[AdapterWeights | None] = [None] * max_loras
        self.log: list[tuple[str, int]] = []
        self.fold = fold

    def prepare(self, weights: AdapterWeights) -> AdapterWeights:
        return self.fold(weights) if self.fold is not None else weights

    def set_slot(self, slot: int, weights: AdapterWeights) -> None:
        self.slots[slot] = weights
        self.log.append(("set", slot))

    def clear_slot(self, slot: int) -> None:
        self.slots[slot] = None
        self.log.append(("clear", slot))


class LayerWriter:
    """A real writer: packed ``LoRALinear`` layers (q/k/v, o, gate/up, down) per block, base weights zero,
    so ``delta`` returns the LoRA part alone for the slots a ``LoRABatch`` selects."""

    GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))

    def __init__(self, mc: ModelConfig, max_loras: int, max_lora_rank: int) -> None:
        shapes = mc.projections()
        self.layers = [[LoRALinear(shapes[g[0]].in_features, tuple(shapes[n].out_features for n in g), g, max_loras,
                                   max_lora_rank)
                        for g in self.GROUPS] for _ in range(mc.num_layers)]
        for linear in (lin for layer in self.layers for lin in layer):
            linear.weight.data.zero_()

    def prepare(self, weights: AdapterWeights) -> AdapterWeights:
        return weights  # plain LoRA: nothing to fold

    def set_slot(self, slot: int, weights: AdapterWeights) -> None:
        for idx, layer in enumerate(self.layers):
            for linear in layer:
                linear.set_slot(slot, {n: weights.modules[(idx, n)] for n in linear.names
                                       if (idx, n) in weights.modules})

    def clear_slot(self, slot: int) -> None:
        for linear in (lin for layer in self.layers for lin in layer):
            linear.clear_slot(slot)

    def delta(self, layer: int, proj: str, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        linear = next(lin for lin in self.layers[layer] if proj in lin.names)
        i = linear.names.index(proj)
        return linear(x, batch)[:, linear.out_offsets[i]:linear.out_offsets[i + 1]]  # [T, out]


@pytest.fixture()
def model_config(tiny_llama: Path) -> ModelConfig:
    return ModelConfig.from_hf(tiny_llama)


def make_manager(mc: ModelConfig, max_loras: int, max_cpu_loras: int, writer=None) -> AdapterManager:
    return AdapterManager(mc, max_loras, max_cpu_loras, 16, writer or RecordingWriter(max_loras))


def activate(manager: AdapterManager, version_id: int) -> int:
    """An out-of-band activation: acquire and release at once."""
    slot = manager.acquire(version_id)
    manager.release(version_id)
    manager.check_integrity()
    return slot


SEED_ADAPTERS = ("r8_all", "r4_attn", "r2_qv")  # all three adapt q_proj


@pytest.mark.parametrize("writer_kind", ["recording", "layers"])
def test_seed_scenario(writer_kind: str, model_config: ModelConfig, tiny_llama_adapters: dict[str, Path]) -> None:
    """seed.md "The exact scenario": same mapping, rotated slots -> indices must follow the slots."""
    writer = RecordingWriter(2) if writer_kind == "recording" else LayerWriter(model_config, 2, 16)
    manager = make_manager(model_config, max_loras=2, max_cpu_loras=3, writer=writer)
    ids = [manager.load(f"a{i + 1}", tiny_llama_adapters[n]).version_id for i, n in enumerate(SEED_ADAPTERS)]
    assert ids == [1, 2, 3]
    assert (manager.acquire(1), manager.acquire(2)) == (0, 1)  # the two in-flight requests pin them
    assert manager.slot_table.slots == [1, 2]
    mapping = BatchMapping(token_version_ids=(1, 2))
    first = manager.lora_batch(mapping)
    assert first.token_slots.tolist() == [0, 1]
    assert manager.lora_batch(mapping) is first  # unchanged layout: the memo serves it
    version = manager.slot_table.version

    manager.release(1)  # the requests step out (e.g. preempted); out-of-band activations rotate the slots
    manager.release(2)
    assert [activate(manager, a) for a in (3, 1, 2)] == [0, 1, 0]
    assert manager.slot_table.slots == [2, 1]
    assert manager.acquire(1) == 1 and manager.acquire(2) == 0  # back in the batch: pure device hits

    second = manager.lora_batch(mapping)
    assert second.token_slots.tolist() == [1, 0]
    # A memo keyed on the mapping alone would have returned `first`: same mapping, stale slots.
    assert manager.slot_table.version == version + 3 == second.slot_version != first.slot_version
    assert first.token_slots.tolist() == [0, 1]
    counters = manager.counters()
    assert (counters["device_evictions"], counters["device_hits"], counters["host_hits"]) == (3, 2, 5)

    if isinstance(writer, LayerWriter):  # the real layers: each token gets its own adapter's delta
        x = torch.randn(2, model_config.hidden_size, generator=torch.Generator().manual_seed(0))  # [2, h]
        q = [read_peft_adapter(tiny_llama_adapters[n], model_config, 16).modules[(0, "q_proj")]
             for n in SEED_ADAPTERS[:2]]  # (A [r, h], B [q_out, r]) of adapters 1 and 2
        want = torch.stack([x[t] @ q[t][0].t() @ q[t][1].t() for t in (0, 1)])  # [2, q_out]
        torch.testing.assert_close(writer.delta(0, "q_proj", x, second), want)
        swapped = torch.stack([x[t] @ q[1 - t][0].t() @ q[1 - t][1].t() for t in (0, 1)])
        torch.testing.assert_close(writer.delta(0, "q_proj", x, first), swapped)  # the seed bug
        assert not torch.allclose(swapped, want, atol=1e-3)
    manager.check_integrity()
    manager.close()


def test_pinned_slots_block_a_runtime_activation(model_config: ModelConfig,
                                                  tiny_llama_adapters: dict[str, Path]) -> None:
    writer = RecordingWriter(2)
    manager = make_manager(model_config, max_loras=2, max_cpu_loras=4, writer=writer)
    a = manager.load("a", tiny_llama_adapters["r8_all"]).version_id
    b = manager.load("b", tiny_llama_adapters["r4_attn"]).version_id
    manager.acquire(a)
    manager.acquire(b)
    before = (list(manager.slot_table.slots), manager.slot_table.version, list(writer.log))
    c = manager.load("c", tiny_llama_adapters["r2_qv"]).version_id
    for _ in range(3):
        assert not manager.can_acquire(c)
        assert manager.try_acquire(c) is None
        with pytest.raises(RuntimeError, match="can_acquire is False"):
            manager.acquire(c)
    assert (list(manager.slot_table.slots), manager.slot_table.version, writer.log) == before
    manager.release(b)
    assert manager.can_acquire(c)
    assert manager.acquire(c) == 1
    assert manager.slot_table.slots == [a, c] and writer.slots[1].path == str(tiny_llama_adapters["r2_qv"])
    manager.check_integrity()
    manager.close()


def test_versions_unload_and_reload(model_config: ModelConfig, tiny_llama_adapters: dict[str, Path]) -> None:
    writer = RecordingWriter(2)
    manager = make_manager(model_config, max_loras=2, max_cpu_loras=2, writer=writer)
    old = manager.load("x", tiny_llama_adapters["r4_attn"])
    with pytest.raises(AdapterAlreadyLoaded, match="'x' is already loaded"):
        manager.load("x", tiny_llama_adapters["r2_qv"])
    manager.acquire(old.version_id)  # a running request
    manager.unload("x")
    with pytest.raises(UnknownAdapter):
        manager.resolve("x")
    with pytest.raises(UnknownAdapter):
        manager.unload("x")
    assert manager.failure(old.version_id) is None  # pinned: still servable
    mapping = BatchMapping((old.version_id,))
    assert manager.lora_batch(mapping).token_slots.tolist() == [0]  # the running one keeps its slot
    new = manager.load("x", tiny_llama_adapters["r2_qv"])
    assert new.version_id != old.version_id and manager.list() == [new]
    assert manager.info(old.version_id) == old
    version = manager.slot_table.version
    manager.release(old.version_id)  # the last pin: the old version is dropped, its slot cleared
    assert manager.slot_table.slots == [None, None] and writer.slots == [None, None]
    assert manager.slot_table.version == version + 1
    with pytest.raises(UnknownAdapter):
        manager.info(old.version_id)
    assert isinstance(manager.failure(old.version_id), UnknownAdapter) and not manager.can_acquire(old.version_id)
    assert manager.acquire(new.version_id) == 0 and writer.slots[0].path == new.path
    manager.check_integrity()
    manager.close()


def test_held_version_outlives_its_unload(model_config: ModelConfig, tiny_llama_adapters: dict[str, Path],
                                         tmp_path: Path) -> None:
    """Accepted means served: requests hold their version from ``hold`` to ``release_hold``. Unload stops new
    requests at once; the held version stays acquirable (re-read from its folder if it left host memory) and
    is dropped with everything kept for it when the last request ends. Only a version that can no longer be
    read fails its requests, with an error naming the folder."""
    folder = tmp_path / "x"
    shutil.copytree(tiny_llama_adapters["r4_attn"], folder)
    manager = make_manager(model_config, max_loras=1, max_cpu_loras=1)
    v1 = manager.load("x", folder).version_id
    assert [manager.hold(manager.resolve("x")).version_id for _ in range(2)] == [v1, v1]  # two accepted requests
    manager.unload("x")
    with pytest.raises(UnknownAdapter, match="no adapter named 'x'"):
        manager.resolve("x")  # a new request's frontend finds no version to route to
    with pytest.raises(UnknownAdapter, match="no longer loaded"):
        manager.hold(v1)  # and a request routed to it before the unload is refused
    assert manager.drain_dropped() == [] and manager.failure(v1) is None
    assert manager.acquire(v1) == 0  # the first request runs on it
    manager.release(v1)
    manager.release_hold(v1)
    manager.check_integrity()
    other = manager.load("y", tiny_llama_adapters["r2_qv"]).version_id  # pushes v1 out of host memory and its slot
    activate(manager, other)
    assert not manager.can_acquire(v1)  # cold: re-read in the background
    manager.wait_for_read(v1, timeout=30)
    assert manager.acquire(v1) == 0  # the second request is served too
    manager.release(v1)
    manager.release_hold(v1)  # the last one: dropped
    assert manager.drain_dropped() == [v1] and isinstance(manager.failure(v1), UnknownAdapter)
    assert v1 not in manager.host and manager.slot_table.slot_of.get(v1) is None
    manager.check_integrity()
    v2 = manager.load("x", folder).version_id
    assert manager.hold(manager.resolve("x")).version_id == v2
    manager.unload("x")
    assert not manager.can_acquire(other)  # y left host memory when v2 was loaded: its re-read pushes v2 out ...
    manager.wait_for_read(other, timeout=30)
    shutil.rmtree(folder)  # ... and its folder vanishes
    assert not manager.can_acquire(v2)
    manager.wait_for_read(v2, timeout=30)
    error = manager.failure(v2)
    assert isinstance(error, AdapterContentChanged) and str(folder) in str(error) and "re-read" in str(error)
    manager.release_hold(v2)  # the failed request ends: the record goes with the version
    assert manager.drain_dropped() == [v2] and manager._failures == {}
    manager.check_integrity()
    manager.close()


def test_lora_batch_requires_pins_and_skips_base_only(model_config: ModelConfig,
                                                      tiny_llama_adapters: dict[str, Path]) -> None:
    manager = make_manager(model_config, max_loras=2, max_cpu_loras=2)
    a = manager.load("a", tiny_llama_adapters["r4_attn"]).version_id
    assert manager.lora_batch(BatchMapping((None, None))) is None
    activate(manager, a)  # resident but unpinned
    with pytest.raises(RuntimeError, match=f"adapter {a} is in the batch mapping but holds no pin"):
        manager.lora_batch(BatchMapping((None, a)))
    manager.acquire(a)
    mapping = BatchMapping((None, a, a))
    batch = manager.lora_batch(mapping)
    assert batch.token_slots.tolist() == [-1, 0, 0]
    manager.release(a)
    with pytest.raises(RuntimeError, match="holds no pin"):  # a memo hit is checked too
        manager.lora_batch(mapping)
    manager.close()


def test_host_tier_rereads_evicted_adapters(model_config: ModelConfig, tiny_llama_adapters: dict[str, Path],
                                            tmp_path: Path) -> None:
    writer = RecordingWriter(1)
    manager = make_manager(model_config, max_loras=1, max_cpu_loras=1, writer=writer)
    folder = shutil.copytree(tiny_llama_adapters["r4_attn"], tmp_path / "a")
    a = manager.load("a", folder)
    b = manager.load("b", tiny_llama_adapters["r2_qv"])
    assert manager.counters()["host_evictions"] == 1
    assert not manager.can_acquire(a.version_id)  # cold: a background re-read starts
    manager.wait_for_read(a.version_id, timeout=30)
    assert manager.can_acquire(a.version_id) and manager.acquire(a.version_id) == 0
    assert writer.slots[0].content_hash == a.content_hash
    assert manager.counters()["disk_reads"] == 1 and manager.counters()["host_evictions"] == 2
    manager.release(a.version_id)

    tensors = load_file(folder / "adapter_model.safetensors")  # the files change behind our back
    save_file({k: v * 2 for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    assert not manager.can_acquire(b.version_id)  # b was pushed out of host memory by a's re-read
    manager.wait_for_read(b.version_id, timeout=30)  # ... and its re-read now pushes a out
    assert manager.acquire(b.version_id) == 0  # and takes a's slot
    assert manager.counters()["disk_reads"] == 2 and manager.counters()["host_evictions"] == 3
    manager.release(b.version_id)
    assert not manager.can_acquire(a.version_id)
    manager.wait_for_read(a.version_id, timeout=30)
    error = manager.failure(a.version_id)
    assert isinstance(error, AdapterContentChanged)
    assert str(folder) in str(error) and "changed on disk" in str(error)
    assert not manager.can_acquire(a.version_id)
    with pytest.raises(AdapterContentChanged):
        manager.acquire(a.version_id)
    assert manager.failure(b.version_id) is None  # the failure stays local
    fresh = manager.load("a2", folder)  # loading again makes a new, servable version
    assert fresh.content_hash != a.content_hash and manager.acquire(fresh.version_id) == 0
    manager.check_integrity()
    manager.close()


def test_file_io_never_holds_the_lock(model_config: ModelConfig, tiny_llama_adapters: dict[str, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_manager(model_config, max_loras=1, max_cpu_loras=1)
    reads: list[bool] = []

    def read_and_probe(*args, **kwargs):
        probe = threading.Thread(target=manager.list)  # blocks if the manager lock is held
        probe.start()
        probe.join(timeout=5)
        reads.append(not probe.is_alive())
        return read_peft_adapter(*args, **kwargs)

    monkeypatch.setattr(manager_module, "read_peft_adapter", read_and_probe)
    a = manager.load("a", tiny_llama_adapters["r4_attn"]).version_id  # the caller's thread
    manager.load("b", tiny_llama_adapters["r2_qv"])
    assert not manager.can_acquire(a)
    manager.wait_for_read(a, timeout=30)  # the background reader's thread
    assert reads == [True, True, True]
    manager.close()



def test_failed_slot_write_rolls_back(model_config: ModelConfig, tiny_llama_adapters: dict[str, Path]) -> None:
    class FailingWriter(RecordingWriter):
        def set_slot(self, slot: int, weights: AdapterWeights) -> None:
            raise MemoryError("device out of memory")

    writer = FailingWriter(1)
    manager = make_manager(model_config, max_loras=1, max_cpu_loras=2, writer=writer)
    a = manager.load("a", tiny_llama_adapters["r4_attn"]).version_id
    with pytest.raises(MemoryError):
        manager.acquire(a)
    assert manager.slot_table.slots == [None] and manager.slot_table.pins(a) == 0
    assert writer.log == [("clear", 0)]
    manager.check_integrity()
    manager.close()

