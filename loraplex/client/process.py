"""``EngineProcess``: the engine core in its own process, driven from this (the API) process.

``start()`` launches the engine process (``client/launcher``: ``python -m loraplex.engine.core_process``
on one end of a socket pair) with the ``EngineConfig`` and the start-up adapters, and waits until
it serves. Then, in this process:

- the **event loop** (``submit``, ``abort``, the adapter calls) only queues messages and awaits
  futures: it never writes to the socket, so it never blocks on the engine;
- the **sender thread** writes whatever queued up, as one pickled batch per write;
- the **reader thread** reads the engine's messages: per step ONE ``StepOutputs``, which it turns
  into full outputs with text (the client's ``OutputProcessor``: detokenization and stop strings happen
  here, not in the engine process) and hands to their streams with one ``call_soon_threadsafe`` per
  event loop.

The engine's version table is copied here (the client's ``AdapterDirectory``): it arrives with
``Ready`` and with every reply to a call that changes it, and the versions that ship their own
tokenizer are read from their folders then (``client/tokenizers.py``), before the call returns.

If the engine process dies, the reader sees end of file: open requests end with ``EngineUnavailable``
(a retryable 503) and pending calls fail. With a ``RestartPolicy`` (what ``loraplex serve`` runs unless
``--no-engine-restart``), ``health()`` then says "restarting" while the reader thread starts a new engine
process (bounded attempts with backoff, ``client/restart.py``), loads the adapters the table held
again from their recorded calls (new version ids, after every id handed out before) and says "ready";
without one, or when every attempt fails, ``health()`` says "dead". ``shutdown()`` asks the engine to stop,
then terminates and kills it; it also exits by itself when this process goes away (killed included): no orphans.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from loraplex.client.base import EngineClient, EngineHealth
from loraplex.client.directory import AdapterDirectory
from loraplex.client.launcher import exit_status, launch, terminate
from loraplex.client.restart import AdapterRecipes, RestartPolicy
from loraplex.client.tokenizers import folder_reader
from loraplex.config import EngineConfig
from loraplex.engine import wire as m
from loraplex.engine.request import NewRequest, RequestTags
from loraplex.errors import EngineUnavailable

logger = logging.getLogger(__name__)


class EngineProcess(EngineClient):
    """``cpus``: bind the engine's OpenMP threads to these cores (one thread per core unless
    ``config.num_threads`` says otherwise); None leaves placement to the OS. ``restart``: how a dead engine
    process is restarted (None: it is not, and the client stays "dead"). ``on_dead``: called (from the reader
    thread) when the engine process is gone for good, not by ``shutdown``."""

    def __init__(self, config: EngineConfig, adapters: Sequence[tuple[str, str]] = (), *,
                 cpus: Sequence[int] | None = None, log_level: str | None = None,
                 start_timeout: float = 900.0, restart: RestartPolicy | None = None,
                 on_dead: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.config = config
        self._adapters = tuple((str(name), str(path)) for name, path in adapters)
        self._cpus = tuple(cpus) if cpus else None
        self._log_level = log_level or logging.getLevelName(logging.getLogger("loraplex").getEffectiveLevel())
        self._start_timeout = start_timeout
        self._restart, self._on_dead = restart, on_dead
        self._recipes = AdapterRecipes(self._adapters)
        self.restarts = 0  # engine processes started after a death
        self._state = EngineHealth("starting", "the engine process is not started")
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[int | str, Future] = {}  # call id / request id (its Accepted) -> future; _lock
        self._call_ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._info: m.EngineInfo | None = None
        self._step_failures: tuple[int, str] = (0, "")  # as the engine's last StepOutputs said
        self.tokenizer = None
        self.directory = AdapterDirectory(None, 0, folder_reader(None, 0))

    @property
    def info(self) -> m.EngineInfo:  # type: ignore[override]
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
            self._launch(self.config, self._adapters)
        except BaseException as exc:
            self._state = EngineHealth("dead", f"the engine failed to start: {exc}")
            raise
        self._state = EngineHealth("ready")
        logger.info("engine process %d ready: %s", self.info.pid, self.info.model_name)

    def _launch(self, config: EngineConfig, adapters: Sequence[tuple[str, str]]) -> None:
        """Start an engine process, a fresh directory of its table and the two threads (state unchanged)."""
        self._proc, self._conn, ready = launch(config, adapters, self._cpus, self._log_level, self._start_timeout)
        info = self._info = ready.info
        if info.has_tokenizer and self.tokenizer is None:
            from loraplex.models.tokenizer_source import model_tokenizer

            self.tokenizer = model_tokenizer(info.model_path)
        self.directory = AdapterDirectory(self.tokenizer, info.vocab_size,
                                          folder_reader(self.tokenizer, info.vocab_size))
        try:
            self._update_directory(ready.versions)
        except BaseException:
            terminate(self._proc)
            raise
        self._outbox = queue.SimpleQueue()  # what was queued for a dead process is dropped with it
        roles = ((m.send_batches, (self._outbox, self._conn), "loraplex-engine-send"),
                 (self._read_loop, (), "loraplex-engine-read"))
        self._threads = [threading.Thread(target=target, args=args, name=name, daemon=True)
                         for target, args, name in roles]
        for thread in self._threads:
            thread.start()

    def _update_directory(self, view: m.VersionView) -> None:
        self._recipes.saw(view)
        self.directory.update(view)

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
            if thread is not threading.current_thread():
                thread.join(timeout)
        self._fail_open(EngineUnavailable("the server is shutting down"), EngineHealth("stopped", "shut down"))

    def health(self) -> EngineHealth:
        state, (failures, why) = self._state, self._step_failures
        return dataclasses.replace(state, step_failures=failures, last_step_error=why) if state.ok else state

    # ---- requests (event loop) ----
    def _check_serving(self) -> None:
        if not self._state.ok:
            raise EngineUnavailable(f"the engine is {self._state.state}: {self._state.detail}")

    async def _enqueue(self, requests: list[NewRequest], tags: RequestTags) -> None:
        message = m.AddRequests(requests, tags)
        accepted: Future = Future()
        with self._lock:
            self._check_serving()
            self._pending[message.key] = accepted
        self._outbox.put(message)
        try:
            error = await asyncio.wrap_future(accepted)
        except BaseException:  # cancelled while waiting, or the engine died
            for request in requests:
                self.abort(str(request.request_id))
            raise
        if error is not None:
            raise error

    def _abort_in_engine(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)
        self._outbox.put(m.Abort(request_id))

    # ---- engine calls ----
    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result, view = await asyncio.wrap_future(self.call(method, *args, **kwargs))
        if view is not None:
            try:
                await asyncio.to_thread(self._update_directory, view)
            except Exception:
                if method == "load_adapter":  # this process cannot read its tokenizer: undo the load
                    name, new_version = args[0], kwargs.get("new_version", False)
                    await self._call("rollback_adapter" if new_version else "unload_adapter", name)
                raise
        self._recipes.record(method, args, kwargs)
        return result

    def call(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Run ``engine.<method>(*args, **kwargs)`` in the engine process; a future of (its result, the version table
        after it when the call changes it) (any thread)."""
        return self._send_call(method, args, kwargs, require_ready=True)

    def _send_call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, require_ready: bool) -> Future:
        future: Future = Future()
        call_id = next(self._call_ids)
        with self._lock:
            if require_ready and not self._state.ok:
                future.set_exception(EngineUnavailable(f"the engine is {self._state.state}: {self._state.detail}"))
                return future
            self._pending[call_id] = future
        packed = m.packed_kwargs(kwargs)
        future.add_done_callback(lambda _: m.remove_spooled(packed))
        self._outbox.put(m.Call(call_id, method, args, packed))
        return future

    # ---- the two threads ----
    def _read_loop(self) -> None:
        assert self._conn is not None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, m.StepOutputs):
                self._step_failures = (message.step_failures, message.last_step_error)
                self._on_step(message.seconds, message.outputs)
            elif isinstance(message, m.Accepted):  # its future's result: why it was refused, or None
                self._settle(message.request_id, message.error)
            elif isinstance(message, m.Reply):
                self._settle_call(message)
            elif isinstance(message, m.StepFailed):
                self._fail_streams(message.request_ids, message.error)
        assert self._proc is not None
        code = exit_status(self._proc)
        if self._state.state == "stopping" or self._restart is None:
            if self._state.state != "stopping":
                logger.error("the engine process exited (status %s); failing every open request", code)
            self._fail_open(EngineUnavailable(f"the engine process exited (status {code})"),
                            EngineHealth("dead", f"the engine process exited (status {code})"))
            if self._state.state == "dead" and self._on_dead is not None:
                self._on_dead()
            return
        logger.error("the engine process exited (status %s); failing every open request and restarting it", code)
        self._fail_open(EngineUnavailable(f"the engine process exited (status {code}); it is restarting"),
                        EngineHealth("restarting", f"the engine process exited (status {code}) and is restarting"))
        self._restart_engine(self._restart)

    def _restart_engine(self, policy: RestartPolicy) -> None:
        """Start a new engine process (this thread ends once it serves; its own reader takes over)."""
        why = ""
        for delay in policy.delays():
            time.sleep(delay)
            if self._state.state != "restarting":  # shut down meanwhile
                return
            config = dataclasses.replace(self.config, first_version_id=self._recipes.next_version_id)
            try:
                self._launch(config, ())
            except Exception as exc:
                why = str(exc)
                logger.error("restarting the engine process failed: %s", why)
                continue
            self._reload_adapters()
            with self._lock:
                restarted = self._state.state == "restarting"
                if restarted:
                    self._state = EngineHealth("ready")
                    self.restarts += 1
            if not restarted:  # shut down while it started
                terminate(self._proc)
                return
            logger.info("engine process %d ready again (restart %d)", self.info.pid, self.restarts)
            return
        with self._lock:
            dead = self._state.state == "restarting"
            if dead:
                self._state = EngineHealth("dead", f"the engine process could not be restarted: {why}")
        if dead and self._on_dead is not None:
            self._on_dead()

    def _reload_adapters(self) -> None:
        """Replay the recorded adapter calls into the new engine (in order; one that fails is logged and forgotten)."""
        for method, args, kwargs in self._recipes.replay():
            try:
                _, view = self._send_call(method, args, kwargs, require_ready=False).result(self._start_timeout)
                if view is not None:
                    self._update_directory(view)
            except Exception as exc:
                logger.error("adapter %r could not be restored after the restart (%s): %s", args[0], method, exc)
                self._recipes.forget(str(args[0]))

    def _settle(self, key: int | str, result: Any) -> None:
        with self._lock:
            future = self._pending.pop(key, None)
        if future is not None:
            future.set_result(result)

    def _settle_call(self, reply: m.Reply) -> None:
        with self._lock:
            future = self._pending.pop(reply.call_id, None)
        if future is None:
            return
        if reply.error is None:
            future.set_result((reply.result, reply.versions))
        else:  # a failed call changed nothing
            future.set_exception(reply.error)

    def _fail_open(self, error: EngineUnavailable, state: EngineHealth) -> None:
        """The engine is gone: end every open request and call with ``error``."""
        with self._lock:
            if self._state.state != "stopping" or state.state == "stopped":
                self._state = state
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(error)
        self._fail_streams(None, error)
