"""``EngineProcess``: the engine core in its own process, driven from this (the API) process.

``start()`` launches the engine process (``core_launch``: ``python -m loraplex.engine.core_process``
on one end of a socket pair) with the ``EngineConfig`` and the start-up adapters, and waits until
it serves. Then, in this process:

- the **event loop** (``submit``, ``abort``, the adapter calls) only queues messages and awaits
  futures: it never writes to the socket, so it never blocks on the engine;
- the **sender thread** writes whatever queued up, as one pickled batch per write;
- the **reader thread** reads the engine's messages: per step ONE ``StepOutputs``, which it turns
  into full outputs with text (``OutputProcessor``: detokenization and stop strings happen here, not
  in the engine process) and hands to their streams with one ``call_soon_threadsafe`` per event loop.

Each request is tokenized and decoded with its adapter version's tokenizer: the versions that ship one
are mirrored here (``TokenizerMirror``), refreshed after start, every load and every unload.

If the engine process dies, the reader sees end of file: open requests end with ``EngineUnavailable``,
pending calls fail, ``health()`` says "dead". ``shutdown()`` asks the engine to stop, then terminates
and kills it; it also exits by itself when this process goes away (killed included): no orphans.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import subprocess
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from loraplex.config import EngineConfig
from loraplex.engine import messages as m
from loraplex.engine.client import EngineClient, EngineHealth, EngineInfo, RequestStream, deliver, route_outputs
from loraplex.engine.core_launch import exit_status, launch, terminate
from loraplex.engine.output_processor import OutputProcessor
from loraplex.engine.request import NO_TAGS, RequestTags, SamplingParams
from loraplex.engine.tokenizers import TokenizerMirror, TokenizerTable
from loraplex.errors import EngineUnavailable, RequestError

logger = logging.getLogger(__name__)


class EngineProcess(EngineClient):
    """``cpus``: bind the engine's OpenMP threads to these cores (one thread per core unless
    ``config.num_threads`` says otherwise); None leaves placement to the OS."""

    def __init__(self, config: EngineConfig, adapters: Sequence[tuple[str, str]] = (), *,
                 cpus: Sequence[int] | None = None, log_level: str | None = None,
                 start_timeout: float = 900.0) -> None:
        self.config = config
        self.step_observers = []  # typed by EngineClient
        self._adapters = tuple((str(name), str(path)) for name, path in adapters)
        self._cpus = tuple(cpus) if cpus else None
        self._log_level = log_level or logging.getLevelName(logging.getLogger("loraplex").getEffectiveLevel())
        self._start_timeout = start_timeout
        self._state = EngineHealth("starting", "the engine process is not started")
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _streams, _pending, _state
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int | str, Future] = {}  # call id / request id (its Accepted) -> future
        self._call_ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._outputs = OutputProcessor()
        self._info: EngineInfo | None = None
        self._step_failures: tuple[int, str] = (0, "")  # as the engine's last StepOutputs said
        self.tokenizer = None
        self._tokenizers = TokenizerMirror(None, 0, self._fetch_tokenizers)  # adapter versions' tokenizers

    @property
    def info(self) -> EngineInfo:  # type: ignore[override]
        if self._info is None:
            raise EngineUnavailable("the engine process is not started: call start() first")
        return self._info

    # ---- life cycle ----
    def start(self) -> None:
        """Start the engine process and wait until it serves (blocking; idempotent). Raises the
        engine's own error (``ModelError``, ``AdapterError``...) if it could not start."""
        if self._proc is not None:
            return
        try:
            self._proc, self._conn, info = launch(self.config, self._adapters, self._cpus, self._log_level,
                                                  self._start_timeout)
        except BaseException as exc:
            self._state = EngineHealth("dead", f"the engine failed to start: {exc}")
            raise
        self._info = info
        if info.has_tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(info.model_path)
        self._tokenizers = TokenizerMirror(self.tokenizer, info.vocab_size, self._fetch_tokenizers)
        self._state = EngineHealth("ready")
        for target, args, name in ((m.send_batches, (self._outbox, self._conn), "loraplex-engine-send"),
                                   (self._read_loop, (), "loraplex-engine-read")):
            self._threads.append(threading.Thread(target=target, args=args, name=name, daemon=True))
            self._threads[-1].start()
        try:
            self._tokenizers.refresh()
        except BaseException:
            self.shutdown()
            raise
        logger.info("engine process %d ready: %s", info.pid, info.model_name)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every open request, stop the engine process (asked, then terminated, then killed)."""
        with self._lock:
            if self._state.state in ("stopping", "stopped") or self._proc is None:
                return
            self._state = EngineHealth("stopping", "the server is shutting down")
        self._outbox.put(m.Shutdown())
        self._outbox.put(m.STOP_SENDING)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop within %.0f s; terminating it", self._proc.pid, timeout)
            terminate(self._proc)
        for thread in self._threads:
            thread.join(timeout)
        self._fail_open(EngineUnavailable("the server is shutting down"), EngineHealth("stopped", "shut down"))

    def health(self) -> EngineHealth:
        state, (failures, why) = self._state, self._step_failures
        return dataclasses.replace(state, step_failures=failures, last_step_error=why) if state.ok else state

    # ---- requests (event loop) ----
    async def submit_many(self, items: Sequence[tuple[str, str | list[int], SamplingParams, str | None]],
                          tags: RequestTags = NO_TAGS) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        requests, streams = [], []
        for request_id, prompt, params, adapter in items:
            tokenizer = self._tokenizers.tokenizer_or_base(adapter)  # an unknown adapter: the engine says 404
            requests.append((request_id, self._token_ids(prompt, tokenizer), params, adapter, tokenizer))
            streams.append(RequestStream(self, request_id, loop))
        accepted: Future = Future()
        with self._lock:
            if not self._state.ok:
                raise EngineUnavailable(f"the engine is {self._state.state}: {self._state.detail}")
            taken = [s.request_id for s in streams if s.request_id in self._streams]
            if taken or len({s.request_id for s in streams}) < len(streams):
                raise RequestError(f"request id {(taken or [''])[0]!r} is already in use", "request_id")
            self._streams.update((s.request_id, s) for s in streams)
            self._pending[streams[0].request_id] = accepted
        for request_id, token_ids, params, _, tokenizer in requests:
            self._outputs.add(request_id, token_ids, params, tokenizer)
        self._outbox.put(m.AddRequests([(request_id, token_ids, dataclasses.replace(params, stop=()), adapter)  # stops:
                                        for request_id, token_ids, params, adapter, _ in requests], tags))  # ours
        try:
            error = await asyncio.wrap_future(accepted)
        except BaseException:  # cancelled while waiting, or the engine died
            for stream in streams:
                self.abort(stream.request_id)
            raise
        if error is not None:
            for stream in streams:
                self._forget(stream.request_id)
            raise error
        return streams

    def _token_ids(self, prompt: str | list[int], tokenizer: Any) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if tokenizer is None:
            raise RequestError(f"model {self.model_name} has no tokenizer: pass token ids", "prompt")
        return tokenizer.encode(prompt, add_special_tokens=False)

    def abort(self, request_id: str) -> None:
        if self._forget(request_id):
            self._outbox.put(m.Abort(request_id))

    def _forget(self, request_id: str) -> bool:
        """Stop tracking a request; True if it was tracked."""
        with self._lock:
            self._pending.pop(request_id, None)
            known = self._streams.pop(request_id, None) is not None
        self._outputs.drop(request_id)
        return known

    # ---- engine calls ----
    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self.call(method, *args))

    def call(self, method: str, *args: Any) -> Future:
        """Run ``engine.<method>(*args)`` in the engine process; a future of its result (any thread)."""
        future: Future = Future()
        call_id = next(self._call_ids)
        with self._lock:
            if not self._state.ok:
                future.set_exception(EngineUnavailable(f"the engine is {self._state.state}: {self._state.detail}"))
                return future
            self._pending[call_id] = future
        self._outbox.put(m.Call(call_id, method, args))
        return future

    async def load_adapter(self, name: str, path: str, new_version: bool = False) -> Any:
        """Load in the engine process, then mirror the version's own tokenizer here; if that fails, undo the load."""
        info = await self._call("load_adapter", name, path, new_version)
        try:
            await self._live_versions_changed()
        except Exception:
            await self._call("rollback_adapter" if new_version else "unload_adapter", name)
            raise
        return info

    async def _live_versions_changed(self) -> None:
        await asyncio.to_thread(self._tokenizers.refresh)

    async def unload_adapter(self, name: str) -> None:
        await self._call("unload_adapter", name)
        await self._live_versions_changed()

    def tokenizer_for(self, adapter: str | None) -> Any:
        return self._tokenizers.tokenizer_for(adapter)

    def vocab_size_for(self, adapter: str | None) -> int:
        return self._tokenizers.vocab_size_for(adapter)

    def served_adapters(self) -> dict[str, int]:
        return dict(self._tokenizers.vocab_sizes)

    def tokenizer_table(self) -> TokenizerTable:
        return self._tokenizers.table

    def _fetch_tokenizers(self) -> tuple[TokenizerTable, dict[str, int]]:
        """The engine's tokenizer table and every loaded adapter's vocabulary size (blocking)."""
        table, infos = self.call("tokenizer_table").result(), self.call("list_adapters").result()
        return table, {i.name: i.vocab_size or self.vocab_size for i in infos}

    async def list_adapters(self) -> list[Any]:
        return await self._call("list_adapters")

    async def stats(self) -> Any:
        return await self._call("stats")

    async def adapter_snapshot(self) -> dict[str, Any]:
        return await self._call("adapter_snapshot")

    # ---- the two threads ----
    def _read_loop(self) -> None:
        assert self._conn is not None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, m.StepOutputs):
                self._on_step(message)
            elif isinstance(message, m.Accepted):  # its future's result: why it was refused, or None
                self._settle(message.request_id, message.error)
            elif isinstance(message, m.Reply):
                self._settle(message.call_id, message.result, message.error)
            elif isinstance(message, m.StepFailed):
                self._on_step_failed(message)
        assert self._proc is not None
        code = exit_status(self._proc)
        if self._state.state != "stopping":
            logger.error("the engine process exited (status %s); failing every open request", code)
        self._fail_open(EngineUnavailable(f"the engine process exited (status {code})"),
                        EngineHealth("dead", f"the engine process exited (status {code})"))

    def _settle(self, key: int | str, result: Any, error: BaseException | None = None) -> None:
        with self._lock:
            future = self._pending.pop(key, None)
        if future is not None:
            future.set_exception(error) if error else future.set_result(result)

    def _on_step(self, message: m.StepOutputs) -> None:
        self._step_failures = (message.step_failures, message.last_step_error)
        outputs, stopped = self._outputs.process(message.outputs)
        for request_id in stopped:
            self._outbox.put(m.Abort(request_id))
        route_outputs(self._streams, self._lock, outputs)
        for observe in self.step_observers:
            observe(message.seconds, outputs)

    def _on_step_failed(self, message: m.StepFailed) -> None:
        with self._lock:
            streams = [s for s in (self._streams.pop(i, None) for i in message.request_ids) if s is not None]
        for request_id in message.request_ids:
            self._outputs.drop(request_id)
        deliver([(stream, message.error) for stream in streams])

    def _fail_open(self, error: EngineUnavailable, state: EngineHealth) -> None:
        """The engine is gone: end every open request and call with ``error``."""
        with self._lock:
            if self._state.state != "stopping" or state.state == "stopped":
                self._state = state
            streams, self._streams = list(self._streams.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(error)
        deliver([(stream, error) for stream in streams])
