"""Pooling requests (issue 38, engine half): prefill-only rows batched with generation, adapter-aware as
generation is. Embeddings equal HF ``AutoModel`` + PEFT's (last / mean / cls pooling of the last hidden state,
truncated, normalized) within 1e-5 relative; generating neighbours' greedy tokens do not change."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loraplex import LLM, PoolingParams, RequestError, SamplingParams
from tests.engine_harness import Progress, add, gather
from tests.fixtures import write_embedding_adapter
from tests.reference import assert_embedding_close, hf_embeddings

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
EMBEDDERS = {"emb_a": (8, 11), "emb_b": (4, 12)}  # name -> (rank, seed)


def prompts_of(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))] for _ in range(n)]



@pytest.fixture(scope="module")
def embedders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedders")
    return {name: write_embedding_adapter(tiny_llama, root / name, rank=rank, seed=seed)
            for name, (rank, seed) in EMBEDDERS.items()}


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, embedders: dict[str, Path], tiny_llama_adapters: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), max_loras=4, max_lora_rank=16, kv_cache_blocks=256, debug_checks=True)
    for name, folder in {**embedders, **tiny_llama_adapters}.items():
        llm.load_adapter(name, folder)
    return llm


POOLINGS = [PoolingParams("last"), PoolingParams("mean"), PoolingParams("cls"),
            PoolingParams("mean", normalize=False), PoolingParams("last", dimensions=16)]


def test_mixed_batch_embeddings_equal_hf_peft_and_generation_is_unchanged(
        llm: LLM, tiny_llama: Path, embedders: dict[str, Path]) -> None:
    """One ``generate`` call: pooling rows of two embedding adapters and the base model (every pooling kind)
    beside generating rows of two LoRA adapters and the base, all in the same steps."""
    gen_names = ["r8_all", "r4_attn", None]
    gen_prompts = prompts_of(len(gen_names), seed=5)
    pool_names = [name for name in (*embedders, None) for _ in POOLINGS]
    pool_params = [p for _ in (*embedders, None) for p in POOLINGS]
    pool_prompts = prompts_of(len(pool_names), seed=6)
    params = [GREEDY] * len(gen_names) + [SamplingParams(max_tokens=0, pooling=p) for p in pool_params]
    outs = llm.generate(gen_prompts + pool_prompts, params, adapters=gen_names + pool_names)
    alone = llm.generate(gen_prompts, GREEDY, adapters=gen_names)
    for i, out in enumerate(outs[: len(gen_names)]):
        assert out.embedding is None and len(out.token_ids) == GREEDY.max_tokens
        assert out.token_ids == alone[i].token_ids, f"generating row {i} ({gen_names[i]}) changed"
    for out, name, pooling, prompt in zip(outs[len(gen_names):], pool_names, pool_params, pool_prompts, strict=True):
        assert out.token_ids == [] and out.finish_reason == "length" and out.error is None
        ref = hf_embeddings(tiny_llama, embedders.get(name), [prompt], pooling.pooling_type, pooling.normalize,
                            pooling.dimensions)[0]
        assert_embedding_close(out.embedding, ref)
    assert llm.stats().num_running == 0


def test_embed_offline_api(llm: LLM, tiny_llama: Path, embedders: dict[str, Path]) -> None:
    """``LLM.embed``: text and token-id prompts, one adapter per prompt, unit vectors by default."""
    prompts = ["the quick brown fox", [5, 6, 7, 8, 9], "jumps over the lazy dog"]
    names = ["emb_a", None, "emb_b"]
    outs = llm.embed(prompts, PoolingParams("mean"), adapters=names, use_tqdm=False)
    tokenizer = llm.tokenizer
    for out, prompt, name in zip(outs, prompts, names, strict=True):
        ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        assert out.adapter == name and out.prompt_token_ids == ids
        assert_embedding_close(out.embedding, hf_embeddings(tiny_llama, embedders.get(name), [ids], "mean")[0])
        assert abs(sum(x * x for x in out.embedding) - 1.0) < 1e-5


def test_chunked_prefill_pools_every_chunk(tiny_llama: Path, embedders: dict[str, Path]) -> None:
    """Prompts longer than the step budget are prefilled in chunks; mean pooling sums them all, cls keeps the
    first chunk's first row, last the final chunk's last row."""
    llm = LLM(model=str(tiny_llama), max_loras=2, kv_cache_blocks=128, max_num_batched_tokens=16, max_num_seqs=4)
    llm.load_adapter("emb_a", embedders["emb_a"])
    prompts = prompts_of(3, seed=8, lo=40, hi=60)
    for kind in ("mean", "cls", "last"):
        outs = llm.embed(prompts, PoolingParams(kind), adapters="emb_a", use_tqdm=False)
        refs = hf_embeddings(tiny_llama, embedders["emb_a"], prompts, kind)
        for out, ref in zip(outs, refs, strict=True):
            assert_embedding_close(out.embedding, ref)


def test_prefix_cache_serves_last_pooling_only(llm: LLM, tiny_llama: Path, embedders: dict[str, Path]) -> None:
    """A prompt sharing 3 full blocks with an earlier one under the same adapter: last pooling starts from the
    cache, mean pooling computes every row; both still equal HF. No KV block stays held once they finish."""
    base = prompts_of(1, seed=9, lo=48, hi=48)[0]
    engine = llm.engine
    llm.embed([base], PoolingParams("last"), adapters="emb_b", use_tqdm=False)
    variant = base[:48] + [7, 8, 9]
    results: dict[str, Progress] = {}
    for kind in ("last", "mean"):
        add(engine, kind, variant, SamplingParams(max_tokens=0, pooling=PoolingParams(kind)), "emb_b")
    cached = {}
    embeddings = {}
    while engine.has_unfinished_requests():
        for out in gather(engine.step(), results):
            if out.finished:
                cached[out.request_id], embeddings[out.request_id] = out.times.prefix_cached_tokens, out.embedding
    assert cached["last"] >= 32 and cached["mean"] == 0
    for kind in ("last", "mean"):
        assert_embedding_close(embeddings[kind], hf_embeddings(tiny_llama, embedders["emb_b"], [variant], kind)[0])
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total  # cached blocks are free (evictable), none held


def test_pooling_request_keeps_its_version_across_a_reload(tiny_llama: Path, embedders: dict[str, Path]) -> None:
    """Routed once: a queued pooling request of ``emb`` keeps the version it was routed to when the name is
    reloaded with other weights before the step runs."""
    llm = LLM(model=str(tiny_llama), max_loras=2, kv_cache_blocks=64)
    llm.load_adapter("emb", embedders["emb_a"])
    prompt = prompts_of(1, seed=10)[0]
    results: dict[str, Progress] = {}
    add(llm.engine, "old", prompt, SamplingParams(max_tokens=0, pooling=PoolingParams()), "emb")
    llm.load_adapter("emb", embedders["emb_b"], new_version=True)
    add(llm.engine, "new", prompt, SamplingParams(max_tokens=0, pooling=PoolingParams()), "emb")
    embeddings = {}
    while llm.engine.has_unfinished_requests():
        for out in gather(llm.engine.step(), results):
            if out.finished:
                embeddings[out.request_id] = out.embedding
    assert_embedding_close(embeddings["old"], hf_embeddings(tiny_llama, embedders["emb_a"], [prompt])[0])
    assert_embedding_close(embeddings["new"], hf_embeddings(tiny_llama, embedders["emb_b"], [prompt])[0])


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(max_tokens=3, pooling=PoolingParams()), "max_tokens"),
    (SamplingParams(max_tokens=0, logprobs=1, pooling=PoolingParams()), "logprobs"),
    (SamplingParams(max_tokens=0, prompt_logprobs=0, pooling=PoolingParams()), "prompt_logprobs"),
    (SamplingParams(max_tokens=0, pooling=PoolingParams("max")), "pooling"),
    (SamplingParams(max_tokens=0, pooling=PoolingParams(dimensions=65)), "dimensions"),
    (SamplingParams(max_tokens=0, pooling=PoolingParams(dimensions=0)), "dimensions"),
])
def test_invalid_pooling_requests_name_their_field(llm: LLM, params: SamplingParams, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert caught.value.param == field


def test_embed_defaults_to_the_models_sentence_transformers_config(tiny_llama: Path, tmp_path: Path) -> None:
    """``LLM.embed`` without ``pooling``: a folder whose modules.json pools the CLS row without a Normalize module
    gets exactly that."""
    import json
    import shutil

    folder = tmp_path / "st-cls"
    shutil.copytree(tiny_llama, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    ids = [9, 8, 7, 6, 5]
    [out] = LLM(model=str(folder), max_loras=1, kv_cache_blocks=16).embed([ids], use_tqdm=False)
    assert_embedding_close(out.embedding, hf_embeddings(tiny_llama, None, [ids], "cls", normalize=False)[0])


def test_preempted_pooling_request_starts_its_pool_over(tiny_llama: Path, embedders: dict[str, Path]) -> None:
    """A KV cache too small for both: the mean-pooled prompt, prefilled in chunks, is preempted by the growing
    generation and recomputed from its first token; its sum restarts, so it still equals HF."""
    llm = LLM(model=str(tiny_llama), max_loras=2, kv_cache_blocks=6, block_size=16, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    llm.load_adapter("emb_a", embedders["emb_a"])
    [gen_prompt, pool_prompt] = prompts_of(2, seed=12, lo=30, hi=30)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=0, pooling=PoolingParams("mean"))]
    outs = llm.generate([gen_prompt, pool_prompt + pool_prompt], params, adapters=[None, "emb_a"], use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    ref = hf_embeddings(tiny_llama, embedders["emb_a"], [pool_prompt * 2], "mean")[0]
    assert_embedding_close(outs[1].embedding, ref)


def test_pooling_rows_beside_speculative_drafts(tiny_llama: Path, embedders: dict[str, Path]) -> None:
    """Generations verifying n-gram drafts (their entries carry draft tokens after their own) share steps with
    pooling rows that arrive mid-decode: the pooled rows read their own hidden states."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(model=str(tiny_llama), max_loras=2, kv_cache_blocks=256, block_size=4, speculative_config=spec)
    llm.load_adapter("emb_a", embedders["emb_a"])
    engine, results = llm.engine, {}
    rng = random.Random(13)
    for i in range(3):
        span = [rng.randrange(3, 49152) for _ in range(4)]
        add(engine, f"gen-{i}", span * 4, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        gather(engine.step(), results)
    pool_prompts = prompts_of(4, seed=14)
    for i, prompt in enumerate(pool_prompts):
        add(engine, f"emb-{i}", prompt, SamplingParams(max_tokens=0, pooling=PoolingParams("mean")),
            "emb_a" if i % 2 else None)
    embeddings, drafted = {}, False
    execute = engine.runner.execute_pooled

    def spy(entries, lora, rows):  # noqa: ANN001, ANN202
        nonlocal drafted
        drafted = drafted or any(len(e.token_ids) > 1 and not e.pooled for e in entries)
        return execute(entries, lora, rows)

    engine.runner.execute_pooled = spy
    while engine.has_unfinished_requests():
        for out in gather(engine.step(), results):
            if out.finished and out.embedding is not None:
                embeddings[out.request_id] = out.embedding
    assert drafted, "no pooled step ran beside a drafting row"
    for i, prompt in enumerate(pool_prompts):
        ref = hf_embeddings(tiny_llama, embedders["emb_a"] if i % 2 else None, [prompt], "mean")[0]
        assert_embedding_close(embeddings[f"emb-{i}"], ref)
