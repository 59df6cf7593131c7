"""Continuous batching with adapter-aware admission.

Policy, once per step:
1. Running requests go first: a decode token each (oldest first), then the next chunk of each unfinished
   prefill (oldest first) from the budget the decodes leave, so a long prompt never costs a running
   request its token. While requests wait for a free seat, one chunk takes at most half the budget, so
   the other half admits them: a new request does not wait for an older prompt's last chunk.
   If the KV cache cannot grow, the newest running request is preempted (its blocks are
   returned; it keeps its adapter pin and is recomputed later from its prompt and its tokens so far).
2. Waiting requests are admitted in fair order (``engine/scheduler/fair_share.py``: the tenant with the least
   service first, by virtual token counters, priority within a tenant; with one tenant or
   ``scheduling_policy="fcfs"``: queue order, oldest first), while ``max_num_seqs``, the step's token
   budget (``max_num_batched_tokens``) and the KV cache allow, and only if their adapter can be
   pinned in a device slot (cold adapters are read from disk in that order, a few ahead: ``read_ahead``).
   One whose adapter cannot be placed yet stays queued while requests behind
   it whose adapters fit go ahead, so the batch stays full. No starvation: once the first request in
   that order has waited ``max_skip_steps`` steps, admission turns strict: it still goes in order and
   places adapters in free or unpinned slots, but after the first request that cannot be placed, only
   *ride-alongs* are admitted: requests without an adapter, or whose adapter is already pinned by
   running requests and whose ``max_tokens`` left is no more than theirs. A ride-along never delays
   the moment a slot drains, so the pinned slots empty and the blocked request is placed next, while
   the batch stays as full as that allows (all requests of the placed adapters join together).
   Every token a step computes, and every slot write an admission causes, is charged to the
   request's tenant (``fair_share``; also kept under FCFS, for the service-per-tenant metrics).
Prefill and decode share a step; a prompt longer than the remaining budget is prefilled in chunks
(chunked prefill: ``max_num_batched_tokens`` bounds a step's tokens, so a step's time, and so the gap
between two tokens of a running stream, stays bounded whatever prompt arrives).
Prefix caching (the block manager's index): an admitted request starts with the longest prefix of its
full blocks that is cached under its adapter version (never its last token, which must be computed to
sample, nor prompt tokens whose logprobs it asked for and lacks: their logits must be computed), and
computes only the rest. Every block a step fills is keyed as the step is scheduled, so a
request admitted later in the same step (a sibling with the same prompt) already shares it.
After the step, ``update`` owns every request's progress: the step's keys are committed, computed tokens
advance, sampled tokens are appended, and a request that hits a stop condition finishes (its blocks and
pin are returned; keyed blocks stay cached). ``undo`` reverts a step whose forward pass failed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loraplex.adapters.manager import AdapterManager
from loraplex.config import EngineConfig
from loraplex.engine.request import Plan, Request, RequestStatus
from loraplex.engine.scheduler.block_hash import extend_chain
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.engine.scheduler.fair_share import FairShare
from loraplex.engine.speculative.speculator import Speculator
from loraplex.ops.lora_batch import BatchMapping


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int  # tokens computed this step (of the request's own; a draft's come after them)
    draft: tuple[int, ...] = ()  # draft tokens verified after its next token (speculative decoding)

    @property
    def prompt_complete(self) -> bool:
        """Whether this step's last token yields the request's next token (prefill complete)."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def draws(self) -> bool:
        """Whether a token is drawn for it this step (prefill complete and ``max_tokens > 0``; a request
        with ``max_tokens == 0`` only computes its prompt, e.g. to score it)."""
        return self.prompt_complete and self.request.params.max_tokens > 0


def step_mapping(batch: Sequence[ScheduledRequest]) -> BatchMapping:
    """What each token of the step asks for, in batch order (a row's draft tokens included): its request's version
    or LoRA plan, except an aLoRA request's positions before its invocation point (``Request.alora_start``), which
    read the base weights."""
    seqs: list[tuple[int | None, int]] = []
    plans: list[Plan | None] = []
    for s in batch:
        request, num_tokens = s.request, s.num_tokens + len(s.draft)  # a draft runs under the row's adapter
        before = 0 if request.alora_start is None else max(0, min(request.alora_start - s.start, num_tokens))
        if before:
            seqs.append((None, before))
            plans.append(None)
        seqs.append((request.version_id, num_tokens - before))
        plans.append(request.plan)
    return BatchMapping.from_sequences(seqs, plans)


