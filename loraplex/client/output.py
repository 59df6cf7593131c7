"""The one home of detokenization and stop strings: every frontend (``LLM.generate``, ``AsyncEngine``,
``EngineProcess``) turns the engine's ``EngineOutput`` s (new token ids only) into ``RequestOutput`` s here.

For each request in flight the ``OutputProcessor`` keeps its prompt's token ids, its token ids and
logprobs so far and an ``IncrementalDetokenizer`` built with the tokenizer of the request's adapter
*version* (the one its frontend routed it to), and turns each engine output into the full
``RequestOutput``: cumulative ``token_ids``, ``text``, ``delta_text``, logprobs.

Stop strings are matched here, token by token: the request finishes with "stop" at the token that
completes one (``token_ids`` ends with it, ``text`` is cut before the stop string). The engine does not
know yet: ``process`` returns the ids to abort there, and the engine's later outputs for them are dropped.

Incremental detokenization decodes from a sliding window of token ids, so each step costs O(window),
and a delta is only released once it no longer ends in an incomplete UTF-8 sequence. With stop
strings, the last ``max(len(stop)) - 1`` characters are held back until they can no longer start a stop
string, so a stream never shows text that the final output cuts off.

One thread calls ``process``; ``add`` and ``drop`` may come from others; one lock serialises them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.engine.request import EngineOutput, EngineTimes, SamplingParams, TokenLogprob
from loraplex.errors import LoraplexError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RequestOutput:
    """One request's state after a step; ``delta_text`` is what is new since its previous output.

    ``logprobs`` (when the request asked) has one entry per ``token_ids`` entry; ``prompt_logprobs`` one
    per prompt token, the first None. ``LLM.generate`` returns one output per prompt: its first choice,
    with every choice (``n`` of them, vLLM's shape) in ``outputs``, each with its ``index``.
    """

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: LoraplexError | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which choice of its prompt this is
    outputs: list[RequestOutput] = field(default_factory=list)
    times: EngineTimes | None = None  # the engine's instants for it, as of its latest output that sent them
    embedding: list[float] | None = None  # a pooling request's vector (``SamplingParams.pooling``), once finished


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's embedding (``LLM.embed``): its adapter's name, prompt token ids and pooled vector
    (``PoolingParams``: ``dimensions`` long, unit length when normalized)."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    embedding: list[float]

    @classmethod
    def of(cls, out: RequestOutput) -> EmbeddingOutput:
        """The embedding of a finished pooling request; its error if it failed."""
        if out.error is not None:
            raise out.error
        if out.embedding is None:
            raise RuntimeError(f"request {out.request_id} finished ({out.finish_reason}) without an embedding")
        return cls(out.request_id, out.adapter, out.prompt_token_ids, out.embedding)


def softmax(logits: list[float]) -> list[float]:
    """``exp(z - max z) / sum exp(z - max z)``, in float64."""
    top = max(logits)
    exps = [math.exp(z - top) for z in logits]
    total = sum(exps)
    return [e / total for e in exps]


@dataclass(frozen=True)
class ClassificationOutput:
    """One prompt's classification (``LLM.classify``): its adapter's name, prompt token ids, the head's
    ``logits [num_labels]``, ``probs = softmax(logits)`` and ``label``, the most probable class's name."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    logits: list[float]
    probs: list[float]
    label: str

    @classmethod
    def of(cls, out: RequestOutput, class_labels: tuple[str, ...]) -> ClassificationOutput:
        """The classification of a finished classifying request (``class_labels``: its version's); its error if
        it failed."""
        embedded = EmbeddingOutput.of(out)
        logits = embedded.embedding
        probs = softmax(logits)
        best = max(range(len(probs)), key=probs.__getitem__)
        return cls(out.request_id, out.adapter, out.prompt_token_ids, logits, probs, class_labels[best])


_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # decoded so far, cut at a stop string if one was hit
        self._emitted = 0

    def _decode(self, ids: list[int]) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Append one generated token; True when the text now contains a stop string (text is cut)."""
        if self._tokenizer is None:
            return False
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return False
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        for stop in self._stop:
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def pop_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, keep back what could still begin a stop string."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


@dataclass
class _Progress:
    adapter: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
    times: EngineTimes | None = None


class OutputProcessor:
    def __init__(self) -> None:
        self._requests: dict[str, _Progress] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            tokenizer: PreTrainedTokenizerBase | None, adapter: str | None = None) -> None:
        """Track a request of ``adapter`` (its name, for the outputs); ``tokenizer`` (that of its adapter
        version; None: no text) decodes it and matches its stop strings."""
        detokenizer = IncrementalDetokenizer(tokenizer, params.stop) if tokenizer is not None else None
        with self._lock:
            self._requests[request_id] = _Progress(adapter, list(prompt_token_ids), detokenizer)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, outputs: Sequence[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(full outputs of the requests still tracked, ids that a stop string finished here)."""
        full, stopped = [], []
        with self._lock:
            for out in outputs:
                progress = self._requests.get(out.request_id)
                if progress is None:  # aborted, or finished here by a stop string
                    continue
                kept, hit_stop = _accept(progress, out.new_token_ids)
                if out.new_logprobs is not None:
                    progress.logprobs = (progress.logprobs or []) + out.new_logprobs[:kept]
                if out.prompt_logprobs is not None:
                    progress.prompt_logprobs = out.prompt_logprobs
                if out.times is not None:
                    progress.times = out.times
                finished = out.finished or hit_stop
                if hit_stop and not out.finished:
                    stopped.append(out.request_id)
                if finished:
                    del self._requests[out.request_id]
                full.append(_full(out, progress, finished, "stop" if hit_stop else out.finish_reason))
        return full, stopped


def _full(out: EngineOutput, progress: _Progress, finished: bool, finish_reason: str | None) -> RequestOutput:
    detok = progress.detokenizer
    return RequestOutput(
        request_id=out.request_id, adapter=progress.adapter, prompt_token_ids=progress.prompt_token_ids,
        token_ids=list(progress.token_ids), text=detok.text if detok else "",
        delta_text=detok.pop_delta(finished) if detok else "", finished=finished, finish_reason=finish_reason,
        error=out.error, logprobs=None if progress.logprobs is None else list(progress.logprobs),
        prompt_logprobs=None if progress.prompt_logprobs is None else list(progress.prompt_logprobs),
        times=progress.times, embedding=out.embedding)


def _accept(progress: _Progress, token_ids: list[int]) -> tuple[int, bool]:
    """Append ``token_ids`` up to the one that completes a stop string: (how many were kept, whether one did)."""
    for kept, token in enumerate(token_ids, 1):
        progress.token_ids.append(token)
        if progress.detokenizer is not None and progress.detokenizer.add(token):
            return kept, True
    return len(token_ids), False
