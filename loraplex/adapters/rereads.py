"""``Rereads``: one background thread re-reading adapter versions evicted from host memory, each under the
allowed roots it was loaded with and checked against the content hash it was loaded with (the version's
identity); ``ReadAhead`` says which may be read."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from loraplex.adapters.info import AdapterInfo
from loraplex.adapters.read_ahead import ReadAhead
from loraplex.adapters.reading.weights import AdapterWeights
from loraplex.errors import AdapterContentChanged, AdapterError

Done = Callable[[AdapterInfo, AdapterWeights | None, AdapterError | None], None]


class Rereads:
    """``start(info)`` queues a re-read (once per id while one is pending, and only if ``ahead`` allows it:
    ``ahead.plan`` sets the window); ``done(info, weights, error)``
    is called from the reader thread with the weights, or with the ``AdapterContentChanged`` that the
    version's requests must fail with (changed on disk, or unreadable)."""

    def __init__(self, read: Callable[[str | Path, tuple[str, ...] | None], AdapterWeights], done: Done,
                 ahead: ReadAhead) -> None:
        self._read, self._done, self.ahead = read, done, ahead
        self._lock = threading.Lock()
        self._pending: dict[int, Future[None]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-adapter-read")

    def start(self, info: AdapterInfo) -> None:
        with self._lock:
            if info.version_id not in self._pending and self.ahead.allows(info.version_id):
                self._pending[info.version_id] = self._executor.submit(self._reread, info)

    def wait(self, version_id: int, timeout: float | None = None) -> None:
        """Block until a pending re-read of ``version_id`` (if any) has finished."""
        with self._lock:
            future = self._pending.get(version_id)
        if future is not None:
            future.result(timeout)

    def close(self) -> None:
        """Stop the reader (pending reads are cancelled)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _reread(self, info: AdapterInfo) -> None:
        weights: AdapterWeights | None = None
        error: AdapterError | None = None
        who = f"{info.path}: adapter {info.name!r} (id {info.version_id})"
        try:
            weights = self._read(info.path, info.roots)
            if weights.content_hash != info.content_hash:
                error = AdapterContentChanged(f"{who} changed on disk since it was loaded; load it again")
        except Exception as e:  # any failure must reach the waiting requests, not die in this thread
            error = AdapterContentChanged(f"{who} could not be re-read: {e}")
        try:
            self._done(info, None if error else weights, error)
        finally:
            with self._lock:
                del self._pending[info.version_id]
