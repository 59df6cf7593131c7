"""Incremental detokenization with stop strings, for streaming.

Text is decoded from a sliding window of token ids so each step costs O(window), and a delta is only
released once it no longer ends in an incomplete UTF-8 sequence. With stop strings, the last
``max(len(stop)) - 1`` characters are held back until they can no longer start a stop string, so a
stream never shows text that the final output cuts off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
