"""``CompilePool``: grammar compiles in worker processes, each within a time budget, cancellable, shared
among tenants so that one tenant's compiles never hold every worker.

Untrusted schemas within every static limit (``params.check_limits``) can still take minutes to compile
(512 properties with a short ``pattern`` each: 96 s here). So compiles run in ``workers`` processes
(``compile_worker.py``; xgrammar releases the GIL, but a compile cannot be stopped in a thread, and a
process can be killed), started on the first submission or by ``start`` (``loraplex serve`` starts
them with the engine: the first structured request would otherwise wait seconds for their imports).
Each worker has a thread here that sends it one ``CompileTask`` at a time and waits for the answer:

- **time budget**: a compile that has not answered ``timeout_s`` seconds after it was sent fails with a
  ``RequestError`` (a 400 on ``structured_outputs``) naming the budget; its worker is killed and
  replaced (the replacement imports for seconds, still counted in its tenant's share; the budget counts
  from the send);
- **cancellation**: ``abandon`` is called when a request waiting for the task goes away; when no request
  waits any more the task is dropped from the queue, or its worker killed and replaced if it runs;
- **tenant share**: a free worker takes the oldest queued task of a tenant running fewer than
  ``per_tenant`` compiles (``workers - 1`` by default, at least 1): with two or more workers, a tenant
  flooding hostile schemas holds at most all but one, and another tenant's small schema runs at once.
  Requests without a tenant (no API keys) count as one tenant.

A compile the worker finished within its budget is then compiled again here, by the same thread (in
the engine's process, where the grammar is needed; xgrammar releases the GIL): it takes what it took in
the worker, so a cold compile costs twice its time, milliseconds for ordinary schemas. The compiled
grammar cannot come back instead: serializing it is far slower than compiling it (``compile_worker.py``).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

from loraplex.engine.sampling.structured.compile_worker import TOKENIZER, CompileJob
from loraplex.errors import RequestError

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a worker that has not imported xgrammar by then is replaced
POLL_S = 0.05  # how often a waiting thread looks at its task's cancellation


@dataclass(eq=False)
class CompileTask:
    """One compile and the requests waiting for it (``waiters``; the pool cancels it when they reach 0)."""

    tokenizer_info: Callable[[], tuple[int, xgr.TokenizerInfo]]  # (its id, it): built once per tokenizer
    compile_here: Callable[[], xgr.CompiledGrammar]  # the same compile in this process, once vetted
    kind: str
    source: str
    options: dict[str, Any]
    tenant: str | None
    future: Future[xgr.CompiledGrammar] = field(default_factory=Future)
    waiters: int = 1
    cancelled: bool = False
    sent_at: float | None = None  # monotonic time the task was sent to a worker


class _Worker:
    """One compile-worker process (started, and replaced after a kill, by its thread) and the tokenizer
    ids it has been sent."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.infos: set[int] = set()

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex.engine.sampling.structured.compile_worker",
                                      str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        conn = self.conn = Connection(ours.detach())
        self.infos = set()
        if not conn.poll(READY_TIMEOUT_S) or conn.recv() != "ready":
            raise RuntimeError("a grammar-compile worker did not start")

    def kill(self) -> None:
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if conn is not None:
            conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


