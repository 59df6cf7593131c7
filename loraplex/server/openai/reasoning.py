"""Reasoning parsers (``--reasoning-parser``, vLLM's names): a chat completion's text -> (reasoning, content).

- ``deepseek_r1``: the model starts thinking at once (its template opens ``<think>`` in the prompt): the text
  up to ``</think>`` is reasoning (a leading ``<think>`` dropped), the rest content; without ``</think>``
  all of it is reasoning (still thinking, or cut by ``max_tokens``).
- ``qwen3``: the same, except that a text with neither ``<think>`` nor ``</think>`` is all content (Qwen3
  with ``enable_thinking: false`` writes an empty think block, or none).

``reasoning_content`` goes into the message (and the stream's deltas), kept out of ``content``; tool calls
are read from the content only. A streamed choice holds back a piece that may still become a marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.server.openai.tool_parsers.calls import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """``thinks_first``: text before any marker is reasoning (DeepSeek-R1) rather than content (Qwen3)."""

    thinks_first: bool

    def split(self, text: str, finished: bool = True) -> tuple[str, str]:
        """(reasoning, content) of ``text`` as far as it is generated: both only ever grow with the text."""
        if not finished and THINK_START.startswith(text.lstrip()):  # may still open a think block
            return "", ""
        opened = text.lstrip().startswith(THINK_START)
        body = text.lstrip()[len(THINK_START):] if opened else text
        if THINK_END in body:
            reasoning, content = body.split(THINK_END, 1)
            return reasoning, content
        if opened or self.thinks_first:
            return (body if finished else held_back(body, (THINK_END,))), ""
        return "", (text if finished else held_back(text, (THINK_END,)))


REASONING_PARSERS: dict[str, ReasoningParser] = {"deepseek_r1": ReasoningParser(thinks_first=True),
                                                 "qwen3": ReasoningParser(thinks_first=False)}


class ReasoningStream:
    """One streamed choice's reasoning: ``delta(text, finished)`` gives the new reasoning and the content
    so far (what the tool-call parser, or the plain content stream, reads)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent = 0

    def delta(self, text: str, finished: bool) -> tuple[str, str]:
        reasoning, content = self.parser.split(text, finished)
        new = reasoning[self.sent:]
        self.sent = max(self.sent, len(reasoning))
        return new, content
