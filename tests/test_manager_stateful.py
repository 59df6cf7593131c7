"""AdapterManager under random operation sequences, held against a plain reference model of what every
slot must hold (design.md section 2, invariants 1-3), with ``check_integrity()`` after every step, over
plain LoRA, DoRA, embed_tokens/lm_head LoRA, saved vocabulary rows and trainable tokens, with a budget for
saved rows that fits one such adapter; and under concurrent loads from another thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from loraplex.adapters.manager import AdapterManager
from loraplex.config import ModelConfig
from loraplex.errors import AdapterAlreadyLoaded, AdapterMemoryBudgetExceeded, UnknownAdapter
from loraplex.models.loader import load_model
from loraplex.models.registry import model_config as registry_config
from loraplex.ops.lora_batch import BatchMapping, LoRABatch
from tests.fixtures import write_peft_adapter, write_tiny_model
from tests.format_fixtures import FORMATS, write_format_adapter
from tests.test_manager import RecordingWriter, make_manager

VOCAB, ROW = 512, 64 * 4  # the small base's vocabulary and bytes per float32 row
# folder -> (DoRA, saved vocabulary bytes) as the fixtures build them
KINDS = {"plain_a": (False, 0), "plain_b": (False, 0), "dora": (True, 0), "dora_embed_head": (True, 0),
         "embed_head": (False, 0), "saved": (False, 2 * 40 * ROW), "tokens": (False, 3 * ROW)}
BUDGET = 2 * 40 * ROW + 4 * ROW  # "saved" fits with "tokens"; a second "saved" does not


@pytest.fixture(scope="module")
def format_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A small-vocabulary tiny Llama and one adapter of each kind in ``KINDS``."""
    root = tmp_path_factory.mktemp("stateful")
    base = write_tiny_model(root / "base", "llama", vocab_size=VOCAB)
    folders = {name: write_peft_adapter(base, root / name, rank=4, seed=i) for i, name in enumerate(("plain_a",
                                                                                                     "plain_b"))}
    for i, name in enumerate(("dora", "dora_embed_head", "embed_head", "saved", "tokens")):
        folders[name] = write_format_adapter(base, root / name, seed=10 + i, **dict(FORMATS[name]))
    return base, {name: str(path) for name, path in folders.items()}


class ReferenceSlots:
    """The plain model of what each slot must hold: lowest free slot, else least recently used unpinned."""

    def __init__(self, max_loras: int) -> None:
        self.slots: list[int | None] = [None] * max_loras
        self.lru: list[int] = []  # occupied slots, least recently used first
        self.pins: dict[int, int] = {}
        self.version = 0

    def victim(self) -> int | None:
        free = [s for s, a in enumerate(self.slots) if a is None]
        unpinned = [s for s in self.lru if self.pins.get(self.slots[s], 0) == 0]
        return (free + unpinned + [None])[0]

    def acquire(self, version_id: int) -> int:
        if version_id in self.slots:
            slot = self.slots.index(version_id)
            self.lru.remove(slot)
        else:
            slot = self.victim()
            if self.slots[slot] is not None:
                self.lru.remove(slot)
            self.slots[slot] = version_id
            self.version += 1
        self.lru.append(slot)
        self.pins[version_id] = self.pins.get(version_id, 0) + 1
        return slot

    def clear(self, version_id: int) -> None:
        if version_id in self.slots:
            slot = self.slots.index(version_id)
            self.slots[slot] = None
            self.lru.remove(slot)
            self.version += 1


