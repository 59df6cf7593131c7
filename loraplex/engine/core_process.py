"""The engine process: ``python -m loraplex.engine.core_process FD``, started by ``EngineProcess``.

It reads ``Start`` from the socket FD, builds the ``Engine``, loads the start-up adapters and answers
``Ready`` (or ``StartFailed``). Then two threads serve:

- the **main thread** runs the step loop: ``engine.step()`` while there is work (it sleeps on an
  event otherwise) and sends each step's outputs, compacted, as ONE ``StepOutputs`` message;
- the **receiver thread** reads the socket: ``AddRequests`` are validated and queued at once, together,
  by ``engine.add_requests`` (each holds exactly the adapter version its frontend routed it to) and
  answered with ``Accepted``, so the HTTP status is known before the first step; ``Abort`` goes into the
  inbox too; ``Call`` s (adapter loads read files) run on a small thread pool, never on the step loop;
  a call that changes the version table replies with the table after it.

The engine deals in token ids only: text and stop strings are the frontend's (``client/output.py``).
The process ends on ``Shutdown``, or when the API process goes away (end of file on the socket,
also when it was killed), so it never outlives its parent. SIGINT is ignored (Ctrl-C reaches the
whole process group; the API process coordinates the shutdown); SIGTERM ends it at once.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from loraplex.engine import wire as m
from loraplex.engine.engine import Engine
from loraplex.engine.request import EngineOutput
from loraplex.engine.step_loop import run_step_loop

logger = logging.getLogger("loraplex.engine.core_process")  # also when run as __main__

_ORPHAN_EXIT_S = 10.0  # after the API process vanished, exit even if a step or a load still runs


class EngineCore:
    """The served engine and the two loops that drive it."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self._conn = conn
        self._send_lock = threading.Lock()  # the step loop, the receiver and the call pool all send
        self._wakeup = threading.Event()
        self._stopping = False
        self._live: set[str] = set()  # requests accepted and not yet finished
        self._live_lock = threading.Lock()
        self._calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loraplex-call")

    def send(self, message: Any) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:  # the API process is gone: nobody to tell, so stop
            self._stopping = True
            self._wakeup.set()

    def serve(self) -> None:
        receiver = threading.Thread(target=self._receive, name="loraplex-receiver", daemon=True)
        receiver.start()
        try:
            self._step_loop()
        finally:
            self._calls.shutdown(wait=False, cancel_futures=True)

    # ---- the receiver thread ----
    def _receive(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                logger.info("the API process went away; stopping")
                deadline = threading.Timer(_ORPHAN_EXIT_S, os._exit, (1,))
                deadline.daemon = True  # a prompt exit needs no deadline
                deadline.start()
                break
            if any(isinstance(message, m.Shutdown) for message in batch):
                break
            for message in batch:
                self._handle(message)
            self._wakeup.set()
        self._stopping = True
        self._wakeup.set()

    def _handle(self, message: Any) -> None:
        if isinstance(message, m.AddRequests):
            ids = [request[0] for request in message.requests]
            try:
                with self._live_lock:
                    self._live.update(ids)
                self.engine.add_requests(message.requests, message.tags)
                error = None
            except Exception as exc:  # refused: nothing was queued
                with self._live_lock:
                    self._live.difference_update(ids)
                error = m.portable(exc)
            self.send(m.Accepted(message.key, error))
        elif isinstance(message, m.Abort):
            self.engine.abort_request(message.request_id)
        elif isinstance(message, m.Call):
            self._calls.submit(self._call, message)
        else:
            logger.error("unexpected message %r", message)

    def _call(self, call: m.Call) -> None:
        try:
            if call.method not in m.CALLABLE:
                raise AttributeError(f"engine method {call.method!r} cannot be called from the API process")
            reply = m.Reply(call.call_id, m.portable_result(
                getattr(self.engine, call.method)(*call.args, **m.unpacked_kwargs(call.kwargs))))
        except Exception as exc:
            reply = m.Reply(call.call_id, error=m.portable(exc))
        if call.method in m.CHANGES_VERSIONS and reply.error is None:
            reply = dataclasses.replace(reply, versions=self.engine.version_view())
        self._wakeup.set()  # an unload may end queued requests
        self.send(reply)

    # ---- the step loop (main thread) ----
    def _step_loop(self) -> None:
        logger.info("step loop started (pid %d)", os.getpid())
        run_step_loop(self.engine, self._wakeup, lambda: self._stopping, self._send_outputs, self._fail_all)
        logger.info("step loop stopped")

    def _send_outputs(self, seconds: float, outputs: list[EngineOutput]) -> None:
        finished = [out.request_id for out in outputs if out.finished]
        if finished:
            with self._live_lock:
                self._live.difference_update(finished)
        self.send(m.StepOutputs(seconds, [m.portable_output(out) for out in outputs], self.engine.step_failures,
                                self.engine.last_step_error))

    def _fail_all(self, exc: Exception) -> None:
        with self._live_lock:
            ids = sorted(self._live)
            self._live.clear()
        for request_id in ids:
            self.engine.abort_request(request_id)
        self.send(m.StepFailed(ids, m.portable(exc)))


def _start(conn: Connection, started: threading.Event) -> EngineCore | None:
    start = conn.recv()
    assert isinstance(start, m.Start), start
    threading.Thread(target=_exit_if_orphaned_during_start, args=(conn, started), daemon=True).start()
    logging.basicConfig(level=start.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(start.config)
        for name, path in start.adapters:
            engine.load_adapter(name, path)
    except Exception as exc:
        logger.debug("engine start failed", exc_info=True)
        conn.send(m.StartFailed(m.portable(exc)))
        return None
    started.set()
    conn.send(m.Ready(engine.info(), engine.version_view()))
    return EngineCore(engine, conn)


def _exit_if_orphaned_during_start(conn: Connection, started: threading.Event) -> None:
    """Before ``Ready`` the API process sends nothing: anything readable is end of file (it went away)
    or ``Shutdown``; either way a model that is still loading is not wanted any more."""
    conn.poll(None)
    if not started.is_set():
        os._exit(1)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    started = threading.Event()
    try:
        core = _start(conn, started)
    except (EOFError, OSError):  # the API process went away during start-up
        return 1
    if core is None:
        return 1
    gc.freeze()  # the model's objects stay out of every later collection: shorter GC pauses between steps
    core.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
