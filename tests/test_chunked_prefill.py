"""Issue 30 item 5: long prompts never freeze decoding. A step computes at most ``max_num_batched_tokens``
tokens; running streams get their decode token first and a long prompt is prefilled, chunk by chunk, from what
is left. Chunked prefill keeps the KV cache, the prefix cache's keys and the per-row adapter indices right: its
greedy output equals HF + PEFT's and the unchunked run's. On a tiny Llama with a 4096-token context."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.cli import build_parser, engine_config
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.scheduler.scheduler import ScheduledRequest
from tests.engine_harness import Progress, add, gather
from tests.fixtures import write_peft_adapter, write_tiny_model
from tests.model_harness import random_prompts
from tests.reference import with_adapter

LONG = 4000  # prompt tokens
BUDGET = 256  # max_num_batched_tokens of the chunked runs
CONFIG = dict(max_loras=2, max_cpu_loras=2, max_lora_rank=8, kv_cache_blocks=600, max_num_seqs=4, debug_checks=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("long-llama"), "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def adapters(long_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long-llama-adapters")
    return {"all": write_peft_adapter(long_llama, root / "all", rank=8, alpha=16, seed=1),
            "attn": write_peft_adapter(long_llama, root / "attn", rank=4, alpha=8, seed=2,
                                       target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))}


def test_victims_get_a_token_every_step_while_a_long_prompt_prefills(long_llama: Path,
                                                                     adapters: dict[str, Path]) -> None:
    """Two streams (an adapter and the base) decode; a 4000-token prompt of another adapter arrives. While it
    prefills (in chunks of at most the budget the two decodes leave: 16 steps or more) every step gives both
    streams their token; all three greedy outputs equal HF + PEFT's."""
    engine = Engine(EngineConfig(model=str(long_llama), max_num_batched_tokens=BUDGET, **CONFIG))
    for name, folder in adapters.items():
        engine.load_adapter(name, folder)
    short, long = random_prompts([12, 20], 49152, seed=1), random_prompts([LONG], 49152, seed=2)[0]
    victims = {"v1": ("attn", short[0]), "v2": (None, short[1])}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for rid, (adapter, prompt) in victims.items():
        add(engine, rid, prompt, params, adapter)
    steps: list[list[ScheduledRequest]] = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]  # type: ignore[method-assign]
    results: dict[str, Progress] = {}
    for _ in range(2):
        gather(engine.step(), results)
    add(engine, "long", long, GREEDY, "all")
    prefilling = 0
    while not results.get("long", Progress()).token_ids:
        out = {o.request_id: o for o in gather(engine.step(), results)}
        chunk = [s for s in steps[-1] if s.request.request_id == "long"]
        if chunk:
            prefilling += 1
            assert chunk[0].num_tokens <= BUDGET - 2, "the decodes' tokens come out of the budget first"
        assert all(out[rid].new_token_ids for rid in victims), f"a stream got no token in step {len(steps)}"
    assert prefilling >= LONG // (BUDGET - 2), "the long prompt was prefilled in chunks"
    while engine.has_unfinished_requests():
        gather(engine.step(), results)
    assert results["long"].token_ids == with_adapter(long_llama, adapters["all"], [long], 6)[0]
    for rid, (adapter, prompt) in victims.items():
        folder = adapters[adapter] if adapter else None
        assert results[rid].token_ids == with_adapter(long_llama, folder, [prompt], 40)[0], rid
    engine.allocator.check_integrity([])


def test_a_request_arriving_while_a_long_prompt_prefills_starts_at_once(long_llama: Path,
                                                                       adapters: dict[str, Path]) -> None:
    """A 4000-token prompt of an adapter is prefilling when a short base request arrives: while it waits for a
    seat the long prompt's chunks take half the budget, so the short one gets its first token in its first step
    and a token in every step after it while the long prompt goes on prefilling (the decodes come first); both
    greedy outputs equal HF + PEFT's."""
    engine = Engine(EngineConfig(model=str(long_llama), max_num_batched_tokens=BUDGET, **CONFIG))
    engine.load_adapter("all", adapters["all"])
    long, short = random_prompts([LONG], 49152, seed=6)[0], random_prompts([12], 49152, seed=7)[0]
    add(engine, "long", long, GREEDY, "all")
    results: dict[str, Progress] = {}
    for _ in range(3):
        gather(engine.step(), results)
    add(engine, "short", short, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    got = []  # per step until the long prompt's first token: did the short request get one?
    while not results.get("long", Progress()).token_ids:
        got.append(any(o.request_id == "short" and o.new_token_ids for o in gather(engine.step(), results)))
    assert got[0] and all(got), f"the short request waited or missed steps: {got}"
    assert len(got) >= 10, "the long prompt was still prefilling for many of its steps"
    while engine.has_unfinished_requests():
        gather(engine.step(), results)
    assert results["long"].token_ids == with_adapter(long_llama, adapters["all"], [long], 6)[0]
    assert results["short"].token_ids == with_adapter(long_llama, None, [short], 30)[0]


def test_chunked_prefill_equals_unchunked_and_serves_a_cached_prefix(long_llama: Path,
                                                                     adapters: dict[str, Path]) -> None:
    """A 4000-token prompt and one sharing its first 3000 tokens (the second finds them in the prefix cache,
    under the same adapter version, and prefills the rest in chunks), two adapters side by side: the chunked run
    (budget 256) and an unchunked one (budget 8192) give the same greedy tokens, equal to HF + PEFT's."""
    long = random_prompts([LONG], 49152, seed=3)[0]
    sharing = long[:3000] + random_prompts([900], 49152, seed=4)[0]
    outputs = {}
    for budget in (BUDGET, 8192):
        llm = LLM(model=str(long_llama), max_num_batched_tokens=budget, **CONFIG)
        for name, folder in adapters.items():
            llm.load_adapter(name, folder)
        first = llm.generate([long, random_prompts([30], 49152, seed=5)[0]], GREEDY, adapters=["all", "attn"],
                             use_tqdm=False)
        second = llm.generate([sharing], GREEDY, adapters=["all"], use_tqdm=False)
        hits = llm.stats().prefix_cache_hit_tokens
        assert hits >= 3000 - 16, f"budget {budget}: the shared prefix came from the cache ({hits} tokens)"
        outputs[budget] = [o.token_ids for o in (*first, *second)]
    assert outputs[BUDGET] == outputs[8192]
    assert outputs[BUDGET][0] == with_adapter(long_llama, adapters["all"], [long], 6)[0]
    assert outputs[BUDGET][2] == with_adapter(long_llama, adapters["all"], [sharing], 6)[0]


def test_max_num_batched_tokens_flag_reaches_the_engine_config() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-num-batched-tokens", "64"])
    assert engine_config(args, parser).max_num_batched_tokens == 64
    default = engine_config(parser.parse_args(["serve"]), parser).max_num_batched_tokens
    assert default == EngineConfig().max_num_batched_tokens
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=0)