class Scheduler:
    """``adapters`` needs only ``try_acquire(id) -> slot | None``, ``resident(id)``, ``release(id)``,
    ``read_ahead(ids)`` (after each admission pass: the adapters still waiting, in admission order) and
    ``release_hold(id)`` (for a request made with ``holds_version``, when it finishes); a
    request stops at any of ``eos_token_ids`` (unless it ignores EOS) and at ``max_model_len`` tokens."""

    def __init__(self, config: EngineConfig, allocator: BlockManager, adapters: AdapterManager,
                 eos_token_ids: Sequence[int] = (), max_model_len: int | None = None) -> None:
        if allocator.block_size != config.block_size:
            raise ValueError(f"block manager block_size {allocator.block_size} != config {config.block_size}")
        self.config = config
        self.allocator = allocator
        self.adapters = adapters
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.fair_share = FairShare()
        spec = config.speculative_config
        self.speculator = Speculator(spec) if spec is not None else None
        adapters.read_ahead(())  # a scheduler drives reads from now on: none until a queue wants one

    def add(self, request: Request) -> None:
        request.arrival_step = self.step_count
        request.arrival_time = time.time()
        self.fair_share.arrive(request)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        self.step_count += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preemptions_before = self.num_preemptions
        chunk_cap = self._chunk_cap()
        # vLLM's disable_by_batch_size counts the requests enqueued: waiting ones too (a wave being admitted)
        drafting = self.speculator is not None and self.speculator.active(len(self.running) + len(self.waiting))
        for request in self._running_order():
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget, chunk_cap)
            if n <= 0:
                continue
            draft = self._draft(request, n, budget) if drafting else ()
            if not self._grow(request, n + len(draft), scheduled):
                continue
            self._key_filled_blocks(request, request.num_computed_tokens, n)  # a draft's blocks wait for update
            self.fair_share.charge_tokens(request, request.num_computed_tokens, n + len(draft))
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, n, draft))
            budget -= n + len(draft)
        if self.num_preemptions == preemptions_before:  # admitting now would only thrash the cache
            scheduled += self._admit(budget)
        return scheduled

    def _running_order(self) -> list[Request]:
        """The running requests, decoding ones first (one token each), then those still prefilling, each in
        admission order: a prompt's chunks take only the budget the decodes leave, whenever it was admitted."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        return decoding + [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]

    def _chunk_cap(self) -> int:
        """The most tokens one running request computes this step: half the budget while requests wait for a
        free seat (so one is admitted every step, not after an older prompt's last chunk), else the budget."""
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return max(1, self.config.max_num_batched_tokens // 2)
        return self.config.max_num_batched_tokens

    def _admit(self, budget: int) -> list[ScheduledRequest]:
        admitted: list[ScheduledRequest] = []
        order = self._waiting_order()
        strict = None
        blocked = False  # strict mode met a request whose adapter cannot be placed: only ride-alongs now
        for request in order:
            if strict is None:  # the first request in order decides
                strict = self.step_count - request.arrival_step > self.config.max_skip_steps
            if len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break
            eligible = self._chain(request)[: self._reusable_tokens(request) // self.config.block_size]
            prefix = self.allocator.match(eligible, request.kv_owner, request.num_tokens)
            start = prefix.hit_tokens
            n = min(request.num_tokens - start, budget)
            blocks = self._blocks_for(start + n) - len(prefix.blocks)
            if not self.allocator.can_allocate(blocks, prefix):
                break  # the cache is full for everyone behind it too
            if blocked and not self._rides_along(request):
                continue
            if request.members and not request.pinned:
                if not self._acquire_members(request):
                    blocked = blocked or strict
                    continue
            request.block_table = self.allocator.allocate(blocks, request.kv_owner, prefix,
                                                          base_blocks=request.base_blocks(self.config.block_size))
            request.num_computed_tokens = start
            self._key_filled_blocks(request, start, n)
            self.fair_share.charge_tokens(request, start, n)
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:  # its first admission (a preempted one comes back)
                request.scheduled_time, request.prefix_cached_tokens = time.time(), start
            self.waiting.remove(request)
            self.running.append(request)
            admitted.append(ScheduledRequest(request, start, n))
            budget -= n
        # the next pass's order (iterating it charges nothing): its cold adapters are read in the background now
        wanted = (v for r in self._waiting_order() if not r.pinned for v in r.members)
        self.adapters.read_ahead(wanted)
        return admitted

    def _acquire_members(self, request: Request) -> bool:
        """Pin every adapter version ``request`` reads (each takes a slot), or none: a mix whose members do not all
        fit in a slot now gives back the ones it took and waits (it never runs with a member missing)."""
        taken: list[int] = []
        for version_id in request.members:
            # One locked ask-and-do per member: a concurrent load cannot slip between the two.
            resident = self.adapters.resident(version_id)
            if self.adapters.try_acquire(version_id) is None:
                for held in taken:
                    self.adapters.release(held)
                return False
            taken.append(version_id)
            if not resident:
                self.fair_share.charge_swap(request)
        request.pinned = True
        return True

    def _waiting_order(self) -> Iterable[Request]:
        """The waiting requests in admission order: fair share's (lazy: charges made while iterating count),
        or a copy of the queue under ``scheduling_policy="fcfs"``; either way admission may remove from
        ``waiting`` while iterating."""
        return self.fair_share.order(self.waiting) if self.config.scheduling_policy == "fair" else list(self.waiting)

    @staticmethod
    def _reusable_tokens(request: Request) -> int:
        """How many leading tokens of ``request`` may come from the prefix cache: all but the last (it is
        computed to sample), and with prompt logprobs only the positions already scored (a recomputed
        request keeps the logprobs it has; the others need their logits); none for mean or cls pooling."""
        reusable = request.num_tokens - 1
        if request.params.pooling is not None and request.params.pooling.needs_every_row:
            return 0  # mean / cls pooling read every prompt row's (or the first one's) final hidden state
        if request.prompt_logprobs is not None:
            reusable = min(reusable, len(request.prompt_logprobs) - 1)
        return reusable

    def _rides_along(self, request: Request) -> bool:
        """Whether ``request`` may go ahead of a starving one without delaying it: it needs no adapter, or
        each of its adapters is pinned by running requests and it will not outlast them (no slot frees later)."""
        left = request.params.max_tokens - len(request.output_token_ids)
        for version_id in request.members:
            horizon = max((r.params.max_tokens - len(r.output_token_ids) for r in self.running
                           if version_id in r.members), default=None)
            if horizon is None or left > horizon:
                return False
        return True

    def _chain(self, request: Request) -> list[bytes]:
        """The keys of the request's full blocks (its prompt and outputs), computed once each; empty when
        prefix caching is off."""
        if self.allocator.caching and len(request.block_keys) < request.num_tokens // self.config.block_size:
            extend_chain(request.block_keys, request.all_token_ids, request.kv_owner, self.config.block_size,
                         request.base_blocks(self.config.block_size))
        return request.block_keys

    def _key_filled_blocks(self, request: Request, start: int, n: int) -> None:
        """Key the blocks that computing tokens ``[start, start + n)`` this step fills."""
        first, end = start // self.config.block_size, (start + n) // self.config.block_size
        if self.allocator.caching and end > first:
            self.allocator.cache(request.block_table[first:end], self._chain(request)[first:end])

    def _draft(self, request: Request, n: int, budget: int) -> tuple[int, ...]:
        """The draft ``request`` verifies this step (speculative decoding): only a decoding request drafts, no
        more than its ``max_tokens`` and the context leave room for beyond its next token, within the step's
        budget, and only into KV blocks free now (a draft never preempts a request)."""
        if n != 1 or request.num_tokens - request.num_computed_tokens != 1 or not request.output_token_ids:
            return ()
        limit = min(budget - 1, request.params.max_tokens - len(request.output_token_ids) - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - request.num_tokens - 1)
        draft = self.speculator.draft(request, limit)
        need = self._blocks_for(request.num_tokens + len(draft)) - len(request.block_table)
        return draft if not draft or self.allocator.can_allocate(need) else ()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _grow(self, request: Request, n: int, scheduled: list[ScheduledRequest]) -> bool:
        """Make room in the cache for ``n`` more tokens of ``request``, preempting the newest running
        requests not yet scheduled this step; False if ``request`` itself had to be preempted."""
        need = self._blocks_for(request.num_computed_tokens + n) - len(request.block_table)
        taken = {s.request for s in scheduled}
        while not self.allocator.can_allocate(need):
            victims = [r for r in reversed(self.running) if r is not request and r not in taken]
            if not victims:
                self.preempt(request)
                return False
            self.preempt(victims[0])
        if need > 0:
            request.block_table += self.allocator.allocate(need, request.kv_owner, first=len(request.block_table),
                                                           base_blocks=request.base_blocks(self.config.block_size))
        return True

    def update(self, scheduled: Sequence[ScheduledRequest], tokens: Sequence[int | Sequence[int]]) -> list[Request]:
        """Post-step bookkeeping. Every scheduled request's computed tokens advance; each one that drew
        (``draws``; ``tokens`` holds, in batch order, its new token, or for a request that verified a draft its
        accepted run: the draft tokens kept, then one more) appends them, one by one, and finishes at the
        first that hits a stop condition, as plain decoding would; one whose prompt is complete with
        ``max_tokens == 0`` finishes ("length"). Returns the requests whose prompt is complete
        (``prompt_complete``), in batch order."""
        if len(tokens) != sum(s.draws for s in scheduled):
            raise ValueError(f"{len(tokens)} tokens for {sum(s.draws for s in scheduled)} requests that draw one")
        complete = [(s, s.draws) for s in scheduled if s.prompt_complete]  # before tokens are appended
        for s in scheduled:
            s.request.num_computed_tokens += s.num_tokens
        drawn = iter(tokens)
        for s, draws in complete:
            request = s.request
            if not draws:
                self.finish(request, "length")
                continue
            run = next(drawn)
            if request.first_token_time is None:
                request.first_token_time = time.time()
            reason, kept = None, 0
            for token in [run] if isinstance(run, int) else run:
                request.output_token_ids.append(token)
                kept += 1
                if (reason := self._stop_reason(request, token)) is not None:
                    break
            if s.draft:
                self._settle_draft(s, kept - 1)
            if reason is not None:
                self.finish(request, reason)
        self.allocator.commit()  # the step's K/V are written: its blocks' keys hold from now on
        return [s.request for s, _ in complete]

    def _settle_draft(self, s: ScheduledRequest, accepted: int) -> None:
        """``s`` verified a draft and kept its first ``accepted`` tokens: their K/V (computed from inputs equal
        to the tokens now appended) count as computed and the blocks they fill are keyed; the blocks past the
        computed tokens, which hold only rejected drafts' K/V, are freed (never keyed: nothing can match them)."""
        request = s.request
        request.num_computed_tokens += accepted
        self._key_filled_blocks(request, s.start, s.num_tokens + accepted)
        keep = self._blocks_for(request.num_computed_tokens)
        if len(request.block_table) > keep:
            self.allocator.free(request.block_table[keep:])
            del request.block_table[keep:]
        self.speculator.record(request, len(s.draft), accepted)

    def undo(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """The step of ``scheduled`` failed before ``update``: its K/V may be partly written, so the cache
        keys it entered are forgotten and its requests are recomputed (preempted)."""
        self.allocator.rollback()
        for s in scheduled:
            if s.request.status is RequestStatus.RUNNING:
                self.preempt(s.request)

    def forget_step_keys(self, request: Request) -> None:
        """The running step computed unusable values for ``request`` (it is about to fail alone): the keys this
        step entered for its blocks are forgotten, so no request matches their K/V (``BlockManager.forget``)."""
        self.allocator.forget(request.block_table)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        """"stop" for a stop token id or EOS, "length" at ``max_tokens`` or the context length; None to go on.
        Stop *strings* are matched on text, by the frontend (``client/output.py``), which then aborts it."""
        params = request.params
        if token in params.stop_token_ids or (
                not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens or (
                self.max_model_len is not None and request.num_tokens >= self.max_model_len):
            return "length"
        return None

    def preempt(self, request: Request) -> None:
        """Return ``request``'s KV blocks (keyed ones stay cached, so it may find them again); it goes back to
        the front of the queue to be recomputed. It keeps its adapter pin, so the version it started with
        stays in its slot (even if unloaded meanwhile)."""
        self.allocator.free(request.block_table)
        request.block_table = []
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish(self, request: Request, reason: str) -> None:
        """Remove ``request`` from whichever queue holds it and return its blocks, its pin and its version."""
        if request.status is not RequestStatus.FINISHED:
            self.fair_share.leave(request)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        if request.block_table:
            self.allocator.free(request.block_table)
            request.block_table = []
        if request.pinned:
            for version_id in request.members:
                self.adapters.release(version_id)
            request.pinned = False
        if request.holds_version:
            for version_id in request.members:
                self.adapters.release_hold(version_id)
            request.holds_version = False
