"""``EngineClient``: the one interface through which the HTTP server drives an engine.

Two implementations, same behaviour, because everything but the transport lives here:

- ``AsyncEngine`` (``client/inproc.py``): the step loop in a thread of the caller's process. For
  embedding (``create_app(Engine)``), tests and Ray Serve replicas.
- ``EngineProcess`` (``client/process.py``): the engine core in its own process, fed token ids through a
  socket. What ``loraplex serve`` runs: the step loop never waits on this process's event loop or its GIL.

A request's path through a client: ``route(name)`` decides its adapter ``Version`` once, first (the
``AdapterDirectory``: the engine's version table copied here); the caller prepares it with that
version's tokenizer and chat template; ``submit_many(items, version)`` registers every choice with the
``OutputProcessor`` (that version's tokenizer decodes it and matches its stop strings) and hands the
engine token ids and the version id, which the engine holds exactly (or refuses, when it is gone). The
engine's outputs (new token ids only) come back per step and leave as ``RequestOutput`` s on each
request's ``RequestStream``. Adapter calls go through ``_call``; the ones that change the version table
bring the directory up to date before they return.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.client.directory import AdapterDirectory, Version
from loraplex.client.output import OutputProcessor, RequestOutput
from loraplex.client.stream import RequestStream, deliver
from loraplex.engine.request import NO_TAGS, EngineOutput, NewRequest, RequestTags, SamplingParams
from loraplex.engine.wire import EngineInfo, TensorBlob
from loraplex.errors import RequestError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from loraplex.adapters.info import AdapterInfo
    from loraplex.config import EngineConfig
    from loraplex.engine.stats import EngineStats

logger = logging.getLogger(__name__)

StepObserver = Callable[[float, list[RequestOutput]], None]  # (step seconds, outputs), after every step
Submission = tuple[str, list[int], SamplingParams]  # (request id, prompt token ids, one choice's params)


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


class EngineClient(abc.ABC):
    """What the server needs from an engine. ``config`` (``EngineConfig``) and ``info`` (``EngineInfo``)
    describe the served model; ``tokenizer`` is its tokenizer in this process (None for a model without
    one: token-id prompts only); ``directory`` routes adapter names to versions. ``step_observers`` are
    called after every step with (seconds, outputs), from a background thread."""

    config: EngineConfig
    info: EngineInfo
    tokenizer: PreTrainedTokenizerBase | None
    directory: AdapterDirectory

    def __init__(self) -> None:
        self.step_observers: list[StepObserver] = []
        self.outputs = OutputProcessor()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams (and the subclass's own state)
        self._beat = time.monotonic()  # the last step's arrival, or when work became pending after none was
        self._base_fingerprint: str | None = None

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

    # ---- life cycle ----
    @abc.abstractmethod
    def start(self) -> None:
        """Start serving (idempotent)."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and stop; blocks up to about ``timeout`` seconds."""

    @abc.abstractmethod
    def health(self) -> EngineHealth:
        """The engine's state now; never blocks."""

    def heartbeat(self) -> tuple[int, float]:
        """The step loop's heartbeat, seen from here: (requests open, seconds since a step's outputs last
        arrived or since work became pending while none was, whichever is later). Open requests and a
        growing age mean the step loop is stalled (the engine process stopped, a step that never ends)."""
        with self._lock:
            return len(self._streams), time.monotonic() - self._beat

    @property
    def running(self) -> bool:
        return self.health().ok

    # ---- routing: once per API request, first (any thread; never blocks) ----
    def route(self, name: str | None) -> Version:
        """The adapter version ``name``'s next request runs on (a split's pick, else the current version;
        None: the base model). ``UnknownAdapter`` if no adapter of that name is loaded."""
        self._sync_versions()
        return self.directory.route(name)

    def current(self, name: str | None) -> Version:
        """The version ``name`` serves now, without routing (``/tokenize``); ``UnknownAdapter`` if none."""
        self._sync_versions()
        return self.directory.current(name)

    def served_adapters(self) -> dict[str, int]:
        """Every loaded adapter's name and its current version's vocabulary size."""
        self._sync_versions()
        return self.directory.names()

    def served_class_label_counts(self) -> dict[str, int | None]:
        """Every loaded adapter's name and its current version's number of classes (None: no head)."""
        self._sync_versions()
        return self.directory.class_label_counts()

    def has_adapter(self, name: str) -> bool:
        """Whether an adapter named ``name`` is loaded now (O(1); never waits on the engine)."""
        self._sync_versions()
        return self.directory.has(name)

    def _sync_versions(self) -> None:  # noqa: B027 - a hook: only the in-process client's copy can fall behind
        """Bring the directory up to date if it can be behind (in process: another caller changed the table)."""

    # ---- requests (event loop) ----
    async def submit_many(self, items: Sequence[Submission], version: Version,
                          tags: RequestTags = NO_TAGS) -> list[RequestStream]:
        """Queue ``(request_id, prompt_token_ids, params)`` requests, all on ``version`` (routed by ``route``),
        in one engine call, so they are admitted together (the choices and prompts of one API request; each
        is one choice, ``params.n == 1``), with ``tags`` (tenant, priority). Raises before anything is queued
        when the engine refuses any: ``UnknownAdapter`` (the version is gone), ``RequestError`` (its
        ``param`` names the field), ``EngineUnavailable``."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, request_id, loop) for request_id, _, _ in items]
        with self._lock:
            self._check_serving()
            taken = [s.request_id for s in streams if s.request_id in self._streams]
            if taken or len({s.request_id for s in streams}) < len(streams):
                raise RequestError(f"request id {(taken or [''])[0]!r} is already in use", "request_id")
            if not self._streams:
                self._beat = time.monotonic()
            self._streams.update((s.request_id, s) for s in streams)
        for request_id, token_ids, params in items:
            self.outputs.add(request_id, token_ids, params, version.tokenizer, version.name)
        try:
            await self._enqueue([NewRequest(request_id, list(token_ids), params, version.version_id, version.plan)
                                 for request_id, token_ids, params in items], tags)
        except BaseException:
            for stream in streams:
                self._forget(stream.request_id)
            raise
        return streams

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, version: Version,
                     tags: RequestTags = NO_TAGS) -> RequestStream:
        """Queue one request (``submit_many`` of one)."""
        return (await self.submit_many([(request_id, prompt_token_ids, params)], version, tags))[0]

    async def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Route ``adapter``, tokenize a text ``prompt`` with that version's tokenizer and yield the request's
        outputs until it finishes; stopping early aborts it in the engine."""
        version = self.route(adapter)
        if isinstance(prompt, str):
            if version.tokenizer is None:
                raise RequestError(f"model {self.model_name} has no tokenizer: pass token ids", "prompt")
            prompt = version.tokenizer.encode(prompt, add_special_tokens=False)
        stream = await self.submit(request_id or f"req-{time.monotonic_ns()}", list(prompt), params, version)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Stop delivering outputs and abort the request in the engine (a no-op once it finished)."""
        if self._forget(request_id):
            self._abort_in_engine(request_id)

    @abc.abstractmethod
    def _check_serving(self) -> None:
        """Raise ``EngineUnavailable`` unless requests can be queued now (under ``_lock``)."""

    @abc.abstractmethod
    async def _enqueue(self, requests: list[NewRequest], tags: RequestTags) -> None:
        """Hand ``requests`` to the engine in one call; raise its refusal (nothing queued then)."""

    @abc.abstractmethod
    def _abort_in_engine(self, request_id: str) -> None:
        """Abort the request in the engine (frees its KV blocks and adapter pin)."""

    def _forget(self, request_id: str) -> bool:
        """Stop tracking a request; True if it was tracked."""
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        self.outputs.drop(request_id)
        return known

    def _on_step(self, seconds: float, outputs: list[EngineOutput]) -> None:
        """One step's engine outputs (the step loop's thread): through the ``OutputProcessor`` (stop strings
        found there abort their requests in the engine), to the observers and each request's stream."""
        full, stopped = self.outputs.process(outputs)
        for request_id in stopped:
            self._abort_in_engine(request_id)
        for observe in self.step_observers:
            observe(seconds, full)
        with self._lock:
            self._beat = time.monotonic()
            targets = [(self._streams.get(out.request_id), out) for out in full]
            for out in full:
                if out.finished:
                    self._streams.pop(out.request_id, None)
        deliver([(stream, out) for stream, out in targets if stream is not None])

    def _fail_streams(self, request_ids: Sequence[str] | None, error: BaseException) -> None:
        """End the streams of ``request_ids`` (None: every open one) with ``error``."""
        with self._lock:
            ids = list(self._streams) if request_ids is None else list(request_ids)
            streams = [s for s in (self._streams.pop(i, None) for i in ids) if s is not None]
        for request_id in ids:
            self.outputs.drop(request_id)
        deliver([(stream, error) for stream in streams])

    # ---- engine calls (``wire.EngineCalls``), off the event loop ----
    @abc.abstractmethod
    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``engine.<method>(*args, **kwargs)`` off the event loop (a worker thread, or the engine process)."""

    async def load_adapter(self, name: str, path: str | None = None, *,
                           tensors: Mapping[str, torch.Tensor] | TensorBlob | None = None,
                           config: Mapping | str | None = None, new_version: bool = False,
                           roots: list[str] | None = None) -> AdapterInfo:
        """Validate and register a PEFT folder ``path``, or ``tensors`` with their ``config`` (exactly one;
        ``Engine.load_adapter``; ``tensors`` may be a ``TensorBlob``, a safetensors file's bytes, parsed in the
        engine's process off the event loop); raises ``AdapterError`` subclasses. ``new_version``: a loaded
        ``name`` moves to the new version at once (its requests in flight finish on theirs). ``roots``: every
        file a folder load reads must resolve inside one of these folders."""
        return await self._call("load_adapter", name, path, tensors=tensors, config=config,
                                new_version=new_version, roots=roots)

    async def unload_adapter(self, name: str) -> None:
        await self._call("unload_adapter", name)

    async def pin_adapter(self, name: str) -> None:
        """Keep ``name`` in a device slot and host memory until unpinned or unloaded (``Engine.pin_adapter``)."""
        await self._call("pin_adapter", name)

    async def unpin_adapter(self, name: str) -> None:
        await self._call("unpin_adapter", name)

    async def rollback_adapter(self, name: str) -> AdapterInfo:
        """Move ``name`` back to its previous held version (``AdapterVersionConflict`` if none); returns it."""
        return await self._call("rollback_adapter", name)

    async def split_adapter(self, name: str, weights: dict[int, float]) -> None:
        """Route ``name``'s new requests among its held versions by ``weights`` (version id -> share)."""
        await self._call("split_adapter", name, weights)

    async def list_adapters(self) -> list[AdapterInfo]:
        return await self._call("list_adapters")

    async def adapter_versions(self) -> list[dict[str, Any]]:
        """``VersionTable.listing()``: every name with its current version, split and held versions."""
        return await self._call("adapter_versions")

    async def adapter_snapshot(self) -> dict[str, Any]:
        """``Engine.adapter_snapshot()``: the adapter tiers at one instant, JSON-serialisable."""
        return await self._call("adapter_snapshot")

    async def stats(self) -> EngineStats:
        return await self._call("stats")

    async def base_fingerprint(self) -> str:
        """The base checkpoint's fingerprint (``models/fingerprint.py``; computed once, then cached here)."""
        if self._base_fingerprint is None:
            self._base_fingerprint = await self._call("base_fingerprint")
        return self._base_fingerprint
