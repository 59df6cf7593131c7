"""``EngineClient``: the one interface through which the HTTP server drives an engine.

Two implementations, same behaviour:

- ``AsyncEngine`` (``engine/async_engine.py``): the step loop in a thread of the caller's process. For
  embedding (``create_app(Engine)``), tests and Ray Serve replicas.
- ``EngineProcess`` (``engine/process_client.py``): the engine core in its own process, fed token ids
  through a socket, its outputs detokenized here. What ``loraplex serve`` runs: the step loop never
  waits on this process's event loop or its GIL.

Every server feature goes through these methods (submit/stream, abort, adapters, stats, snapshots,
health, the tokenizer of an adapter version), so a feature added here works in both. Requests arrive
as prompt token ids (a ``str`` prompt is tokenized by the client, for convenience); outputs leave as
``RequestOutput`` s with their text, decoded with the tokenizer of the request's adapter version.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.engine.request import NO_TAGS, RequestOutput, RequestTags, SamplingParams
from loraplex.engine.tokenizers import TokenizerTable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from loraplex.adapters.manager import AdapterInfo
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import EngineStats

logger = logging.getLogger(__name__)

StepObserver = Callable[[float, list[RequestOutput]], None]  # (step seconds, outputs), after every step


@dataclass(frozen=True)
class EngineHealth:
    """``state``: "starting", "ready", "stopping", "stopped" or "dead" (its step loop or process is gone).
    ``step_failures``: steps that raised so far (each failed only its own requests; ``last_step_error`` says why)."""

    state: str
    detail: str = ""
    step_failures: int = 0
    last_step_error: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True)
class EngineInfo:
    """The served model, as the API side needs it (plain data: it crosses the process boundary)."""

    model_name: str
    model_path: str  # its folder (config, weights, tokenizer)
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    has_tokenizer: bool
    pid: int  # the process running the step loop

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        """The info of an ``Engine`` in this process."""
        return cls(model_name=engine.model_name, model_path=str(engine.model_path),
                   max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
                   dtype=str(engine.dtype), device=str(engine.device), has_tokenizer=engine.tokenizer is not None,
                   pid=os.getpid())


class RequestStream:
    """Outputs of one submitted request, in order; the last one has ``finished`` set. An exception put
    on the stream (the engine failed or died) is raised to the consumer and ends it.

    ``abort()`` (idempotent, also called when a ``generate`` consumer stops early) cancels the
    request in the engine, which frees its KV blocks and its adapter pin.
    """

    def __init__(self, owner: EngineClient, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.done = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the stream's event loop (producers schedule it with ``deliver``)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._owner.abort(self.request_id)

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (raised to its consumer after the outputs already delivered) and abort
        the request in the engine, which frees its KV blocks and adapter pin; on the stream's event loop."""
        if not self.done:
            self._owner.abort(self.request_id)
            self.put(exc)


