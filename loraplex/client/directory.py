"""``AdapterDirectory``: a frontend's copy of the engine's adapter version table, and the one place a
request's adapter name becomes a version.

A request resolves its adapter name exactly once, first (``route``), before anything is derived from the
adapter; the ``Version`` it gets travels with it from then on: the tokenizer and chat template it is
prepared with, its context check, the version id the engine holds, the detokenizer of its outputs, the
version header and ``system_fingerprint``. Nothing downstream looks the name up again, so a promotion,
rollback or split between two requests changes which version the *next* request gets, never what a
request already routed sees (design.md, invariant 6).

The copy is a ``VersionView`` of the engine's table (``adapters/versions.py``) at some ``generation``;
``update`` installs a newer one (an older one is ignored). Frontends keep it current: in process by
comparing generations before routing, across processes from the view every version-changing reply
carries (``engine/wire.py``). A split is the table's weights; the picks are made here, by smooth weighted
round-robin (nginx's): exact proportions over every window of requests for integer ratios, and
deterministic (a test or an auditor can reproduce the sequence). The engine holds exactly the version
id it is given, or refuses it when that version is no longer held.

Tokenizers are per version: a version that ships its own (``HeldVersion.has_tokenizer``) gets it from
``read_tokenizer`` once, when its view arrives (never on the request path); every other request uses the
base model's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loraplex.adapters.versions import EMPTY_VIEW, HeldVersion, NameView, VersionView
from loraplex.errors import UnknownAdapter


@dataclass(frozen=True)
class Version:
    """The adapter version a request was routed to (``version_id`` None: the base model)."""

    version_id: int | None
    name: str | None
    content_hash: str | None  # None for the base model (its fingerprint is the checkpoint's)
    vocab_size: int
    tokenizer: Any = None  # its tokenizer in this process (None: the model has none)
    tokenizer_folder: str | None = None  # where a worker process reads it from (None: the base model's)
    tokenizer_roots: tuple[str, ...] | None = None  # the roots that folder's files must resolve in
    # the request's LoRA plan when it is not this version at scale 1 (``client/adapter_mix.py``): a lora_scale on
    # it, or an adapter mix (``version_id`` None, ``name`` its members' names joined by "+")
    plan: tuple[tuple[int, float], ...] | None = None
    class_labels: tuple[str, ...] | None = None  # its classification head's class names (None: it has no head)

    @property
    def label(self) -> str:
        """``v<id>``, or ``base``, or a mix's members ``v<id>+v<id>``: the ``x-loraplex-adapter-version`` header."""
        if self.version_id is None and self.plan:
            return "+".join(f"v{version_id}" for version_id, _ in self.plan)
        return "base" if self.version_id is None else f"v{self.version_id}"

    def portable(self) -> Version:
        """This version without its tokenizer object, to hand to another process."""
        return Version(self.version_id, self.name, self.content_hash, self.vocab_size, None, self.tokenizer_folder,
                       self.tokenizer_roots, self.plan, self.class_labels)


TokenizerReader = Callable[[HeldVersion], Any]  # a held version that ships a tokenizer -> that tokenizer


class _SplitPicks:
    """Smooth weighted round-robin over one name's split (shares normalised to sum 1)."""

    def __init__(self, split: tuple[tuple[int, float], ...]) -> None:
        total = sum(share for _, share in split)
        self.split = split
        self._entries = [[version_id, share / total, 0.0] for version_id, share in split]

    def pick(self) -> int:
        for entry in self._entries:
            entry[2] += entry[1]
        best = max(self._entries, key=lambda e: e[2])
        best[2] -= 1.0
        return int(best[0])


class AdapterDirectory:
    """Thread-safe. ``base_tokenizer`` and ``base_vocab_size`` serve requests of the base model and of every
    version without a tokenizer of its own."""

    def __init__(self, base_tokenizer: Any, base_vocab_size: int, read_tokenizer: TokenizerReader) -> None:
        self.base = Version(None, None, None, base_vocab_size, base_tokenizer)
        self._read_tokenizer = read_tokenizer
        self._view = EMPTY_VIEW
        self._versions: dict[int, Version] = {}
        self._picks: dict[str, _SplitPicks] = {}
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        return self._view.generation

    def update(self, view: VersionView) -> None:
        """Install ``view`` unless this copy is as new already; reads the tokenizers of versions it has not
        seen (blocking: call it off the event loop). ``InvalidAdapter`` if one cannot be read."""
        if view.generation <= self.generation:
            return
        known = dict(self._versions)
        versions = {held.version_id: known.get(held.version_id) or self._version(held)
                    for entry in view.names.values() for held in entry.held}
        with self._lock:
            if view.generation <= self._view.generation:
                return
            self._view, self._versions = view, versions
            self._picks = {name: picks for name, picks in self._picks.items()
                           if name in view.names and picks.split == view.names[name].split}

    def route(self, name: str | None) -> Version:
        """The version ``name``'s next request runs on: the split's next pick, else the current version
        (None: the base model). ``UnknownAdapter`` if no adapter of that name is loaded."""
        if name is None:
            return self.base
        with self._lock:
            entry = self._entry(name)
            if entry.split:
                picks = self._picks.get(name)
                if picks is None:
                    picks = self._picks[name] = _SplitPicks(entry.split)
                return self._versions[picks.pick()]
            return self._versions[entry.current]

    def current(self, name: str | None) -> Version:
        """The version ``name`` serves when no split applies (``/tokenize``, ``/detokenize``); not a route."""
        if name is None:
            return self.base
        with self._lock:
            return self._versions[self._entry(name).current]

    def version(self, version_id: int | None) -> Version:
        """A held version by id (None: the base model); ``UnknownAdapter`` if it is not held."""
        if version_id is None:
            return self.base
        with self._lock:
            version = self._versions.get(version_id)
        if version is None:
            raise UnknownAdapter(f"adapter version v{version_id} is not loaded")
        return version

    def has(self, name: str) -> bool:
        """Whether an adapter named ``name`` is loaded (O(1))."""
        return name in self._view.names

    def names(self) -> dict[str, int]:
        """Every loaded adapter name -> the vocabulary size of its current version."""
        with self._lock:
            return {name: self._versions[entry.current].vocab_size for name, entry in self._view.names.items()}

    def class_label_counts(self) -> dict[str, int | None]:
        """Every loaded adapter name -> how many classes its current version's classification head has (None:
        it has none)."""
        with self._lock:
            labels = {name: self._versions[entry.current].class_labels for name, entry in self._view.names.items()}
        return {name: None if names is None else len(names) for name, names in labels.items()}

    def _entry(self, name: str) -> NameView:
        entry = self._view.names.get(name)
        if entry is None:
            raise UnknownAdapter(f"no adapter named {name!r} is loaded")
        return entry

    def _version(self, held: HeldVersion) -> Version:
        tokenizer = self._read_tokenizer(held) if held.has_tokenizer else None
        return Version(held.version_id, held.name, held.content_hash, held.vocab_size or self.base.vocab_size,
                       tokenizer if tokenizer is not None else self.base.tokenizer,
                       held.path if tokenizer is not None else None, held.roots, class_labels=held.class_labels)
