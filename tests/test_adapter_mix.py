"""Per-request LoRA plans through the offline API (issue 31 item 3): ``lora_scale`` (an ``AdapterMix`` of one
entry) and blends of several adapters (``AdapterMix``), token for token against HF + PEFT: a scale ``s`` and a
blend against PEFT's ``add_weighted_adapter(..., combination_type="cat")``, scale 0 against the base model.
All in one mixed batch with base rows and plain adapter rows, under slot pressure (a 3-adapter blend on 3
slots while 4 adapters are wanted), with prefix caching on and the engine's invariant checks on."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplex import LLM, AdapterMix, RequestError, SamplingParams, UnknownAdapter
from tests.conftest import make_adapters
from tests.fixtures import write_peft_adapter
from tests.reference import with_adapter, with_mix

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
MIX2 = (("r8_all", 0.7), ("r16_mlp", 1.0))  # different ranks and targets
MIX3 = (("r4_attn", 0.5), ("r16_mlp", 1.3), ("r2_qv", 2.0))
# what each row asks: None (base), a name (plain), or a plan (scaled adapter or blend)
CASES: list[str | tuple[tuple[str, float], ...] | None] = [
    None, "r8_all", (("r8_all", 0.0),), (("r8_all", 0.5),), (("r8_all", 2.0),), MIX2, MIX3]


def prompts(n: int, seed: int, length: int = 14) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(length + i)] for i in range(n)]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("mix-adapters"))


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, adapters: dict[str, Path]) -> LLM:
    """3 slots for 4 adapters: a 3-adapter blend takes every slot, so rows wait for their members."""
    engine = LLM(model=str(tiny_llama), max_loras=3, max_lora_rank=16, kv_cache_blocks=256, block_size=4,
                 debug_checks=True)
    for name, folder in adapters.items():
        engine.load_adapter(name, folder)
    return engine


def as_request(case: str | tuple[tuple[str, float], ...] | None) -> str | AdapterMix | None:
    return case if case is None or isinstance(case, str) else AdapterMix(case)


def expected(tiny_llama: Path, adapters: dict[str, Path], case: str | tuple[tuple[str, float], ...] | None,
             batch: list[list[int]]) -> list[list[int]]:
    """HF + PEFT: the base model (scale 0 too: exactly the base), one adapter, or PEFT's cat blend."""
    if case is None or (not isinstance(case, str) and all(scale == 0.0 for _, scale in case)):
        return with_adapter(tiny_llama, None, batch, MAX_TOKENS)
    if isinstance(case, str):
        return with_adapter(tiny_llama, adapters[case], batch, MAX_TOKENS)
    return with_mix(tiny_llama, [(adapters[name], scale) for name, scale in case], batch, MAX_TOKENS)


def test_scales_and_blends_in_one_batch_equal_peft(llm: LLM, tiny_llama: Path, adapters: dict[str, Path]) -> None:
    """Every case over the same two prompts (so scale 0.5 and 1.0 of one prompt are co-scheduled and must never
    share K/V), all in one generate call, then again (their blocks cached now): each row equals its reference."""
    batch = prompts(2, seed=3)
    wanted = {i: expected(tiny_llama, adapters, case, batch) for i, case in enumerate(CASES)}
    for attempt in range(2):
        outs = llm.generate([p for _ in CASES for p in batch], GREEDY,
                            adapters=[as_request(c) for c in CASES for _ in batch], use_tqdm=False)
        for i, case in enumerate(CASES):
            for j in range(len(batch)):
                assert outs[i * len(batch) + j].token_ids == wanted[i][j], f"attempt {attempt}: {case} prompt {j}"
    assert llm.stats().prefix_cache_hit_tokens > 0  # the second pass read cached blocks


def test_a_blend_never_reads_the_blocks_of_its_first_member(llm: LLM, tiny_llama: Path,
                                                            adapters: dict[str, Path]) -> None:
    """The same prompt first under r8_all alone (its blocks cached), then under blends and scales whose first
    member is r8_all: each equals its own reference, so none read r8_all's cached K/V."""
    batch = prompts(1, seed=11, length=21)
    plain = llm.generate(batch, GREEDY, adapters="r8_all", use_tqdm=False)
    assert plain[0].token_ids == expected(tiny_llama, adapters, "r8_all", batch)[0]
    for case in ((("r8_all", 1.0), ("r4_attn", 1.0)), MIX2, (("r8_all", 0.5),)):
        before = llm.stats().prefix_cache_hit_tokens
        out = llm.generate(batch, GREEDY, adapters=AdapterMix(case), use_tqdm=False)
        assert out[0].token_ids == expected(tiny_llama, adapters, case, batch)[0], case
        assert llm.stats().prefix_cache_hit_tokens == before, f"{case} matched another plan's blocks"
    again = llm.generate(batch, GREEDY, adapters=AdapterMix(MIX2), use_tqdm=False)  # its own blocks: a hit
    assert again[0].token_ids == expected(tiny_llama, adapters, MIX2, batch)[0]
    assert llm.stats().prefix_cache_hit_tokens > before


