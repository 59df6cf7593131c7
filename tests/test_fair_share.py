"""Fair share per tenant (engine/scheduler/fair_share.py), driven step by step without a model. Service is measured
here from the scheduled batches (weighted tokens each step computes), independently of the counters."""

from __future__ import annotations

import dataclasses
import random

from loraplex.engine.request import Request, SamplingParams
from loraplex.engine.scheduler.fair_share import FairShareWeights
from loraplex.engine.scheduler.scheduler import Scheduler
from tests.test_scheduler import make

W = FairShareWeights()


def request(i: int, tenant: str | None, adapter: int | None = None, prompt: int = 8, max_tokens: int = 8,
            priority: int = 0) -> Request:
    return Request(f"{tenant}-{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   None if adapter is None else f"a{adapter}", adapter, None, tenant=tenant, priority=priority)


def run_step(scheduler: Scheduler, service: dict[str | None, float]) -> list[Request]:
    """One simulated step; adds each scheduled request's weighted tokens to its tenant's ``service``."""
    batch = scheduler.schedule()
    for s in batch:
        prompt = len(s.request.prompt_token_ids)
        prefill = max(0, min(s.start + s.num_tokens, prompt) - s.start)
        service[s.request.tenant] = (service.get(s.request.tenant, 0.0) + W.prefill * prefill
                                     + W.decode * (s.num_tokens - prefill))
    scheduler.update(batch, [7] * sum(s.draws for s in batch))
    return [s.request for s in batch]


def max_gap(policy: str, heavy: int = 200, light: int = 20, seqs: int = 4) -> tuple[float, float]:
    """Tenants "heavy" and "light" arrive together, interleaved 10:1, prompts of 4-16 tokens asking 1-12;
    returns (the largest service gap while both have waiting requests, the bound N·R of the fair_share
    docstring)."""
    scheduler, _ = make(max_loras=2, max_num_seqs=seqs)
    scheduler.config = dataclasses.replace(scheduler.config, scheduling_policy=policy)
    rng = random.Random(19)
    for i in range(light):
        for j in range(heavy // light):
            scheduler.add(request(i * 10 + j, "heavy", prompt=rng.randint(4, 16), max_tokens=rng.randint(1, 12)))
        scheduler.add(request(i, "light", prompt=rng.randint(4, 16), max_tokens=rng.randint(1, 12)))
    service: dict[str | None, float] = {}
    gap = 0.0
    while any(r.tenant == "light" for r in scheduler.waiting):
        run_step(scheduler, service)
        gap = max(gap, abs(service.get("heavy", 0.0) - service.get("light", 0.0)))
    bound = seqs * (W.prefill * 16 + W.decode * 12)  # R: the longest prompt and output; no adapters, no swap
    return gap, bound


def test_service_gap_of_two_backlogged_tenants_stays_under_the_bound() -> None:
    gap, bound = max_gap("fair")
    assert gap <= bound, (gap, bound)
    fcfs_gap, _ = max_gap("fcfs")
    assert fcfs_gap > 4 * bound, fcfs_gap  # FCFS serves the heavy tenant 10:1: the bound is not vacuous


def test_a_lone_tenant_gets_the_whole_machine_in_queue_order() -> None:
    """One tenant under fair share is scheduled exactly as FCFS, with a full batch while backlogged."""
    schedules = {}
    for policy in ("fair", "fcfs"):
        scheduler, _ = make(max_loras=2, max_num_seqs=4)
        scheduler.config = dataclasses.replace(scheduler.config, scheduling_policy=policy)
        for i in range(24):
            scheduler.add(request(i, "only", adapter=i % 3, max_tokens=3 + i % 5))
        steps = []
        while scheduler.has_work():
            steps.append([r.request_id for r in run_step(scheduler, {})])
        schedules[policy] = steps
    assert schedules["fair"] == schedules["fcfs"]
    assert all(len(s) == 4 for s in schedules["fair"][:5])


def test_priority_orders_within_a_tenant_not_across() -> None:
    scheduler, _ = make(max_loras=2, max_num_seqs=2)
    scheduler.add(request(0, "a", priority=5))
    scheduler.add(request(1, "a", priority=-1))
    scheduler.add(request(2, "b", priority=9))
    assert [r.request_id for r in run_step(scheduler, {})] == ["a-1", "b-2"]  # b is not behind a's priority


def test_returning_tenant_is_lifted_to_the_least_active_counter() -> None:
    scheduler, _ = make(max_loras=2, max_num_seqs=8)
    for i in range(4):
        scheduler.add(request(i, "busy"))
    for _ in range(6):
        run_step(scheduler, {})
    busy = scheduler.fair_share.counters["busy"]
    assert busy > 0
    scheduler.add(request(9, "late"))
    assert scheduler.fair_share.counters["late"] == busy  # no banked credit for its idle time


def test_adapter_slot_swap_is_charged_to_the_tenant_causing_it() -> None:
    scheduler, _ = make(max_loras=2, max_num_seqs=8)
    scheduler.add(request(0, "a", adapter=1, prompt=8, max_tokens=1))
    scheduler.add(request(1, "b", adapter=1, prompt=8, max_tokens=1))  # the slot is resident for b
    run_step(scheduler, {})
    counters = scheduler.fair_share.counters
    assert counters["a"] == 8 * W.prefill + W.swap
    assert counters["b"] == 8 * W.prefill


def test_recomputation_after_preemption_is_not_charged_again() -> None:
    scheduler, _ = make(max_loras=2, max_num_seqs=8)
    r = request(0, "a", prompt=8, max_tokens=8)
    scheduler.add(r)
    run_step(scheduler, {})
    run_step(scheduler, {})
    charged = scheduler.fair_share.counters["a"]
    scheduler.preempt(r)
    run_step(scheduler, {})  # recomputes the prompt and the first output token
    assert scheduler.fair_share.counters["a"] == charged + W.decode  # only the new position