def test_manager_against_reference_model(format_folders: tuple[Path, dict[str, str]]) -> None:
    base, folders = format_folders
    model_config = registry_config(base)
    model = load_model(base, model_config, 2, 16, torch.float32, "cpu")  # folds DoRA / vocabulary rows
    names = ("a", "b", "c", "d", "e")

    class ManagerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.writer = RecordingWriter(2, fold=model.prepare)
            self.manager = AdapterManager(model_config, 2, 2, 16, self.writer, saved_rows_budget=BUDGET)
            self.ref = ReferenceSlots(2)
            self.live: dict[str, int] = {}  # name -> id
            self.folder_of: dict[int, str] = {}
            self.kind_of: dict[int, str] = {}
            self.retired: set[int] = set()
            self.holds: dict[int, int] = {}  # version -> requests holding it (AdapterManager.hold)
            self.next_id = 1
            self.last: tuple[BatchMapping, LoRABatch] | None = None

        def known_ids(self) -> list[int]:
            return sorted(set(self.live.values()) | self.retired)

        def pinned_ids(self) -> list[int]:
            return sorted(a for a, n in self.ref.pins.items() if n > 0)

        def in_use(self, version_id: int) -> bool:
            return bool(self.ref.pins.get(version_id, 0) or self.holds.get(version_id, 0))

        def held_bytes(self) -> int:
            """Saved rows of live versions and of unloaded ones still pinned or held by requests."""
            held = set(self.live.values()) | {a for a in self.retired if self.in_use(a)}
            return sum(KINDS[self.kind_of[a]][1] for a in held)

        @rule(name=st.sampled_from(names), folder=st.sampled_from(sorted(folders)))
        def load(self, name: str, folder: str) -> None:
            if name in self.live:
                with pytest.raises(AdapterAlreadyLoaded):
                    self.manager.load(name, folders[folder])
                return
            if self.held_bytes() + KINDS[folder][1] > BUDGET:
                event("load: refused, over the saved-rows budget")
                with pytest.raises(AdapterMemoryBudgetExceeded):
                    self.manager.load(name, folders[folder])
                return
            info = self.manager.load(name, folders[folder])
            assert info.version_id == self.next_id and info.name == name
            assert (info.uses_dora, info.saved_bytes) == KINDS[folder]
            self.live[name], self.folder_of[info.version_id] = info.version_id, folders[folder]
            self.kind_of[info.version_id] = folder
            self.next_id += 1

        @rule(name=st.sampled_from(names))
        def unload(self, name: str) -> None:
            if name not in self.live:
                with pytest.raises(UnknownAdapter):
                    self.manager.unload(name)
                return
            self.manager.unload(name)
            version_id = self.live.pop(name)
            self.retired.add(version_id)
            if not self.in_use(version_id):
                self.ref.clear(version_id)

        @rule(name=st.sampled_from(names))
        def hold(self, name: str) -> None:
            """A request of ``name`` is accepted: it holds the version the name serves now."""
            for retired in self.retired:  # a request routed before its version left is refused
                with pytest.raises(UnknownAdapter):
                    self.manager.hold(retired)
            if name not in self.live:
                with pytest.raises(UnknownAdapter):
                    self.manager.resolve(name)
                return
            assert self.manager.hold(self.manager.resolve(name)).version_id == self.live[name]
            self.holds[self.live[name]] = self.holds.get(self.live[name], 0) + 1

        @precondition(lambda self: any(self.holds.values()))
        @rule(data=st.data())
        def release_hold(self, data: st.DataObject) -> None:
            version_id = data.draw(st.sampled_from(sorted(a for a, n in self.holds.items() if n)))
            self.manager.release_hold(version_id)
            self.holds[version_id] -= 1
            if version_id in self.retired and not self.in_use(version_id):
                event("release_hold: the last request of an unloaded version drops it")
                self.ref.clear(version_id)

        def _acquire(self, version_id: int) -> bool:
            if version_id in self.retired and not self.in_use(version_id):
                assert isinstance(self.manager.failure(version_id), UnknownAdapter)
                assert not self.manager.can_acquire(version_id)
                return False
            expected = version_id in self.ref.slots or self.ref.victim() is not None
            ok = self.manager.can_acquire(version_id)
            event("acquire: " + ("must wait, all slots pinned" if not expected else "resident" if version_id
                                 in self.ref.slots else "cold, re-read" if not ok else "in host memory"))
            if not ok and expected:  # cold in host memory: wait for the background re-read
                self.manager.wait_for_read(version_id, timeout=30)
                ok = self.manager.can_acquire(version_id)
            assert ok == expected
            if ok:
                assert self.manager.acquire(version_id) == self.ref.acquire(version_id)
            return ok

        def _release(self, version_id: int) -> None:
            self.manager.release(version_id)
            self.ref.pins[version_id] -= 1
            if version_id in self.retired and not self.in_use(version_id):
                self.ref.clear(version_id)

        @precondition(lambda self: self.known_ids())
        @rule(data=st.data())
        def acquire(self, data: st.DataObject) -> None:
            self._acquire(data.draw(st.sampled_from(self.known_ids())))

        @precondition(lambda self: self.pinned_ids())
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            self._release(data.draw(st.sampled_from(self.pinned_ids())))

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def activate(self, data: st.DataObject) -> None:
            version_id = data.draw(st.sampled_from(sorted(self.live.values())))
            if self._acquire(version_id):
                self._release(version_id)

        @rule(data=st.data())
        def build_indices(self, data: st.DataObject) -> None:
            choices = st.sampled_from([None, *self.pinned_ids()])
            seqs = data.draw(st.lists(st.tuples(choices, st.integers(1, 3)), min_size=1, max_size=5))
            mapping = BatchMapping.from_sequences(seqs)
            batch = self.manager.lora_batch(mapping)
            if all(a is None for a, _ in seqs):
                assert batch is None
                return
            self.check_batch(mapping, batch)
            assert self.manager.lora_batch(mapping) is batch  # same layout: a memo hit
            self.last = (mapping, batch)

        def check_batch(self, mapping: BatchMapping, batch: LoRABatch) -> None:
            slot = {a: self.ref.slots.index(a) for a in self.pinned_ids()}
            assert batch.token_slots.tolist() == [-1 if a is None else slot[a] for a in mapping.token_version_ids]
            assert batch.slot_version == self.ref.version

        @invariant()
        def slots_match_reference(self) -> None:
            self.manager.check_integrity()
            assert self.manager.slot_table.slots == self.ref.slots  # pinned ids never move
            assert self.manager.slot_table.version == self.ref.version  # every slot write bumps it
            for slot, version_id in enumerate(self.ref.slots):  # invariant 1: the writer got the right weights
                written = self.writer.slots[slot]
                assert (written.path if written else None) == self.folder_of.get(version_id)
                assert written is None or written.prepared  # folded at load, never in a step
            assert self.manager.budget.used == self.held_bytes()
            if self.last is not None and all(self.ref.pins.get(a, 0) for a in self.last[0].token_version_ids
                                             if a is not None):
                mapping, batch = self.last  # invariant 3: indices follow the version, never a stale memo
                fresh = self.manager.lora_batch(mapping)
                assert (fresh is batch) == (batch.slot_version == self.ref.version)
                self.check_batch(mapping, fresh)

        def teardown(self) -> None:
            self.manager.close()

    run_state_machine_as_test(ManagerMachine, settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]))


