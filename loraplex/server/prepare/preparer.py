"""Request preparation off the event loop: ``RequestPreparer``, a pool of workers that run
``prepare/worker.PrepareWorker`` (parse and validate a generation body and check its limits; then, with
the adapter version the request was routed to, render the chat template and tokenize; ``/tokenize`` and
``/detokenize``).

The event loop reads a generation request's (size-bounded) body and hands the bytes to the preparer,
which parses it in a worker; the event loop routes the body's ``model`` to a ``Version`` (once:
``EngineClient.route``); a worker then prepares the prompts with that version. Errors come back as what
to answer with: a malformed body becomes the ``RequestValidationError`` FastAPI would have raised,
anything else a ``RequestError`` naming the field.

Workers are threads (``processes=0``, for in-process engines: the tokenizer releases the GIL while
it encodes) or processes (``loraplex serve``: JSON parsing, pydantic validation and chat templates
hold the GIL, so in a thread a 100k-message chat would stall the event loop, and every stream with
it, for as long as it takes). A thread gets the routed ``Version`` with its tokenizer object; a process
gets it portable and reads that version's tokenizer once (``client/tokenizers.VersionTokenizers``).
Each worker process has its own tokenizers, runs at a lower priority
(``WORKER_NICENESS``), exits with the server (it watches its parent) and ignores SIGINT (the server
coordinates shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Any

from fastapi.exceptions import RequestValidationError

from loraplex.client.directory import Version
from loraplex.client.tokenizers import VersionTokenizers
from loraplex.server.openai.errors import ServerError
from loraplex.server.prepare.worker import InvalidBody, Parsed, PrepareConfig, Prepared, PrepareWorker

logger = logging.getLogger(__name__)

# Worker processes yield the CPU to the engine's step loop and the event loop: one request's
# preparation (a huge body's parse, a long chat template) waits; the streams in flight do not.
WORKER_NICENESS = 10


_local = threading.local()  # each worker's PrepareWorker


def _init_process(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(WORKER_NICENESS)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from transformers import AutoTokenizer  # noqa: F401 - seconds of imports, done before the first job


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def _worker(config: PrepareConfig, base: Any) -> PrepareWorker:
    """This worker's ``PrepareWorker`` for ``config``, built by its first job. ``base``: the base tokenizer
    (a thread's job carries it; a process loads it from ``config.tokenizer_path``)."""
    worker = getattr(_local, "worker", None)
    if worker is None or worker.config != config:
        if base is None and config.tokenizer_path is not None:
            from loraplex.models.tokenizer_source import model_tokenizer

            base = model_tokenizer(config.tokenizer_path)
        worker = _local.worker = PrepareWorker(config, VersionTokenizers(base))
    return worker


def _run(config: PrepareConfig, base: Any, kind: str, *args: Any) -> Any:
    return getattr(_worker(config, base), kind)(*args)


def _started() -> None:
    """A first job: makes a pool start its process (which imports what it needs) before any config."""


class _Worker:
    """One worker process (a one-process pool: its death breaks only it), with its jobs in flight."""

    def __init__(self) -> None:
        self.pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_init_process,
                                        initargs=(os.getpid(),))
        self.jobs = 0
        self.ready = False  # its tokenizer is loaded (a replacement is cold until its warm-up ran)