class CompilePool:
    def __init__(self, workers: int = 2, timeout_s: float = 10.0, per_tenant: int | None = None) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"CompilePool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.timeout_s = timeout_s
        self.per_tenant = per_tenant if per_tenant is not None else max(1, workers - 1)
        self._workers = [_Worker() for _ in range(workers)]
        self._queue: list[CompileTask] = []
        self._running: Counter[str | None] = Counter()  # compiles running per tenant
        self._cond = threading.Condition()
        self._started = self._stopping = False
        self.killed: Counter[str] = Counter()  # workers killed, by why: "past its time budget", "cancelled"

    def start(self) -> None:
        """Start the worker processes now (idempotent; the first ``submit`` does otherwise): each imports
        xgrammar for seconds, in the background."""
        with self._cond:
            if not self._started:
                self._started = True
                for i, worker in enumerate(self._workers):
                    threading.Thread(target=_serve, args=(self, worker), daemon=True,
                                     name=f"loraplex-grammar-{i}").start()

    def submit(self, task: CompileTask) -> None:
        """Queue ``task``; its ``future`` gets the compiled grammar or the compile's exception."""
        self.start()
        with self._cond:
            self._queue.append(task)
            self._cond.notify_all()

    def abandon(self, task: CompileTask) -> None:
        """A request waiting for ``task`` went away; with none left, ``task`` is cancelled (queued: dropped;
        running: its worker is killed when its thread next looks)."""
        with self._cond:
            task.waiters -= 1
            if task.waiters > 0 or task.future.done():
                return
            task.cancelled = True
            if task in self._queue:
                self._queue.remove(task)
                task.future.cancel()

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    def running(self) -> int:
        """Compiles sent to a worker and not answered yet."""
        with self._cond:
            return sum(self._running.values())

    def take(self) -> CompileTask | None:
        """The next task a free worker may run (blocks); None once the pool is stopping."""
        with self._cond:
            while not self._stopping:
                task = next((t for t in self._queue if self._running[t.tenant] < self.per_tenant), None)
                if task is not None:
                    self._queue.remove(task)
                    self._running[task.tenant] += 1
                    return task
                self._cond.wait()
            return None

    def done(self, task: CompileTask) -> None:
        with self._cond:
            self._running[task.tenant] -= 1
            self._cond.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def shutdown(self) -> None:
        """Stop every worker; queued tasks are cancelled."""
        with self._cond:
            self._stopping = True
            for task in self._queue:
                task.future.cancel()
            self._queue.clear()
            self._cond.notify_all()
        _kill_all(self._workers)


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()


def _serve(pool: CompilePool, worker: _Worker) -> None:
    """A worker's thread: start the process, then run the tasks it takes, one at a time. A worker killed
    by a task is replaced before the task counts as done, so its tenant's share stays taken meanwhile
    (seconds of imports), and its next compile cannot take another tenant's worker. The process is killed
    when the pool stops."""
    try:
        while _started(pool, worker):
            task = pool.take()
            if task is None:
                return
            try:
                _run(pool, worker, task)
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer xgrammar cannot read: this task's failure
                if not task.future.done():
                    task.future.set_exception(exc)
            finally:
                _started(pool, worker)
                pool.done(task)
    finally:
        worker.kill()


def _started(pool: CompilePool, worker: _Worker) -> bool:
    """Start ``worker``'s process unless it runs (retrying every second); False once the pool stops."""
    while worker.proc is None and not pool.stopping:
        try:
            worker.start()
        except (OSError, EOFError, RuntimeError) as exc:
            logger.error("grammar-compile worker failed to start (%s); retrying", exc)
            worker.kill()
            time.sleep(1.0)
    return not pool.stopping


def _run(pool: CompilePool, worker: _Worker, task: CompileTask) -> None:
    """Send ``task`` to ``worker`` and wait for its answer, its budget, or its cancellation."""
    conn = worker.conn
    assert conn is not None
    info_id, info = task.tokenizer_info()
    try:
        if info_id not in worker.infos:  # the worker loads the tokenizer first, outside the compile's budget
            conn.send(CompileJob(info_id, info.serialize_json(), TOKENIZER, ""))
            if not conn.poll(READY_TIMEOUT_S) or conn.recv()[0] != "ok":
                raise EOFError("the worker did not load the tokenizer")
            worker.infos.add(info_id)
        task.sent_at = time.monotonic()
        conn.send(CompileJob(info_id, None, task.kind, task.source, task.options))
        while not conn.poll(POLL_S):
            if task.cancelled or pool.stopping:
                _stop(pool, worker, task, "cancelled")
                task.future.cancel()
                return
            if time.monotonic() - task.sent_at > pool.timeout_s:
                _stop(pool, worker, task, "past its time budget")
                task.future.set_exception(RequestError(
                    f"structured_outputs: the grammar did not compile within {pool.timeout_s:g} s (the compile "
                    "time budget, --grammar-compile-timeout); simplify the schema", "structured_outputs"))
                return
        status, payload = conn.recv()
    except (EOFError, OSError) as exc:
        worker.kill()
        task.future.set_exception(RuntimeError(f"the grammar-compile worker died ({exc or 'end of file'})"))
        return
    if status != "ok":
        task.future.set_exception(RuntimeError(payload))
        return
    task.future.set_result(task.compile_here())  # vetted: it compiled within the budget in the worker


def _stop(pool: CompilePool, worker: _Worker, task: CompileTask, why: str) -> None:
    logger.warning("grammar compile %s after %.1f s (tenant %s): killing its worker", why,
                   time.monotonic() - (task.sent_at or 0), task.tenant)
    worker.kill()
    pool.killed[why] += 1