def test_concurrent_loads_while_the_step_loop_runs(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """An API thread loads and unloads while the step thread acquires, builds indices and releases."""
    manager = make_manager(ModelConfig.from_hf(tiny_llama), max_loras=2, max_cpu_loras=2)
    stable = manager.load("stable", tiny_llama_adapters["r2_qv"]).version_id
    folders = list(tiny_llama_adapters.values())
    errors: list[BaseException] = []

    def api_thread() -> None:
        try:
            for i in range(40):
                manager.load(f"n{i}", folders[i % len(folders)])
                if i >= 2:
                    manager.unload(f"n{i - 2}")
        except BaseException as e:  # surfaced below
            errors.append(e)

    thread = threading.Thread(target=api_thread)
    thread.start()
    steps = 0
    while thread.is_alive() or steps < 20:
        held = {}
        for version_id in {stable, manager.list()[-1].version_id}:  # the newest may be unloaded any time
            slot = manager.try_acquire(version_id)
            if slot is not None:
                held[version_id] = slot
            elif manager.failure(version_id) is None:
                manager.wait_for_read(version_id, timeout=30)
        ids = tuple(held)
        batch = manager.lora_batch(BatchMapping((*ids, None)))
        assert ids == () or batch.token_slots.tolist() == [*held.values(), -1]
        assert all(manager.slot_owner(s) == a for a, s in held.items())
        for version_id in ids:
            manager.release(version_id)
        manager.check_integrity()
        steps += 1
    thread.join()
    assert not errors and manager.counters()["slots_pinned"] == 0
    assert [i.name for i in manager.list()] == ["stable", "n38", "n39"]
    manager.close()
