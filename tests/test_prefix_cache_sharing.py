"""Prefix caching inside one step and around failures: requests of the same prompt and adapter version
admitted together share its blocks (the prompt is prefilled once, every sibling reads K/V written earlier
in the same forward pass); a step that fails forgets the keys it entered; the metrics; and keys without
the adapter version (none, or its name), rebuilt on purpose, are caught."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest

import loraplex.engine.scheduler.scheduler as scheduler_module
from loraplex.engine.engine import Engine
from loraplex.engine.request import SamplingParams
from loraplex.errors import EngineStepFailed
from loraplex.server.metrics import ServerMetrics
from tests.engine_harness import Progress, add, gather, run_to_end
from tests.test_prefix_cache import PARAMS, make_llm, words


def poison(engine: Engine) -> None:
    """Unwritten K/V becomes loud garbage, so reading a block before it is written changes the output."""
    for t in engine.kv_cache.kv:
        t.normal_(0.0, 50.0)


def test_same_step_siblings_share_the_prompt_blocks(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """Three requests of one 17-token prompt and adapter (the siblings compute only the last token: the decode
    path), one of the same prompt with another adapter (shares nothing), two base requests of a 19-token
    prompt (the sibling computes 3 tokens as a chunk continuing from the shared blocks)."""
    rng = random.Random(4)
    p17, p19 = words(rng, 17), words(rng, 19)
    requests = [(p17, "r8_all")] * 3 + [(p17, "r2_qv"), (p19, None), (p19, None)]
    results = {}
    for caching in (True, False):
        engine = make_llm(tiny_llama, caching, tiny_llama_adapters).engine
        poison(engine)
        ids = [add(engine, None, p, PARAMS, a) for p, a in requests]
        outputs: dict[str, Progress] = {}
        assert len(gather(engine.step(), outputs)) == 6, "every request is admitted and samples in the first step"
        if caching:
            tables = {r.request_id: r.block_table for r in engine.scheduler.running}
            t = [tables[i] for i in ids]
            assert t[0][:4] == t[1][:4] == t[2][:4] and len({t[0][4], t[1][4], t[2][4]}) == 3
            assert [engine.allocator.ref_count(b) for b in t[0][:4]] == [3] * 4
            assert not set(t[3]) & set(t[0]) and t[4][:4] == t[5][:4] and not set(t[4]) & set(t[0] + t[3])
            by_adapter = engine.stats().prefix_cache_by_adapter
            assert [by_adapter[a].hit_tokens for a in ("r8_all", "r2_qv", None)] == [2 * 16, 0, 16]
        run_to_end(engine, outputs)
        results[caching] = [outputs[i].token_ids for i in ids]
        assert engine.allocator.num_free == engine.allocator.num_total
    assert results[True] == results[False]
    assert results[True][0] == results[True][1] == results[True][2] != results[True][3]


def test_a_failed_step_forgets_its_keys(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward pass fails after garbling the cache: its requests fail (``EngineStepFailed``) with their blocks
    returned, nothing the step keyed may be matched later, and the same prompt afterwards ends as if the failure
    never happened."""
    prompt = words(random.Random(5), 18)
    reference = make_llm(tiny_llama, False).generate([prompt], PARAMS, use_tqdm=False)[0].token_ids
    engine = make_llm(tiny_llama, True).engine
    real_execute = engine.runner.execute

    def failing_execute(entries, lora):  # noqa: ANN001, ANN202
        poison(engine)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", failing_execute)
    add(engine, "a", prompt, PARAMS)
    add(engine, "b", prompt, PARAMS)  # shares a's blocks keyed in the failing step
    failed = engine.step()
    assert [(o.request_id, o.finish_reason, type(o.error)) for o in failed] == [
        ("a", "error", EngineStepFailed), ("b", "error", EngineStepFailed)]
    assert "device lost" in str(failed[0].error) and engine.step_failures == 1
    assert engine.allocator.num_cached == 0 and engine.allocator.num_free == engine.allocator.num_total
    assert not engine.scheduler.waiting and not engine.scheduler.running
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    add(engine, "a2", prompt, PARAMS)
    add(engine, "b2", prompt, PARAMS)
    results: dict[str, Progress] = {}
    run_to_end(engine, results)
    assert results["a2"].token_ids == results["b2"].token_ids == reference


