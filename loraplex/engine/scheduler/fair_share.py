"""Fair share per tenant: the virtual token counter (VTC, Sheng et al., OSDI '24) behind admission order.

Each tenant ``t`` has a counter ``c_t`` of the service it has received, in weighted tokens:
``w_p`` per prompt token computed, ``w_d`` per generated token computed, and ``s`` per adapter-slot
write its admission causes (the swap is charged to the tenant that causes it). A token is charged
once: a preempted request's recomputation charges nothing new (``Request.charged_tokens`` is the
high-water mark). The scheduler offers waiting requests in ``order``: repeatedly the next request of
the tenant with the smallest counter (ties: whose next request comes first in the waiting queue),
within a tenant by ``priority`` (vLLM's field: lower first), then queue order. Counters are read
live, so a request admitted in a step moves its tenant back for the rest of that step. A tenant that
becomes active (its first request in the scheduler while it had none) is lifted to the smallest
counter among active tenants, so idle time is not banked as credit. One tenant (or none: every
request without a tenant is one tenant) gets exactly the queue order: the whole machine, as FCFS.

Bound (service gap). Let ``N = max_num_seqs`` and ``R = w_p·L + w_d·M + s`` the most one request can
be charged (``L`` prompt and ``M`` generated tokens, ``L + M <= max_model_len``). Let tenants ``f``
and ``g`` both be backlogged (each has a waiting request) at every admission in ``[T1, T2]``, and every
waiting request of ``g`` placeable (its adapter resident or a slot free: adapter-aware placement may
pass over a request that cannot be placed, fairness or not). Then for every ``t`` in ``[T1, T2]``:
``c_f(t) - c_g(t) <= max(c_f(T1) - c_g(T1), 0) + N·R``, and symmetrically, so the service received
in ``[T1, T2]`` differs by at most ``|D(T1)| + max(D(T1), 0) + N·R`` where ``D = c_f - c_g``; from a
common start (``D(T1) = 0``) by at most ``N·R``.
Proof. Counters of backlogged tenants only grow, by charges (no lift: they stay active). If ``f`` is
admitted at some ``τ`` in ``[T1, t]``, take the last such ``τ``: the order offered ``f`` before ``g``'s
placeable head, so ``c_f(τ) <= c_g(τ)`` just before it. After ``τ`` ``f`` is charged only by its requests
in the engine at ``τ`` (no later admission), at most ``N`` of them, each at most ``R`` in its lifetime:
``c_f(t) <= c_g(τ) + N·R <= c_g(t) + N·R``. If ``f`` is never admitted in ``[T1, t]``, likewise
``c_f(t) <= c_f(T1) + N·R`` and ``c_g(t) >= c_g(T1)``. The starvation bound composes: strict mode offers
the same order and only withholds requests behind one that cannot be placed (outside the premise).
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from loraplex.engine.request import Request


@dataclass(frozen=True)
class FairShareWeights:
    prefill: float = 1.0  # per prompt token computed
    decode: float = 2.0  # per generated token computed (VTC's w_q = 2 w_p)
    swap: float = 32.0  # per adapter-slot write caused


class FairShare:
    def __init__(self, weights: FairShareWeights = FairShareWeights()) -> None:
        self.weights = weights
        self.counters: dict[str | None, float] = {}
        self._active: Counter[str | None] = Counter()  # requests in the scheduler per tenant

    def arrive(self, request: Request) -> None:
        """``request`` entered the scheduler; lift its tenant if it was inactive."""
        tenant = request.tenant
        if self._active[tenant] == 0:
            active = [self.counters.get(t, 0.0) for t, n in self._active.items() if n > 0]
            floor = min(active) if active else 0.0
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self._active[tenant] += 1

    def leave(self, request: Request) -> None:
        """``request`` finished (or was aborted)."""
        self._active[request.tenant] -= 1
        if self._active[request.tenant] <= 0:
            del self._active[request.tenant]

    def charge_tokens(self, request: Request, start: int, num_tokens: int) -> None:
        """Charge computing positions ``[start, start + num_tokens)`` of ``request`` (each position once)."""
        first, end = max(start, request.charged_tokens), start + num_tokens
        if end <= first:
            return
        prompt = len(request.prompt_token_ids)
        prefill = max(0, min(end, prompt) - first)
        decode = end - first - prefill
        request.charged_tokens = end
        self._add(request.tenant, self.weights.prefill * prefill + self.weights.decode * decode)

    def charge_swap(self, request: Request) -> None:
        """``request``'s admission wrote its adapter into a device slot."""
        self._add(request.tenant, self.weights.swap)

    def _add(self, tenant: str | None, amount: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + amount

    def order(self, waiting: Iterable[Request]) -> Iterator[Request]:
        """The waiting requests in fair order, re-ranking each tenant by its counter when its next request
        is due (charges made while iterating count)."""
        queues: dict[str | None, list[tuple[int, int, Request]]] = defaultdict(list)
        for position, request in enumerate(waiting):
            queues[request.tenant].append((request.priority, position, request))
        heap = []
        for tenant, queue in queues.items():
            queue.sort(key=lambda item: item[:2], reverse=True)  # pop() takes the first
            heap.append((self.counters.get(tenant, 0.0), queue[-1][1], tenant is None, tenant or ""))
        heapq.heapify(heap)
        while heap:
            _, _, anonymous, name = heapq.heappop(heap)
            tenant = None if anonymous else name
            queue = queues[tenant]
            yield queue.pop()[2]
            if queue:
                heapq.heappush(heap, (self.counters.get(tenant, 0.0), queue[-1][1], anonymous, name))
