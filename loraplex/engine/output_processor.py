"""The API process's half of a request run by the engine process: text and stop strings.

The engine process sends compact outputs (``messages.compact``: new token ids only, no text). For
each request in flight this keeps its prompt's token ids, its token ids so far and its
``IncrementalDetokenizer`` (with the tokenizer of the request's adapter version), and turns each
compact output back into the full ``RequestOutput`` an in-process engine would have produced:
cumulative ``token_ids``, ``text``, ``delta_text``.

Stop strings are matched here, token by token, exactly as the engine's scheduler matches them: the
request finishes with "stop" at the token that completes one (``token_ids`` ends with it, ``text`` is
cut before the stop string). The engine does not know yet: ``process`` returns the ids to abort
there, and the engine's later outputs for them are dropped.

One thread (the engine client's reader) calls ``process``; ``add`` and ``drop`` come from event
loops; one lock serialises them.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.request import RequestOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class _Progress:
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None


class OutputProcessor:
    def __init__(self) -> None:
        self._requests: dict[str, _Progress] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            tokenizer: PreTrainedTokenizerBase | None) -> None:
        """Track a request; ``tokenizer`` (that of its adapter version; None: no text) decodes it."""
        detokenizer = IncrementalDetokenizer(tokenizer, params.stop) if tokenizer is not None else None
        with self._lock:
            self._requests[request_id] = _Progress(prompt_token_ids, detokenizer)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(full outputs of the requests still tracked, ids that a stop string finished here)."""
        full, stopped = [], []
        with self._lock:
            for out in outputs:
                progress = self._requests.get(out.request_id)
                if progress is None:  # aborted, or finished here by a stop string
                    continue
                kept, hit_stop = _accept(progress, out.token_ids)
                if out.logprobs is not None:
                    progress.logprobs = (progress.logprobs or []) + out.logprobs[:kept]
                if out.prompt_logprobs is not None:
                    progress.prompt_logprobs = out.prompt_logprobs
                finished = out.finished or hit_stop
                if hit_stop and not out.finished:
                    stopped.append(out.request_id)
                if finished:
                    del self._requests[out.request_id]
                detok = progress.detokenizer
                full.append(dataclasses.replace(
                    out, prompt_token_ids=progress.prompt_token_ids, token_ids=list(progress.token_ids),
                    text=detok.text if detok else "", delta_text=detok.pop_delta(finished) if detok else "",
                    finished=finished, finish_reason="stop" if hit_stop else out.finish_reason,
                    logprobs=None if progress.logprobs is None else list(progress.logprobs),
                    prompt_logprobs=None if progress.prompt_logprobs is None else list(progress.prompt_logprobs)))
        return full, stopped


def _accept(progress: _Progress, token_ids: list[int]) -> tuple[int, bool]:
    """Append ``token_ids`` up to the one that completes a stop string: (how many were kept, whether one did)."""
    for kept, token in enumerate(token_ids, 1):
        progress.token_ids.append(token)
        if progress.detokenizer is not None and progress.detokenizer.add(token):
            return kept, True
    return len(token_ids), False
