"""``RequestIntake``: from what a caller submits to a ``Request`` the engine can queue (any thread).

Per request: route the adapter name to a version and *hold* it (``AdapterManager.hold``: accepted means
served, so the version outlives an unload until the request ends), then validate with that version's
vocabulary, tokenize with its tokenizer (its own if it ships one, else the base model's), check the
context length, and attach a detokenizer and a structured-output grammar. A request that fails any
check releases its hold before the error is raised; ``make_all`` is all or nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from loraplex.adapters.manager import AdapterManager
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.request import Request, SamplingParams, check_context_length
from loraplex.engine.structured.compiler import GrammarCompilers
from loraplex.errors import RequestError

Item = tuple[str | None, "str | list[int]", SamplingParams, str | None]  # (request id, prompt, params, adapter)


class RequestIntake:
    def __init__(self, adapters: AdapterManager, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 model_name: str, max_model_len: int, grammars: GrammarCompilers, seed: int) -> None:
        self.adapters, self.tokenizer, self.vocab_size = adapters, tokenizer, vocab_size
        self.model_name, self.max_model_len, self.grammars = model_name, max_model_len, grammars
        self._generator = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()

    def version(self, version_id: int | None) -> tuple[PreTrainedTokenizerBase | None, int]:
        """(tokenizer, vocabulary size) that a request for ``version_id`` (None: the base) uses."""
        info = self.adapters.info(version_id) if version_id is not None else None
        tokenizer = info.tokenizer if info is not None and info.tokenizer is not None else self.tokenizer
        return tokenizer, (info.vocab_size if info is not None and info.vocab_size else self.vocab_size)

    def tokenize(self, prompt: str | list[int], tokenizer: PreTrainedTokenizerBase | None, vocab: int) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError(f"model {self.model_name} has no tokenizer: pass token ids", "prompt")
            return tokenizer.encode(prompt, add_special_tokens=False)
        if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt token ids must be a non-empty list of ints in [0, {vocab})", "prompt")
        return list(prompt)

    def make_all(self, items: Sequence[Item], detokenize: bool, adapter_version: int | None = None,
                 **fields: Any) -> list[Request]:
        """A request per item, each holding its version, with ``fields`` set on each; if any item is refused,
        the holds of the others are released and the error raised."""
        requests: list[Request] = []
        try:
            for item in items:
                requests.append(self.make(*item, detokenize, adapter_version))
        except BaseException:
            for request in requests:
                self.release(request)
            raise
        for request in requests:
            for name, value in fields.items():
                setattr(request, name, value)
        return requests

    def make(self, request_id: str | None, prompt: str | list[int], params: SamplingParams, adapter: str | None,
             detokenize: bool, adapter_version: int | None = None) -> Request:
        version_id = self.adapters.hold(adapter, adapter_version).version_id if adapter is not None else None
        try:
            request = self._build(request_id, prompt, params, adapter, version_id, detokenize)
        except BaseException:
            if version_id is not None:
                self.adapters.release_hold(version_id)
            raise
        request.holds_version = version_id is not None
        return request

    def release(self, request: Request) -> None:
        """Release the hold of a request that will never be queued."""
        if request.holds_version:
            self.adapters.release_hold(request.version_id)
            request.holds_version = False

    def _build(self, request_id: str | None, prompt: str | list[int], params: SamplingParams, adapter: str | None,
               version_id: int | None, detokenize: bool) -> Request:
        tokenizer, vocab_size = self.version(version_id)  # the version's own tokenizer, if it ships one
        params.validate(vocab_size)
        if params.n != 1:
            raise RequestError(f"an engine request is one choice, got n={params.n}: submit params.choices() "
                               "(LLM.generate and the server do)", "n")
        token_ids = self.tokenize(prompt, tokenizer, vocab_size)
        check_context_length(len(token_ids), params.max_tokens, self.max_model_len)
        generator = self._generator if params.seed is None else torch.Generator().manual_seed(params.torch_seed)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        detokenizer = IncrementalDetokenizer(tokenizer, params.stop) if detokenize else None
        grammar = self.grammars.state_for(params.structured_outputs, tokenizer, vocab_size)  # compiles off the loop
        return Request(request_id, token_ids, params, adapter, version_id, generator, detokenizer, grammar=grammar)