def test_refused_plans_name_their_field(llm: LLM) -> None:
    batch = prompts(1, seed=5)
    cases = [(AdapterMix([("r8_all", -0.5)]), RequestError, "lora_scale"),
             (AdapterMix([("r8_all", float("nan"))]), RequestError, "lora_scale"),
             (AdapterMix([("r8_all", 1.0), ("r4_attn", 1.0), ("r16_mlp", 1.0), ("r2_qv", 1.0)]), RequestError,
              "adapter_mix"),  # 4 entries on 3 slots
             (AdapterMix([("r8_all", 1.0), ("r8_all", 0.5)]), RequestError, "adapter_mix"),
             (AdapterMix([("r8_all", 1.0), ("nope", 0.5)]), UnknownAdapter, None)]
    for mix, error, field in cases:
        with pytest.raises(error) as info:
            llm.generate(batch, GREEDY, adapters=mix, use_tqdm=False)
        if field is not None:
            assert info.value.param == field, mix
    assert llm.stats().num_waiting == 0 and llm.stats().num_running == 0


def test_unscalable_adapters_and_other_tokenizers_are_refused(tiny_llama: Path, adapters: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """An adapter with LoRA on embed_tokens reads the step's first pass unscaled: served at scale 1, refused
    scaled or blended. An adapter that ships its own tokenizer (another chat template) cannot be blended with one
    that does not."""
    embed = write_peft_adapter(tiny_llama, tmp_path / "embed", rank=4, target_modules=["q_proj", "embed_tokens"])
    own = tmp_path / "own_tokenizer"
    shutil.copytree(adapters["r2_qv"], own)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(own)  # another chat format: its own tokenizer
    llm = LLM(model=str(tiny_llama), max_loras=3, max_lora_rank=16, kv_cache_blocks=64)
    for name, folder in (("embed", embed), ("own", own), ("r8_all", adapters["r8_all"])):
        llm.load_adapter(name, folder)
    batch = prompts(1, seed=7)
    plain = llm.generate(batch, GREEDY, adapters=AdapterMix([("embed", 1.0)]), use_tqdm=False)
    assert plain[0].token_ids == with_adapter(tiny_llama, embed, batch, MAX_TOKENS)[0]
    for mix, field in (([("embed", 0.5)], "lora_scale"), ([("embed", 1.0), ("r8_all", 1.0)], "adapter_mix"),
                       ([("own", 1.0), ("r8_all", 1.0)], "adapter_mix")):
        with pytest.raises(RequestError) as info:
            llm.generate(batch, GREEDY, adapters=AdapterMix(mix), use_tqdm=False)
        assert info.value.param == field, mix


def test_a_blend_waits_for_all_its_slots_and_never_runs_short(tiny_llama: Path, adapters: dict[str, Path]) -> None:
    """2 slots; a long plain request holds one. A 2-adapter blend cannot take both: it waits, holding no slot
    pin (all or nothing), while a base request and another request of the running adapter go ahead; once the
    long request ends it runs, on both members, and equals PEFT's blend."""
    from loraplex.engine.request import NewRequest
    from tests.engine_harness import Progress, gather, run_to_end

    llm = LLM(model=str(tiny_llama), max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=128,
              block_size=4, debug_checks=True)
    for name in ("r8_all", "r4_attn", "r16_mlp"):
        llm.load_adapter(name, adapters[name])
    engine, versions = llm.engine, {n: llm.engine.adapters.resolve(n) for n in ("r8_all", "r4_attn", "r16_mlp")}
    batch = prompts(3, seed=13)
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_requests([NewRequest("long", batch[0], long, versions["r8_all"])])
    results: dict[str, Progress] = {}
    gather(engine.step(), results)  # "long" runs and pins r8_all's slot
    mix = ((versions["r4_attn"], 0.5), (versions["r16_mlp"], 1.0))
    engine.add_requests([NewRequest("mix", batch[1], GREEDY, None, mix), NewRequest("base", batch[2], GREEDY),
                         NewRequest("rider", batch[2], GREEDY, versions["r8_all"])])
    for _ in range(MAX_TOKENS + 2):
        gather(engine.step(), results)
        waiting = [r.request_id for r in engine.scheduler.waiting]
        assert waiting == ["mix"] and engine.stats().slots_pinned == 1, (waiting, engine.stats())
    assert results["base"].finished and results["rider"].finished
    run_to_end(engine, results)
    assert results["mix"].token_ids == with_mix(tiny_llama, [(adapters["r4_attn"], 0.5), (adapters["r16_mlp"], 1.0)],
                                                [batch[1]], MAX_TOKENS)[0]
    assert engine.stats().slots_pinned == 0
