"""Read-ahead of cold adapters: only the few the queue wants next are read from disk, so a queue over more
adapters than the host tier holds does not make the reader push out what the queue's head needs (each
adapter would be read again and again). Outputs stay those of an engine with every adapter resident."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.adapters.read_ahead import ReadAhead, read_ahead_depth
from tests.fixtures import write_peft_adapter
from tests.test_manager import make_manager, model_config  # noqa: F401  (the fixture)

NUM_ADAPTERS = 12


def test_window_is_the_first_unplaced_distinct_ids_in_order() -> None:
    ahead = ReadAhead(depth=2)
    assert ahead.allows(7)  # no window declared yet: anything may be read
    assert ahead.plan([4, 4, 1, 9, 3], placed={1}.__contains__) == [4, 9]
    assert ahead.allows(4) and ahead.allows(9) and not ahead.allows(3) and not ahead.allows(1)
    assert ahead.plan([], placed=lambda _: False) == [] and not ahead.allows(4)
    assert [read_ahead_depth(8, 64), read_ahead_depth(8, 6), read_ahead_depth(2, 1)] == [8, 3, 1]
    with pytest.raises(ValueError):
        ReadAhead(0)


def test_manager_reads_only_the_window(model_config, tiny_llama_adapters: dict[str, Path]) -> None:  # noqa: F811
    manager = make_manager(model_config, max_loras=1, max_cpu_loras=2)  # read-ahead depth 1
    ids = [manager.load(name, tiny_llama_adapters[name]).version_id for name in ("r4_attn", "r2_qv", "r8_all")]
    cold = ids[0]  # pushed out of host memory by the third load
    assert cold not in manager.host
    manager.read_ahead([ids[1], cold])  # ids[1] is in host memory: the window holds it, nothing to read
    assert not manager.can_acquire(cold)
    manager.wait_for_read(cold, timeout=30)
    assert cold not in manager.host and manager.counters()["disk_reads"] == 0
    manager.read_ahead([cold, ids[1]])  # now the head of the queue: read in the background
    manager.wait_for_read(cold, timeout=30)
    assert cold in manager.host and manager.counters()["disk_reads"] == 1
    assert manager.can_acquire(cold) and manager.acquire(cold) == 0
    manager.release(cold)
    manager.check_integrity()
    manager.close()


@pytest.fixture(scope="module")
def twelve(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("twelve")
    return {f"a{i}": write_peft_adapter(tiny_llama, root / f"a{i}", rank=4, alpha=8, seed=300 + i)
            for i in range(NUM_ADAPTERS)}


def test_queue_over_more_adapters_than_the_host_tier_reads_each_once(tiny_llama: Path,
                                                                     twelve: dict[str, Path]) -> None:
    names = [f"a{i // 2}" for i in range(2 * NUM_ADAPTERS)]  # two requests per adapter, all queued at once
    prompts = [[3 + (7 * i) % 200 for _ in range(4 + i % 5)] for i in range(len(names))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    churn = LLM(model=str(tiny_llama), max_loras=2, max_cpu_loras=4, max_num_seqs=8, debug_checks=True)
    for name, folder in twelve.items():
        churn.load_adapter(name, folder)  # the host tier keeps the last 4: 8 adapters start cold
    outs = churn.generate(prompts, params, adapters=names, use_tqdm=False)
    counters = churn.engine.adapters.counters()
    assert counters["disk_reads"] <= NUM_ADAPTERS, counters  # at most once each (reading all ahead: ~2x)
    assert churn.engine.adapters.slot_table.pinned() == 0
    resident = LLM(model=str(tiny_llama), max_loras=2, max_cpu_loras=NUM_ADAPTERS, max_num_seqs=8)
    for name, folder in twelve.items():
        resident.load_adapter(name, folder)
    expected = resident.generate(prompts, params, adapters=names, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert resident.engine.adapters.counters()["disk_reads"] == 0
