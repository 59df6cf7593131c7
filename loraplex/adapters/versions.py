"""``VersionTable``: adapter names -> the versions held for each, which one the name serves, and an
optional weighted split between held versions (a canary).

- Every load makes a version (``AdapterInfo.version_id``, shown as ``v<id>``); loading an existing name
  as a new version *promotes* it: the name moves to it in one step, and the version it served stays
  held (its requests in flight finish on it; new requests may be rolled back to it).
- ``rollback(name)`` moves the name back to the held version loaded before the current one.
- ``set_split(name, {id: weight})`` records how new requests of the name are shared among its held
  versions. The table only records the weights; the *pick* for each request is the frontend's, made
  once, first, before anything is derived from the adapter (``client/directory.py``). A promotion, a
  rollback or a split of one version clears it.
- At most ``max_held`` versions per name are held; promoting past that retires the oldest.
- Requests in flight hold their version: ``hold(version_id)`` admits one engine request on exactly that
  version (it must still be held: a version that was unloaded or retired is gone for new requests) and
  counts it (``in_flight``) until ``release``; a version that left the table stays in use while any
  request holds it, and ``release`` says when its last one ended (its memory may be freed then).
- ``pinned``: the names an operator pinned (``AdapterManager.pin``): each one's current version keeps a device
  slot and its host copy; unloading the name drops its pin.
- ``generation`` counts the table's changes (every load, unload, promotion, rollback, split, retirement):
  a copy of it elsewhere (a frontend's directory, another process's) is current exactly while its
  generation equals this one. ``view()`` is that copy, as plain data.
Not thread-safe: ``AdapterManager`` calls it under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.adapters.info import AdapterInfo
from loraplex.errors import AdapterVersionConflict, RequestError, UnknownAdapter


@dataclass(frozen=True)
class HeldVersion:
    """One held version as a frontend needs it to route, tokenize and answer (plain data)."""

    version_id: int
    name: str
    content_hash: str
    path: str
    vocab_size: int | None  # its vocabulary when it adds tokens, else None (the base model's)
    has_tokenizer: bool  # it ships its own tokenizer or chat template (read from ``path``)
    roots: tuple[str, ...] | None = None  # the allowed roots it was loaded under (a re-read keeps them)
    class_labels: tuple[str, ...] | None = None  # its classification head's class names (a SEQ_CLS adapter), else None


@dataclass(frozen=True)
class NameView:
    current: int  # the version id the name serves when no split is set
    split: tuple[tuple[int, float], ...]  # (version id, share), by id; () when none is set
    held: tuple[HeldVersion, ...]  # oldest first


@dataclass(frozen=True)
class VersionView:
    """The whole table at one ``generation``, name -> ``NameView`` in name-load order."""

    generation: int
    names: Mapping[str, NameView]


EMPTY_VIEW = VersionView(0, {})


class VersionTable:
    def __init__(self, max_held: int = 4) -> None:
        self.max_held = max_held
        self.generation = 0
        self._held: dict[str, list[AdapterInfo]] = {}  # oldest first
        self._current: dict[str, AdapterInfo] = {}
        self._split: dict[str, dict[int, float]] = {}  # name -> {version id: share}
        self._by_id: dict[int, AdapterInfo] = {}
        self.served: dict[int, int] = {}  # version id -> API requests admitted on it (held versions)
        self.in_flight: dict[int, int] = {}  # version id -> engine requests holding it now (held or not)
        self.pinned: dict[str, None] = {}  # pinned names, in pin order (an ordered set)

    def current(self, name: str) -> AdapterInfo | None:
        return self._current.get(name)

    def currents(self) -> list[AdapterInfo]:
        """The version each name serves now, in name-load order."""
        return list(self._current.values())

    def all_held(self) -> list[AdapterInfo]:
        """Every held version, in id order."""
        return sorted(self._by_id.values(), key=lambda i: i.version_id)

    def held(self, name: str) -> list[AdapterInfo]:
        return list(self._held.get(name, ()))

    def is_held(self, version_id: int) -> bool:
        return version_id in self._by_id

    def split(self, name: str) -> dict[int, float]:
        return dict(self._split.get(name, {}))

    def add(self, info: AdapterInfo) -> list[AdapterInfo]:
        """Hold ``info`` and move its name to it; returns the versions retired past ``max_held``."""
        held = self._held.setdefault(info.name, [])
        held.append(info)
        self._by_id[info.version_id] = info
        self.served[info.version_id] = 0
        self._current[info.name] = info
        self._split.pop(info.name, None)
        retired = held[: max(0, len(held) - self.max_held)]
        for old in retired:
            self._forget(old)
        self.generation += 1
        return retired

    def remove(self, name: str) -> list[AdapterInfo]:
        """Forget ``name`` and every version held for it (returned, current last)."""
        if name not in self._current:
            raise UnknownAdapter(f"no adapter named {name!r} is loaded")
        current = self._current.pop(name)
        held = self._held.pop(name)
        self._split.pop(name, None)
        self.pinned.pop(name, None)
        for info in held:
            del self._by_id[info.version_id]
            self.served.pop(info.version_id, None)
        self.generation += 1
        return [i for i in held if i is not current] + [current]

    def rollback(self, name: str) -> AdapterInfo:
        """Move ``name`` to the held version loaded before its current one; returns it."""
        current = self._require(name)
        held = self._held[name]
        index = held.index(current)
        if index == 0:
            raise AdapterVersionConflict(
                f"adapter {name!r} holds no version older than v{current.version_id} to roll back to")
        self._current[name] = held[index - 1]
        self._split.pop(name, None)
        self.generation += 1
        return held[index - 1]

    def set_split(self, name: str, weights: Mapping[int, float]) -> None:
        """Share ``name``'s new requests among held versions by ``weights`` (positive, summing to 1)."""
        self._require(name)
        ids = {i.version_id for i in self._held[name]}
        unknown = sorted(set(weights) - ids)
        if not weights or unknown:
            raise UnknownAdapter(f"adapter {name!r} holds no version {', '.join(f'v{i}' for i in unknown)}"
                                 if unknown else "split names no version")
        if any(not (w > 0 and math.isfinite(w)) for w in weights.values()) or abs(sum(weights.values()) - 1) > 1e-6:
            raise RequestError(f"split weights must be positive and sum to 1, got {dict(weights)}", "split")
        if len(weights) == 1:  # one version: a promotion
            self._current[name] = self._by_id[next(iter(weights))]
            self._split.pop(name, None)
        else:
            self._split[name] = dict(sorted(weights.items()))
        self.generation += 1

    def pin(self, name: str) -> None:
        """Mark ``name`` pinned (``UnknownAdapter`` if it is not loaded)."""
        self._require(name)
        self.pinned[name] = None

    def unpin(self, name: str) -> None:
        """Drop ``name``'s pin (``UnknownAdapter`` if it is not loaded; a name without one is left as it is)."""
        self._require(name)
        self.pinned.pop(name, None)

    def pinned_versions(self) -> set[int]:
        """The current version of every pinned name: the versions that keep a slot."""
        return {self._current[name].version_id for name in self.pinned}

    def hold(self, version_id: int) -> AdapterInfo:
        """Admit one engine request on exactly ``version_id``, which it holds until ``release``;
        ``UnknownAdapter`` if the version is no longer held (unloaded, or retired past ``max_held``)."""
        info = self._by_id.get(version_id)
        if info is None:
            raise UnknownAdapter(f"adapter version v{version_id} is no longer loaded (unloaded or replaced)")
        self.in_flight[version_id] = self.in_flight.get(version_id, 0) + 1
        return info

    def count_served(self, version_id: int) -> None:
        """One API request (all its choices and prompts) was admitted on ``version_id``."""
        if version_id in self.served:
            self.served[version_id] += 1

    def release(self, version_id: int) -> bool:
        """One request holding ``version_id`` ended; True if it was the last one and the version is no longer
        held (unloaded or retired meanwhile): nothing can use it any more."""
        left = self.in_flight[version_id] - 1
        if left:
            self.in_flight[version_id] = left
            return False
        del self.in_flight[version_id]
        return not self.is_held(version_id)

    def in_use(self, version_id: int) -> bool:
        """Whether a request in flight holds ``version_id``."""
        return version_id in self.in_flight

    def view(self) -> VersionView:
        """The table now, as plain data (``VersionView``)."""
        return VersionView(self.generation, {
            name: NameView(current.version_id, tuple(self._split.get(name, {}).items()),
                           tuple(_held_version(i) for i in self._held[name]))
            for name, current in self._current.items()})

    def listing(self) -> list[dict[str, Any]]:
        """Every name with its current version, split and held versions, as JSON-serialisable data."""
        return [{"name": name, "current": f"v{current.version_id}",
                 "split": {f"v{i}": w for i, w in self.split(name).items()} or None, "pinned": name in self.pinned,
                 "versions": [{"id": f"v{i.version_id}", "content_hash": i.content_hash, "path": str(i.path),
                               "loaded_at": i.loaded_at, "requests_served": self.served[i.version_id]}
                              for i in self._held[name]]}
                for name, current in self._current.items()]

    def _require(self, name: str) -> AdapterInfo:
        current = self._current.get(name)
        if current is None:
            raise UnknownAdapter(f"no adapter named {name!r} is loaded")
        return current

    def _forget(self, info: AdapterInfo) -> None:
        self._held[info.name].remove(info)
        del self._by_id[info.version_id]
        self.served.pop(info.version_id, None)
        for shares in self._split.values():
            shares.pop(info.version_id, None)


def _held_version(info: AdapterInfo) -> HeldVersion:
    return HeldVersion(info.version_id, info.name, info.content_hash, str(info.path), info.vocab_size,
                       info.tokenizer is not None, info.roots, info.class_labels)
