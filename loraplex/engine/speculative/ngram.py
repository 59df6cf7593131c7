"""Prompt-lookup (n-gram) drafting: a request proposes the tokens that followed an earlier occurrence of its
own last few tokens, in its prompt or its output so far. No draft model: extraction, rewriting and RAG
answers copy spans of their context, and those spans are found this way."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("I").itemsize  # bytes per token id in the search buffer


class NgramIndex:
    """One request's token ids as a byte string (4 bytes per id), grown as its output grows, searched with
    ``bytes.rfind`` (C speed; a match must start on a token boundary)."""

    def __init__(self) -> None:
        self._tokens = array("I")
        if self._tokens.itemsize != 4:
            raise RuntimeError("array('I') is not 32-bit on this platform")

    def sync(self, token_ids: Sequence[int]) -> None:
        """Catch up with ``token_ids`` (the request's prompt then its output: append-only)."""
        if len(token_ids) > len(self._tokens):
            self._tokens.extend(token_ids[len(self._tokens):])

    def propose(self, k: int, min_n: int, max_n: int) -> list[int]:
        """Semantics: with t the synced tokens (length L), for n = max_n down to min_n (n < L), the first n
        with a match decides: a match is an i with t[i:i+n] == t[L-n:] and i + n < L; the largest i with
        i + n + k <= L (k tokens follow it) is preferred, else the largest i; it gives t[i+n : i+n+k]
        (at least one token). No match for any n gives []."""
        data = self._tokens.tobytes()
        size = len(self._tokens)
        for n in range(min(max_n, size - 1), min_n - 1, -1):
            pattern = data[(size - n) * _WIDTH:]
            for last in (size - k, size - 1):  # the match ends before token ``last``
                at = self._rfind(data, pattern, last * _WIDTH) if last >= n else -1
                if at >= 0:
                    first = at // _WIDTH + n
                    return self._tokens[first:first + k].tolist()
        return []

    @staticmethod
    def _rfind(data: bytes, pattern: bytes, end: int) -> int:
        """The last token-aligned occurrence of ``pattern`` inside ``data[:end]``; -1 if none."""
        while (at := data.rfind(pattern, 0, end)) >= 0:
            if at % _WIDTH == 0:
                return at
            end = at + len(pattern) - 1  # unaligned: look further left
        return -1
