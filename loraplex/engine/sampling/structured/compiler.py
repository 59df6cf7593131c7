"""Grammar compilation off the step loop, cached by (tokenizer, vocabulary size, constraint hash).

``GrammarCompilers.submit`` returns a ``Future`` at once: one worker thread builds the tokenizer's
``xgrammar.TokenizerInfo`` and ``GrammarCompiler`` the first time that tokenizer is seen, then compiles
the constraint against it (xgrammar's C++ releases the GIL, so the step loop keeps running). Requests
with the same constraint and tokenizer share one ``Future``: the second is a cache hit however soon
it comes. The cache holds ``max_cached`` compiled grammars (least recently used out).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from loraplex.engine.sampling.structured.masks import GrammarState
from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.errors import RequestError

logger = logging.getLogger(__name__)


@dataclass
class CompileStats:
    compiles: int = 0  # cold compiles (cache misses)
    hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # one per cold compile, in order


class GrammarCompilers:
    """One ``xgrammar.GrammarCompiler`` per (tokenizer, vocabulary size); a shared LRU of compiled grammars."""

    def __init__(self, stop_token_ids: Collection[int], max_cached: int = 512) -> None:
        self._stop_token_ids = sorted(stop_token_ids)
        self._max_cached = max_cached
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar")
        self._lock = threading.Lock()
        # (id(tokenizer), vocab) -> (tokenizer, its compiler): holding the tokenizer keeps its id unique
        self._compilers: dict[tuple[int, int], tuple[Any, xgr.GrammarCompiler]] = {}
        self._cache: OrderedDict[tuple[int, int, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self.stats = CompileStats()

    def state_for(self, params: StructuredOutputsParams | None, tokenizer: Any, vocab_size: int) -> GrammarState | None:
        """A new request's ``GrammarState`` (None without a constraint); its grammar compiles in the background."""
        if params is None:
            return None
        if tokenizer is None:
            raise RequestError("this model has no tokenizer to compile a grammar for", "structured_outputs")
        return GrammarState(self.submit(params, tokenizer, vocab_size))

    def submit(self, params: StructuredOutputsParams, tokenizer: Any, vocab_size: int) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``params`` for ``tokenizer`` over ``vocab_size`` logits (a Future)."""
        key = (id(tokenizer), vocab_size, params.cache_key())
        with self._lock:
            found = self._cache.get(key)
            if found is not None and not (found.done() and found.exception() is not None):
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return found
            future = self._executor.submit(self._compile, params, tokenizer, vocab_size)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def _compile(self, params: StructuredOutputsParams, tokenizer: Any, vocab_size: int) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiler = self._compiler(tokenizer, vocab_size)
        kind = params.kind
        if kind == "json":
            compiled = compiler.compile_json_schema(params.source(), **params.json_options())
        elif kind == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        elif kind == "regex":
            compiled = compiler.compile_regex(params.source())
        else:
            compiled = compiler.compile_grammar(params.source())
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds.append(seconds)
        logger.debug("compiled a %s constraint in %.1f ms", kind, seconds * 1e3)
        return compiled

    def _compiler(self, tokenizer: Any, vocab_size: int) -> xgr.GrammarCompiler:
        key = (id(tokenizer), vocab_size)
        if key not in self._compilers:  # only the worker thread writes here
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self._compilers[key] = (tokenizer, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False))
        return self._compilers[key][1]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
