"""Which requests draft this step, how many tokens, and what their drafts earned (the counters).

A request drafts only where speculation cannot change what it generates, only how fast: its params opt in
(``SamplingParams.speculative_decoding``, the default) and use no logits processor, grammar or logprobs, and a
sampled one is unseeded (a seeded request's tokens must not depend on whether speculation ran; the rejection
rule draws its own uniforms). Those rows decode one token per step as without speculation.

Adaptive switch-off, where a draft does not pay for its extra positions:
- by batch: no drafts in a step with more requests running or waiting than ``disable_by_batch_size`` (a CPU
  step with many rows is compute-bound: k more positions per row cost about k more tokens of compute; the
  waiting count keeps the first requests of a wave being admitted from drafting);
- by request: a request whose draft had nothing accepted, or (in a step with other requests, where each draft
  position costs about a token of compute) whose acceptance rate falls below ``MIN_BATCHED_ACCEPTANCE``, waits
  before it drafts again, twice as long each time in a row (1, 2, 4 .. ``MAX_BACKOFF`` steps); a draft that
  pays resets the wait. Its acceptance rate is a moving average (weight ``RATE_WEIGHT`` for the newest draft)
  of accepted / drafted tokens, starting at 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.config import SpeculativeConfig
from loraplex.engine.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from loraplex.engine.request import Request

MAX_BACKOFF = 16  # steps a request at most skips drafting after drafts that did not pay
MIN_BATCHED_ACCEPTANCE = 0.5  # measured: 0.34 at batch 4 of free chat lost 22 %, 0.75 of extraction won 63 %
RATE_WEIGHT = 0.5


@dataclass
class DraftState:
    """One request's drafting state: its n-gram index and its back-off."""

    index: NgramIndex = field(default_factory=NgramIndex)
    backoff: int = 1  # steps to skip after the next draft that does not pay
    skip: int = 0  # steps left before it drafts again
    rate: float = 1.0  # moving average of accepted / drafted tokens


@dataclass
class DraftCounts:
    """Draft tokens proposed and accepted (vLLM's ``spec_decode_num_draft_tokens`` / ``..._accepted_tokens``),
    and the verification steps that carried drafts."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def can_speculate(request: Request) -> bool:
    """Whether drafting leaves ``request``'s output exactly as plain decoding makes it (see the module doc)."""
    p = request.params
    return (p.speculative_decoding and not p.has_penalties and request.grammar is None and p.logprobs is None
            and (p.greedy or p.seed is None))


class Speculator:
    """Drafts for the scheduler (``draft``) and counts what verification accepted (``record``), per adapter
    version (``counts``; a retired version's counters are dropped with it: ``retire``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.totals = DraftCounts()
        self._by_version: dict[int | None, DraftCounts] = {}
        self._num_running = 1  # of the step being scheduled

    def active(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests drafts at all."""
        self._num_running = num_running
        return num_running <= self.config.disable_by_batch_size

    def draft(self, request: Request, limit: int) -> tuple[int, ...]:
        """Up to ``min(num_speculative_tokens, limit)`` draft tokens to verify after ``request``'s next token
        this step (``limit``: what its ``max_tokens``, the context and the step's budget leave); () when it
        does not draft this step."""
        if limit <= 0 or not can_speculate(request):
            return ()
        state = request.draft_state
        if state is None:
            state = request.draft_state = DraftState()
        if state.skip > 0:
            state.skip -= 1
            return ()
        state.index.sync(request.all_token_ids)
        c = self.config
        return tuple(state.index.propose(min(c.num_speculative_tokens, limit), c.prompt_lookup_min,
                                         c.prompt_lookup_max))

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        """``request``'s ``drafted`` draft tokens were verified and its first ``accepted`` kept."""
        for counts in (self.totals, self._by_version.setdefault(request.version_id, DraftCounts())):
            counts.drafts += 1
            counts.draft_tokens += drafted
            counts.accepted_tokens += accepted
        state = request.draft_state
        if state is None or not drafted:
            return
        state.rate += RATE_WEIGHT * (accepted / drafted - state.rate)
        if accepted and (self._num_running == 1 or state.rate >= MIN_BATCHED_ACCEPTANCE):
            state.backoff = 1
        else:
            state.skip, state.backoff = state.backoff, min(2 * state.backoff, MAX_BACKOFF)

    def counts(self) -> dict[int | None, DraftCounts]:
        """Counters per adapter version (None: the base model) not retired; a copy."""
        return {v: DraftCounts(c.drafts, c.draft_tokens, c.accepted_tokens) for v, c in self._by_version.copy().items()}

    def retire(self, version_id: int) -> None:
        self._by_version.pop(version_id, None)
