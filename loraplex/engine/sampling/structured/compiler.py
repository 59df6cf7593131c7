"""Grammar compilation off the step loop, cached by (tokenizer, vocabulary size, constraint hash).

``GrammarCompilers.submit`` returns a ``Future`` at once: the compile is vetted in a worker process of a
``CompilePool`` (``compile_pool.py``: a time budget per compile, cancellation, a share per tenant), then
compiled here by a pool thread against the tokenizer's ``xgrammar.TokenizerInfo`` (built the first time
that tokenizer is seen). Requests with
the same constraint and tokenizer share one ``Future``: the second is a cache hit however soon it comes,
and the compile is cancelled only when every request waiting for it went away (``GrammarState.abandon``).
The cache holds ``max_cached`` compiled grammars (least recently used out); a failed or cancelled compile
is not kept.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from loraplex.engine.sampling.structured.compile_pool import CompilePool, CompileTask
from loraplex.engine.sampling.structured.compile_worker import compile_with
from loraplex.engine.sampling.structured.masks import GrammarState
from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.errors import RequestError

logger = logging.getLogger(__name__)


@dataclass
class CompileStats:
    compiles: int = 0  # cold compiles (cache misses)
    hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # one per cold compile that succeeded, in order


class GrammarCompilers:
    """One ``xgrammar.TokenizerInfo`` per (tokenizer, vocabulary size); a shared LRU of compile tasks.
    ``workers`` and ``timeout_s``: the ``CompilePool``'s (``EngineConfig.grammar_compile_workers`` and
    ``grammar_compile_timeout_s``)."""

    def __init__(self, stop_token_ids: Collection[int], max_cached: int = 512, workers: int = 2,
                 timeout_s: float = 10.0) -> None:
        self._stop_token_ids = sorted(stop_token_ids)
        self._max_cached = max_cached
        self.pool = CompilePool(workers, timeout_s)
        weakref.finalize(self, self.pool.shutdown)  # the engine has no close: its workers go with it
        self._lock, self._info_lock = threading.Lock(), threading.Lock()
        # (id(tokenizer), vocab) -> (tokenizer, its info, a compiler): holding the tokenizer keeps its id unique
        self._infos: dict[tuple[int, int], tuple[Any, xgr.TokenizerInfo, xgr.GrammarCompiler]] = {}
        self._cache: OrderedDict[tuple[int, int, str], CompileTask] = OrderedDict()
        self.stats = CompileStats()

    def state_for(self, params: StructuredOutputsParams | None, tokenizer: Any, vocab_size: int,
                  tenant: str | None = None) -> GrammarState | None:
        """A new request's ``GrammarState`` (None without a constraint); its grammar compiles in the background."""
        if params is None:
            return None
        if tokenizer is None:
            raise RequestError("this model has no tokenizer to compile a grammar for", "structured_outputs")
        task = self._task(params, tokenizer, vocab_size, tenant)
        return GrammarState(task.future, lambda: self._abandon(task))

    def submit(self, params: StructuredOutputsParams, tokenizer: Any, vocab_size: int,
               tenant: str | None = None) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``params`` for ``tokenizer`` over ``vocab_size`` logits (a Future)."""
        return self._task(params, tokenizer, vocab_size, tenant).future

    def _task(self, params: StructuredOutputsParams, tokenizer: Any, vocab_size: int,
              tenant: str | None) -> CompileTask:
        key = (id(tokenizer), vocab_size, params.cache_key())
        with self._lock:
            found = self._cache.get(key)
            if found is not None and not found.cancelled and not (found.future.done()
                                                                  and found.future.exception() is not None):
                self._cache.move_to_end(key)
                found.waiters += 1
                self.stats.hits += 1
                return found
            kind, source = params.kind, params.source()
            options = params.json_options() if kind == "json" else {}
            task = CompileTask(lambda: self._info(tokenizer, vocab_size)[:2],
                               lambda: compile_with(self._info(tokenizer, vocab_size)[2], kind, source, options),
                               kind, source, options, tenant)
            start = time.perf_counter()
            task.future.add_done_callback(lambda f: self._compiled(f, start))
            self._cache[key] = task
            self.stats.compiles += 1
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        self.pool.submit(task)
        return task

    def _compiled(self, future: Future[xgr.CompiledGrammar], start: float) -> None:
        if not future.cancelled() and future.exception() is None:
            with self._lock:
                self.stats.compile_seconds.append(time.perf_counter() - start)

    def _abandon(self, task: CompileTask) -> None:
        with self._lock:  # under the cache's lock: a new request either joins before, or starts a new task
            self.pool.abandon(task)

    def _info(self, tokenizer: Any, vocab_size: int) -> tuple[int, xgr.TokenizerInfo, xgr.GrammarCompiler]:
        """(an id, the ``TokenizerInfo``, a compiler) of ``tokenizer`` over ``vocab_size``: built by the first
        compile that needs them, in a pool thread (hundreds of milliseconds over a 49k vocabulary)."""
        key = (id(tokenizer), vocab_size)
        with self._info_lock:
            if key not in self._infos:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._infos[key] = (tokenizer, info, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False))
            _, info, compiler = self._infos[key]
            return id(info), info, compiler

    def start(self, tokenizer: Any, vocab_size: int) -> None:
        """Start the pool's workers and build ``tokenizer``'s info in the background (``loraplex serve``:
        the first structured request then waits for neither)."""
        self.pool.start()
        if tokenizer is not None:
            threading.Thread(target=self._info, args=(tokenizer, vocab_size), daemon=True,
                             name="loraplex-grammar-info").start()

    def shutdown(self) -> None:
        self.pool.shutdown()
