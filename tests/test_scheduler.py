"""Scheduler admission policy, driven step by step without a forward pass: ``schedule()``, then the
scheduler's own post-step ``update`` with a stand-in token for every request that samples. The adapters
are the real ``AdapterManager`` over real tiny adapters (slot writes into a real tiny model, a host tier,
background re-reads of cold adapters), so ``try_acquire`` misses as it does in the engine."""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
import time
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import torch

from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.slots import SlotTable
from loraplex.config import EngineConfig
from loraplex.engine.request import Request, SamplingParams
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.engine.scheduler.scheduler import Scheduler
from loraplex.models.loader import load_model
from loraplex.models.registry import model_config
from tests.fixtures import write_peft_adapter, write_tiny_model


@lru_cache(maxsize=1)
def tiny() -> tuple[Path, Path]:
    """A tiny llama and a rank-2 adapter on it, written once per process (plain functions build schedulers
    here and in ``tests/test_fair_share.py``)."""
    root = Path(tempfile.mkdtemp(prefix="loraplex-scheduler-"))
    atexit.register(shutil.rmtree, root, True)
    base = write_tiny_model(root / "base")
    return base, write_peft_adapter(base, root / "adapter", rank=2, target_modules=("q_proj",))


class Slots:
    """The real ``AdapterManager`` the scheduler drives, with adapters ``a0``.. ``a{n-1}`` loaded from one
    tiny folder as versions 0..n-1 (so a test's adapter number is its version id); ``wanted`` records each
    ``read_ahead`` call the scheduler makes (and passes it on)."""

    def __init__(self, max_loras: int, max_cpu_loras: int, adapters: int = 10) -> None:
        base, folder = tiny()
        cfg = model_config(base)
        model = load_model(base, cfg, max_loras, 16, torch.float32, torch.device("cpu"))
        self.manager = AdapterManager(cfg, max_loras, max_cpu_loras, 16, writer=model, first_version_id=0)
        assert [self.manager.load(f"a{i}", folder).version_id for i in range(adapters)] == list(range(adapters))
        self.wanted: list[list[int]] = []
        read_ahead = self.manager.read_ahead

        def recording(wanted: Iterable[int]) -> None:
            self.wanted.append(list(wanted))
            read_ahead(self.wanted[-1])

        self.manager.read_ahead = recording  # type: ignore[method-assign]

    @property
    def table(self) -> SlotTable:
        return self.manager.slot_table


def make(max_loras: int, max_num_seqs: int, max_skip_steps: int = 64, blocks: int = 4096, adapters: int = 10,
         max_cpu_loras: int = 64, max_num_batched_tokens: int | None = None) -> tuple[Scheduler, Slots]:
    budget = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    config = EngineConfig(max_loras=max_loras, max_cpu_loras=max(max_loras, max_cpu_loras), max_num_seqs=max_num_seqs,
                          max_skip_steps=max_skip_steps, **budget)
    slots = Slots(max_loras, config.max_cpu_loras, adapters)
    return Scheduler(config, BlockManager(blocks), slots.manager), slots


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
    mode starts after the first round, and ride-alongs keep the batch nearly full all the same. The step's
    token budget is set so that it is not what limits the batch (32 prompts of 30 tokens fit one step): this
    test is about adapter slots (the default budget's admission in time: docs/server.md, Chunked prefill)."""
    scheduler, _ = make(max_loras=8, max_num_seqs=32, max_skip_steps=64, adapters=32, max_num_batched_tokens=1024)
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
    slots = Slots(1, 1, adapters=2)
    scheduler = Scheduler(config, allocator, slots.manager, eos_token_ids=(2,), max_model_len=9)
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


def test_cold_adapters_wait_for_their_reads_and_everything_finishes() -> None:
    """A host tier of 2 under 6 adapters: most versions are cold (evicted from host memory), so ``try_acquire``
    misses and starts a background re-read from disk; their requests wait (no error) and run once the weights
    are back, while the other adapters' requests keep running."""
    scheduler, slots = make(max_loras=2, max_num_seqs=4, max_skip_steps=8, blocks=128, adapters=6, max_cpu_loras=2)
    reqs = [request(i, i % 6, max_tokens=3 + i % 4) for i in range(24)]
    for r in reqs:
        scheduler.add(r)
    deadline = time.monotonic() + 60
    while scheduler.has_work():
        if not step(scheduler):
            assert time.monotonic() < deadline, "cold adapters never became placeable"
            time.sleep(0.005)  # the engine backs off the same way when nothing is placeable
    assert all(r.finished and r.finish_reason == "length" for r in reqs)
    counters = slots.manager.counters()
    assert counters["disk_reads"] >= 4 and counters["host_evictions"] >= 4, counters
    assert slots.table.pinned() == 0 and scheduler.allocator.num_free == 128
    slots.manager.check_integrity()
