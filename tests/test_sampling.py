"""Sampling: greedy, top-k, top-p against explicit reference distributions; seeded reproducibility."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, RequestError, SamplingParams
from loraplex.engine.sampling import sample


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([sample(logits[None], [params], [gen])[0] for _ in range(n)])


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 100)
    gens = [torch.Generator() for _ in range(5)]
    assert sample(logits, [SamplingParams(temperature=0.0)] * 5, gens) == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(50)
    assert set(draws(logits, SamplingParams(temperature=1.5, top_k=1), 20).tolist()) == {int(logits.argmax())}


def test_top_k_restricts_support() -> None:
    logits = torch.randn(64)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    assert set(draws(logits, SamplingParams(temperature=2.0, top_k=5), 300).tolist()) <= allowed


def test_top_p_matches_nucleus_reference() -> None:
    """Empirical frequencies match the renormalised nucleus distribution computed independently."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    top_p = 0.8
    probs = torch.softmax(logits, -1).double()
    nucleus, mass = [], 0.0
    for i in torch.argsort(probs, descending=True).tolist():
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += float(probs[i])
    expected = torch.zeros_like(probs)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    n = 6000
    got = torch.bincount(draws(logits, SamplingParams(top_p=top_p), n), minlength=6).double() / n
    assert torch.allclose(got, expected, atol=0.03)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    cold = (draws(logits, SamplingParams(temperature=0.3), 2000) == 0).double().mean()
    hot = (draws(logits, SamplingParams(temperature=1.5), 2000) == 0).double().mean()
    assert cold > 0.9 > hot


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 0), ("temperature", -0.1), ("temperature", 2.5),
                                              ("top_p", 0.0), ("top_p", 1.2), ("top_k", -1)])
def test_invalid_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.param == field


def test_seeded_sampling_reproducible_across_batches(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), kv_cache_blocks=128)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(["hello there"], seeded)[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batch = llm.generate(["a different prompt", "hello there", "third"], [other, seeded, other])
    assert batch[1].token_ids == alone
    different_seed = llm.generate(["hello there"], SamplingParams(max_tokens=10, seed=99, ignore_eos=True))
    assert different_seed[0].token_ids != alone


def test_top_k_one_generation_equals_greedy(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), kv_cache_blocks=128)
    greedy = llm.generate(["count to ten"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    topk1 = llm.generate(["count to ten"], SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    assert greedy[0].token_ids == topk1[0].token_ids
