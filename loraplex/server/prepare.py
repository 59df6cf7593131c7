"""Request preparation off the event loop: ``RequestPreparer``, a pool of workers that run
``prepare_worker.PrepareWorker`` (parse and validate a generation body, check its limits, render the
chat template, check the context length, tokenize; ``/tokenize`` and ``/detokenize``).

The event loop reads a generation request's (size-bounded) body and hands the bytes to the preparer;
a worker does everything else and returns the parsed body and the prompts' token ids, or the error to
answer with: a malformed body becomes the ``RequestValidationError`` FastAPI would have raised,
anything else a ``RequestError`` naming the field.

Workers are threads (``processes=0``, for in-process engines: the tokenizer releases the GIL while
it encodes) or processes (``loraplex serve``: JSON parsing, pydantic validation and chat templates
hold the GIL, so in a thread a 100k-message chat would stall the event loop, and every stream with
it, for as long as it takes). Threads ask the engine client for each adapter version's tokenizer;
processes get the client's ``TokenizerTable`` with every job and read the tokenizers it names once
(``engine/tokenizers.py``). Each worker process has its own tokenizers, runs at a lower priority
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
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from multiprocessing import get_context
from typing import Any

from fastapi.exceptions import RequestValidationError

from loraplex.engine.client import EngineClient
from loraplex.engine.tokenizers import TokenizerCache, TokenizerTable
from loraplex.errors import UnknownAdapter
from loraplex.server.errors import ServerError
from loraplex.server.prepare_worker import InvalidBody, PrepareConfig, Prepared, PrepareWorker

logger = logging.getLogger(__name__)

# Worker processes yield the CPU to the engine's step loop and the event loop: one request's
# preparation (a huge body's parse, a long chat template) waits; the streams in flight do not.
WORKER_NICENESS = 10


_local = threading.local()  # each worker's PrepareWorker


def _init_thread(config: PrepareConfig, client: EngineClient | None) -> None:
    _local.worker = PrepareWorker(config, partial(_client_tokenizer, client))


def _client_tokenizer(client: EngineClient | None, _table: TokenizerTable, adapter: str | None) -> Any:
    """The client's tokenizer for ``adapter``; the base model's for an unknown name (the engine refuses it)."""
    if client is None:
        return None
    try:
        return client.tokenizer_for(adapter)
    except UnknownAdapter:
        return client.tokenizer


def _init_process(config: PrepareConfig, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(WORKER_NICENESS)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    base = None
    if config.tokenizer_path is not None:
        from transformers import AutoTokenizer

        base = AutoTokenizer.from_pretrained(config.tokenizer_path)
    cache = TokenizerCache(base)

    def tokenizer_for(table: TokenizerTable, adapter: str | None) -> Any:
        cache.prune(table)  # versions unloaded since the last request
        return cache.tokenizer_for(table, adapter)

    _local.worker = PrepareWorker(config, tokenizer_for)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def _run(kind: str, *args: Any) -> Any:
    return getattr(_local.worker, kind)(*args)


class RequestPreparer:
    """``processes`` worker processes, or (0) ``threads`` worker threads. ``client`` names each adapter
    version's tokenizer: threads ask it directly, processes get its ``tokenizer_table()`` with every
    request. Without a client, only the base tokenizer (``config.tokenizer_path``, processes) is used."""

    def __init__(self, config: PrepareConfig, client: EngineClient | None = None, processes: int = 0,
                 threads: int = 2) -> None:
        self.config, self.client, self.processes, self.threads = config, client, processes, threads
        self._pool = self._new_pool()

    def _new_pool(self) -> Executor:
        if self.processes:
            return ProcessPoolExecutor(self.processes, mp_context=get_context("spawn"), initializer=_init_process,
                                       initargs=(self.config, os.getpid()))
        return ThreadPoolExecutor(self.threads, thread_name_prefix="loraplex-prepare", initializer=_init_thread,
                                  initargs=(self.config, self.client))

    async def warm_up(self) -> None:
        """Start every worker now (processes load their tokenizer), not on the first requests."""
        await asyncio.gather(*(self._run("warm_up") for _ in range(self.processes or self.threads)))

    async def completion(self, raw: bytes, default_max_tokens: int) -> Prepared:
        return await self._run("completion", raw, default_max_tokens)

    async def chat(self, raw: bytes) -> Prepared:
        return await self._run("chat", raw)

    async def tokenize(self, body: Any, adapter: str | None) -> tuple[list[int], list[str] | None]:
        return await self._run("tokenize", body, adapter)

    async def detokenize(self, tokens: list[int], adapter: str | None) -> str:
        return await self._run("detokenize", tokens, adapter)

    async def _run(self, kind: str, *args: Any) -> Any:
        table = self.client.tokenizer_table() if self.processes and self.client else _NO_TABLE
        try:
            return await asyncio.wrap_future(self._pool.submit(_run, kind, *args, table))
        except InvalidBody as exc:
            raise RequestValidationError(exc.errors) from None
        except BrokenProcessPool:
            logger.error("a request-preparation worker process died; starting new ones")
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            raise ServerError(503, "a request-preparation worker died while preparing this request; "
                              "retry it") from None

    def shutdown(self) -> None:
        """Stop the workers (blocking until they exited)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


_NO_TABLE = TokenizerTable()
