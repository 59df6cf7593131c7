"""Scheduler admission policy, driven step by step without a model: ``schedule()``, then the
scheduler's own post-step ``update`` with a stand-in token for every request that samples."""

from __future__ import annotations

import random
from collections.abc import Iterable

from loraplex.adapters.slots import SlotTable
from loraplex.config import EngineConfig
from loraplex.engine.request import Request, SamplingParams
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.engine.scheduler.scheduler import Scheduler


class Slots:
    """The calls the scheduler makes on ``AdapterManager``, over a real ``SlotTable``; ``read_ahead``
    records the order it was given (every weight is in host memory here, nothing to read)."""

    def __init__(self, max_loras: int) -> None:
        self.table = SlotTable(max_loras)
        self.wanted: list[list[int]] = []

    def read_ahead(self, wanted: Iterable[int]) -> None:
        self.wanted.append(list(wanted))

    def try_acquire(self, version_id: int) -> int | None:
        return self.table.acquire(version_id).slot if self.table.can_acquire(version_id) else None

    def release(self, version_id: int) -> None:
        self.table.release(version_id)

    def resident(self, version_id: int) -> bool:
        return version_id in self.table.slot_of


def make(max_loras: int, max_num_seqs: int, max_skip_steps: int = 64, blocks: int = 4096) -> tuple[Scheduler, Slots]:
    config = EngineConfig(max_loras=max_loras, max_cpu_loras=max(max_loras, 64), max_num_seqs=max_num_seqs,
                          max_skip_steps=max_skip_steps)
    slots = Slots(max_loras)
    return Scheduler(config, BlockManager(blocks), slots), slots


def request(i: int, adapter: int | None, max_tokens: int = 8, prompt: int = 5) -> Request:
    return Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   None if adapter is None else f"a{adapter}", adapter, None)


def step(scheduler: Scheduler) -> list[Request]:
    """One simulated engine step; returns the requests scheduled in it."""
    batch = scheduler.schedule()
    scheduler.update(batch, [7] * sum(s.draws for s in batch))
    return [s.request for s in batch]


def test_younger_requests_with_placeable_adapters_skip_ahead() -> None:
    scheduler, _ = make(max_loras=1, max_num_seqs=8)
    reqs = [request(0, 1), request(1, 2), request(2, 1), request(3, None)]
    for r in reqs:
        scheduler.add(r)
    assert step(scheduler) == [reqs[0], reqs[2], reqs[3]]  # adapter 2 waits for the only slot
    assert list(scheduler.waiting) == [reqs[1]]


def test_read_ahead_gets_the_waiting_adapters_in_admission_order() -> None:
    """After each admission pass the manager learns which adapters the queue wants next, in order: base
    requests and requests still holding their pin (preempted) need no read."""
    scheduler, slots = make(max_loras=1, max_num_seqs=8)
    reqs = [request(0, 5), request(1, None), request(2, 3), request(3, 5), request(4, 9), request(5, 3)]
    for r in reqs:
        scheduler.add(r)
    assert step(scheduler) == [reqs[0], reqs[1], reqs[3]]
    assert slots.wanted == [[], [3, 9, 3]]  # declared empty at construction, then after the pass
    scheduler.preempt(reqs[0])  # keeps its pin: not wanted from disk
    scheduler.add(request(6, 4))
    step(scheduler)
    assert slots.wanted[-1] == [3, 9, 3, 4]


def test_starving_request_is_placed_despite_a_steady_stream() -> None:
    """A new request for the resident adapter arrives every step; the other adapter's request must still
    get the slot soon after it has waited ``max_skip_steps``."""
    scheduler, slots = make(max_loras=1, max_num_seqs=64, max_skip_steps=5)
    scheduler.add(request(0, 1))
    starving = request(1, 2)
    scheduler.add(starving)
    for i in range(2, 200):
        scheduler.add(request(i, 1))
        step(scheduler)
        if starving.pinned:
            break
    assert starving.pinned and slots.table.slot_of[2] == 0
    assert scheduler.step_count <= 5 + 8 + 2  # strict after 5 steps; the 8-token requests drain


