"""The seed scenario end to end: an out-of-band adapter load while requests decode must never change
which weights a running request reads (../shared/docs/seed.md)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.ops.lora_batch import BatchMapping, LoRABatch, build_lora_batch
from tests.engine_harness import Progress, add, gather, run_to_end
from tests.fixtures import write_peft_adapter

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = {"A": "alpha request prompt", "B": "beta request, a little longer prompt", "C": "gamma"}


@pytest.fixture(scope="module")
def abc(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("abc")
    return {n: write_peft_adapter(tiny_llama, root / n, rank=8, seed=10 + i) for i, n in enumerate("ABC")}


@pytest.fixture(scope="module")
def solo(tiny_llama: Path, abc: dict[str, Path]) -> dict[str, list[int]]:
    """Each request run alone, on a fresh engine with room for every adapter."""
    llm = LLM(model=str(tiny_llama), max_loras=3, kv_cache_blocks=128)
    for name, folder in abc.items():
        llm.load_adapter(name, folder)
    out = {n: llm.generate([PROMPTS[n]], PARAMS, adapters=[n])[0].token_ids for n in "AB"}
    out["C"] = llm.generate([PROMPTS["C"]], SHORT, adapters=["C"])[0].token_ids
    out["A2"] = llm.generate([PROMPTS["A"]], SHORT, adapters=["A"])[0].token_ids
    return out


def new_engine(tiny_llama: Path, abc: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), max_loras=2, max_cpu_loras=3, kv_cache_blocks=128, debug_checks=True)
    llm.load_adapter("A", abc["A"])
    llm.load_adapter("B", abc["B"])
    return llm


def test_runtime_load_mid_decode_keeps_every_request_on_its_adapter(
        tiny_llama: Path, abc: dict[str, Path], solo: dict[str, list[int]]) -> None:
    engine = new_engine(tiny_llama, abc).engine
    add(engine, "A", PROMPTS["A"], PARAMS, "A")
    add(engine, "B", PROMPTS["B"], PARAMS, "B")
    results: dict[str, Progress] = {}
    for _ in range(5):
        gather(engine.step(), results)
    table_before = list(engine.adapters.slot_table.slots)
    engine.load_adapter("C", abc["C"])  # out of band, while A and B decode in both slots
    add(engine, "C", PROMPTS["C"], SHORT, "C")
    add(engine, "A2", PROMPTS["A"], SHORT, "A")
    # Activation attempts outside the batch are refused while both slots are pinned.
    c_id = engine.adapters.resolve("C")
    assert not engine.adapters.can_acquire(c_id)
    for _ in range(3):
        gather(engine.step(), results)
        assert engine.adapters.slot_table.slots == table_before
    run_to_end(engine, results)
    assert {k: v.token_ids for k, v in results.items()} == solo
    assert engine.adapters.counters()["device_evictions"] >= 1, "C must have displaced A or B eventually"
    assert engine.allocator.num_free == engine.allocator.num_total
    assert engine.adapters.slot_table.pinned() == 0


def stale_memo(manager) -> None:  # noqa: ANN001
    """The upstream bug, rebuilt on purpose: indices memoised on the mapping alone, and eviction that
    ignores pins (as vLLM's out-of-band add_lora did)."""
    memo: dict[BatchMapping, LoRABatch] = {}

    def lora_batch(mapping: BatchMapping) -> LoRABatch | None:
        if mapping not in memo:
            memo[mapping] = build_lora_batch(mapping, dict(manager.slot_table.slot_of), manager.slot_table.version)
        return memo[mapping]

    table = manager.slot_table
    manager.lora_batch = lora_batch
    table._victim = lambda: next(iter(table._lru)) if None not in table.slots else table.slots.index(None)
    table._lru = OrderedDict(table._lru)


@pytest.mark.parametrize("debug_checks", [True, False])
def test_stale_index_bug_would_be_caught(
        tiny_llama: Path, abc: dict[str, Path], solo: dict[str, list[int]], debug_checks: bool) -> None:
    """With the memo keyed on the mapping alone and pins bypassed, the seed's rotation (activate C, A,
    B out of band) swaps the running requests' weights: the right-weights check fires, and without it
    the outputs differ from the solo outputs, so the tests above would fail on such a bug."""
    llm = new_engine(tiny_llama, abc)
    engine = llm.engine
    engine.config = type(engine.config)(**{**engine.config.__dict__, "debug_checks": debug_checks})
    llm.load_adapter("C", abc["C"])
    stale_memo(engine.adapters)
    add(engine, "A", PROMPTS["A"], PARAMS, "A")
    add(engine, "B", PROMPTS["B"], PARAMS, "B")
    outputs: dict[str, Progress] = {}
    for _ in range(3):
        gather(engine.step(), outputs)
    assert engine.adapters.slot_table.slots == [engine.adapters.resolve("A"), engine.adapters.resolve("B")]
    for name in ("C", "A", "B"):  # the seed's out-of-band activations: slot table becomes [B, A]
        engine.adapters.slot_table.acquire(engine.adapters.resolve(name))
        engine.adapters.writer.set_slot(engine.adapters.slot_table.slot_of[engine.adapters.resolve(name)],
                                        engine.adapters.host.get(engine.adapters.resolve(name)))
    assert engine.adapters.slot_table.slots == [engine.adapters.resolve("B"), engine.adapters.resolve("A")]
    if debug_checks:
        a, b = engine.adapters.resolve("A"), engine.adapters.resolve("B")  # A's tokens now read B's slot
        wrong = rf"asked for \(adapter, scale\) \[\({a}, 1.0\)\] but reads \[\({b}, 1.0\)\]"
        with pytest.raises(AssertionError, match=wrong):
            engine.step()
        return
    for _ in range(8):
        gather(engine.step(), outputs)
    got = {k: outputs[k].token_ids for k in "AB"}
    assert any(got[k] != solo[k][: len(got[k])] for k in "AB")
