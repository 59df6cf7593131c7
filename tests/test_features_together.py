"""The features that change a step's rows, all in one batch: speculative decoding on, prefix caching and the
invariant checks on, beside base rows, plain adapter rows, a per-request scale, a two-adapter blend, an aLoRA
row and pooling rows. Every generating row's greedy tokens equal the same requests' on an engine with
speculation off (each feature is checked against HF + PEFT in its own file: test_speculative, test_adapter_mix,
test_alora, test_pooling), every embedding equals that engine's, and drafts were verified and accepted in
these very steps (so the comparison covers drafted rows of every kind)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex import LLM, AdapterMix, PoolingParams, SamplingParams
from tests.fixtures import write_embedding_adapter
from tests.test_alora import write_alora_adapter

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}  # drafts in every step of this batch
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
INVOCATION = [101, 202, 303]


def repeating_prompt(rng: random.Random, suffix: list[int] = ()) -> list[int]:
    """A random span repeated (a source of n-gram drafts), then ``suffix``."""
    span = [rng.randrange(1000, 49152) for _ in range(rng.randint(3, 5))]
    return span * rng.randint(3, 4) + list(suffix)


@pytest.fixture(scope="module")
def folders(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("together")
    return {"r8_all": tiny_llama_adapters["r8_all"], "r4_attn": tiny_llama_adapters["r4_attn"],
            "intrinsic": write_alora_adapter(tiny_llama, root / "intrinsic", INVOCATION, seed=31),
            "embedder": write_embedding_adapter(tiny_llama, root / "embedder", rank=4, seed=32)}


def engine(tiny_llama: Path, folders: dict[str, Path], spec: dict | None) -> LLM:
    llm = LLM(model=str(tiny_llama), max_loras=5, max_lora_rank=16, kv_cache_blocks=512, block_size=4,
              debug_checks=True, enable_prefix_caching=True, speculative_config=spec)
    for name, folder in folders.items():
        llm.load_adapter(name, folder)
    return llm


def test_every_row_kind_in_one_batch_with_speculation(tiny_llama: Path, folders: dict[str, Path]) -> None:
    rng = random.Random(17)
    rows: list[tuple[list[int], SamplingParams, str | AdapterMix | None]] = []
    for _ in range(2):
        rows += [(repeating_prompt(rng), GREEDY, None),
                 (repeating_prompt(rng), GREEDY, "r8_all"),
                 (repeating_prompt(rng), GREEDY, AdapterMix([("r4_attn", 2.0)])),
                 (repeating_prompt(rng), GREEDY, AdapterMix([("r8_all", 0.5), ("r4_attn", 1.0)])),
                 (repeating_prompt(rng, INVOCATION + [7, 8]), GREEDY, "intrinsic"),
                 (repeating_prompt(rng), SamplingParams(max_tokens=0, pooling=PoolingParams("mean")), "embedder"),
                 (repeating_prompt(rng), SamplingParams(max_tokens=0, pooling=PoolingParams("last")), None)]
    prompts, params, adapters = (list(column) for column in zip(*rows, strict=True))
    speculating = engine(tiny_llama, folders, SPEC)
    plain = engine(tiny_llama, folders, None)
    ours = speculating.generate(prompts, params, adapters=adapters, use_tqdm=False)
    expected = plain.generate(prompts, params, adapters=adapters, use_tqdm=False)
    for i, (got, want) in enumerate(zip(ours, expected, strict=True)):
        assert got.error is None and want.error is None
        if params[i].pooling is None:
            assert len(got.token_ids) == GREEDY.max_tokens
            assert got.token_ids == want.token_ids, f"row {i} ({adapters[i]}) differs with speculation on"
        else:
            torch.testing.assert_close(torch.tensor(got.embedding), torch.tensor(want.embedding), rtol=1e-5, atol=1e-6)
    totals = speculating.engine.scheduler.speculator.totals
    assert totals.accepted_tokens > 0, "no draft was accepted: the batch did not exercise speculation"
    assert speculating.stats().num_running == 0
