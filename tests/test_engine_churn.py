"""Churn: 20 adapters through 3 slots and a host tier of 6, loaded and unloaded while 60 requests run.
Every accepted request completes (it holds its adapter version through an unload) with its solo output;
no request is lost; all KV blocks and pins come back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.errors import UnknownAdapter
from tests.engine_harness import Progress, add, gather
from tests.fixtures import write_peft_adapter

NUM_ADAPTERS = 20


@pytest.fixture(scope="module")
def twenty(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("twenty")
    rng = random.Random(5)
    return {f"a{i}": write_peft_adapter(tiny_llama, root / f"a{i}", rank=rng.choice([2, 4, 8, 16]),
                                        alpha=16, seed=100 + i) for i in range(NUM_ADAPTERS)}


def test_churn(tiny_llama: Path, twenty: dict[str, Path]) -> None:
    rng = random.Random(0)
    names = list(twenty)
    requests = []
    for i in range(60):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(2, 30))]
        adapter = rng.choice([*names, None])
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True)
        requests.append((f"r{i}", prompt, params, adapter))
    # A final burst that must preempt whatever the timing of background adapter reads: 8 base requests
    # admitted in one step into the drained cache (3 blocks each, 24 of 28) that each grow to 6 blocks.
    burst = [(f"b{i}", [rng.randrange(3, 49152) for _ in range(12)],
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), None) for i in range(8)]

    llm = LLM(model=str(tiny_llama), max_loras=3, max_cpu_loras=6, max_num_seqs=8, kv_cache_blocks=28,
              block_size=4, debug_checks=True)
    engine = llm.engine
    loaded = set(names[:10])
    for name in loaded:
        llm.load_adapter(name, twenty[name])
    results: dict[str, Progress] = {}
    progress: dict[str, Progress] = {}
    rejected: set[str] = set()
    pending = [[r] for r in requests] + [burst]  # one batch of submissions per step
    requests += burst
    step = 0
    while pending or engine.has_unfinished_requests():
        step += 1
        # the burst goes in once the engine has drained, so all 8 are admitted together
        ready = bool(pending) and (pending[0] is not burst or not engine.has_unfinished_requests())
        for rid, prompt, params, adapter in pending.pop(0) if ready else ():
            try:
                add(engine, rid, prompt, params, adapter)
            except UnknownAdapter:
                rejected.add(rid)  # clean refusal: the adapter is not loaded right now
        if step % 5 == 0:  # churn the registry while requests run
            name = rng.choice(names)
            if name in loaded and rng.random() < 0.4:
                llm.unload_adapter(name)
                loaded.discard(name)
            elif name not in loaded:
                llm.load_adapter(name, twenty[name])
                loaded.add(name)
        gather(engine.step(), progress)
        results.update((rid, p) for rid, p in progress.items() if p.finished)
        engine.adapters.check_integrity()
        assert step < 5000, "engine stopped making progress"

    assert set(results) | rejected == {r[0] for r in requests}, "a request was lost"
    completed = {rid: out for rid, out in results.items() if out.error is None}
    errored = {rid: out.error for rid, out in results.items() if out.error is not None}
    assert errored == {}, "an accepted request failed: it holds its adapter version until it ends"
    assert len(completed) >= 30
    assert engine.allocator.num_free == engine.allocator.num_total
    assert engine.adapters.slot_table.pinned() == 0
    assert engine.scheduler.num_preemptions > 0, "the small KV cache should force preemptions"

    reference = LLM(model=str(tiny_llama), max_loras=1, kv_cache_blocks=64)
    by_id = {r[0]: r for r in requests}
    for rid, out in completed.items():
        _, prompt, params, adapter = by_id[rid]
        if adapter is not None and adapter not in {a.name for a in reference.list_adapters()}:
            reference.load_adapter(adapter, twenty[adapter])
        assert reference.generate([prompt], params, adapters=[adapter], use_tqdm=False)[0].token_ids == \
            out.token_ids, rid
