"""Prefix caching end to end: with caching on, every output equals the caching-off output token for token
(greedy), over mixed adapters that touch different projections, a shared system prompt, multi-turn chats,
preemption under a small cache, and adapters loaded, unloaded and reloaded with other weights between
turns; the multi-turn chats and the reloads also equal HF transformers + PEFT's greedy tokens for each
turn's whole prompt (a reference that shares neither the cache nor the engine). Every caching-on engine
runs with the debug checks (each block a request reads was written under its adapter version) and must
really hit the cache, or the comparison would prove nothing."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from tests.reference import with_adapter

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 4


def make_llm(model: Path, caching: bool, adapters: dict[str, Path] | None = None, **kw: object) -> LLM:
    options = {"max_loras": 4, "max_cpu_loras": 8, "kv_cache_blocks": 256, "debug_checks": caching, **kw}
    llm = LLM(model=str(model), block_size=BLOCK, enable_prefix_caching=caching, **options)
    for name, path in (adapters or {}).items():
        llm.load_adapter(name, path)
    return llm


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def multi_turn_chats(llm: LLM, adapters: list[str | None], turns: int = 3,
                     system_len: int = 37) -> list[tuple[list, list]]:
    """Conversations over ``adapters`` sharing one system prompt; each turn sends the whole history plus a
    new user message, all conversations at once. Returns every turn's (prompts, outputs) (token ids)."""
    rng = random.Random(1)
    system = words(rng, system_len)
    history = [list(system) for _ in adapters]
    outputs = []
    for _ in range(turns):
        for h in history:
            h += words(rng, rng.randint(3, 9))
        prompts = [list(h) for h in history]
        outs = llm.generate(prompts, PARAMS, adapters=adapters, use_tqdm=False)
        for h, out in zip(history, outs, strict=True):
            h += out.token_ids
        outputs.append((prompts, [out.token_ids for out in outs]))
    return outputs


def hf_outputs(base: Path, folders: list[Path | None], prompts: list[list[int]]) -> list[list[int]]:
    """HF + PEFT's ``PARAMS.max_tokens`` greedy tokens of each prompt under its adapter folder (None: base)."""
    out: list[list[int]] = [[] for _ in prompts]
    for folder in dict.fromkeys(folders):
        idx = [i for i, f in enumerate(folders) if f == folder]
        for i, tokens in zip(idx, with_adapter(base, folder, [prompts[i] for i in idx], PARAMS.max_tokens),
                             strict=True):
            out[i] = tokens
    return out


CHAT_ADAPTERS = [None, "r8_all", "r4_attn", "r16_mlp", "r2_qv", "r8_all"]


def test_multi_turn_chats_over_mixed_adapters_equal_caching_off(
        tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    on = make_llm(tiny_llama, True, tiny_llama_adapters)
    off = make_llm(tiny_llama, False, tiny_llama_adapters)
    turns = multi_turn_chats(on, CHAT_ADAPTERS)
    assert turns == multi_turn_chats(off, CHAT_ADAPTERS)
    folders = [None if a is None else tiny_llama_adapters[a] for a in CHAT_ADAPTERS]
    for i, (prompts, outputs) in enumerate(turns):
        assert outputs == hf_outputs(tiny_llama, folders, prompts), f"turn {i + 1} differs from HF + PEFT"
    stats = on.stats()
    assert stats.prefix_cache_hit_tokens > stats.prefix_cache_queried_tokens / 2
    by_adapter = stats.prefix_cache_by_adapter
    assert set(by_adapter) == set(CHAT_ADAPTERS)
    system_blocks = 37 // BLOCK * BLOCK
    # turn 1: the second r8_all chat shares the first one's system prompt (same step); later turns hit their
    # own history; no chat could ever hit another adapter's blocks, so each adapter's hits are its own
    assert by_adapter["r8_all"].hit_tokens >= system_blocks + 4 * system_blocks
    for name in ("r4_attn", "r16_mlp", "r2_qv", None):
        assert system_blocks * 2 <= by_adapter[name].hit_tokens <= by_adapter[name].queried_tokens
    assert off.stats().prefix_cache_queried_tokens == off.stats().prefix_cache_blocks == 0


def test_preemption_under_a_small_cache_equals_caching_off(tiny_llama: Path,
                                                           tiny_llama_adapters: dict[str, Path]) -> None:
    """Eight requests over two adapters and the base share a 16-token system prompt and grow until the
    36-block cache cannot hold them: preempted requests recompute, finding their own cached blocks."""
    rng = random.Random(2)
    system = words(rng, 16)
    prompts = [system + words(rng, 4) for _ in range(8)]
    adapters = ["r8_all", "r2_qv", None, "r8_all"] * 2
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_llama, caching, tiny_llama_adapters, kv_cache_blocks=36, max_num_seqs=8)
        results[caching] = [o.token_ids for o in llm.generate(prompts, params, adapters=adapters, use_tqdm=False)]
        stats = llm.stats()
        assert stats.num_preemptions > 0 and stats.kv_blocks_free == stats.kv_blocks_total
        assert (stats.prefix_cache_evictions > 0 and stats.prefix_cache_hit_tokens > 8 * 16) == caching
    assert results[True] == results[False]


