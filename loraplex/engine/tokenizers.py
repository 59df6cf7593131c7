"""Which tokenizer a request uses, for code that tokenizes or detokenizes outside the engine.

An adapter version that ships its own tokenizer (``adapters/tokenizer.py``) encodes, renders the chat
template of, and decodes its requests with it; every other request uses the base model's. The engine
decides this per version in ``Engine.add_request``. The server's API side (the engine process's
client, the request-preparation workers) tokenizes and detokenizes itself, so it must decide the same:

- ``TokenizerTable``: the live versions that ship a tokenizer, by adapter name, as plain data (their
  folder, version id and vocabulary size). It crosses process boundaries: the engine process answers
  it, and a preparation worker process gets it with every request (usually empty: most adapters use
  the base model's tokenizer, and then it costs nothing).
- ``TokenizerCache``: those tokenizers read from their folders with the engine's own reader
  (``read_adapter_tokenizer``), once per version and process; versions no longer in the table are
  dropped.
- ``TokenizerMirror``: the engine's table, its tokenizers and every live adapter's vocabulary size in
  the engine process's client, refreshed after start and every load and unload, so a lookup never
  reads a file and never waits on the engine.

An adapter's folder is read again here, as the engine re-reads weights that left host memory: a
folder must not change while its adapter is loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from loraplex.adapters.info import AdapterInfo
from loraplex.adapters.tokenizer import read_adapter_tokenizer
from loraplex.errors import UnknownAdapter


@dataclass(frozen=True)
class TokenizerSource:
    """One adapter version's own tokenizer, as plain data."""

    version_id: int  # the version
    folder: str  # the adapter folder it is read from
    vocab_size: int  # the version's vocabulary (its tokenizer may not exceed it)


@dataclass(frozen=True)
class TokenizerTable:
    """Adapter name -> ``TokenizerSource`` for each live version that ships its own tokenizer."""

    sources: dict[str, TokenizerSource] = field(default_factory=dict)

    @classmethod
    def of(cls, infos: Iterable[AdapterInfo], base_vocab_size: int) -> TokenizerTable:
        """The table of the live versions ``infos`` (``Engine.list_adapters()``)."""
        return cls({i.name: TokenizerSource(i.version_id, str(i.path), i.vocab_size or base_vocab_size)
                    for i in infos if i.tokenizer is not None})

    def get(self, adapter: str | None) -> TokenizerSource | None:
        """The source for requests to ``adapter``; None: they use the base model's tokenizer (also for
        an unknown name, which the engine refuses later)."""
        return None if adapter is None else self.sources.get(adapter)


class TokenizerCache:
    """Tokenizers of table entries, read once per version; thread-safe."""

    def __init__(self, base: Any) -> None:
        self.base = base  # the base model's tokenizer (None: the model has none)
        self._by_version: dict[int, Any] = {}
        self._lock = threading.Lock()

    def tokenizer_for(self, table: TokenizerTable, adapter: str | None) -> Any:
        """The tokenizer of ``adapter``'s version in ``table``, read from its folder if not cached;
        ``InvalidAdapter`` if that fails."""
        source = table.get(adapter)
        if source is None:
            return self.base
        with self._lock:
            cached = self._by_version.get(source.version_id)
        if cached is None:
            cached = read_adapter_tokenizer(source.folder, self.base, source.vocab_size) or self.base
            with self._lock:
                self._by_version[source.version_id] = cached
        return cached

    def cached(self, table: TokenizerTable, adapter: str | None) -> Any:
        """Like ``tokenizer_for`` but never reads a folder: a version not cached yet gets the base
        model's tokenizer."""
        source = table.get(adapter)
        with self._lock:
            return self.base if source is None else self._by_version.get(source.version_id, self.base)

    def prune(self, table: TokenizerTable) -> None:
        """Forget the versions that are not in ``table`` (unloaded or replaced)."""
        with self._lock:
            if len(self._by_version) > len(table.sources) or any(
                    s.version_id not in self._by_version for s in table.sources.values()):
                live = {s.version_id for s in table.sources.values()}
                self._by_version = {k: v for k, v in self._by_version.items() if k in live}

    def load(self, table: TokenizerTable) -> None:
        """Read every version of ``table`` not cached yet; forget versions that left it."""
        self.prune(table)
        for name in table.sources:
            self.tokenizer_for(table, name)


class TokenizerMirror:
    """In another process than the engine: the engine's ``TokenizerTable``, the tokenizers it names, and
    every live adapter's vocabulary size. ``fetch`` asks the engine for (table, {adapter: vocab size})."""

    def __init__(self, base: Any, base_vocab_size: int,
                 fetch: Callable[[], tuple[TokenizerTable, dict[str, int]]]) -> None:
        self._cache = TokenizerCache(base)
        self._base_vocab_size = base_vocab_size
        self._fetch = fetch
        self._view: tuple[TokenizerTable, dict[str, int]] = (TokenizerTable(), {})  # swapped whole
        self._lock = threading.Lock()  # one refresh at a time, so the newest answer wins

    def refresh(self) -> None:
        """Fetch the engine's answer and read the tokenizers of its new versions (blocking);
        ``InvalidAdapter`` if one cannot be read."""
        with self._lock:
            table, vocab_sizes = self._fetch()
            self._cache.load(table)
            self._view = (table, vocab_sizes)

    @property
    def table(self) -> TokenizerTable:
        return self._view[0]

    @property
    def vocab_sizes(self) -> dict[str, int]:
        return self._view[1]

    def tokenizer_for(self, adapter: str | None) -> Any:
        """``UnknownAdapter`` if ``adapter`` is not loaded."""
        self.vocab_size_for(adapter)
        return self.tokenizer_or_base(adapter)

    def tokenizer_or_base(self, adapter: str | None) -> Any:
        """Like ``tokenizer_for``, but the base model's tokenizer for an unknown name."""
        return self._cache.cached(self.table, adapter)

    def vocab_size_for(self, adapter: str | None) -> int:
        if adapter is None:
            return self._base_vocab_size
        size = self.vocab_sizes.get(adapter)
        if size is None:
            raise UnknownAdapter(f"no adapter named {adapter!r} is loaded")
        return size
