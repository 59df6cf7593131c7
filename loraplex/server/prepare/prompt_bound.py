"""``PromptBound``: the fewest tokens a text can encode to, from its character count alone.

A prompt whose character count proves that it cannot fit the context is refused before it is
tokenized (tokenizing megabytes takes seconds). The proof: every token stands for at most
``L = max(len(t) for t in vocabulary)`` characters of the text the tokenizer's model sees, so a
text of ``C`` characters needs at least ``ceil(C / L)`` tokens, provided the steps before the model
never shrink the text. That holds for byte-level pre-tokenizers (each character becomes 1-4 byte
symbols), Metaspace (``" "`` -> ``"▁"``), splitting that keeps every character, and normalizers
that only prepend, replace one literal by a longer-or-equal one, decompose or lowercase. Unicode
composition (NFC, NFKC) merges at most 4 code points into one, so it divides the bound by 4. Any
other step (stripping, collapsing whitespace, dropping characters) voids the proof: the bound is
then None and every prompt is tokenized.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

_COMPOSING = {"NFC", "NFKC"}
_KEEPS_LENGTH = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
_MAX_COMPOSITION = 4  # code points NFC can merge into one (the longest canonical decomposition)


@dataclass(frozen=True)
class PromptBound:
    chars_per_token: int  # no token stands for more characters of the prompt than this

    def min_tokens(self, num_chars: int) -> int:
        return math.ceil(num_chars / self.chars_per_token)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PromptBound | None:
        """The bound for a transformers fast tokenizer; None when its pipeline may shrink the text."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        factor = _normalizer_factor(spec.get("normalizer"))
        if factor is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
            return None
        longest = max(len(token) for token in tokenizer.get_vocab())
        return cls(chars_per_token=max(1, longest) * factor)


def _normalizer_factor(spec: dict | None) -> int | None:
    """How many input characters one normalized character can stand for (1 or 4); None: unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_normalizer_factor(s) for s in spec.get("normalizers", [])]
        return None if None in factors else math.prod(factors)
    if kind in _COMPOSING:
        return _MAX_COMPOSITION
    if kind in _KEEPS_LENGTH:
        return 1
    if kind == "Replace":
        literal = spec.get("pattern", {}).get("String")
        return 1 if literal is not None and len(spec.get("content", "")) >= len(literal) >= 1 else None
    return None


def _pre_tokenizer_keeps_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(s) for s in spec.get("pretokenizers", []))
    return kind in _PRE_TOKENIZERS and str(spec.get("behavior", "isolated")).lower() != "removed"
