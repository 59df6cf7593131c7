"""Speculative decoding (issue 37 item 2): n-gram drafts verified in the step's one forward pass, each row
under its own adapter. Greedy outputs equal plain decoding's and HF + PEFT's over a mixed-adapter batch (rows
with penalties, a grammar, logprobs, a seed or the opt-out decode plainly beside drafting rows); rejected
drafts' K/V blocks are freed and never keyed (the invariant checks on); the drafter equals a slow reference."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.config import EngineConfig, SpeculativeConfig
from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.engine.scheduler.scheduler import Scheduler
from loraplex.engine.speculative.ngram import NgramIndex
from tests.conftest import make_adapters
from tests.reference import with_adapter

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = 20


def pattern_prompts(n: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    """Prompts that repeat a random span (a draft source), then a few random tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        span = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        prompts.append(span * rng.randint(2, 4) + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 3))])
    return prompts


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("spec-adapters"))


def make_llm(tiny_llama: Path, adapters: dict[str, Path], spec: dict | None, **config) -> LLM:
    llm = LLM(model=str(tiny_llama), max_loras=4, max_lora_rank=16, kv_cache_blocks=512, block_size=4,
              debug_checks=True, speculative_config=spec, **config)
    for name, folder in adapters.items():
        llm.load_adapter(name, folder)
    return llm


# ---- the config ----

