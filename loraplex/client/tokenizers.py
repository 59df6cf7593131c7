"""Adapter versions' own tokenizers outside the engine's process, read from their folders.

An adapter version that ships its own tokenizer or chat template (``adapters/reading/tokenizer.py``) encodes,
renders and decodes its requests with it; every other request uses the base model's. The engine keeps
the tokenizer objects it read at load time; a process without them (the engine process's frontend, a
request-preparation worker) reads the version's folder again, once per version, with the same reader:

- ``folder_reader(base, base_vocab_size)``: the ``TokenizerReader`` an ``AdapterDirectory`` in another
  process than the engine uses (it runs when a version's view arrives, never on the request path);
- ``VersionTokenizers``: a worker process's tokenizers by version id, for the portable ``Version`` each
  job carries (``Version.tokenizer_folder``), bounded LRU.

An adapter's folder is read again here, as the engine re-reads weights that left host memory: a folder
must not change while its adapter is loaded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from loraplex.adapters.reading.tokenizer import read_adapter_tokenizer
from loraplex.adapters.versions import HeldVersion
from loraplex.client.directory import TokenizerReader, Version


def folder_reader(base: Any, base_vocab_size: int) -> TokenizerReader:
    """Read a held version's tokenizer from its folder (None when it equals the base's)."""

    def read(held: HeldVersion) -> Any:
        return read_adapter_tokenizer(held.path, base, held.vocab_size or base_vocab_size, held.roots)

    return read


class VersionTokenizers:
    """The tokenizer of a portable ``Version``, read once per version id; thread-safe."""

    MAX_CACHED = 64

    def __init__(self, base: Any) -> None:
        self.base = base  # the base model's tokenizer (None: the model has none)
        self._by_version: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer_for(self, version: Version) -> Any:
        """``version``'s tokenizer: the object it carries, the base model's, or its folder's (read once)."""
        if version.tokenizer is not None or version.tokenizer_folder is None or version.version_id is None:
            return version.tokenizer if version.tokenizer is not None else self.base
        with self._lock:
            cached = self._by_version.get(version.version_id)
            if cached is not None:
                self._by_version.move_to_end(version.version_id)
                return cached
        tokenizer = read_adapter_tokenizer(version.tokenizer_folder, self.base, version.vocab_size,
                                           version.tokenizer_roots) or self.base
        with self._lock:
            self._by_version[version.version_id] = tokenizer
            while len(self._by_version) > self.MAX_CACHED:
                self._by_version.popitem(last=False)
        return tokenizer