class RequestPreparer:
    """``processes`` worker processes, or (0) ``threads`` worker threads. ``base_tokenizer``: the base model's
    tokenizer for thread workers (processes load it from ``config.tokenizer_path``).

    Each process is a pool of its own, and a job goes to the ready one with the fewest jobs: a worker that
    dies (killed, out of memory) fails only the job it was running (503) and is replaced alone, warmed up in
    the background, while the others keep serving; a job refused because its worker was already dead is
    sent to another one.

    ``config`` may come later (``configure``), so that ``start`` can spawn the worker processes, which
    spend seconds importing, while the engine is still loading the model: ``loraplex serve`` does."""

    def __init__(self, config: PrepareConfig | None = None, base_tokenizer: Any = None, processes: int = 0,
                 threads: int = 2) -> None:
        self.config, self.base_tokenizer, self.processes, self.threads = config, base_tokenizer, processes, threads
        self._threads = None if processes else ThreadPoolExecutor(threads, thread_name_prefix="loraplex-prepare")
        self._workers = [_Worker() for _ in range(processes)]
        self.replaced = 0  # worker processes replaced after a death

    def start(self) -> None:
        """Spawn the worker processes now (no-op for threads); they import while the caller goes on."""
        for worker in self._workers:
            worker.pool.submit(_started)

    def configure(self, config: PrepareConfig, base_tokenizer: Any = None) -> None:
        """The model's tokenizer and limits, once the engine has said them (before the first job)."""
        self.config, self.base_tokenizer = config, base_tokenizer

    def worker_pids(self) -> list[int]:
        """The worker processes' pids (those started so far)."""
        return [pid for worker in self._workers for pid in worker.pool._processes or {}]

    async def warm_up(self) -> None:
        """Start every worker now (processes load their tokenizer), not on the first requests."""
        if self._threads is not None:
            await asyncio.gather(*(self._run("warm_up") for _ in range(self.threads)))
        else:
            await asyncio.gather(*(self._warm(worker) for worker in self._workers))

    async def _warm(self, worker: _Worker) -> None:
        await asyncio.wrap_future(worker.pool.submit(_run, self._config(), None, "warm_up"))
        worker.ready = True

    async def parse_completion(self, raw: bytes) -> Parsed:
        light = bool(self.processes)
        return Parsed(await self._run("parse_completion", raw, light), raw, light)

    async def parse_chat(self, raw: bytes) -> Parsed:
        light = bool(self.processes)
        return Parsed(await self._run("parse_chat", raw, light), raw, light)

    async def completion(self, parsed: Parsed, version: Version, default_max_tokens: int) -> Prepared:
        return await self._run("completion", self._light(parsed), self._job(version), default_max_tokens)

    async def chat(self, parsed: Parsed, version: Version) -> Prepared:
        return await self._run("chat", self._light(parsed), self._job(version))

    async def parse_pooling(self, raw: bytes, task: str) -> Parsed:
        """Parse the body of pooling route ``task``: ``embeddings``, ``classify``, ``score`` or ``rerank``."""
        light = bool(self.processes)
        return Parsed(await self._run("parse_pooling", raw, light, task), raw, light)

    async def pooling(self, parsed: Parsed, version: Version, task: str) -> Prepared:
        return await self._run("pooling", self._light(parsed), self._job(version), task)

    @staticmethod
    def _light(parsed: Parsed) -> Parsed:
        """What goes back into a worker: the raw bytes alone when the body is light (the worker parses them)."""
        return Parsed(None, parsed.raw, True) if parsed.light else parsed

    async def tokenize(self, body: Any, version: Version) -> tuple[list[int], list[str] | None]:
        return await self._run("tokenize", body, self._job(version))

    async def detokenize(self, tokens: list[int], version: Version) -> str:
        return await self._run("detokenize", tokens, self._job(version))

    def _config(self) -> PrepareConfig:
        if self.config is None:
            raise RuntimeError("RequestPreparer.configure() was not called")
        return self.config

    def _job(self, version: Version) -> Version:
        """The version as a job carries it: whole to a thread, portable to a process."""
        return version.portable() if self.processes else version

    async def _run(self, kind: str, *args: Any) -> Any:
        try:
            if self._threads is not None:
                return await asyncio.wrap_future(self._threads.submit(_run, self._config(), self.base_tokenizer,
                                                                      kind, *args))
            return await self._run_in_process(kind, *args)
        except InvalidBody as exc:
            raise RequestValidationError(exc.errors) from None

    async def _run_in_process(self, kind: str, *args: Any) -> Any:
        for _ in range(len(self._workers) + 1):  # a worker found dead at submission: the job goes elsewhere
            worker = min(self._workers, key=lambda w: (not w.ready, w.jobs))
            try:
                future = worker.pool.submit(_run, self._config(), None, kind, *args)
            except BrokenProcessPool:
                self._replace(worker)
                continue
            worker.jobs += 1
            try:
                return await asyncio.wrap_future(future)
            except BrokenProcessPool:
                self._replace(worker)
                raise ServerError(503, "a request-preparation worker died while preparing this request; "
                                  "retry it") from None
            finally:
                worker.jobs -= 1
        raise ServerError(503, "no request-preparation worker is alive; retry the request")

    def _replace(self, dead: _Worker) -> None:
        """Replace ``dead`` alone (once, however many jobs saw it die); its replacement warms up meanwhile."""
        if dead not in self._workers:
            return
        logger.error("a request-preparation worker process died; starting a new one (the others keep serving)")
        dead.pool.shutdown(wait=False, cancel_futures=True)
        fresh = _Worker()
        self._workers[self._workers.index(dead)] = fresh
        self.replaced += 1
        task = asyncio.ensure_future(self._warm(fresh))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failed warm-up: the next job says why

    def shutdown(self) -> None:
        """Stop the workers (blocking until they exited)."""
        for pool in [self._threads] if self._threads is not None else [w.pool for w in self._workers]:
            pool.shutdown(wait=True, cancel_futures=True)