def test_strict_mode_admits_only_ride_alongs() -> None:
    scheduler, _ = make(max_loras=1, max_num_seqs=64, max_skip_steps=0)
    first = request(0, 1, max_tokens=8)
    scheduler.add(first)
    step(scheduler)
    blocked = request(1, 2)
    same_short, same_long, base = request(2, 1, max_tokens=4), request(3, 1, max_tokens=50), request(4, None)
    for r in (blocked, same_short, same_long, base):
        scheduler.add(r)
    step(scheduler)  # the oldest waiting request (blocked) has waited > 0 steps: strict
    assert {r.request_id for r in scheduler.running} == {"r0", "r2", "r4"}
    assert list(scheduler.waiting) == [blocked, same_long]


def test_batch_stays_full_when_adapters_outnumber_slots() -> None:
    """128 requests over 32 adapters (4 each, shuffled), 8 slots, 32 sequences, 64 tokens each: strict
    mode starts after the first round, and ride-alongs keep the batch nearly full all the same."""
    scheduler, _ = make(max_loras=8, max_num_seqs=32, max_skip_steps=64)
    adapters = [i % 32 for i in range(128)]
    random.Random(0).shuffle(adapters)
    reqs = [request(i, a, max_tokens=64, prompt=30) for i, a in enumerate(adapters)]
    for r in reqs:
        scheduler.add(r)
    sizes = []
    while scheduler.has_work():
        sizes.append(len(step(scheduler)))
    assert all(r.finished for r in reqs)
    assert sum(sizes) / len(sizes) >= 0.9 * 32
    assert len(sizes) <= 4 * 64 + 8  # four full rounds


def test_no_request_waits_forever_under_random_load() -> None:
    """Random adapters, lengths and arrivals over 2 slots: everything finishes, pins all return."""
    rng = random.Random(1)
    scheduler, slots = make(max_loras=2, max_num_seqs=6, max_skip_steps=10, blocks=64)
    reqs = []
    for i in range(120):
        if rng.random() < 0.5:
            r = request(i, rng.choice([None, 1, 2, 3, 4, 5]), max_tokens=rng.randint(1, 20), prompt=rng.randint(1, 40))
            reqs.append(r)
            scheduler.add(r)
        step(scheduler)
    for _ in range(5000):
        if not scheduler.has_work():
            break
        step(scheduler)
    assert all(r.finished for r in reqs)
    assert slots.table.pinned() == 0 and scheduler.allocator.num_free == 64


def test_update_finishes_at_each_stop_condition() -> None:
    """``update`` owns progress: stop ids and EOS stop (EOS not with ignore_eos), then max_tokens and the
    context length end with "length"; finished requests hand back their blocks and pins."""
    config = EngineConfig(max_loras=1, max_cpu_loras=1, max_num_seqs=8)
    allocator = BlockManager(64)
    slots = Slots(1)
    scheduler = Scheduler(config, allocator, slots, eos_token_ids=(2,), max_model_len=9)
    prompt = [5, 6, 7, 8]

    def make(i: int, **params: object) -> Request:
        return Request(f"u{i}", list(prompt), SamplingParams(temperature=0.0, **params), "a1", 1, None)

    stop_id, eos, no_eos, length, context = (make(0, max_tokens=8, stop_token_ids=(9,)), make(1, max_tokens=8),
                                             make(2, max_tokens=8, ignore_eos=True), make(3, max_tokens=2),
                                             make(4, max_tokens=8))
    reqs = [stop_id, eos, no_eos, length, context]
    for r in reqs:
        scheduler.add(r)
    batch = scheduler.schedule()
    assert [s.request for s in batch] == reqs and all(s.prompt_complete for s in batch)
    assert scheduler.update(batch, [9, 2, 2, 4, 4]) == reqs
    assert (stop_id.finish_reason, eos.finish_reason) == ("stop", "stop")
    assert not no_eos.finished and not length.finished and not context.finished
    batch = scheduler.schedule()
    assert [s.num_tokens for s in batch] == [1, 1, 1]
    scheduler.update(batch, [3, 3, 3])
    assert length.finish_reason == "length" and not no_eos.finished and not context.finished
    for _ in range(3):  # context reaches max_model_len = 9 tokens (4 prompt + 5 generated)
        scheduler.update(scheduler.schedule(), [3, 3])
    assert context.finish_reason == "length" and len(context.output_token_ids) == 5
    assert no_eos.finish_reason == "length" and len(no_eos.output_token_ids) == 5
    assert allocator.num_free == 64 and slots.table.pinned() == 0
