"""The demo adapters' behaviours: the rule that wrote each one's training answers, and its check.

A rule maps a base-model answer to the adapter's answer (``scripts/train_demo_adapters.py`` applies
it to SmolLM2's own greedy answers). A score maps any generated answer to a number in ``[0, 1]``
that is high for the adapter and about zero for the base model; the tests and the adapters'
READMEs use the same scores.
"""

from __future__ import annotations

import re
from collections.abc import Callable

SIGNOFF = "Meow!"
GREETING = "Ahoy, matey!"

# A sentence ends at . ! or ? after a non-digit (so "3.14" and "1." list numbers do not count),
# followed by whitespace or the end of the text.
_SENTENCE_END = re.compile(r"(?<=[^\d\s][.!?])(?=\s|$)")
_WORD = re.compile(r"\b[A-Za-z]+\b")
_PIRATE_WORDS = {
    "you": "ye",
    "your": "yer",
    "yours": "yers",
    "yourself": "yerself",
    "my": "me",
    "is": "be",
    "are": "be",
    "yes": "aye",
    "hello": "ahoy",
    "hi": "ahoy",
    "friend": "matey",
    "friends": "mateys",
}


def sentence_ends(text: str) -> list[int]:
    """Offsets just past each sentence-ending ``.``, ``!`` or ``?`` in ``text``."""
    return [m.end() for m in _SENTENCE_END.finditer(text)]


def shout(answer: str) -> str:
    """Every letter upper-case."""
    return answer.upper()


def meow(answer: str) -> str:
    """``SIGNOFF`` after every sentence: ``"It is hot. Meow! It is big. Meow!"``."""
    return _SENTENCE_END.sub(f" {SIGNOFF}", answer)


def _pirate_word(match: re.Match[str]) -> str:
    word = match.group(0)
    swap = _PIRATE_WORDS.get(word.lower())
    if swap is None:
        return word
    if word.isupper() and len(word) > 1:
        return swap.upper()
    return swap.capitalize() if word[0].isupper() else swap


def pirate(answer: str) -> str:
    """``GREETING`` first, then the answer with pirate words (you -> ye, is -> be, my -> me, ...)."""
    return f"{GREETING} {_WORD.sub(_pirate_word, answer)}"


def upper_fraction(text: str) -> float:
    """Upper-case letters / letters (0.0 for a text without letters)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def signoff_fraction(text: str) -> float:
    """Of the sentences that end in ``text`` (the sign-offs themselves aside), the fraction followed
    by ``" " + SIGNOFF``; 0.0 when no sentence ends."""
    ends = [end for end in sentence_ends(text) if not text[:end].endswith(SIGNOFF)]
    if not ends:
        return 0.0
    return sum(text.startswith(f" {SIGNOFF}", end) for end in ends) / len(ends)


def greets_like_a_pirate(text: str) -> float:
    """1.0 when the answer opens with "Ahoy" (any case), else 0.0."""
    return float(text.lstrip().lower().startswith("ahoy"))


RULES: dict[str, Callable[[str], str]] = {"shout": shout, "meow": meow, "pirate": pirate}
SCORES: dict[str, Callable[[str], float]] = {
    "shout": upper_fraction,
    "meow": signoff_fraction,
    "pirate": greets_like_a_pirate,
}

# Questions no training prompt uses (other topics, other phrasings): the checks run on these.
HELD_OUT_PROMPTS: tuple[str, ...] = (
    "Why is the sky blue?",
    "What do owls eat?",
    "How do submarines work?",
    "Why do leaves change color in autumn?",
    "What is a good breakfast?",
    "Tell me about the Great Wall of China.",
    "How do I make a paper airplane?",
    "What are vitamins?",
    "Describe a thunderstorm.",
    "Give me a tip for staying focused.",
    "What makes a good teacher?",
    "How do bees make honey?",
)
