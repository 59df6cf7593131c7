"""Per-row grammar masks in a mixed batch: only the rows whose request has a grammar pay for one.

Each step, the sampler's rows that carry a ``GrammarState`` get their allowed-token bitmask filled by
their matcher (xgrammar, on the CPU, microseconds per row for the schemas measured) and applied to
their logits rows in place; every other row of the batch is left untouched, bit for bit, so a free
row's output does not depend on whether constrained rows share its batch. After sampling, each
constrained row's matcher accepts the token drawn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)


class GrammarState:
    """One request's grammar: its compile ``Future``, then its matcher (built on first use, once compiled).

    The matcher has accepted exactly the request's output tokens so far (``accept`` after every draw;
    a preempted request keeps its tokens and its matcher)."""

    def __init__(self, compiled: Future[xgr.CompiledGrammar], abandon: Callable[[], None] | None = None) -> None:
        self.compiled = compiled
        self._abandon = abandon
        self._matcher: xgr.GrammarMatcher | None = None

    def abandon(self) -> None:
        """The request went away before its grammar was used: its compile may be cancelled (once)."""
        if self._abandon is not None:
            self._abandon, abandon = None, self._abandon
            abandon()

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    @property
    def terminated(self) -> bool:
        """True once the grammar accepted a stop token: nothing more is constrained."""
        return self._matcher is not None and self._matcher.is_terminated()

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # cannot happen for a token drawn under its mask
            logger.warning("grammar matcher rejected token %d drawn under its own mask", token)


class ConstrainedRow(Protocol):
    grammar: GrammarState | None


def _constrained(rows: Sequence[ConstrainedRow]) -> list[int]:
    return [i for i, r in enumerate(rows) if r.grammar is not None and not r.grammar.terminated]


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[ConstrainedRow]) -> None:
    """Mask, in place, the tokens each constrained row's grammar does not allow next.

    Semantics: for each row i with a grammar G_i (not yet terminated): logits[i, t] = -inf for every t not
    in allowed(G_i) (what G_i accepts after the row's output tokens so far; the stop tokens only where the
    output may end); every other row is unchanged.
    Shapes: logits [S, vocab] float; ``rows`` has S entries.
    """
    constrained = _constrained(rows)
    if not constrained:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])  # [S, ceil(vocab / 32)] int32
    for i in constrained:
        rows[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=constrained)


def accept_tokens(rows: Sequence[ConstrainedRow], tokens: Sequence[int]) -> None:
    """Advance each constrained row's matcher by the token drawn for it (``tokens`` in row order)."""
    for i in _constrained(rows):
        rows[i].grammar.accept(tokens[i])
