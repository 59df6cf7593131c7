"""AdapterManager: adapter names -> versions, and versions through disk -> host memory -> device slots.

Tiers: registry (names -> held versions: ``VersionTable``), host memory (``max_cpu_loras`` versions,
LRU), device slots (``max_loras``, written through ``writer``).
- Ids are versions. Each successful ``load`` gets a fresh id (``new_version=True`` promotes an existing
  name to it; the versions it held stay acquirable); ``unload`` retires every version of the name
  (as does a promotion past ``VersionTable.max_held`` for the oldest): no new request resolves to it.
- Accepted means served: ``hold(version_id)`` admits each engine request on the version its frontend
  routed it to and holds it until ``release_hold``; a retired version stays acquirable while any request
  holds it or a pin is left.
  When the last one ends, the version is *dropped*: its host weights, saved-rows reservation, tokenizer,
  slot and failure record go, and ``drain_dropped`` hands its id to the engine (its cached KV blocks).
- Per request, ask then do: ``can_acquire(id)``, then ``acquire(id) -> slot`` (pins), ``release(id)`` when
  the request stops running; ``try_acquire`` does both atomically. ``can_acquire`` is False while every
  slot is pinned, or while the weights are not in host memory: a background re-read from the folder then
  starts if ``ReadAhead`` allows (``read_ahead(wanted)``: the scheduler's queue). A re-read that fails or
  whose content hash differs fails the id with ``AdapterContentChanged`` (the one way a held version fails).
- Per step, ``lora_batch(mapping)`` derives slot indices, memoised on (mapping, slot-table version).
- ``load`` folds the version against the base weights once (``writer.prepare``: DoRA scales), reads its
  own tokenizer if it ships one, and reserves its saved vocabulary rows in ``SavedRowsBudget`` (kept
  in host memory while held); ``AdapterMemoryBudgetExceeded`` past the budget.
- Pins (an operator's): ``pin(name)`` keeps the name's current version in a device slot (one slot pin of its
  own, taken as soon as a slot can be had) and its weights in host memory, following the name through
  promotions and rollbacks, until ``unpin`` or ``unload``. At most ``max_loras - 1`` names are pinned, so one
  slot always serves the rest (``AdapterPinLimit``).
- One re-entrant lock guards all state; adapter files are never read while it is held: a load's name
  check, reading, validation, folding and tokenizer run in the caller's thread before it takes the lock
  (to register the version), so a hostile file delays only its own load, never ``lora_batch`` or
  ``try_acquire``. Names match ``names.ADAPTER_NAME_PATTERN``; a load with ``roots`` reads only files inside
  them (and its re-reads keep them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from loraplex.adapters.batch_indices import BatchIndices
from loraplex.adapters.budget import SavedRowsBudget
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.info import AdapterCounters, AdapterInfo
from loraplex.adapters.integrity import check_tiers
from loraplex.adapters.names import check_adapter_name
from loraplex.adapters.read_ahead import ReadAhead, read_ahead_depth
from loraplex.adapters.reading.overflow_bound import check_dora_scales
from loraplex.adapters.reading.peft_format import in_memory_source, read_peft_adapter, read_peft_adapter_from_tensors
from loraplex.adapters.reading.tokenizer import read_adapter_tokenizer
from loraplex.adapters.reading.weights import AdapterWeights
from loraplex.adapters.rereads import Rereads
from loraplex.adapters.slots import SlotTable, SlotWriter
from loraplex.adapters.snapshot import tier_snapshot
from loraplex.adapters.versions import VersionTable, VersionView
from loraplex.config import ModelConfig
from loraplex.errors import AdapterAlreadyLoaded, AdapterError, AdapterPinLimit, UnknownAdapter
from loraplex.ops.lora_batch import BatchMapping, LoRABatch

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AdapterManager:
    def __init__(self, model_config: ModelConfig, max_loras: int, max_cpu_loras: int, max_lora_rank: int,
                 writer: SlotWriter, allow_pickle: bool = False, saved_rows_budget: int | None = None,
                 base_tokenizer: Any = None, first_version_id: int = 1) -> None:
        self.model_config, self.max_lora_rank, self.allow_pickle = model_config, max_lora_rank, allow_pickle
        self.writer, self.base_tokenizer = writer, base_tokenizer
        self.slot_table = SlotTable(max_loras)
        self.host = HostCache(max_cpu_loras)
        self.budget = SavedRowsBudget(saved_rows_budget)
        self._counters = AdapterCounters()
        self._lock = threading.RLock()
        self.versions = VersionTable()  # held versions per name, and the requests holding each version
        self._infos: dict[int, AdapterInfo] = {}  # versions not dropped: held, in use or pinned
        self._dropped: list[int] = []  # dropped since the last drain_dropped
        self._failures: dict[int, AdapterError] = {}  # versions that can no longer be read (until dropped)
        self._written: list[str | None] = [None] * max_loras  # content hash handed to the writer per slot
        self._next_id = first_version_id
        self._rereads = Rereads(self._read, self._reread_done, ReadAhead(read_ahead_depth(max_loras, max_cpu_loras)))
        self._indices = BatchIndices()
        self._pin_holds: set[int] = set()  # pinned versions holding their own slot pin
        self._checked_version = 0

    def load(self, name: str, path: str | Path, new_version: bool = False,
             roots: Sequence[str | Path] | None = None) -> AdapterInfo:
        """Read and validate ``path`` in the caller's thread, then register it as a new version (of an
        existing name, which moves to it, only with ``new_version``). With ``roots`` (the server's
        ``--adapter-root`` folders), every file read must resolve inside one of them."""
        check_adapter_name(name)
        self._check_name_free(name, path, new_version)
        kept_roots = None if roots is None else tuple(str(r) for r in roots)
        weights = self._read(path, kept_roots)
        vocab_size = weights.vocab_size or self.model_config.vocab_size
        tokenizer = read_adapter_tokenizer(path, self.base_tokenizer, vocab_size, kept_roots)
        return self._register(name, weights, new_version, tokenizer, kept_roots, in_memory=False)

    def load_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping | str | bytes,
                     new_version: bool = False) -> AdapterInfo:
        """``load`` from PEFT state-dict ``tensors`` and their ``adapter_config`` (an object or its JSON text),
        validated exactly as a folder is (``read_peft_adapter_from_tensors``). The version has no folder: its
        weights stay in host memory until it is dropped (never evicted, never re-read) and it ships no
        tokenizer (the base model's serves it)."""
        check_adapter_name(name)
        source = in_memory_source(name)
        self._check_name_free(name, source, new_version)
        weights = self.writer.prepare(read_peft_adapter_from_tensors(tensors, config, self.model_config,
                                                                     self.max_lora_rank, source))
        check_dora_scales(weights)
        return self._register(name, weights, new_version, None, None, in_memory=True)

    def _register(self, name: str, weights: AdapterWeights, new_version: bool, tokenizer: Any,
                  roots: tuple[str, ...] | None, in_memory: bool) -> AdapterInfo:
        """Register validated, folded ``weights`` as the new version of ``name`` (under the lock)."""
        alora = weights.config.alora_invocation_tokens  # an aLoRA is served alone, at scale 1
        with self._lock:
            self._check_name_free(name, weights.path, new_version)
            info = AdapterInfo(name, weights.path, self._next_id, weights.content_hash, weights.max_rank,
                               weights.vocab_size, weights.saved_bytes, weights.uses_dora, tokenizer, time.time(),
                               roots, in_memory, weights.scalable and alora is None, alora, weights.score_head)
            self.budget.reserve(info.version_id, info.saved_bytes, f"{weights.path}: adapter {name!r}")
            self._next_id += 1
            self._infos[info.version_id] = info
            for old in self.versions.add(info):
                self._drop_if_unused(old.version_id)
            self._put_host(info.version_id, weights)
            self._counters.loads += 1
            self._follow_pins()
        logger.info("loaded adapter %r (id %d, rank %d) from %s", name, info.version_id, info.max_rank,
                    weights.path)
        return info

    def unload(self, name: str) -> AdapterInfo:
        """Retire every version of ``name`` (returns the one it served): new requests of the name fail at once;
        the requests holding a version still run on it, and it is dropped when the last one ends."""
        with self._lock:
            infos = self.versions.remove(name)
            self._follow_pins()
            for info in infos:
                self._drop_if_unused(info.version_id)
        logger.info("unloaded adapter %r (versions %s)", name, ", ".join(f"v{i.version_id}" for i in infos))
        return infos[-1]

    def drain_dropped(self) -> list[int]:
        """Version ids dropped since the last call (their memory is freed; the engine frees their KV blocks)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    def hold(self, version_id: int) -> AdapterInfo:
        """Admit one engine request on exactly ``version_id`` (``VersionTable.hold``): it stays acquirable,
        even unloaded, until ``release_hold``; ``UnknownAdapter`` if it is no longer held."""
        with self._lock:
            return self.versions.hold(version_id)

    def release_hold(self, version_id: int) -> None:
        """A request holding ``version_id`` ended; the last one of an unloaded version drops it."""
        with self._lock:
            if self.versions.release(version_id):
                self._drop_if_unused(version_id)

    def count_served(self, version_id: int) -> None:
        """One API request was admitted on ``version_id`` (``requests_served`` in the listing)."""
        with self._lock:
            self.versions.count_served(version_id)

    def resolve(self, name: str) -> int:
        """The version ``name`` serves now (ignoring a split)."""
        with self._lock:
            info = self.versions.current(name)
            if info is None:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded")
            return info.version_id

    @property
    def generation(self) -> int:
        """``VersionTable.generation``: changes whenever ``version_view()`` would."""
        return self.versions.generation

    def version_view(self) -> VersionView:
        """The version table as plain data, for frontends that route (``VersionTable.view``)."""
        with self._lock:
            return self.versions.view()

    def with_versions(self, operation: Callable[[VersionTable], T]) -> T:
        """``operation(self.versions)`` under the lock: rollback, split, listing (``VersionTable``); pins follow
        the names' current versions after it."""
        with self._lock:
            result = operation(self.versions)
            self._follow_pins()
            return result

    def pin(self, name: str) -> None:
        """Pin ``name``: its current version keeps a device slot and its host copy (module docstring);
        ``UnknownAdapter`` if not loaded, ``AdapterPinLimit`` past ``max_loras - 1`` pinned names."""
        with self._lock:
            if self.versions.current(name) is None:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded")
            pinned = self.versions.pinned
            limit = self.slot_table.max_loras - 1
            if name not in pinned and len(pinned) >= limit:
                raise AdapterPinLimit(
                    f"cannot pin {name!r}: {len(pinned)} adapters are pinned ({', '.join(pinned) or 'none'}) and at "
                    f"most max_loras - 1 = {limit} may be, so that one slot stays free for the others")
            self.versions.pin(name)
            self._follow_pins()

    def unpin(self, name: str) -> None:
        """Drop ``name``'s pin; its slot becomes evictable once no request uses it (``UnknownAdapter`` if not
        loaded)."""
        with self._lock:
            self.versions.unpin(name)
            self._follow_pins()

    def list(self) -> list[AdapterInfo]:
        """The version each name serves, in load order of the names."""
        with self._lock:
            return self.versions.currents()

    def info(self, version_id: int) -> AdapterInfo:
        with self._lock:
            if (info := self._infos.get(version_id)) is None:
                raise UnknownAdapter(f"no adapter with id {version_id}")
            return info

    def failure(self, version_id: int) -> AdapterError | None:
        """Why ``version_id`` can never be acquired again (dropped, or its files can no longer be read), or None."""
        with self._lock:
            if version_id not in self._infos:
                return UnknownAdapter(f"adapter version v{version_id} is not loaded (unloaded; no request holds it)")
            return self._failures.get(version_id)

    def can_acquire(self, version_id: int) -> bool:
        """Whether ``acquire`` would succeed now; starts a background re-read if the weights are cold."""
        with self._lock:
            if self.failure(version_id) is not None:
                return False
            if version_id in self.slot_table.slot_of:
                return True
            if not self.host.contains(version_id):
                self._rereads.start(self._infos[version_id])
                return False
            return self.slot_table.can_acquire(version_id)

    def read_ahead(self, wanted: Iterable[int]) -> None:
        """``wanted``: versions in admission order; the first few not in a slot are read ahead (``ReadAhead``)."""
        with self._lock:
            for version_id in self._rereads.ahead.plan(wanted, self.slot_table.slot_of.__contains__):
                if self.failure(version_id) is None and self.host.get(version_id) is None:
                    self._rereads.start(self._infos[version_id])

    def acquire(self, version_id: int) -> int:
        """Pin ``version_id`` into a slot (writing it there if needed) and return the slot."""
        with self._lock:
            if (error := self.failure(version_id)) is not None:
                raise error
            if version_id in self.slot_table.slot_of:
                self.slot_table.acquire(version_id)
                self._counters.device_hits += 1
                return self.slot_table.slot_of[version_id]
            weights = self.host.get(version_id)
            if weights is None or not self.slot_table.can_acquire(version_id):
                raise RuntimeError(f"acquire({version_id}) while can_acquire is False: ask first, then wait")
            slot, evicted = self.slot_table.acquire(version_id)
            self._written[slot] = None
            try:
                self.writer.set_slot(slot, weights)
            except BaseException:
                self.slot_table.release(version_id)
                self.slot_table.clear(slot)
                self.writer.clear_slot(slot)
                raise
            self._written[slot] = weights.content_hash
            self._counters.host_hits += 1
            self._counters.device_evictions += evicted is not None
            logger.debug("slot %d <- adapter %d (evicted %s)", slot, version_id, evicted)
            return slot

    def resident(self, version_id: int) -> bool:
        """Whether ``version_id`` sits in a device slot now (acquiring it writes no slot)."""
        with self._lock:
            return version_id in self.slot_table.slot_of

    def try_acquire(self, version_id: int) -> int | None:
        """``acquire`` if ``can_acquire`` (atomically), else None."""
        with self._lock:
            return self.acquire(version_id) if self.can_acquire(version_id) else None

    def release(self, version_id: int) -> None:
        """Drop one pin; the last pin of an unused, unloaded version drops it."""
        with self._lock:
            if self.slot_table.release(version_id) == 0:
                self._drop_if_unused(version_id)
                self._settle_pins()

    def wait_for_read(self, version_id: int, timeout: float | None = None) -> None:
        """Block until a background re-read of ``version_id`` (if one is running) has finished."""
        self._rereads.wait(version_id, timeout)

    def lora_batch(self, mapping: BatchMapping) -> LoRABatch | None:
        """Slot indices (None if no token uses an adapter), memoised on (mapping, slot-table version)."""
        with self._lock:
            return self._indices.derive(mapping, self.slot_table)

    def slot_owner(self, slot: int) -> int | None:
        """The adapter id in ``slot`` (None if empty), for the engine's right-weights debug check."""
        with self._lock:
            return self.slot_table.slots[slot]

    def counters(self) -> dict[str, int]:
        """A snapshot of ``AdapterCounters`` plus the current tier occupancy, for metrics."""
        with self._lock:
            by_requests = sum(self.slot_table.pins(v) > (v in self._pin_holds) for v in self.slot_table.slot_of)
            return dict(asdict(self._counters), slots_in_use=self.slot_table.in_use(), slots_pinned=by_requests,
                        host_adapters=len(self.host), registered=len(self.versions.currents()),
                        adapters_pinned=len(self.versions.pinned))

    def snapshot(self) -> dict[str, Any]:
        """Slots, pins, last use, host tier, registry and counters at one instant (``adapters/snapshot.py``)."""
        with self._lock:
            return tier_snapshot(self.slot_table, self.host, self._infos, self.versions.all_held(),
                                 asdict(self._counters), self.versions.pinned_versions())

    def check_integrity(self) -> None:
        """Raise AssertionError unless slots, pins, writer-visible state and registry agree."""
        with self._lock:
            held = {i.version_id for i in self.versions.all_held()} | set(self.versions.in_flight) | {
                a for a in self.slot_table.slot_of if self.slot_table.pins(a)}
            self._checked_version = check_tiers(self.slot_table, self.host, self._infos, self._written, held,
                                                self._checked_version, self._indices.version)

    def close(self) -> None:
        """Stop the background reader (pending reads are cancelled)."""
        self._rereads.close()

    def _check_name_free(self, name: str, path: str | Path, new_version: bool) -> None:
        with self._lock:
            if not new_version and (current := self.versions.current(name)) is not None:
                raise AdapterAlreadyLoaded(f"{path}: an adapter named {name!r} is already loaded (from "
                                           f"{current.path}); unload it first, or load it as a new version")

    def _read(self, path: str | Path, roots: tuple[str, ...] | None = None) -> AdapterWeights:
        """Read, validate and fold one version (in the caller's thread, or the re-reader's), checking the
        folded DoRA scales against ``overflow_bound``."""
        weights = self.writer.prepare(read_peft_adapter(path, self.model_config, self.max_lora_rank,
                                                        self.allow_pickle, roots))
        check_dora_scales(weights)
        return weights

    def _put_host(self, version_id: int, weights: AdapterWeights) -> None:
        # saved rows stay resident while loaded; so do weights that exist nowhere else
        self._counters.host_evictions += len(self.host.put(version_id, weights, keep=self._keeps_host(version_id)))

    def _keeps_host(self, version_id: int) -> bool:
        """Whether ``version_id``'s weights must stay in host memory: saved rows stay resident while loaded, a
        pinned version's copy stays, and weights loaded from tensors exist nowhere else."""
        return (self.budget.holds(version_id) or self._infos[version_id].in_memory
                or version_id in self.versions.pinned_versions())

    def _follow_pins(self) -> None:
        """Each pinned name's current version holds one slot pin of its own (``_settle_pins``); a version no
        pinned name serves any more gives its pin back and its host copy counts in the LRU again."""
        wanted = self.versions.pinned_versions()
        for version_id in sorted(self._pin_holds - wanted):
            self._pin_holds.discard(version_id)
            self._counters.host_evictions += len(self.host.set_kept(version_id, self._keeps_host(version_id)))
            self.release(version_id)
        for version_id in wanted:
            self.host.set_kept(version_id, True)
        self._settle_pins()

    def _settle_pins(self) -> None:
        """Take the slot pin of every pinned version that lacks one, where a slot can be had now (else at the next
        release, or when its background re-read lands)."""
        for version_id in sorted(self.versions.pinned_versions() - self._pin_holds):
            if self.can_acquire(version_id):
                self.acquire(version_id)
                self._pin_holds.add(version_id)

    def _drop_if_unused(self, version_id: int) -> None:
        """Forget a version that is not held, holds no request and no pin: everything kept for it is freed."""
        if version_id not in self._infos or self.versions.is_held(version_id) or self.versions.in_use(version_id) \
                or self.slot_table.pins(version_id):
            return
        del self._infos[version_id]
        self._failures.pop(version_id, None)
        self._dropped.append(version_id)
        self.host.pop(version_id)
        self.budget.release(version_id)
        slot = self.slot_table.slot_of.get(version_id)
        if slot is not None:
            self.slot_table.clear(slot)
            self._written[slot] = None
            self.writer.clear_slot(slot)

    def _reread_done(self, info: AdapterInfo, weights: AdapterWeights | None, error: AdapterError | None) -> None:
        """The background re-read of ``info`` finished (reader thread)."""
        with self._lock:
            self._counters.disk_reads += 1
            if info.version_id not in self._infos:
                return  # dropped meanwhile
            if error is not None:
                self._failures[info.version_id] = error
                logger.warning("%s", error)
            elif weights is not None:
                self._put_host(info.version_id, weights)
                self._settle_pins()