def test_config_takes_vllms_keys_and_refuses_others() -> None:
    config = SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (3, 4, 4)
    assert SpeculativeConfig.of({"prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert SpeculativeConfig().prompt_lookup_min == SpeculativeConfig().prompt_lookup_max == 5
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config == SpeculativeConfig(
        num_speculative_tokens=2)
    assert EngineConfig().speculative_config is None
    with pytest.raises(ValueError, match="unknown speculative_config key.*'draft_model'"):
        SpeculativeConfig.of({"method": "ngram", "draft_model": "x"})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.of({"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        SpeculativeConfig.of({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min .* must be <="):
        SpeculativeConfig.of({"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.of("{method")


# ---- the drafter ----

def slow_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        matches = [i for i in range(size - n) if tokens[i:i + n] == tokens[size - n:]]
        if matches:
            full = [i for i in matches if i + n + k <= size]
            i = max(full) if full else max(matches)
            return tokens[i + n:i + n + k]
    return []


def test_ngram_proposals_equal_a_slow_reference() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        vocab = rng.choice([3, 5, 70000])  # 70000 > 2**16: ids whose bytes straddle token boundaries
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        if vocab == 70000 and len(tokens) > 4:
            tokens += tokens[: rng.randint(1, 4)]
        k, min_n = rng.randint(1, 5), rng.randint(1, 3)
        max_n = min_n + rng.randint(0, 3)
        index = NgramIndex()
        index.sync(tokens[: len(tokens) // 2])
        index.sync(tokens)
        expected = slow_propose(tokens, k, min_n, max_n)
        assert index.propose(k, min_n, max_n) == expected, (tokens, k, min_n, max_n)
        checked += bool(expected)
    assert checked > 100


def test_unaligned_byte_matches_are_not_token_matches() -> None:
    """The last token's 4 bytes (11 11 22 22, little-endian) occur across the first two tokens' bytes
    (00 00 11 11 | 22 22 00 00), off a token boundary: that is no match."""
    index = NgramIndex()
    index.sync([0x11110000, 0x00002222, 5, 0x22221111])
    assert index.propose(2, 1, 1) == []
    index.sync([0x11110000, 0x00002222, 5, 0x22221111, 6, 0x22221111])
    assert index.propose(2, 1, 1) == [6, 0x22221111]


# ---- the engine ----

def mixed_params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [greedy, greedy, greedy,
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,40}")),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, speculative_decoding=False)]


def test_greedy_outputs_identical_over_a_mixed_adapter_batch(tiny_llama: Path, adapters: dict[str, Path]) -> None:
    """Plain greedy rows of every adapter and the base draft and equal plain decoding and HF + PEFT; rows
    with a penalty, a grammar, logprobs, a seed or the opt-out decode plainly, with identical outputs."""
    names = [*adapters, None]
    prompts = pattern_prompts(16, seed=1)
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    params = [mixed_params()[i % len(mixed_params())] for i in range(len(prompts))]
    runs = {}
    for spec in (None, {**SPEC, "disable_by_batch_size": 64}):
        llm = make_llm(tiny_llama, adapters, spec)
        outs = llm.generate(prompts, params, adapters=chosen, use_tqdm=False)
        runs[spec is None] = [(o.token_ids, o.outputs[0].logprobs) for o in outs]
    assert runs[True] == runs[False]
    totals = llm.engine.scheduler.speculator.totals
    assert 0 < totals.accepted_tokens < totals.draft_tokens, "drafts were both accepted and rejected"
    for name in names:
        rows = [i for i, (c, p) in enumerate(zip(chosen, params, strict=True))
                if c == name and p.greedy and not p.has_penalties and p.structured_outputs is None]
        expected = with_adapter(tiny_llama, adapters.get(name), [prompts[i] for i in rows], MAX_TOKENS)
        for i, tokens in zip(rows, expected, strict=True):
            assert runs[False][i][0] == tokens, f"prompt {i} adapter {name}"


def test_rejected_drafts_across_a_block_boundary_free_their_blocks(
        tiny_llama: Path, adapters: dict[str, Path]) -> None:
    """Rejected draft positions in a block of their own: the block is freed and never keyed, the table holds
    exactly the computed tokens' blocks after every step; a later request that reuses the cached prefix of
    such a sequence generates what a fresh engine without speculation generates."""
    llm = make_llm(tiny_llama, adapters, SPEC)
    scheduler = llm.engine.scheduler
    freed: list[int] = []
    settle = Scheduler._settle_draft

    def watched(self: Scheduler, s, accepted: int) -> None:  # noqa: ANN001
        before = len(s.request.block_table)
        settle(self, s, accepted)
        after = len(s.request.block_table)
        assert after == -(-s.request.num_computed_tokens // self.config.block_size)
        assert s.request.num_tokens - s.request.num_computed_tokens == 1, "accepted drafts' K/V count as computed"
        freed.append(before - after)

    scheduler._settle_draft = watched.__get__(scheduler)
    names = [*adapters, None]
    prompts = pattern_prompts(8, seed=5)
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    # each sequence ends on a block boundary: its last token's K/V is never computed, so its last block must
    # never be keyed (a key made one position too far would hand that block's stale slot to a follow-up)
    params = [SamplingParams(max_tokens=MAX_TOKENS + (-len(p) - MAX_TOKENS) % 4, temperature=0.0, ignore_eos=True)
              for p in prompts]
    first = llm.generate(prompts, params, adapters=chosen, use_tqdm=False)
    assert any(n > 0 for n in freed), "no rejected draft left a block of its own"
    llm.engine.allocator.check_integrity([])
    follow = [p + o.token_ids + [3] for p, o in zip(prompts, first, strict=True)]
    hits = llm.stats().prefix_cache_hit_tokens
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    again = llm.generate(follow, greedy, adapters=chosen, use_tqdm=False)
    assert llm.stats().prefix_cache_hit_tokens - hits >= 4 * len(follow), "the follow-ups reuse cached blocks"
    plain = make_llm(tiny_llama, adapters, None).generate(follow, greedy, adapters=chosen, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in plain]


def test_max_tokens_and_stop_tokens_cut_an_accepted_run(tiny_llama: Path, adapters: dict[str, Path]) -> None:
    """A stop token inside an accepted run ends the output exactly where plain decoding ends it."""
    prompts = pattern_prompts(6, seed=9)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = make_llm(tiny_llama, adapters, None).generate(prompts, greedy, use_tqdm=False)
    params = [SamplingParams(max_tokens=MAX_TOKENS - i, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[o.token_ids[5 + i]]) for i, o in enumerate(plain)]
    llm = make_llm(tiny_llama, adapters, SPEC)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p, ref in zip(outs, params, plain, strict=True):
        cut = ref.token_ids.index(p.stop_token_ids[0]) + 1
        assert o.token_ids == ref.token_ids[:min(cut, p.max_tokens)]
    assert llm.engine.scheduler.speculator.totals.accepted_tokens > 0


def test_drafting_switches_off_where_it_does_not_pay() -> None:
    """No drafts past ``disable_by_batch_size``; a request backs off (1, 2, 4 .. steps) after a draft with nothing
    accepted, and in a batched step after its acceptance rate falls below ``MIN_BATCHED_ACCEPTANCE``."""
    from loraplex.engine.request import Request
    from loraplex.engine.speculative.speculator import MIN_BATCHED_ACCEPTANCE, Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1))
    assert spec.active(8) and not spec.active(9)
    request = Request("r", [3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(temperature=0.0), None, None, None)
    assert spec.active(1) and spec.draft(request, 8) == (5, 3)
    spec.record(request, 2, 0)
    assert [spec.draft(request, 8) for _ in range(2)] == [(), (5, 3)]
    spec.record(request, 2, 0)
    assert [spec.draft(request, 8) for _ in range(3)] == [(), (), (5, 3)]
    spec.record(request, 2, 2)  # paid: the wait resets
    assert spec.draft(request, 8) == (5, 3)
    spec.active(4)  # batched: a quarter of each draft accepted drags the rate below the bar
    rates = []
    while spec.draft(request, 8) and len(rates) < 10:
        spec.record(request, 4, 1)
        rates.append(request.draft_state.rate)
    assert rates == [pytest.approx(0.4375)] and rates[0] < MIN_BATCHED_ACCEPTANCE  # 0.625 before: it drafted
    opted_out = Request("o", [3, 4, 3, 4], SamplingParams(temperature=0.0, speculative_decoding=False), None, None,
                        None)
    assert spec.draft(opted_out, 8) == ()