def test_metrics_count_hits_per_loaded_adapter(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    llm = make_llm(tiny_llama, True, {"x": tiny_llama_adapters["r4_attn"]})
    prompt = words(random.Random(6), 13)  # 3 full blocks before the last token
    for _ in range(2):
        llm.generate([prompt, prompt], PARAMS, adapters=["x", None], use_tqdm=False)
    stats = llm.stats()
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (4 * 13, 2 * 12)
    assert stats.prefix_cache_blocks == 2 * (13 + 7) // 4  # each prompt's and its outputs' full blocks
    text = ServerMetrics().render(llm.stats()).decode()
    for line in ("loraplex_prefix_cache_queried_tokens_total 52.0", "loraplex_prefix_cache_hit_tokens_total 24.0",
                 'loraplex_adapter_prefix_cache_hit_tokens_total{adapter="x"} 12.0',
                 'loraplex_adapter_prefix_cache_queried_tokens_total{adapter="base"} 26.0',
                 "loraplex_prefix_cache_blocks 10.0", "loraplex_prefix_cache_evictions_total 0.0"):
        assert line in text, line
    llm.unload_adapter("x")
    llm.engine.step()  # the step loop retires the version
    assert 'adapter="x"' not in ServerMetrics().render(llm.stats()).decode()
    assert set(llm.stats().prefix_cache_by_adapter) == {None}


@pytest.mark.parametrize("debug_checks", [True, False])
@pytest.mark.parametrize("keyed_on", ["nothing", "name"])
def test_a_key_without_the_version_would_be_caught(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch, debug_checks: bool,
                                                   keyed_on: str) -> None:
    """The bug class of vLLM #30931 / #42125 rebuilt on purpose: block keys that leave out the adapter version
    (or hold the adapter's *name*, and the name is reloaded with other weights while a request of the old
    version runs) let a request read K/V that
    other weights computed. The debug check fires; without it, the output is wrong."""
    prompt = words(random.Random(7), 21)
    reference = make_llm(tiny_llama, False, tiny_llama_adapters).generate(
        [prompt], PARAMS, adapters=["r2_qv"], use_tqdm=False)[0].token_ids
    llm = make_llm(tiny_llama, True, {"a": tiny_llama_adapters["r8_all"]}, debug_checks=debug_checks)
    real_chain = scheduler_module.extend_chain

    def mutated_chain(keys: list[bytes], tokens: list[int], version_id: int | None, block_size: int,
                      base_blocks: int = 0) -> list[bytes]:
        name = llm.engine.adapters.info(version_id).name if version_id is not None else None
        stand_in = None if keyed_on == "nothing" or name is None else zlib.crc32(name.encode())
        return real_chain(keys, tokens, stand_in, block_size, base_blocks)

    monkeypatch.setattr(scheduler_module, "extend_chain", mutated_chain)
    llm.generate([prompt], PARAMS, adapters=["a"], use_tqdm=False)
    if keyed_on == "name":  # the name now holds other weights (the reference's), while the old version's
        # blocks stay cached: a request of it still runs (a dropped version's blocks are freed at once)
        add(llm.engine, "old", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), "a")
        llm.engine.step()
        llm.unload_adapter("a")
        llm.load_adapter("a", tiny_llama_adapters["r2_qv"])
        second = "a"
    else:
        llm.load_adapter("b", tiny_llama_adapters["r2_qv"])
        second = "b"
    if debug_checks:
        with pytest.raises(AssertionError, match="holds K/V of version"):
            llm.generate([prompt], PARAMS, adapters=[second], use_tqdm=False)
        return
    assert llm.generate([prompt], PARAMS, adapters=[second], use_tqdm=False)[0].token_ids != reference


def test_n_choices_and_prompt_lists_share_one_prefill(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """``LLM.generate`` queues every choice of every prompt in one ``add_requests`` call: three sampled choices
    of a 21-token prompt and the same prompt again in the list (greedy) are admitted in one step, and only the
    first computes the prompt's 5 full blocks; choice 0 also asks for prompt logprobs, so it computes every
    prompt token itself. Every output and logprob equals caching off."""
    prompt = words(random.Random(9), 21)
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=11, ignore_eos=True, prompt_logprobs=2)
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_llama, caching, tiny_llama_adapters)
        outs = llm.generate([prompt, prompt], [sampled, PARAMS], adapters="r8_all", use_tqdm=False)
        results[caching] = [[(c.token_ids, c.prompt_logprobs) for c in o.outputs] for o in outs]
        if caching:
            assert (llm.stats().prefix_cache_queried_tokens, llm.stats().prefix_cache_hit_tokens) == (4 * 21, 3 * 20)
    assert results[True] == results[False]
    assert len({tuple(tokens) for tokens, _ in results[True][0]}) == 3, "the seeded choices differ"


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(tiny_llama: Path) -> None:
    """A request asking for prompt logprobs cannot take cached K/V for the positions it must score: on a warm
    cache it prefills its whole prompt, and gets every position's logprob, equal to caching off; a request of
    the same prompt without them reuses the cache."""
    prompt = words(random.Random(10), 22)
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_llama, caching)
        llm.generate([prompt], PARAMS, use_tqdm=False)  # the prompt's 5 full blocks are now cached
        out = llm.generate([prompt], scored, use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        results[caching] = (out.token_ids, out.prompt_logprobs)
        if caching:
            assert llm.stats().prefix_cache_hit_tokens == 0
            llm.generate([prompt], PARAMS, use_tqdm=False)
            assert llm.stats().prefix_cache_hit_tokens == 20
    assert results[True] == results[False]
