"""Logprobs of generated and prompt tokens against HF + PEFT log-softmax (1e-4 absolute) in mixed-adapter
batches, with chunked prefill and preemption; scoring with max_tokens=0; n choices with derived seeds."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.sampling.logprobs import TokenLogprob
from tests.reference import hf_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> LLM:
    # A small token budget chunks the prompts over several steps; a small cache forces preemptions.
    llm = LLM(model=str(tiny_llama), max_loras=4, max_lora_rank=16, kv_cache_blocks=12, block_size=8,
              max_num_batched_tokens=24)
    for name in ("r8_all", "r4_attn"):
        llm.load_adapter(name, tiny_llama_adapters[name])
    return llm


def hf_logprobs(tiny_llama: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF (+ PEFT) logits at every position of ``ids``: ``[len(ids), vocab]``."""
    model = hf_model(tiny_llama, adapter)
    with torch.inference_mode():
        out = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    if adapter is not None:
        model.unload()
    return out


def check(entry: TokenLogprob, ref: torch.Tensor, token: int, k: int) -> None:
    """``entry`` scores ``token`` under the reference row ``ref [vocab]``, with its top ``k``."""
    assert entry.token_id == token
    assert abs(entry.logprob - float(ref[token])) <= ATOL
    assert entry.rank == 1 + int((ref > ref[token] + ATOL).sum()) or abs(float(ref.sort(descending=True).values[
        entry.rank - 1]) - float(ref[token])) <= ATOL
    assert len(entry.top) == k
    torch.testing.assert_close(torch.tensor([lp for _, lp in entry.top]), ref.topk(k).values, rtol=0, atol=ATOL)
    for t, lp in entry.top:
        assert abs(float(ref[t]) - lp) <= ATOL


def test_logprobs_equal_hf_peft_in_mixed_batch(llm: LLM, tiny_llama: Path,
                                               tiny_llama_adapters: dict[str, Path]) -> None:
    """Greedy, sampled and penalised rows, with and without an adapter, in one batch: generated-token and
    prompt logprobs are the raw model's (before temperature and penalties), prompts prefilled in chunks."""
    rng = random.Random(3)
    names = ["r8_all", None, "r4_attn", "r8_all", None, "r4_attn"]
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 40))] for _ in names]
    base = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    params = [replace(base, temperature=0.0), replace(base, temperature=0.9, seed=1),
              replace(base, temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, logit_bias={7: 5.0}),
              replace(base, temperature=1.3, top_k=5, frequency_penalty=2.0, seed=2),
              replace(base, temperature=0.0, logprobs=0, prompt_logprobs=None), replace(base, prompt_logprobs=0)]
    outs = llm.generate(prompts, params, adapters=names, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0  # prompt logprobs survive a recompute, not doubled
    for prompt, name, p, out in zip(prompts, names, params, outs, strict=True):
        ref = hf_logprobs(tiny_llama, tiny_llama_adapters.get(name), prompt + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 6
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            check(entry, ref[len(prompt) + j - 1], token, p.logprobs)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            check(out.prompt_logprobs[i], ref[i - 1], prompt[i], p.prompt_logprobs)


def test_score_without_generating(llm: LLM, tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """``max_tokens=0`` with ``prompt_logprobs``: the prompt is scored, nothing is generated."""
    prompt = list(range(100, 130))
    out = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1), adapters="r4_attn", use_tqdm=False)[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([], "", "length")
    ref = hf_logprobs(tiny_llama, tiny_llama_adapters["r4_attn"], prompt)
    for i in range(1, len(prompt)):
        check(out.prompt_logprobs[i], ref[i - 1], prompt[i], 1)


def test_n_choices_and_their_seeds(llm: LLM) -> None:
    """n choices per prompt in one call; a seeded request is reproducible, its choice 0 equals the same
    request with n=1, and choice j equals its derived one-choice params run alone."""
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=1)
    first = llm.generate(["a prompt", "another one"], params, adapters=["r8_all", None], use_tqdm=False)
    assert [len(o.outputs) for o in first] == [3, 3]
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    assert first[0].token_ids == first[0].outputs[0].token_ids and first[0].text == first[0].outputs[0].text
    assert len({tuple(c.token_ids) for c in first[0].outputs}) == 3, "choices should differ"
    again = llm.generate(["another one", "a prompt"], params, adapters=[None, "r8_all"], use_tqdm=False)
    assert [c.token_ids for c in again[1].outputs] == [c.token_ids for c in first[0].outputs]
    single = llm.generate("a prompt", replace(params, n=1), adapters="r8_all", use_tqdm=False)[0]
    assert single.token_ids == first[0].outputs[0].token_ids
    choice2 = params.choices()[2]
    assert choice2.n == 1 and choice2.seed not in (None, params.seed)
    alone = llm.generate("a prompt", choice2, adapters="r8_all", use_tqdm=False)[0]
    assert alone.token_ids == first[0].outputs[2].token_ids
    assert all(len(c.logprobs) == 8 for c in first[0].outputs)