def deliver(items: Iterable[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Hand items to their streams from any thread: ONE ``call_soon_threadsafe`` per event loop, so a
    producer wakes each loop once per step rather than once per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the consumers' event loop is closed
            logger.debug("dropping %d outputs: their event loop is closed", len(batch))


def route_outputs(streams: dict[str, RequestStream], lock: threading.Lock, outputs: list[RequestOutput]) -> None:
    """Deliver each output to its request's stream in ``streams`` (guarded by ``lock``), forgetting the
    streams of finished requests; outputs of requests with no stream (aborted) are dropped."""
    with lock:
        targets = [(streams.get(out.request_id), out) for out in outputs]
        for out in outputs:
            if out.finished:
                streams.pop(out.request_id, None)
    deliver([(stream, out) for stream, out in targets if stream is not None])


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.put(item)


class EngineClient(abc.ABC):
    """What the server needs from an engine. ``config`` (``EngineConfig``) and ``info`` (``EngineInfo``)
    describe the served model; ``tokenizer`` is its tokenizer in this process (None for a model without
    one: token-id prompts only). ``step_observers`` are called after every step with (seconds,
    outputs), from a background thread."""

    config: EngineConfig
    info: EngineInfo
    tokenizer: PreTrainedTokenizerBase | None
    step_observers: list[StepObserver]

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def model_path(self) -> Path:
        return Path(self.info.model_path)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @abc.abstractmethod
    def start(self) -> None:
        """Start serving (idempotent)."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and stop; blocks up to about ``timeout`` seconds."""

    @abc.abstractmethod
    def health(self) -> EngineHealth:
        """The engine's state now; never blocks."""

    @property
    def running(self) -> bool:
        return self.health().ok

    @abc.abstractmethod
    async def submit_many(self, items: Sequence[tuple[str, str | list[int], SamplingParams, str | None]],
                          tags: RequestTags = NO_TAGS) -> list[RequestStream]:
        """Queue ``(request_id, prompt, params, adapter)`` requests in one engine call, so they are admitted
        together (the choices and prompts of one API request; each is one choice, ``params.n == 1``),
        all with ``tags`` (tenant, priority, pinned adapter version: ``Engine.add_requests``).
        Raises before anything is queued when the engine refuses any: ``UnknownAdapter``, ``RequestError``
        (its ``param`` names the field), ``EngineUnavailable``."""

    async def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     adapter: str | None = None, tags: RequestTags = NO_TAGS) -> RequestStream:
        """Queue one request (``submit_many`` of one)."""
        return (await self.submit_many([(request_id, prompt, params, adapter)], tags))[0]

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop delivering outputs and abort the request in the engine (a no-op once it finished)."""

    @abc.abstractmethod
    async def load_adapter(self, name: str, path: str, new_version: bool = False) -> AdapterInfo:
        """Validate and register a PEFT folder; raises ``AdapterError`` subclasses. ``new_version``: a loaded
        ``name`` moves to the new version at once (its requests in flight finish on theirs)."""

    @abc.abstractmethod
    async def unload_adapter(self, name: str) -> None: ...

    @abc.abstractmethod
    async def list_adapters(self) -> list[AdapterInfo]: ...

    @abc.abstractmethod
    async def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    async def adapter_snapshot(self) -> dict[str, Any]:
        """``Engine.adapter_snapshot()``: the adapter tiers at one instant, JSON-serialisable."""

    # ---- adapter versions (adapters/versions.py), through ``_call`` ----
    @abc.abstractmethod
    async def _call(self, method: str, *args: Any) -> Any:
        """``engine.<method>(*args)`` off the event loop (a worker thread, or the engine process)."""

    async def _live_versions_changed(self) -> None:
        """A name's live version moved (rollback, split): refresh what mirrors it here (nothing, in-process)."""
        return None

    async def route_adapter(self, name: str) -> AdapterInfo:
        """The version ``name``'s next request runs on (the split's pick or the current one; counted as
        served): submit that request with ``RequestTags(adapter_version=...)``. ``UnknownAdapter`` if none."""
        return await self._call("route_adapter", name)

    async def rollback_adapter(self, name: str) -> AdapterInfo:
        """Move ``name`` back to its previous held version (``AdapterVersionConflict`` if none); returns it."""
        info = await self._call("rollback_adapter", name)
        await self._live_versions_changed()
        return info

    async def split_adapter(self, name: str, weights: dict[int, float]) -> None:
        """Route ``name``'s new requests among its held versions by ``weights`` (version id -> share)."""
        await self._call("split_adapter", name, weights)
        await self._live_versions_changed()

    async def adapter_versions(self) -> list[dict[str, Any]]:
        """``VersionTable.listing()``: every name with its current version, split and held versions."""
        return await self._call("adapter_versions")

    async def base_fingerprint(self) -> str:
        """The base checkpoint's fingerprint (``models/fingerprint.py``; computed once, then cached here)."""
        cached = getattr(self, "_base_fingerprint", None)
        if cached is None:
            cached = self._base_fingerprint = await self._call("base_fingerprint")
        return cached

    # ---- what the API side needs to tokenize and detokenize (any thread; never reads files) ----
    @abc.abstractmethod
    def tokenizer_for(self, adapter: str | None) -> PreTrainedTokenizerBase | None:
        """The tokenizer (and chat template) of ``adapter``'s live version in this process: its own if
        it ships one, else the base model's. ``UnknownAdapter`` if no such adapter is loaded."""

    @abc.abstractmethod
    def vocab_size_for(self, adapter: str | None) -> int:
        """The vocabulary of ``adapter``'s live version (wider than the base's when it adds tokens)."""

    @abc.abstractmethod
    def served_adapters(self) -> dict[str, int]:
        """Every loaded adapter's name and its live version's vocabulary size."""

    @abc.abstractmethod
    def tokenizer_table(self) -> TokenizerTable:
        """The live versions that ship their own tokenizer, as plain data for worker processes."""

    async def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; stopping early aborts it in the engine."""
        stream = await self.submit(request_id or f"req-{time.monotonic_ns()}", prompt, params, adapter)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()