def test_load_unload_and_reload_between_turns(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """The seed's scenario between chat turns (2 slots, 3 adapters: loading C rotates the slot table under
    cached blocks), then A unloaded and reloaded with other weights: its new version must not see the KV of
    the old one, while B keeps hitting its own."""
    folders = {"A": tiny_llama_adapters["r8_all"], "B": tiny_llama_adapters["r4_attn"],
               "C": tiny_llama_adapters["r16_mlp"]}
    rng = random.Random(3)
    system = words(rng, 22)
    turn1 = [system + words(rng, 5) for _ in range(2)]
    turn2 = [system + words(rng, 3) for _ in range(3)]
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_llama, caching, {"A": folders["A"], "B": folders["B"]}, max_loras=2, max_cpu_loras=3)
        outs = [llm.generate(turn1, PARAMS, adapters=["A", "B"], use_tqdm=False)]
        llm.load_adapter("C", folders["C"])
        outs.append(llm.generate(turn2, PARAMS, adapters=["C", "A", "B"], use_tqdm=False))
        llm.unload_adapter("A")
        llm.load_adapter("A", tiny_llama_adapters["r2_qv"])  # same name, other weights
        outs.append(llm.generate(turn1[:1], PARAMS, adapters=["A"], use_tqdm=False))  # old A's exact prompt
        if caching:
            assert llm.stats().prefix_cache_by_adapter["A"].hit_tokens == 0
        outs.append(llm.generate(turn1, PARAMS, adapters=["A", "B"], use_tqdm=False))
        if caching:
            by_adapter = llm.stats().prefix_cache_by_adapter
            assert by_adapter["A"].hit_tokens == 24  # its own turn-3 prompt
            assert by_adapter["B"].hit_tokens == 20 + 24  # the system prompt in turn 2, its whole prompt now
            assert llm.engine.adapters.counters()["device_evictions"] >= 2
        results[caching] = [[o.token_ids for o in turn] for turn in outs]
    assert results[True] == results[False]
    assert results[True][2][0] != results[True][0][0], "the reload must change A's output"
    a, b, c, new_a = folders["A"], folders["B"], folders["C"], tiny_llama_adapters["r2_qv"]
    assert results[True] == [hf_outputs(tiny_llama, [a, b], turn1), hf_outputs(tiny_llama, [c, a, b], turn2),
                             hf_outputs(tiny_llama, [new_a], turn1[:1]), hf_outputs(tiny_llama, [new_a, b], turn1)]


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gemma3", "phi3"])
def test_other_families_equal_caching_off(tiny_checkpoint: Callable[[str], Path], arch: str) -> None:
    """A system prompt shared by three requests, then a second turn over each history, on the families
    whose attention differs from Llama's (sliding windows, q/k norms, Gemma's local layers). Phi-3's
    LongRoPE makes a token's K depend on its sequence's length past 32 positions (the second turn's
    prompts are longer), which no key can hold: caching stays off there."""
    rng = random.Random(8)
    system = words(rng, 13)
    users = [[words(rng, 8) for _ in range(3)] for _ in range(2)]
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_checkpoint(arch), caching)
        history = [list(system) for _ in range(3)]
        for turn in users:
            outs = llm.generate([h + u for h, u in zip(history, turn, strict=True)], PARAMS, use_tqdm=False)
            history = [h + u + o.token_ids for h, u, o in zip(history, turn, outs, strict=True)]
        results[caching] = history
        assert llm.engine.allocator.caching == (caching and arch != "phi3")
        assert (llm.stats().prefix_cache_hit_tokens > 0) == llm.engine.allocator.caching
    assert results[True] == results[False]
